"""Per-block offsets of a linear's weight: what an asymmetric 4-bit format adds.

llama.cpp's Q4_1 stores each block of 32 input features of a weight row as
``w = d * q + m`` (q in 0..15, scale d and minimum m per block; ggml-quants.c).
XNNPACK's blockwise int4 kernels take symmetric weights only (``scale * q``,
q in -8..7, no zero point). Rewritten ``w = d * (q - 8) + c`` with
``c = m + 8 d``, the first term is exactly such a weight and the second is
constant over the block, so for an input x [..., in_features]

    y = x Wᵀ + b = x (d (q - 8))ᵀ + b + S(x) Cᵀ

where S(x) [..., in_features / 32] sums x over each block and C
[out_features, in_features / 32] holds the c's. ``project`` computes that:
the quantized linear as it is plus one small fp32 linear (in_features / 32
inputs), so a GGUF's 4-bit weights reach the program without requantizing
(exporting/gguf.py finds the exact q, d and c).
"""

import torch
import torch.nn.functional as F
from torch import nn

OFFSETS = "block_offsets"   # the buffer's name on a linear that has them


def project(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear``'s output for x [..., in_features] -> [..., out_features],
    with its block offsets [out_features, n_blocks] when it has them."""
    y = F.linear(x, linear.weight, linear.bias)
    offsets = getattr(linear, OFFSETS, None)
    if offsets is None:
        return y
    sums = x.unflatten(-1, (offsets.shape[1], -1)).sum(-1)
    return y + F.linear(sums, offsets)


class OffsetLinear(nn.Linear):
    """An nn.Linear with block offsets (``add_block_offsets`` makes one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x)


def add_block_offsets(linear: nn.Linear, offsets: torch.Tensor) -> None:
    """Gives ``linear`` (in place) the offsets [out_features, n_blocks] fp32,
    n_blocks dividing in_features. A plain nn.Linear becomes an OffsetLinear;
    a subclass must compute its output with ``project`` itself (FusedLinear
    does). Raises ValueError for offsets of another shape."""
    n_blocks = offsets.shape[1] if offsets.dim() == 2 else 0
    if offsets.dim() != 2 or offsets.shape[0] != linear.out_features or not n_blocks or \
            linear.in_features % n_blocks:
        raise ValueError(f"block offsets of shape {tuple(offsets.shape)} do not fit a linear "
                         f"of {linear.in_features} -> {linear.out_features} features")
    linear.register_buffer(OFFSETS, offsets.to(torch.float32).contiguous())
    if type(linear) is nn.Linear:
        linear.__class__ = OffsetLinear
