"""Edges of the core a breaker found (session 15): the engine and the graph
ops refuse a cache of several pools (window_cells, issue #25 phase 1) by name
instead of failing step after step; retained_margin is checked without pools
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


@pytest.mark.parametrize("op", ["place", "mask", "attend"])
def test_the_graph_ops_refuse_a_cache_of_several_pools(op):
    cache = _pooled()
    seq = cache.seq_new()
    assert cache.declare_step([seq])
    with pytest.raises(InvalidConfigError, match=rf"cache handle {cache.handle} holds 2 cell "
                                                 r"pools .*graph ops serve a cache of one"):
        if op == "place":
            _core.place_op(cache.handle, [0], 0)
        elif op == "mask":
            _core.mask_op(cache.handle, np.zeros(1, np.int64), 0, 8)
        else:
            k = np.zeros((64, 1, 4), np.float32)
            q = np.ones((1, 1, 4), np.float32)
            _core.attend_op(cache.handle, q, k, k, np.zeros(1, np.int64), 0, 0.5, 0.0,
                            np.zeros_like(q))
    assert cache.next_pos(seq) == 0  # nothing placed


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
