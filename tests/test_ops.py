"""cellcache::place and cellcache::mask as torch.library ops (opcheck, eager
errors) and as ExecuTorch kernels (registered on import, missing without it)."""

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from executorch_cellcache import (
    CellCache,
    InvalidConfigError,
    LayerOutOfRangeError,
    PositionConflictError,
    StepNotDeclaredError,
    UnknownCacheError,
)
from executorch_cellcache.cache import _core
from test_core_edges import _NOT_INTS

place = torch.ops.cellcache.place.default
mask = torch.ops.cellcache.mask.default

OPCHECK_UTILS = ["test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic"]


def _handle(cache):
    return torch.tensor([cache.handle], dtype=torch.int64)


def _extent(n):
    return torch.empty(n, dtype=torch.uint8)


@pytest.fixture
def cache():
    return CellCache(16, 2, [None, 2])


# ------------------------------------------------------------------ opcheck

class _FreshForward:
    """Wraps the core's place so that every *real* execution of
    cellcache::place inside opcheck is its own declared forward.

    place is not a pure function: it serves each layer of a declared step once
    (SPEC 1, step protocol), so a second real call with the same layer is,
    correctly, a StepNotDeclaredError. opcheck's test_aot_dispatch_dynamic runs
    the op eagerly and again through AOTAutograd, i.e. it models several
    forwards. To keep the check honest we do what a runner does before every
    forward: undo the previous forward's placement (seq_rm of the positions it
    placed, which frees exactly those cells) and declare the step again. The
    cache then chooses the same lowest free cells, so every real call must
    return the same cells; opcheck compares them. Fake-tensor runs never reach
    this wrapper (the fake kernel has no side effect)."""

    def __init__(self, cache, seq, n_tok):
        self.cache, self.seq, self.n_tok = cache, seq, n_tok
        self.real = _core.place_op
        self.calls = 0

    def __call__(self, handle, positions, layer):
        if self.calls:
            self.cache.seq_rm(self.seq, 0)
            assert self.cache.declare_step([self.seq] * self.n_tok)
        self.calls += 1
        return self.real(handle, positions, layer)


@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_place(cache, util, monkeypatch):
    # Each test_util runs separately, each after a fresh declare_step: a
    # declared step may serve each layer once, and test utils share nothing.
    s = cache.seq_new()
    positions = torch.arange(3, dtype=torch.int64)
    assert cache.declare_step([s] * 3)
    fresh = _FreshForward(cache, s, 3)
    monkeypatch.setattr(_core, "place_op", fresh)
    result = torch.library.opcheck(place, (_handle(cache), positions, 0), test_utils=util)
    assert result == {util: "SUCCESS"}
    if util == "test_aot_dispatch_dynamic":
        assert fresh.calls >= 2  # several forwards: the reason for _FreshForward
    cache.check_invariants()
    if fresh.calls:  # (test_autograd_registration needs no real run without grads)
        assert sorted(cache.cell_positions()[:3]) == [0, 1, 2]
        assert cache.free_cells == 16 - 3


def test_place_is_served_once_per_layer_per_step(cache):
    """Why opcheck needs _FreshForward: the second real call of one layer in
    one step is an undeclared forward."""
    s = cache.seq_new()
    assert cache.declare_step([s] * 3)
    pos = torch.arange(3)
    cells = place(_handle(cache), pos, 0)
    assert cells.dtype == torch.int64 and cells.tolist() == [0, 1, 2]
    assert place(_handle(cache), pos, 1).tolist() == [0, 1, 2]  # later layer reuses
    with pytest.raises(StepNotDeclaredError, match=r"layer 0 ran a forward with no declared step \(declare_step before each forward"):
        place(_handle(cache), pos, 0)


@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_mask(cache, util):
    # mask only reads the placed step, so any number of real calls per step is
    # fine; still, run each util on its own freshly placed step.
    s = cache.seq_new()
    assert cache.declare_step([s] * 3)
    cells = place(_handle(cache), torch.arange(3), 1)
    result = torch.library.opcheck(mask, (_handle(cache), cells, 1, _extent(3)),
                                   test_utils=util)
    assert result == {util: "SUCCESS"}


