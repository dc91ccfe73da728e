"""Edges of the core a breaker found (session 15): the engine and the graph
ops refused a cache of several pools (window_cells, issue #25 phase 1) by
name instead of failing step after step; since phase 2 both serve one (the
engine against a history oracle, the ops against brute force);
retained_margin is checked without pools too; an empty seq_rm range below the reclaimed horizon is a no-op, not a
refusal; admission's worst case saturates instead of overflowing on a
client's huge max_new_tokens. Session 18: a bool or float where the cache's
binding (or the module's admission and step-batch functions) takes an integer
is a TypeError, not read as 0/1."""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from executorch_cellcache import CapacityError, CellCache, InvalidConfigError
from executorch_cellcache.cache import _core


def _pooled(window=4, cells=12, margin=2, full=64):
    return CellCache(full, windows=[None, window], window_cells={window: cells},
                     retained_margin=margin)


def _decode(cache, seq, positions):
    for p in positions:
        assert cache.declare_step([seq])
        for layer in range(cache.n_layers):
            cache.place_step([p], layer)


def _windowed_lm(cache, vocab, window):
    """A forward over a pooled cache whose logits depend on what each layer
    attends (the tokens it stamped on the cells its mask opens), and its greedy
    oracle from a sequence's whole history: layer 0 sums positions 0..p, the
    window layer p-W+1..p. A cell reclaimed too early or reused without its
    new token changes the tokens."""
    kv = [np.full(cache.pool(cache.pool_of(l)).capacity, -1) for l in range(cache.n_layers)]

    def row(token, pos, sums):
        h = (token * 1_000_003 + pos * 97 + sum(s * 31 ** i for i, s in enumerate(sums)))
        return np.array([((h + v) * 2_654_435_761 >> 7) % 10_007 for v in range(vocab)],
                        np.float32)

    def forward(seq_ids, tokens, positions, logits_for):
        assert cache.declare_step(list(seq_ids))
        sums = [[] for _ in tokens]
        for layer in range(cache.n_layers):
            step = cache.place_step(list(positions), layer)
            kv[layer][step.cells] = tokens
            cell_pos = cache.pool(cache.pool_of(layer)).cell_positions
            for i, open_ in enumerate(step.mask):
                cells = np.flatnonzero(open_)
                sums[i].append(int((kv[layer][cells] * 31 + cell_pos[cells]).sum()))
        return np.stack([row(tokens[i], positions[i], sums[i]) for i in logits_for])

    def oracle(prompt, max_new):
        seq = list(prompt)
        for _ in range(max_new):
            p = len(seq) - 1
            full = sum(t * 31 + q for q, t in enumerate(seq))
            win = sum(seq[q] * 31 + q for q in range(max(0, p - window + 1), p + 1))
            seq.append(int(np.argmax(row(seq[p], p, [full, win]))))
        return seq[len(prompt):]

    return forward, oracle


def test_the_engine_serves_a_cache_of_several_pools():
    """Phase 2 of issue #25: the engine (which refused a pooled cache before)
    runs 4 prompts, each decoding 12 windows past W through a window pool too
    small to keep them without reclaim, with the tokens of the history oracle."""
    window, margin, step = 4, 2, 8
    per_sequence = window + max(margin, step - 1) + step  # cellcache/admission.h
    cache = _pooled(window=window, cells=4 * per_sequence, margin=margin, full=512)
    forward, oracle = _windowed_lm(cache, 32, window)
    engine = _core.Engine(cache, forward, 32, step, [])
    prompts = [[(7 * i + 3 * j) % 31 + 1 for j in range(6 + i)] for i in range(4)]
    got = {}
    for prompt in prompts:
        rid = engine.submit(prompt, _core.SamplingParams(max_new_tokens=50),
                            lambda r, s, t, *_: got.setdefault(r, []).append(t), lambda *_: None)
        got[rid] = []
    while engine.step():
        pass
    assert [got[r] for r in sorted(got)] == [oracle(p, 50) for p in prompts]
    assert 4 * 55 > cache.pool(1).capacity  # only reclaimed cells could hold them
    cache.check_invariants()


