"""A quantized linear's fp32 side path: a low-rank fp32 product added to its output.

Two corrections of a quantized linear take a few linear combinations of its
input and multiply them by an fp32 weight: the Q4_1 block offsets
(graph/block_offsets.py: the block sums times each block's offset) and the
outlier channels (graph/outlier_channels.py: the chosen channels times the
weight's columns). Each is ``(x Aᵀ) Bᵀ`` with A [m, in_features] and
B [out_features, m]; stacked as one A and one B they are two small fp32 GEMMs
and one add per linear whatever the corrections, where computed one by one
they were six ops and, for the block sums, two reshapes and a mean (each op
is a separate XNNPACK operator with its own per-call overhead, which at one
token a step costs more than the GEMMs' arithmetic).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Buffers of a module with a side path: A [m, in_features], B [out_features, m], fp32.
INPUTS, WEIGHT = "side_inputs", "side_weight"


def append(module: nn.Module, inputs: torch.Tensor, weight: torch.Tensor) -> None:
    """Adds ``(x inputsᵀ) weightᵀ`` to ``module``'s side path (in place):
    inputs [m, in_features], weight [out_features, m], both made fp32.
    Raises ValueError for shapes that disagree with each other or with the
    side path the module already has."""
    if inputs.dim() != 2 or weight.dim() != 2 or inputs.shape[0] != weight.shape[1]:
        raise ValueError(f"a side path of inputs {tuple(inputs.shape)} and weight "
                         f"{tuple(weight.shape)} does not fit together")
    inputs, weight = inputs.to(torch.float32), weight.to(torch.float32)
    old_inputs, old_weight = getattr(module, INPUTS, None), getattr(module, WEIGHT, None)
    if old_inputs is not None:
        if old_inputs.shape[1] != inputs.shape[1] or old_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"a side path of inputs {tuple(inputs.shape)} and weight "
                             f"{tuple(weight.shape)} does not fit the module's "
                             f"{tuple(old_inputs.shape)} and {tuple(old_weight.shape)}")
        inputs = torch.cat([old_inputs, inputs], 0)
        weight = torch.cat([old_weight, weight], 1)
    module.register_buffer(INPUTS, inputs.contiguous())
    module.register_buffer(WEIGHT, weight.contiguous())


def output(module: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """[..., out_features]: the side path's share of ``module``'s output for
    x [..., in_features], in fp32; None when it has none."""
    inputs = getattr(module, INPUTS, None)
    if inputs is None:
        return None
    return F.linear(F.linear(x, inputs), getattr(module, WEIGHT))
