"""The cell-cache graph ops for PyTorch: ``cellcache::place``, ``cellcache::mask``,
``cellcache::attend``, ``cellcache::write`` and ``cellcache::rope``.

Schemas come from ``ops/cellcache_ops.yaml`` (the same file names the
ExecuTorch kernels). The CPU kernels call the C++ op logic
(``cpp/graph/graph_ops.h``) through the binding, so validation lives once,
in the core; the fake kernels only give shapes for ``torch.export``.

- ``place(handle, positions, layer) -> cells``: serves ``layer`` of the step
  declared on the cache ``handle`` names. handle: int64 [1] (``CellCache.handle``);
  positions: int64 [n_tok]; returns int64 [n_tok], the cell of each token.
- ``mask(handle, cells, layer, extent) -> mask``: the additive attention mask
  of a placed layer. cells: the output of ``place``; extent: a tensor whose
  length is the number of cells attention reads (its values are unused);
  returns float32 [n_tok, extent], 0 = attend, -inf = masked.
- ``attend(handle, query, k_cache, v_cache, cells, layer, scaling, softcap) -> out``:
  attention of a placed layer reading only each token's own cells (its
  sequence's, within the layer's window; SPEC section 8). query: float32
  [n_tok, n_heads, head_dim]; k_cache, v_cache: float32 or float16 [n_cells,
  n_kv_heads, head_dim], or int8 [n_cells, n_kv_heads, head_dim +
  INT8_SCALE_BYTES] (cpp/attention/kv_int8.h) (read, never written); cells: the output of ``place``;
  softcap <= 0 = none; returns float32 [n_tok, n_heads, head_dim]. The CPU
  kernel hands numpy views of the tensors to the C++ kernel (no copies).
- ``write(cache, cells, value) -> empty``: the K/V write of a layer, in
  place: row i of value (float32 [n_tok, n_kv_heads, head_dim]) goes to cell
  cells[i] of cache (float32 or float16 [n_cells, n_kv_heads, head_dim], or
  int8 with head_dim + INT8_SCALE_BYTES), converted to the cache's dtype as
  it is copied (fp16: round to nearest even, as ``Tensor.to``; int8:
  quantized per cell and KV head, cpp/attention/kv_int8.h). One kernel instead of a portable cast and an
  ``index_put_`` a cache. Returns an empty float32 tensor (see the schema).
  A cell outside the cache, rows overlapping it, mismatched shapes or an
  unsupported dtype: InvalidConfigError (checked at export too), nothing written.
- ``rope(x, cos, sin) -> out``: RoPE of a layer's q or k
  (cpp/attention/rope.h): x float32 [*tokens, n_heads, head_dim] (the token
  dims' product: n_tok), cos and sin float32 a row per token, [*tokens,
  head_dim] or [*tokens, 1, head_dim] (e.g. [1, n_tok, 1, head_dim]); returns
  x's shape, equal to the bit to transformers' ``x * cos + rotate_half(x) *
  sin``. exporting/xnnpack_rewrites.py's ``rope_as_op`` puts it where a graph
  has that pattern. Odd head_dim, cos/sin of another shape, or another dtype:
  InvalidConfigError or TypeError (at export too).
"""

import math
from pathlib import Path

import torch
import yaml
from torch.fx.experimental.symbolic_shapes import statically_known_true

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError

NAMESPACE = "cellcache"


def _schemas():
    path = Path(__file__).resolve().parent / "cellcache_ops.yaml"
    if not path.exists():  # editable checkout: the file lives in ops/
        path = Path(__file__).resolve().parents[2] / "ops" / "cellcache_ops.yaml"
    return yaml.safe_load(path.read_text())


_lib = torch.library.Library(NAMESPACE, "DEF")
for _op in _schemas():
    _lib.define(_op["schema"])
    _lib.define(_op["out_schema"])


def _handle(handle: torch.Tensor) -> int:
    if handle.dtype != torch.int64 or handle.numel() != 1:
        raise TypeError(f"cache handle must be an int64 tensor of one element, got "
                        f"{handle.dtype} with {handle.numel()} elements")
    return int(handle.reshape(()).item())


def _int64_vector(t: torch.Tensor, what: str):
    if t.dtype != torch.int64 or t.dim() != 1:
        raise TypeError(f"{what} must be a 1-D int64 tensor, got {t.dtype} of shape "
                        f"{tuple(t.shape)}")
    return t.contiguous().numpy()


# torch.library.impl used as a decorator returns None, so the functional
# kernels are registered by call and stay bound for the .out kernels below.
def _place_cpu(handle, positions, layer):
    cells = _core.place_op(_handle(handle), _int64_vector(positions, "positions"), layer)
    return torch.from_numpy(cells)


torch.library.impl(f"{NAMESPACE}::place", "CPU")(_place_cpu)