def test_the_graph_ops_serve_each_layer_from_its_pool():
    """Phase 2: place/attend answer in the layer's pool (window 4: 12 cells;
    full: 64); attend's output is the brute-force softmax over the positions
    the SPEC's rule lets the token see, also after the windowed pool reclaimed
    and reused cells; K/V buffers sized to another pool are refused by name."""
    rng = np.random.default_rng(3)
    cache = _pooled(window=4, cells=12, margin=2)
    seq = cache.seq_new()
    hd, n_pos = 4, 30
    keys = rng.standard_normal((n_pos, 1, hd)).astype(np.float32)
    vals = rng.standard_normal((n_pos, 1, hd)).astype(np.float32)
    kv = {0: (np.zeros((64, 1, hd), np.float32), np.zeros((64, 1, hd), np.float32)),
          1: (np.zeros((12, 1, hd), np.float32), np.zeros((12, 1, hd), np.float32))}
    for p in range(n_pos):
        assert cache.declare_step([seq])
        for layer, window in ((0, None), (1, 4)):
            cells = np.asarray(_core.place_op(cache.handle, [p], layer))
            assert cells[0] < kv[layer][0].shape[0]
            kv[layer][0][cells] = keys[p]
            kv[layer][1][cells] = vals[p]
            q = rng.standard_normal((1, 1, hd)).astype(np.float32)
            out = np.zeros_like(q)
            if layer == 1 and p == n_pos - 1:
                wrong = np.zeros((64, 1, hd), np.float32)
                with pytest.raises(InvalidConfigError, match="the layer's pool has 12"):
                    _core.attend_op(cache.handle, q, wrong, wrong, cells, layer, 0.5, 0.0, out)
            _core.attend_op(cache.handle, q, kv[layer][0], kv[layer][1], cells, layer, 0.5, 0.0,
                            out)
            lo = 0 if window is None else max(0, p - window + 1)
            scores = (keys[lo:p + 1, 0] @ q[0, 0]) * 0.5
            probs = np.exp(scores - scores.max())
            want = (probs / probs.sum()) @ vals[lo:p + 1, 0]
            np.testing.assert_allclose(out[0, 0], want, rtol=1e-5, atol=1e-6)
    assert cache.reclaimed(seq, 1)[0] > 12  # the windowed pool reused its cells


@pytest.mark.parametrize("margin", [-5, -1, 2 ** 24 + 1])
def test_retained_margin_is_checked_with_or_without_pools(margin):
    for kw in ({}, {"window_cells": {4: 64}}):
        with pytest.raises(InvalidConfigError, match=rf"retained_margin must lie in \[0, "
                                                     rf"16777216\], got {margin}"):
            CellCache(128, windows=[4, None], retained_margin=margin, **kw)


def test_an_empty_range_below_the_horizon_removes_nothing_and_is_not_refused():
    cache = _pooled(window=4, cells=12, margin=2)
    seq = cache.seq_new()
    _decode(cache, seq, range(40))
    below, _ = cache.reclaimed(seq, 1)
    assert below > 10
    before = [cache.pool(i).cell_positions.tolist() for i in range(cache.n_pools)]
    for p in (0, 5, below - 1):
        cache.seq_rm(seq, p, p)
        cache.check_invariants()
    assert [cache.pool(i).cell_positions.tolist() for i in range(cache.n_pools)] == before
    assert cache.next_pos(seq) == 40


def test_admission_saturates_on_huge_requests_instead_of_overflowing():
    big = 2 ** 62
    int64_max = 2 ** 63 - 1
    assert _core.request_worst_case_cells(10, 0, 2, big) == int64_max  # 2 x (2^62 - 1) + 10
    assert _core.request_worst_case_cells(10, 0, 256, 2 ** 63 - 1) == int64_max
    assert _core.request_worst_case_cells(10, 4, 2, 5) == 6 + 2 * 4  # the plain formula
    with pytest.raises(CapacityError, match=f"needs up to {int64_max} cells"):
        _core.check_request_fits("the request", 10, 2, big, 1024)