def test_mask_values(cache):
    """Additive mask: 0 where SPEC's rule allows, -inf elsewhere; window 2 on layer 1."""
    a, b = cache.seq_new(), cache.seq_new()
    assert cache.declare_step([a, a, a, b])
    cells = place(_handle(cache), torch.tensor([0, 1, 2, 0]), 0)
    place(_handle(cache), torch.tensor([0, 1, 2, 0]), 1)
    inf = float("-inf")
    full = mask(_handle(cache), cells, 0, _extent(4))
    assert full.dtype == torch.float32 and full.shape == (4, 4)
    assert full.tolist() == [[0, inf, inf, inf], [0, 0, inf, inf], [0, 0, 0, inf],
                             [inf, inf, inf, 0]]
    win = mask(_handle(cache), cells, 1, _extent(4))
    assert win.tolist() == [[0, inf, inf, inf], [0, 0, inf, inf], [inf, 0, 0, inf],
                            [inf, inf, inf, 0]]


def test_out_variants(cache):
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    out = torch.empty(0, dtype=torch.int64)
    r = torch.ops.cellcache.place.out(_handle(cache), torch.arange(2), 0, out=out)
    assert r is out and out.tolist() == [0, 1]
    m = torch.empty(0, 0, dtype=torch.float32)
    torch.ops.cellcache.mask.out(_handle(cache), out, 0, _extent(2), out=m)
    assert m.tolist() == [[0, float("-inf")], [0, 0]]


# ------------------------------------------------------------------ eager errors

def test_positions_wrong_dtype(cache):
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    with pytest.raises(TypeError, match="int64"):
        place(_handle(cache), torch.arange(2, dtype=torch.int32), 0)
    # nothing changed: the declaration still stands and places correctly
    assert place(_handle(cache), torch.arange(2), 0).tolist() == [0, 1]


def test_positions_wrong_length(cache):
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    with pytest.raises(PositionConflictError,
                       match="got 3 positions for a step declared with 2 tokens"):
        place(_handle(cache), torch.arange(3), 0)
    assert cache.free_cells == 16
    assert place(_handle(cache), torch.arange(2), 0).tolist() == [0, 1]


def test_forward_not_declared(cache):
    cache.seq_new()
    with pytest.raises(StepNotDeclaredError, match=r"layer 0 ran a forward with no declared step \(declare_step before each forward"):
        place(_handle(cache), torch.arange(2), 0)


def test_destroyed_cache_handle():
    c = CellCache(8, 1)
    handle = _handle(c)
    del c
    gc.collect()
    gone = rf"cache handle {int(handle)} names no live CellCache \(destroyed"
    with pytest.raises(UnknownCacheError, match=gone):
        place(handle, torch.arange(1), 0)
    with pytest.raises(UnknownCacheError, match=gone):
        mask(handle, torch.zeros(1, dtype=torch.int64), 0, _extent(1))


def test_handle_wrong_dtype(cache):
    s = cache.seq_new()
    assert cache.declare_step([s])
    with pytest.raises(TypeError, match="handle"):
        place(torch.tensor([cache.handle], dtype=torch.int32), torch.arange(1), 0)


@pytest.mark.parametrize("layer", [-1, 2, 1000])
def test_layer_out_of_range(cache, layer):
    s = cache.seq_new()
    assert cache.declare_step([s])
    out_of_range = rf"layer {layer} is out of range \[0, 2\)"
    with pytest.raises(LayerOutOfRangeError, match=out_of_range):
        place(_handle(cache), torch.arange(1), layer)
    cells = place(_handle(cache), torch.arange(1), 0)
    with pytest.raises(LayerOutOfRangeError, match=out_of_range):
        mask(_handle(cache), cells, layer, _extent(1))


def test_extent_bounds(cache):
    s = cache.seq_new()
    assert cache.declare_step([s] * 3)
    assert cache.planned_used_end == 3
    cells = place(_handle(cache), torch.arange(3), 0)
    assert cache.used_end == 3 and cache.written_end == 3
    with pytest.raises(InvalidConfigError,  # smaller than used_end
                       match=r"attention extent 2 must lie in \[used_end 3, written_end 3\]"):
        mask(_handle(cache), cells, 0, _extent(2))
    with pytest.raises(InvalidConfigError,  # past written_end: never-written K/V
                       match=r"attention extent 4 must lie in \[used_end 3, written_end 3\]"):
        mask(_handle(cache), cells, 0, _extent(4))
    assert mask(_handle(cache), cells, 0, _extent(3)).shape == (3, 3)


