"""Attention over the cell cache: write this step's K/V at the placed cells,
then attend.

Two paths, chosen per program (``ATTENTION_PATHS``):
- "cells" (default): ``cellcache::attend`` reads, for each token, only its own
  sequence's cells within its layer's window (SPEC section 8); the graph holds
  no copy of the cache.
- "reference": scores the first ``extent`` cells of the pool with the dense
  ``cellcache::mask`` (SPEC section 1); kept to compare the two on the same
  weights.

K/V storage (``ops.KV_DTYPES``): fp32, fp16, or int8 with a scale per cell and KV
head (cpp/attention/kv_int8.h), which only the cells path reads.

On the reference path, grouped-query attention (GQA) folds the query heads that share a KV head into
the row dimension instead of expanding K/V, so no copy of the cache is made
per head (transformers' ``repeat_kv`` order: query head h reads KV head
h // group).
"""

from typing import Optional

import torch

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.graph import ops

ATTENTION_PATHS = ("cells", "reference")


def check_attention_path(attention: str, kv_dtype: torch.dtype) -> None:
    """Refuses a path/K-V dtype pair no graph can run (InvalidConfigError),
    before any tracing: an unknown path or dtype, or int8 K/V on the
    reference path (whose dense attention reads fp32/fp16 buffers only)."""
    if attention not in ATTENTION_PATHS:
        raise InvalidConfigError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, "
                                 f"got {attention!r}")
    if kv_dtype not in ops.KV_DTYPES:
        raise InvalidConfigError(f"unsupported K/V dtype {kv_dtype} (supported: "
                                 f"{', '.join(str(d) for d in ops.KV_DTYPES)})")
    if kv_dtype == torch.int8 and attention != "cells":
        raise InvalidConfigError(f"int8 K/V needs the 'cells' attention path, not "
                                 f"{attention!r} (the dense-mask reference path reads fp32 or "
                                 f"fp16 K/V only)")


def kv_cache_buffer(n_cells: int, n_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """A zeroed K (or V) buffer of a layer: [n_cells, n_kv_heads, head_dim] of
    fp32 or fp16, or int8 [n_cells, n_kv_heads, head_dim + INT8_SCALE_BYTES]:
    each head's int8 values, then its fp32 scale (cpp/attention/kv_int8.h).
    An all-zero int8 head reads back as zeros (scale 0)."""
    last = head_dim + _core.INT8_SCALE_BYTES if dtype == torch.int8 else head_dim
    return torch.zeros(n_cells, n_kv_heads, last, dtype=dtype)


def write_cells(cache: torch.Tensor, cells: torch.Tensor, new: torch.Tensor) -> None:
    """Writes ``new`` into ``cache`` at ``cells``, in place (``cellcache::write``).

    cache: ``kv_cache_buffer``'s shape and dtype; cells: int64 [n_tok];
    new: [n_tok, n_kv_heads, head_dim], converted to the cache's dtype (int8:
    quantized per cell and KV head).
    """
    ops.write(cache, cells, new.float().contiguous())


def dense_attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           mask: torch.Tensor, scaling: float,
           softcap: Optional[float] = None) -> torch.Tensor:
    """Scaled dot-product attention of ``query`` over ``cache[:extent]``.

    query: [n_tok, n_heads, head_dim]; k_cache, v_cache: [n_cells, n_kv_heads,
    head_dim]; mask: float32 [n_tok, extent] additive (0 attend, -inf masked);
    returns [n_tok, n_heads, head_dim] in query's dtype. Softmax runs in fp32,
    as transformers' eager attention does.
    """
    n_tok, n_heads, head_dim = query.shape
    extent = mask.shape[1]
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    k = k_cache[:extent].permute(1, 2, 0)  # [n_kv, head_dim, extent]
    v = v_cache[:extent].permute(1, 0, 2)  # [n_kv, extent, head_dim]
    # [n_tok, n_kv, group, hd] -> [n_kv, n_tok * group, hd]
    q = query.reshape(n_tok, n_kv, group, head_dim).permute(1, 0, 2, 3)
    q = q.reshape(n_kv, n_tok * group, head_dim)
    scores = torch.bmm(q, k.to(q.dtype)) * scaling  # [n_kv, n_tok * group, extent]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().reshape(n_kv, n_tok, group, extent) + mask[None, :, None, :]
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.bmm(probs.reshape(n_kv, n_tok * group, extent), v.to(query.dtype))
    # [n_kv, n_tok * group, hd] -> [n_tok, n_heads, hd]
    return out.reshape(n_kv, n_tok, group, head_dim).permute(1, 0, 2, 3).reshape(
        n_tok, n_heads, head_dim)


class StepInputs:
    """What every layer of one forward needs from the graph inputs.

    handle: int64 [1], the CellCache's handle; positions: int64 [n_tok];
    extent: a tensor of length ``extent`` (values unused), the number of
    cells the reference path reads (>= the cache's used_end after placement;
    unused on the cells path). attention: one of ``ATTENTION_PATHS``.
    Masks are shared by the layers with the same window: the first such layer
    asks the cache for it, the rest reuse the tensor.
    """

    def __init__(self, handle: torch.Tensor, positions: torch.Tensor, extent: torch.Tensor,
                 attention: str = "cells"):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
        self.handle = handle
        self.positions = positions
        self.extent = extent
        self.attention = attention
        self._masks = {}

    def place(self, layer: int) -> torch.Tensor:
        return ops.place(self.handle, self.positions, layer)

    def mask(self, layer: int, window: Optional[int], cells: torch.Tensor) -> torch.Tensor:
        if window not in self._masks:
            self._masks[window] = ops.mask(self.handle, cells, layer, self.extent)
        return self._masks[window]


def cell_cache_layer(step: StepInputs, layer: int, window: Optional[int],
                     query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, scaling: float,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """One layer's cache work: place, write K/V in place, attend.

    query: [n_tok, n_heads, hd]; key, value: [n_tok, n_kv_heads, hd];
    k_cache, v_cache: ``kv_cache_buffer``s (fp32, fp16, or int8 on the cells
    path); returns [n_tok, n_heads, hd] in query's dtype.
    """
    cells = step.place(layer)
    write_cells(k_cache, cells, key)
    write_cells(v_cache, cells, value)
    if step.attention == "cells":
        out = ops.attend(step.handle, query.float().contiguous(), k_cache, v_cache, cells, layer,
                         float(scaling), float(softcap) if softcap else 0.0)
        return out.to(query.dtype)
    mask = step.mask(layer, window, cells)
    return dense_attend(query, k_cache, v_cache, mask, scaling, softcap)
