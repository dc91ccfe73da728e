"""Edges of the core a breaker found (session 15): the engine refuses a
cache of several pools (window_cells, issue #25 phase 1) by name instead of
failing step after step (the graph ops serve one since phase 2); retained_margin is checked without pools
too; an empty seq_rm range below the reclaimed horizon is a no-op, not a
refusal; admission's worst case saturates instead of overflowing on a
client's huge max_new_tokens."""

import numpy as np
import pytest

from executorch_cellcache import CapacityError, CellCache, InvalidConfigError
from executorch_cellcache.cache import _core


def _pooled(window=4, cells=12, margin=2):
    return CellCache(64, windows=[None, window], window_cells={window: cells},
                     retained_margin=margin)


def _decode(cache, seq, positions):
    for p in positions:
        assert cache.declare_step([seq])
        for layer in range(cache.n_layers):
            cache.place_step([p], layer)


def test_the_engine_refuses_a_cache_of_several_pools():
    cache = _pooled()

    def forward(seq_ids, tokens, positions, logits_for):  # never reached
        raise AssertionError("the engine ran a step on a pooled cache")

    with pytest.raises(InvalidConfigError, match="holds 2 cell pools .*serves a cache of one"):
        _core.Engine(cache, forward, 64, 4, [])
    cache.check_invariants()
    assert cache.n_sequences == 0


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
