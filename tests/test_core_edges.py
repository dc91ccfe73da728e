"""Edges of the core a breaker found (session 15): the graph ops refuse a
cache of several pools (window_cells, issue #25 phase 1) by name instead of
failing step after step, and the engine, which refused one too, serves it
since phase 2; retained_margin is checked without pools
too; an empty seq_rm range below the reclaimed horizon is a no-op, not a
refusal; admission's worst case saturates instead of overflowing on a
client's huge max_new_tokens."""

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
        rid = engine.submit(prompt, lambda r, s, t, *_: got.setdefault(r, []).append(t),
                            lambda *_: None, max_new_tokens=50)
        got[rid] = []
    while engine.step():
        pass
    assert [got[r] for r in sorted(got)] == [oracle(p, 50) for p in prompts]
    assert 4 * 55 > cache.pool(1).capacity  # only reclaimed cells could hold them
    cache.check_invariants()


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
