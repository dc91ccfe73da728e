"""Projections of the same input computed by one linear: q/k/v and gate/up.

A decoder layer projects its normed input three times for attention (q, k, v)
and twice for the MLP (gate, up). Each projection is one GEMM in the program,
and for weight-quantized programs each also quantizes its input again
(dynamic int8 activations). One linear with the parts' weights concatenated
reads the same weight bytes, quantizes the input once and makes one kernel
call where there were three (or two): on the 135M bench model at one token,
the five GEMMs of a layer took 1.2-1.6x as long as the two fused ones
(scripts/bench_fused_projections.py; issue #27).

How the parts are split again matters: XNNPACK refuses slices of a
dynamically shaped tensor, and a slice outside the delegate would split the
layer's partition. So the fused rows are interleaved: with u the parts'
common unit (KV heads x head_dim for q/k/v, intermediate size for gate/up)
and part p taking c_p units (q: n_heads / n_kv_heads, k and v: 1), the
fused output viewed as [..., u, C] (C = sum c_p) holds part p's feature
i * c_p + a at [..., i, o_p + a]. Part p is then a linear over that last
dim with a constant 0/1 weight [c_p, C] (one 1 per row): [..., u, c_p],
viewed as [..., u * c_p], its features in their own order. 0/1 weights give
the values exactly (1 * x + 0 * y = x for finite y), and a GEMM with K = C
(at most n_heads / n_kv_heads + 2) costs next to nothing beside the
projection.

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

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED_NAMES = {QKV: "qkv_proj", GATE_UP: "gate_up_proj"}
SELECT = "cellcache_select"   # the parts' 0/1 weights: their buffer names start so


class FusedLinear(nn.Linear):
    """One nn.Linear holding several parts' rows, interleaved (module doc);
    remembers its last input's output so each part of one forward reuses it.

    units: u; counts: c_p per part (each part had u * c_p output features)."""

    def __init__(self, parts: Sequence[nn.Linear], units: int, counts: Sequence[int]):
        first = parts[0]
        super().__init__(first.in_features, units * sum(counts), bias=first.bias is not None,
                         device=first.weight.device, dtype=first.weight.dtype)
        self.units, self.counts = units, list(counts)
        with torch.no_grad():
            self.weight.copy_(_interleave([p.weight for p in parts], units, counts))
            if self.bias is not None:
                self.bias.copy_(_interleave([p.bias[:, None] for p in parts], units,
                                            counts)[:, 0])
        self._last: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._served = 0

    def output_for(self, x: torch.Tensor) -> torch.Tensor:
        """[..., units, C] for input x [..., in_features]; computed once for
        the parts of one call (the same x object), forgotten after the last."""
        if self._last is None or self._last[0] is not x:
            y = super().forward(x)
            self._last, self._served = (x, y.view(*y.shape[:-1], self.units, sum(self.counts))), 0
        out = self._last[1]
        self._served += 1
        if self._served == len(self.counts):   # every part has it: hold no activations
            self._last = None
        return out


class FusedPart(nn.Module):
    """Part ``index`` of a FusedLinear: forward(x) = what the original linear
    gave, [..., units * counts[index]]."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        # A plain attribute, not a child module: the fused linear is registered once,
        # under its own name, so quantization and state dicts see it once.
        object.__setattr__(self, "fused", fused)
        counts = fused.counts
        select = torch.zeros(counts[index], sum(counts))
        offset = sum(counts[:index])
        select[torch.arange(counts[index]), offset + torch.arange(counts[index])] = 1.0
        self.register_buffer(f"{SELECT}", select.to(fused.weight.dtype), persistent=False)
        self.out_features = fused.units * counts[index]
        self.in_features = fused.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(self.fused.output_for(x), getattr(self, SELECT))
        return y.view(*y.shape[:-2], self.out_features)


def _interleave(weights: List[torch.Tensor], units: int, counts: Sequence[int]) -> torch.Tensor:
    """Rows of the fused weight: part p's row i * c_p + a at fused row
    i * C + o_p + a. weights: [units * c_p, in] each."""
    blocks = [w.reshape(units, c, w.shape[-1]) for w, c in zip(weights, counts, strict=True)]
    return torch.cat(blocks, dim=1).reshape(units * sum(counts), -1)


def _fusable(linears: List[nn.Module]) -> Optional[Tuple[int, List[int]]]:
    """(units, counts) when ``linears`` are plain nn.Linears of one input
    size, dtype and bias presence whose output sizes share a unit; else None."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0]
    if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
           or (m.bias is None) != (first.bias is None) for m in linears):
        return None
    units = math.gcd(*(m.out_features for m in linears))
    if min(m.out_features for m in linears) != units:
        return None   # the unit must be a whole part (heads of q / k / v, or the MLP width)
    return units, [m.out_features // units for m in linears]


def fuse_projections(model: nn.Module) -> int:
    """Fuses q/k/v and gate/up of every module of ``model`` that has them as
    plain nn.Linears of the same input (in place); returns how many groups it
    fused. Modules whose projections differ in input size, dtype or bias
    presence, or are already fused (Phi-3's qkv_proj), are left as they are."""
    fused = 0
    for module in list(model.modules()):
        for names in (QKV, GATE_UP):
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts) or hasattr(module, FUSED_NAMES[names]):
                continue
            shape = _fusable(parts)
            if shape is None:
                continue
            linear = FusedLinear(parts, *shape)
            setattr(module, FUSED_NAMES[names], linear)
            for i, name in enumerate(names):
                setattr(module, name, FusedPart(linear, i))
            fused += 1
    return fused
