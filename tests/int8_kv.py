"""The int8 K/V rule of cpp/attention/kv_int8.h, written again in numpy from
its text (an oracle for the tests, independent of the C++): symmetric absmax
per (cell, KV head), scale = fl32(amax / 127), q = clamp(round half to even
(fl32(x / scale)), -127, 127); a head with a non-finite value gets a NaN scale
and q = 0; a zero scale gives q = 0. Buffers are int8 [..., head_dim + 4]:
the values, then the fp32 scale's bytes."""

import numpy as np
import torch

SCALE_BYTES = 4


def quantize(x: np.ndarray):
    """x: float32 [..., hd] -> (q int8 [..., hd], scale float32 [...])."""
    x = np.asarray(x, dtype=np.float32)
    finite = np.isfinite(x).all(-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(x), x, 0)).max(-1), 0).astype(np.float32)
    scale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    with np.errstate(over="ignore"):
        q = np.clip(np.rint((x / safe).astype(np.float32)), -127, 127)
    q = np.where((scale > 0)[..., None] & finite[..., None], q, 0).astype(np.int8)
    return q, np.where(finite, scale, np.float32(np.nan)).astype(np.float32)


def pack(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_cells, n_kv, hd] -> the int8 buffer the rule stores."""
    q, scale = quantize(x.numpy())
    scale_bytes = np.ascontiguousarray(scale[..., None]).view(np.int8)
    return torch.from_numpy(np.concatenate([q, scale_bytes], -1))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., hd] -> the values the rule reads back, fl32(q * scale)."""
    q, scale = quantize(x.numpy())
    return torch.from_numpy((q.astype(np.float32) * scale[..., None]).astype(np.float32))
