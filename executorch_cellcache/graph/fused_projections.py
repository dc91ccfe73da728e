"""Projections of the same input computed by one linear: q/k/v and gate/up.

A decoder layer projects its normed input three times for attention (q, k, v)
and twice for the MLP (gate, up). Each projection is one GEMM in the program,
and in a weight-quantized program each also quantizes its input again
(dynamic int8 activations): seven GEMMs and seven activation quantizations a
layer. One linear whose weight is the parts' weights stacked reads the same
weight bytes, quantizes its input once and is one parallel region of the
runtime's thread pool where there were three (or two): four of each a layer.

The parts are copies of slices of the fused output's last dim ([..., sum of
the parts' out_features], q then k then v, gate then up), which stay inside
the layer's XNNPACK partition (exporting/lowering.py lets XNNPACK take a slice
of a dynamically shaped tensor along a static dim). A slice copies the part's
values as they are, so each part is what its own linear gave, to the bit,
wherever the GEMM computes an output feature from its weight row alone, as
eager torch's and XNNPACK's kernels do (tests/test_fused_projections.py
compares transformers' logits and whole programs, fused and not).

Quantization is unchanged by the fusion: torchao's 8da4w / 8da8w scales are
per output row (and per group of input features), so each part's rows get
the scales they would get alone, and the input's dynamic int8 scale is per
token either way.

Integration: ``fuse_projections(model)`` replaces ``q_proj``, ``k_proj``,
``v_proj`` of each attention module (and ``gate_proj``, ``up_proj`` of each
MLP) with ``FusedPart`` modules that share one ``FusedLinear``
(``qkv_proj`` / ``gate_up_proj``, the names vLLM and Phi-3 use). transformers'
modeling code keeps calling ``self.q_proj(x)`` etc.; the first part called
with an input computes the fused projection, the others reuse it.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from executorch_cellcache.graph.block_offsets import project

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED_NAMES = {QKV: "qkv_proj", GATE_UP: "gate_up_proj"}


class FusedLinear(nn.Linear):
    """One nn.Linear holding several parts' weight rows one after another;
    remembers its last input's output so each part of one forward reuses it.

    sizes: each part's out_features, in order."""

    def __init__(self, parts: Sequence[nn.Linear]):
        first = parts[0]
        self.sizes: List[int] = [p.out_features for p in parts]
        super().__init__(first.in_features, sum(self.sizes), bias=first.bias is not None,
                         device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(torch.cat([p.weight for p in parts]))
            if self.bias is not None:
                self.bias.copy_(torch.cat([p.bias for p in parts]))
        self._last: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None
        self._served = 0

    def output_for(self, x: torch.Tensor) -> torch.Tensor:
        """[..., out_features] for input x [..., in_features]; computed once
        for the parts of one call (the same x object, not changed in place
        since: its version counter too), forgotten after the last of them."""
        if self._last is None or self._last[0] is not x or self._last[2] != x._version:
            self._last, self._served = (x, project(self, x), x._version), 0
        out = self._last[1]
        self._served += 1
        if self._served == len(self.sizes):   # every part has it: hold no activations
            self._last = None
        return out


class FusedPart(nn.Module):
    """Part ``index`` of a FusedLinear: forward(x) = what the original linear
    gave, [..., sizes[index]]."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        # A plain attribute, not a child module: the fused linear is registered once,
        # under its own name, so quantization and state dicts see it once.
        object.__setattr__(self, "fused", fused)
        self.start = sum(fused.sizes[:index])
        self.out_features = fused.sizes[index]
        self.in_features = fused.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # slice_copy, not y[..., a:b]: a tensor of its own, contiguous as the
        # linear's output was, so the model's later .contiguous() / reshape
        # calls stay no-ops (a strided view's would each add a copy).
        return torch.ops.aten.slice_copy.Tensor(self.fused.output_for(x), -1, self.start,
                                                self.start + self.out_features)


def _fusable(linears: List[nn.Module]) -> bool:
    """Plain nn.Linears of one input size, dtype and bias presence."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and (m.bias is None) == (first.bias is None) for m in linears)


def fuse_projections(model: nn.Module) -> int:
    """Fuses q/k/v and gate/up of every module of ``model`` that has them as
    plain nn.Linears of the same input (in place); returns how many groups it
    fused. Modules whose projections differ in input size, dtype or bias
    presence, or are already fused (Phi-3's qkv_proj), are left as they are."""
    fused = 0
    for module in list(model.modules()):
        for names in (QKV, GATE_UP):
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts) or hasattr(module, FUSED_NAMES[names]) \
                    or not _fusable(parts):
                continue
            linear = FusedLinear(parts)
            setattr(module, FUSED_NAMES[names], linear)
            for i, name in enumerate(names):
                setattr(module, name, FusedPart(linear, i))
            fused += 1
    return fused