@torch.library.impl(f"{NAMESPACE}::place.out", "CPU")
def _place_out_cpu(handle, positions, layer, *, out):
    out.resize_(positions.shape).copy_(_place_cpu(handle, positions, layer))
    return out


def _mask_cpu(handle, cells, layer, extent):
    if extent.dim() != 1:
        raise TypeError(f"extent must be a 1-D tensor (its length is the attention extent), "
                        f"got shape {tuple(extent.shape)}")
    mask = _core.mask_op(_handle(handle), _int64_vector(cells, "cells"), layer,
                         extent.shape[0])
    return torch.from_numpy(mask)


torch.library.impl(f"{NAMESPACE}::mask", "CPU")(_mask_cpu)


@torch.library.impl(f"{NAMESPACE}::mask.out", "CPU")
def _mask_out_cpu(handle, cells, layer, extent, *, out):
    out.resize_((cells.shape[0], extent.shape[0])).copy_(_mask_cpu(handle, cells, layer, extent))
    return out


KV_DTYPES = (torch.float32, torch.float16, torch.int8)


def kv_head_dim(cache: torch.Tensor) -> int:
    """head_dim of a K/V buffer [n_cells, n_kv_heads, last]: last, less the
    scale bytes of an int8 buffer's heads."""
    return cache.shape[-1] - (_core.INT8_SCALE_BYTES if cache.dtype == torch.int8 else 0)



def _attend_cpu(handle, query, k_cache, v_cache, cells, layer, scaling, softcap):
    if query.dtype != torch.float32:
        raise TypeError(f"attend: query must be float32, got {query.dtype}")
    for t in (k_cache, v_cache):
        _check_kv_dtype(t, "attend")
    out = torch.empty(query.shape, dtype=torch.float32)
    # .numpy() of a contiguous CPU tensor shares its memory: K/V are never copied.
    _core.attend_op(_handle(handle), query.contiguous().numpy(), k_cache.contiguous().numpy(),
                    v_cache.contiguous().numpy(), _int64_vector(cells, "cells"), layer,
                    scaling, softcap, out.numpy())
    return out


torch.library.impl(f"{NAMESPACE}::attend", "CPU")(_attend_cpu)


def _into_out(op: str, out, shape, compute):
    """An .out kernel's float32 result of ``shape``: ``compute()`` returns it
    fresh, before out is touched, so a refused call leaves out as it was, out
    may be one of the inputs, and out is never shown to numpy (which makes a
    storage non-resizable); then out is resized and filled. An out whose
    storage cannot grow to ``shape`` is refused (InvalidConfigError): torch's
    resize_ would set the shape, then fail to grow it, leaving a tensor larger
    than its memory."""
    if out.dtype != torch.float32:
        raise TypeError(f"{op}: out must be float32, got {out.dtype}")
    result = compute()
    needed = (out.storage_offset() + result.numel()) * result.element_size()
    if tuple(out.shape) != tuple(shape) and needed > out.untyped_storage().nbytes() and \
            not out.untyped_storage().resizable():
        raise InvalidConfigError(f"{op}: out {tuple(out.shape)} cannot grow to "
                                 f"{tuple(shape)} (its storage is not resizable)")
    return out.resize_(shape).copy_(result)


@torch.library.impl(f"{NAMESPACE}::attend.out", "CPU")
def _attend_out_cpu(handle, query, k_cache, v_cache, cells, layer, scaling, softcap, *, out):
    return _into_out("attend", out, query.shape, lambda: _attend_cpu(
        handle, query, k_cache, v_cache, cells, layer, scaling, softcap))


def _check_kv_dtype(t, op: str) -> None:
    if t.dtype not in KV_DTYPES:  # numpy has no bfloat16 &c.: refuse before converting
        raise InvalidConfigError(f"{op}: unsupported K/V dtype {t.dtype} (supported: "
                                 f"{', '.join(str(d) for d in KV_DTYPES)})")


def _check_write(cache, cells, value) -> None:
    """What write's kernels refuse, checked on real and fake tensors alike (so
    a program that could not run is refused at export)."""
    _check_kv_dtype(cache, "write")
    if cache.dim() != 3:
        raise InvalidConfigError(f"write: cache must be [n_cells, n_kv_heads, head_dim], got "
                                 f"shape {tuple(cache.shape)}")
    if value.dtype != torch.float32:
        raise TypeError(f"write: value must be float32, got {value.dtype}")
    head_dim = kv_head_dim(cache)
    if value.dim() != 3 or tuple(value.shape[1:]) != (cache.shape[1], head_dim):
        raise InvalidConfigError(f"write: value must be float32 [n_tok, {cache.shape[1]}, "
                                 f"{head_dim}] (cache {cache.dtype} {tuple(cache.shape)} and "
                                 f"value must agree), got shape {tuple(value.shape)}")
    if cells.dtype != torch.int64 or cells.dim() != 1:
        raise TypeError(f"write: cells must be a 1-D int64 tensor, got {cells.dtype} of "
                        f"shape {tuple(cells.shape)}")