def test_mask_before_place(cache):
    s = cache.seq_new()
    assert cache.declare_step([s])
    with pytest.raises(StepNotDeclaredError, match="layer 0 has not been placed in the current step"):
        mask(_handle(cache), torch.zeros(1, dtype=torch.int64), 0, _extent(1))


# ------------------------------------------------------------------ ExecuTorch kernels

def test_executorch_kernels_registered():
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    names = set(_get_operator_names())
    assert "cellcache::place.out" in names
    assert "cellcache::mask.out" in names


@pytest.fixture(scope="module")
def tiny_pte(tmp_path_factory):
    """A minimal cellcache program: place then mask (no XNNPACK needed)."""
    from executorch.exir import to_edge, ExecutorchBackendConfig

    class Tiny(torch.nn.Module):
        def forward(self, positions, handle, extent):
            cells = place(handle, positions, 0)
            return mask(handle, cells, 0, extent)

    dims = ({0: torch.export.Dim("n", min=1, max=8)}, None,
            {0: torch.export.Dim("e", min=1, max=8)})
    args = (torch.arange(2), torch.zeros(1, dtype=torch.int64), _extent(2))
    with torch.no_grad():
        ep = torch.export.export(Tiny(), args, dynamic_shapes=dims, strict=False)
        prog = to_edge(ep).to_executorch(ExecutorchBackendConfig())
    path = tmp_path_factory.mktemp("tiny") / "tiny.pte"
    path.write_bytes(prog.buffer)
    return path


def test_tiny_program_runs_in_process(tiny_pte):
    from executorch.runtime import Runtime

    c = CellCache(8, 1)
    s = c.seq_new()
    assert c.declare_step([s, s])
    m = Runtime.get().load_program(str(tiny_pte)).load_method("forward")
    out = m.execute([torch.arange(2), _handle(c), _extent(c.planned_used_end)])[0]
    assert out.tolist() == [[0, float("-inf")], [0, 0]]