def test_attend_on_a_reclaiming_pool_equals_the_one_pool_cache_to_the_bit():
    """The kernel cuts a sequence's cells into tiles and pieces counted from
    its position 0 (AttendPlan.group_reclaimed), so a windowed pool that has
    reclaimed the oldest cells reduces each score in the same lanes and order
    as a cache that kept them all: the outputs are equal to the bit (greedy
    speculative decoding relies on it)."""
    rng = np.random.default_rng(5)
    window, n_kv, heads, hd, n_pos = 40, 2, 4, 16, 160
    pooled = CellCache(64, windows=[window], window_cells={window: window + 8 + 2},
                       retained_margin=8)
    single = CellCache(n_pos, windows=[window])
    buffers = {}
    for cache in (pooled, single):
        cells = cache.pool(0).capacity
        buffers[cache.handle] = (np.zeros((cells, n_kv, hd), np.float32),
                                 np.zeros((cells, n_kv, hd), np.float32))
    seqs = {pooled.handle: pooled.seq_new(), single.handle: single.seq_new()}
    for p in range(n_pos):
        k = rng.standard_normal((n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((n_kv, hd)).astype(np.float32)
        q = rng.standard_normal((1, heads, hd)).astype(np.float32)
        outs = []
        for cache in (pooled, single):
            assert cache.declare_step([seqs[cache.handle]])
            cells = np.asarray(_core.place_op(cache.handle, [p], 0))
            kbuf, vbuf = buffers[cache.handle]
            kbuf[cells], vbuf[cells] = k, v
            out = np.zeros_like(q)
            _core.attend_op(cache.handle, q, kbuf, vbuf, cells, 0, 0.25, 0.0, out)
            outs.append(out)
        assert np.array_equal(outs[0], outs[1]), f"position {p}"
    assert pooled.reclaimed(seqs[pooled.handle], 0)[1] > n_pos // 2


# Every integer argument of the cache's binding, fed a bool (numpy's too) or a
# number that is not an integer: Python's bool is an int subclass, so pybind11
# read True as 1 and seq_free(True) freed sequence 1; converting, it also
# truncated np.float32(1.5), Decimal and Fraction (through __int__) to 1.
class _IntButNoIndex:
    def __int__(self):
        return 1

    def __repr__(self):
        return "_IntButNoIndex()"


_NOT_INTS = [True, False, np.bool_(True), 1.0, np.float32(1.5), np.float16(1), np.array(1.5),
             Decimal("1.9"), Fraction(3, 2), _IntButNoIndex()]
_CALLS = {
    "seq_clone src": lambda c, x: c.seq_clone(x),
    "seq_clone upto": lambda c, x: c.seq_clone(0, x),
    "seq_rm seq": lambda c, x: c.seq_rm(x),
    "seq_rm p0": lambda c, x: c.seq_rm(1, x),
    "seq_rm p1": lambda c, x: c.seq_rm(1, 0, x),
    "seq_free": lambda c, x: c.seq_free(x),
    "next_pos": lambda c, x: c.next_pos(x),
    "seq_len": lambda c, x: c.seq_len(x),
    "seq_serial": lambda c, x: c.seq_serial(x),
    "cells_owned_only_by ids": lambda c, x: c.cells_owned_only_by([x]),
    "cells_owned_only_by pool": lambda c, x: c.cells_owned_only_by([1], x),
    "can_extend": lambda c, x: c.can_extend(x),
    "holds_prefix seq": lambda c, x: c.holds_prefix(x, 1),
    "holds_prefix upto": lambda c, x: c.holds_prefix(1, x),
    "pool_of": lambda c, x: c.pool_of(x),
    "pool": lambda c, x: c.pool(x),
    "reclaimed seq": lambda c, x: c.reclaimed(x, 0),
    "reclaimed pool": lambda c, x: c.reclaimed(1, x),
    "window": lambda c, x: c.window(x),
    "declare_step": lambda c, x: c.declare_step([0, x]),
    "place_step layer": lambda c, x: c.place_step([3], x),
    "attend_plan": lambda c, x: c.attend_plan(x),
}


@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_bool_or_float_is_refused_where_the_cache_takes_an_integer(call, value):
    cache = CellCache(16, 2)
    for seq in (cache.seq_new(), cache.seq_new()):
        _decode(cache, seq, range(3))
    before = (cache.cell_positions().tolist(), [cache.seq_len(s) for s in (0, 1)])
    with pytest.raises(TypeError, match="incompatible"):
        _CALLS[call](cache, value)
    assert (cache.cell_positions().tolist(), [cache.seq_len(s) for s in (0, 1)]) == before
    cache.check_invariants()


@pytest.mark.parametrize("kwargs", [
    dict(n_cells=True), dict(n_cells=16.0), dict(n_cells=np.float32(16.9)),
    dict(n_cells=16, n_layers=True), dict(n_cells=16, windows=[None, np.float32(4.5)]),
    dict(n_cells=16, windows=[None, True]), dict(n_cells=16, windows=[None, 4.0]),
    dict(n_cells=16, windows=[None, 4], window_cells={4: True}),
    dict(n_cells=16, windows=[None, 4], window_cells={True: 8}),
    dict(n_cells=16, windows=[None, 4], window_cells={4: 8}, retained_margin=True),
], ids=repr)
def test_a_bool_or_float_is_refused_in_the_cache_config(kwargs):
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        CellCache(**kwargs)


def test_numpy_integers_are_still_integers():
    cache = CellCache(np.int64(16), np.int32(2))
    seq = cache.seq_new()
    assert cache.declare_step(np.array([seq]))
    cache.place_step(np.array([0]), np.int64(0))
    cache.place_step([0], np.array(1))
    assert cache.next_pos(np.int32(seq)) == 1 and cache.seq_len(np.uint8(seq)) == 1
    assert not cache.declare_step(np.array([seq] * 16, dtype=np.int16))  # 16 > 15 free cells


def test_float_arrays_are_not_sequence_ids():
    cache = CellCache(16, 2)
    cache.seq_new()
    with pytest.raises(TypeError, match="incompatible"):
        cache.declare_step(np.array([0.0], dtype=np.float32))


# The module's admission and step-batch functions read their counts the same
# way: request_worst_case_cells(True, ...) counted a one-token prompt.
_VALID_CALLS = {
    "request_worst_case_cells": dict(prompt_len=4, cached=0, n=1, max_new_tokens=2),
    "check_request_fits": dict(label="r", prompt_len=4, n=1, max_new_tokens=2, capacity=64),
    "request_worst_case_cells_in_pool": dict(prompt_len=4, cached=0, n=1, max_new_tokens=2,
                                             window=8, retained_margin=2, step_tokens=1),
    "check_request_fits_pools": dict(label="r", prompt_len=4, n=1, max_new_tokens=2,
                                     pools=[(None, 64), (8, 64)], retained_margin=2,
                                     step_tokens=1),
    "check_step_batch": dict(n_seq_ids=1, tokens=[3], n_positions=1, logits_for=[0],
                             max_tokens_per_step=4, vocab_size=16),
}
_FUNCTION_ARGS = [f"{f} {arg}" for f, kwargs in _VALID_CALLS.items()
                  for arg, v in kwargs.items() if type(v) is int] + \
    ["check_request_fits_pools pools window", "check_request_fits_pools pools capacity"]


def _call_with(function, arg, x):
    kwargs = dict(_VALID_CALLS[function])
    if arg == "pools window":
        kwargs["pools"] = [(None, 64), (x, 64)]
    elif arg == "pools capacity":
        kwargs["pools"] = [(None, 64), (8, x)]
    else:
        kwargs[arg] = x
    return getattr(_core, function)(**kwargs)


@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
@pytest.mark.parametrize("call", _FUNCTION_ARGS)
def test_a_bool_or_float_is_refused_where_a_module_function_takes_an_integer(call, value):
    function, _, arg = call.partition(" ")
    getattr(_core, function)(**_VALID_CALLS[function])  # the call is otherwise valid
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _call_with(function, arg, value)


def test_the_module_functions_read_numpy_integers_as_python_ints():
    i64, i32 = np.int64, np.int32
    assert _core.request_worst_case_cells(i64(5), i64(1), i32(2), np.uint16(4)) == \
        _core.request_worst_case_cells(5, 1, 2, 4) == 10
    assert _core.request_worst_case_cells_in_pool(i64(5), 0, i64(2), 100, i32(8), i64(2),
                                                  i64(1)) == \
        _core.request_worst_case_cells_in_pool(5, 0, 2, 100, 8, 2, 1)
    _core.check_request_fits("r", i64(5), i64(2), i64(4), i64(11))
    with pytest.raises(CapacityError):  # 5 + 2 * 3 = 11 cells
        _core.check_request_fits("r", i64(5), i64(2), i64(4), i64(10))
    _core.check_request_fits_pools("r", i64(5), i64(2), i64(4), [(None, i64(11)), (i32(8), 64)],
                                   i64(2), i64(1))
    with pytest.raises(CapacityError):
        _core.check_request_fits_pools("r", 5, 2, 4, [(None, i64(10))], 2, 1)
    _core.check_step_batch(i64(1), [3], i64(1), [0], i64(4), i64(16))
    with pytest.raises(InvalidConfigError):  # token 3 outside a vocabulary of 3
        _core.check_step_batch(i64(1), [3], i64(1), [0], i64(4), i64(3))


def test_beyond_int32_a_window_is_still_refused_as_before():
    # Window is int32 in the core: pybind11 refused a larger one; so does Int32.
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _core.request_worst_case_cells_in_pool(4, 0, 1, 2, 2**31, 2, 1)
