"""A quantized linear's fp32 side path: a low-rank fp32 product added to its output.

Two corrections of a quantized linear take a few linear combinations of its
input and multiply them by an fp32 weight: the Q4_1 block offsets
(graph/block_offsets.py: the block means times each block's offset) and the
outlier channels (graph/outlier_channels.py: the chosen channels times the
weight's columns). Together they are

    side(x) = [means(x), x Aᵀ] Bᵀ

with x [..., in_features] fp32, means(x) [..., n_blocks] the mean of each
block of the input (a pooling: it reads no weight), A [m, in_features] the
rows of other combinations (the outlier channels' selection) and
B [out_features, n_blocks + m]: a pooling, a selection GEMM, a concat, one
fp32 GEMM and an add per linear, where the corrections one by one were two
GEMMs and an add each (plus the pooling). Measured on SmolLM2-135M's default
export (2-core AVX2 VM, paired, docs/journal.md 2026-12-08): decode 1.06x at
B=1 and B=8. The block sums are pooled rather than a GEMM with an indicator
matrix because that matrix (n_blocks x in_features fp32) would be read every
step, a fifth of a layer's int4 weight bytes (that version ran 0.98-1.03x).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Buffers of a module with a side path: A [m, in_features] (only when m > 0) and
# B [out_features, n_blocks + m], fp32 (n_blocks: what B has beyond A's rows).
INPUTS, WEIGHT = "side_inputs", "side_weight"


def n_blocks(module: nn.Module) -> int:
    """The blocks whose means ``module``'s side path takes (0: none, or no
    side path)."""
    weight, inputs = getattr(module, WEIGHT, None), getattr(module, INPUTS, None)
    if weight is None:
        return 0
    return weight.shape[1] - (0 if inputs is None else inputs.shape[0])


def block_means(x: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """x [..., k] -> [..., n_blocks]: the mean of each block of k / n_blocks.

    Written as a 4-D mean over the two innermost dims with keepdim, the one
    reduction XNNPACK's partitioner takes (global average pooling): a sum or
    a mean of another shape would run outside the delegate and split each
    layer's XNNPACK partition in three (measured: 12 delegate calls a step
    for a 2-layer model instead of 5)."""
    lead = x.shape[:-1]
    grid = x.reshape(-1, n_blocks, x.shape[-1] // n_blocks, 1)
    return grid.mean(dim=(2, 3), keepdim=True).reshape(*lead, n_blocks)


def _set(module: nn.Module, inputs: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    if inputs is not None:
        module.register_buffer(INPUTS, inputs.contiguous())
    module.register_buffer(WEIGHT, weight.contiguous())


def _refuse(what: str, module: nn.Module, out_features: int, in_features: int) -> None:
    weight, inputs = getattr(module, WEIGHT, None), getattr(module, INPUTS, None)
    if weight is not None and (weight.shape[0] != out_features or
                               (inputs is not None and inputs.shape[1] != in_features)):
        raise ValueError(f"{what} does not fit the module's side path "
                         f"(weight {tuple(weight.shape)})")


def append_blocks(module: nn.Module, offsets: torch.Tensor, in_features: int) -> None:
    """Adds ``means(x) offsetsᵀ`` to ``module``'s side path (in place):
    offsets [out_features, n_blocks] multiply the mean of each block of
    in_features / n_blocks inputs. Raises ValueError when n_blocks does not
    divide in_features, the module has blocks already, or out_features
    disagrees with its side path."""
    if offsets.dim() != 2 or not offsets.shape[1] or in_features % offsets.shape[1]:
        raise ValueError(f"block offsets of shape {tuple(offsets.shape)} do not fit "
                         f"{in_features} input features")
    if n_blocks(module):
        raise ValueError("the module's side path has block offsets already")
    _refuse(f"block offsets of shape {tuple(offsets.shape)}", module, offsets.shape[0],
            in_features)
    weight = offsets.to(torch.float32)
    old = getattr(module, WEIGHT, None)
    _set(module, None, weight if old is None else torch.cat([weight, old], 1))


def append(module: nn.Module, inputs: torch.Tensor, weight: torch.Tensor) -> None:
    """Adds ``(x inputsᵀ) weightᵀ`` to ``module``'s side path (in place):
    inputs [m, in_features], weight [out_features, m], both made fp32.
    Raises ValueError for shapes that disagree with each other or with the
    side path the module already has."""
    if inputs.dim() != 2 or weight.dim() != 2 or inputs.shape[0] != weight.shape[1]:
        raise ValueError(f"a side path of inputs {tuple(inputs.shape)} and weight "
                         f"{tuple(weight.shape)} does not fit together")
    _refuse(f"a side path of inputs {tuple(inputs.shape)} and weight {tuple(weight.shape)}",
            module, weight.shape[0], inputs.shape[1])
    inputs, weight = inputs.to(torch.float32), weight.to(torch.float32)
    old_inputs, old_weight = getattr(module, INPUTS, None), getattr(module, WEIGHT, None)
    if old_inputs is not None:
        inputs = torch.cat([old_inputs, inputs], 0)
    if old_weight is not None:
        weight = torch.cat([old_weight, weight], 1)
    _set(module, inputs, weight)


def output(module: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """[..., out_features]: the side path's share of ``module``'s output for
    x [..., in_features], in fp32; None when it has none."""
    weight = getattr(module, WEIGHT, None)
    if weight is None:
        return None
    blocks, inputs = n_blocks(module), getattr(module, INPUTS, None)
    parts = ([block_means(x, blocks)] if blocks else []) + \
        ([F.linear(x, inputs)] if inputs is not None else [])
    return F.linear(parts[0] if len(parts) == 1 else torch.cat(parts, -1), weight)
