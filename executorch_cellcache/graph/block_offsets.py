"""Per-block offsets of a linear's weight: what an asymmetric 4-bit format adds.

llama.cpp's Q4_1 stores each block of 32 input features of a weight row as
``w = d * q + m`` (q in 0..15, scale d and minimum m per block; ggml-quants.c).
XNNPACK's blockwise int4 kernels take symmetric weights only (``scale * q``,
q in -8..7, no zero point). Rewritten ``w = d * (q - 8) + c`` with
``c = m + 8 d``, the first term is exactly such a weight and the second is
constant over the block, so for an input x [..., in_features]

    y = x Wᵀ + b = x (d (q - 8))ᵀ + b + S(x) Cᵀ

where S(x) [..., in_features / 32] sums x over each block and C
[out_features, in_features / 32] holds the c's: the linear's fp32 side path
(graph/side_path.py: the block means times 32 C). ``project``
computes the quantized linear as it is plus its side path, so a GGUF's 4-bit
weights reach the program without requantizing (exporting/gguf.py finds the
exact q, d and c).
"""

import torch
import torch.nn.functional as F
from torch import nn

from executorch_cellcache.graph import side_path
from executorch_cellcache.graph.outlier_channels import inliers


def has_block_offsets(module: nn.Module) -> bool:
    """Whether ``module`` (a linear, FusedLinear or Int8AsInt4Pair) has Q4_1
    block offsets in its side path."""
    return side_path.n_blocks(module) > 0


def _append_offsets(module: nn.Module, offsets: torch.Tensor, in_features: int) -> None:
    # the side path multiplies block MEANS: offsets times the block's size
    block = in_features // offsets.shape[1]
    side_path.append_blocks(module, offsets.to(torch.float32) * block, in_features)


def project(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear``'s output for x [..., in_features] -> [..., out_features],
    with its block offsets and outlier channels (graph/outlier_channels.py)
    when it has them."""
    y = F.linear(inliers(linear, x), linear.weight, linear.bias)
    return _add_side_path(linear, x, y)


def _add_side_path(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    side = side_path.output(module, x)
    return y if side is None else y + side


class OffsetLinear(nn.Linear):
    """An nn.Linear computed by ``project``: with block offsets
    (``add_block_offsets`` makes one) or outlier channels (``as_projected``)."""

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
    _append_offsets(linear, offsets, linear.in_features)
    as_projected(linear)


def as_projected(linear: nn.Linear) -> None:
    """A plain nn.Linear becomes an OffsetLinear (in place), so its forward
    is ``project``; a subclass must call ``project`` itself (FusedLinear does)."""
    if type(linear) is nn.Linear:
        linear.__class__ = OffsetLinear


class Int8AsInt4Pair(nn.Module):
    """A linear whose weight is int8 blocks ``w = d q`` (q in -127..127, one
    scale d per block of 32 input features: llama.cpp's Q8_0), computed
    exactly by XNNPACK's blockwise int4 kernel, which has no int8 blocks.

    With u = q + 128 = 16 hi + lo (hi, lo in 0..15),
    ``w = 16 d (hi - 8) + d (lo - 8) + 8 d``: two int4 blocks of the same
    input and a per-block offset. ``linear`` holds both int4 halves side by
    side (in_features * 2 inputs: the hi blocks, then the lo blocks) and reads
    the input twice, [x, x], so one GEMM and one activation quantization
    compute them; the offsets [out_features, in_features / 32] (8 d) multiply
    x's block sums in its side path as in ``project``. Same weight bytes as int8.
    """

    def __init__(self, in_features: int, out_features: int, offsets: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.linear = nn.Linear(2 * in_features, out_features, bias=False)
        _append_offsets(self, offsets, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = inliers(self, x)
        return _add_side_path(self, x, self.linear(torch.cat([kept, kept], -1)))


def int4_pair(q: torch.Tensor, scale: torch.Tensor, block: int = 32):
    """int8 blocks (q int8 [n, k] in -127..127, scale [n, k / block]) ->
    (q4 int8 [n, 2k] in -8..7, scale4 [n, 2k / block], offsets [n, k / block])
    for Int8AsInt4Pair: hi blocks then lo blocks. Raises ValueError for a q
    of -128 (outside Q8_0's range)."""
    if int(q.min()) < -127:
        raise ValueError("int8 block values must lie in -127..127")
    u = q.to(torch.int16) + 128
    hi, lo = (u >> 4) - 8, (u & 15) - 8
    q4 = torch.cat([hi, lo], dim=1).to(torch.int8)
    scale4 = torch.cat([16 * scale, scale], dim=1)
    return q4, scale4, 8 * scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Blocks of ``block`` along dim 1: q [n, k] times scale [n, k / block]."""
    n, k = q.shape
    return (q.float().view(n, k // block, block) * scale.unsqueeze(-1)).view(n, k)