def _write_cpu(cache, cells, value):
    _check_write(cache, cells, value)
    if not cache.is_contiguous():
        raise TypeError("write: cache must be contiguous (it is written in place)")
    _core.write_op(cache.numpy(), _int64_vector(cells, "cells"), value.contiguous().numpy())
    return value.new_empty((0,))


torch.library.impl(f"{NAMESPACE}::write", "CPU")(_write_cpu)


@torch.library.impl(f"{NAMESPACE}::write.out", "CPU")
def _write_out_cpu(cache, cells, value, *, out):
    if out.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
        raise ValueError("write.out: out must not share memory with the cache (it is resized "
                         "to the empty result)")
    _write_cpu(cache, cells, value)
    return out.resize_((0,))


@torch.library.register_fake(f"{NAMESPACE}::write")
def _write_fake(cache, cells, value):
    _check_write(cache, cells, value)
    return value.new_empty((0,))


@torch.library.register_fake(f"{NAMESPACE}::attend")
def _attend_fake(handle, query, k_cache, v_cache, cells, layer, scaling, softcap):
    return query.new_empty(query.shape, dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::place")
def _place_fake(handle, positions, layer):
    return positions.new_empty(positions.shape, dtype=torch.int64)


@torch.library.register_fake(f"{NAMESPACE}::mask")
def _mask_fake(handle, cells, layer, extent):
    return cells.new_empty((cells.shape[0], extent.shape[0]), dtype=torch.float32)


def _check_rope(x, cos, sin) -> None:
    """What rope's kernels refuse, checked on real and fake tensors alike."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise TypeError(f"rope: {name} must be float32, got {t.dtype}")
    if x.dim() < 2 or cos.dim() < 1 or sin.dim() < 1:
        raise InvalidConfigError(f"rope: x must be [..., n_heads, head_dim] and cos, sin "
                                 f"[..., head_dim], got shapes {tuple(x.shape)}, "
                                 f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    head_dim = x.shape[-1]
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape[-1] != head_dim:
        raise InvalidConfigError(f"rope: head_dim must be even and cos, sin must end in it; "
                                 f"got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin "
                                 f"{tuple(sin.shape)}")
    # A row per token, laid out as x's token dims: [*tokens, head_dim] or [*tokens, 1,
    # head_dim] (eager broadcasting's form). Any other shape of n_tok rows (x [2, 3, 2, 8],
    # cos [3, 2, 8]: per-head tables to eager) would be read as token rows all the same.
    # Known unequal (always on real tensors, at export where the shapes tell) is refused
    # here; the kernels refuse the rest (attention::rope_shape, the same rule).
    tokens = list(x.shape[:-2])
    for name, t in (("cos", cos), ("sin", sin)):
        lead = list(t.shape[:-1])
        if len(lead) == len(tokens) + 1 and not statically_known_true(lead[-1] != 1):
            lead = lead[:-1]
        if len(lead) != len(tokens) or any(statically_known_true(a != b)
                                           for a, b in zip(lead, tokens)):
            raise InvalidConfigError(
                f"rope: {name} must hold one row per token of x, shaped [*tokens, head_dim] "
                f"or [*tokens, 1, head_dim] where x is [*tokens, n_heads, head_dim] "
                f"({math.prod(x.shape[:-2])} rows); got x {tuple(x.shape)}, {name} "
                f"{tuple(t.shape)}")


def _rope_cpu(x, cos, sin):
    _check_rope(x, cos, sin)
    out = torch.empty(x.shape, dtype=torch.float32)
    # The op has no gradient: a module's output that requires one is read as a value.
    _core.rope_op(*(t.detach().contiguous().numpy() for t in (x, cos, sin)), out.numpy())
    return out


torch.library.impl(f"{NAMESPACE}::rope", "CPU")(_rope_cpu)


@torch.library.impl(f"{NAMESPACE}::rope.out", "CPU")
def _rope_out_cpu(x, cos, sin, *, out):
    return _into_out("rope", out, x.shape, lambda: _rope_cpu(x, cos, sin))


@torch.library.register_fake(f"{NAMESPACE}::rope")
def _rope_fake(x, cos, sin):
    _check_rope(x, cos, sin)
    return x.new_empty(x.shape, dtype=torch.float32)


place = torch.ops.cellcache.place.default
mask = torch.ops.cellcache.mask.default
attend = torch.ops.cellcache.attend.default
write = torch.ops.cellcache.write.default
rope = torch.ops.cellcache.rope.default