def test_runtime_without_import_names_missing_operator(tiny_pte):
    """Without `import executorch_cellcache` the kernels are not registered:
    ExecuTorch logs `Missing operator: [i] cellcache::place.out` (and
    `kernel 'cellcache::place.out' not found.`), and load_method raises
    RuntimeError `Failed to load method forward, error: 0x:14`
    (Error::OperatorMissing). Nothing runs and nothing crashes."""
    script = textwrap.dedent(f"""
        import sys, torch
        from executorch.runtime import Runtime
        assert "executorch_cellcache" not in sys.modules
        prog = Runtime.get().load_program({str(tiny_pte)!r})
        m = prog.load_method("forward")
        m.execute([torch.arange(2), torch.zeros(1, dtype=torch.int64),
                   torch.empty(2, dtype=torch.uint8)])
        print("RAN WITHOUT THE KERNELS")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd="/")
    output = r.stdout + r.stderr
    assert r.returncode != 0, output
    assert r.returncode > 0, f"crashed with signal {-r.returncode}: {output}"
    assert "RAN WITHOUT THE KERNELS" not in output
    assert "cellcache::place.out" in output
    assert "Missing operator" in output
    assert "RuntimeError" in output and "Failed to load method forward" in output


def test_mask_extent_must_be_a_vector_and_is_checked_before_allocating():
    cache = CellCache(8)
    h = torch.tensor([cache.handle])
    s = cache.seq_new()
    assert cache.declare_step([s])
    cells = torch.ops.cellcache.place(h, torch.tensor([0]), 0)
    with pytest.raises(TypeError, match="1-D"):
        torch.ops.cellcache.mask(h, cells, 0, torch.tensor(3))
    with pytest.raises(InvalidConfigError, match="1099511627776"):
        torch.ops.cellcache.mask(h, cells, 0, torch.zeros(1).expand(2**40))


def test_layer_beyond_int32_is_named_as_passed():
    cache = CellCache(8)
    h = torch.tensor([cache.handle])
    assert cache.declare_step([cache.seq_new()])
    with pytest.raises(LayerOutOfRangeError, match="1099511627776"):
        torch.ops.cellcache.place(h, torch.tensor([0]), 2**40)


# ------------------------------------------------------------------ integer arguments

def _placed_layer_0():
    """A cache with one sequence at positions 0..2 on both layers, then a step
    for position 3 placed on layer 0 only (layer 1 still to serve): the ops'
    valid arguments, and K/V buffers for attend."""
    cache = CellCache(16, 2, [None, 2])
    s = cache.seq_new()
    for p in range(4):
        assert cache.declare_step([s])
        cells = _core.place_op(cache.handle, np.array([p]), 0)
        if p < 3:
            _core.place_op(cache.handle, np.array([p]), 1)
    rng = np.random.default_rng(0)
    kv = [rng.standard_normal((16, 1, 4)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    return cache, cells, kv, q


def _attend(handle, q, kv, cells, layer):
    out = np.full_like(q, 7.0)
    _core.attend_op(handle, q, kv[0], kv[1], cells, layer, 0.5, 0.0, out)
    return out


_OP_CALLS = {
    "place_op handle": lambda c, cells, kv, q, x: _core.place_op(x, np.array([3]), 1),
    "place_op layer": lambda c, cells, kv, q, x: _core.place_op(c.handle, np.array([3]), x),
    "mask_op handle": lambda c, cells, kv, q, x: _core.mask_op(x, cells, 0, 4),
    "mask_op layer": lambda c, cells, kv, q, x: _core.mask_op(c.handle, cells, x, 4),
    "mask_op extent": lambda c, cells, kv, q, x: _core.mask_op(c.handle, cells, 0, x),
    "attend_op handle": lambda c, cells, kv, q, x: _attend(x, q, kv, cells, 0),
    "attend_op layer": lambda c, cells, kv, q, x: _attend(c.handle, q, kv, cells, x),
}


# pybind11 read True as 1 (mask_op(True, ...) asked the cache of handle 1,
# place_op(h, p, True) served layer 1) and, converting, truncated
# np.float32(1.5): every integer argument of the ops is a bindings::Int.
@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
@pytest.mark.parametrize("call", sorted(_OP_CALLS))
def test_a_bool_or_float_is_refused_where_an_op_takes_an_integer(call, value):
    cache, cells, kv, q = _placed_layer_0()
    before = (cache.cell_positions().tolist(), cache.pool(0).step_cells.tolist())
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _OP_CALLS[call](cache, cells, kv, q, value)
    assert (cache.cell_positions().tolist(), cache.pool(0).step_cells.tolist()) == before
    # Layer 1 is still to serve, and serves the same cell as layer 0.
    assert _core.place_op(cache.handle, np.array([3]), 1).tolist() == cells.tolist()
    cache.check_invariants()


def test_the_ops_read_numpy_integers_as_python_ints():
    cache, cells, kv, q = _placed_layer_0()
    h = cache.handle
    assert np.array_equal(_core.mask_op(np.int64(h), cells, np.int32(0), np.int64(4)),
                          _core.mask_op(h, cells, 0, 4))
    assert np.array_equal(_attend(np.int64(h), q, kv, cells, np.int64(0)),
                          _attend(h, q, kv, cells, 0))
    assert _core.place_op(np.int64(h), np.array([3]), np.uint8(1)).tolist() == cells.tolist()
    assert np.array_equal(_attend(h, q, kv, cells, np.int16(1)), _attend(h, q, kv, cells, 1))


def test_a_refused_attend_out_leaves_out_as_it_was():
    """attend.out resized out to the query's shape before its checks, so a call
    refused (here: a handle that is not int64) still changed out's shape."""
    query = torch.randn(3, 2, 8)
    kv = torch.zeros(4, 1, 8)
    out = torch.full((5,), 9.0)
    with pytest.raises(TypeError, match="handle"):
        torch.ops.cellcache.attend.out(torch.tensor([0], dtype=torch.int32), query, kv, kv,
                                       torch.zeros(3, dtype=torch.int64), 0, 1.0, 0.0, out=out)
    assert out.shape == (5,) and torch.equal(out, torch.full((5,), 9.0))
