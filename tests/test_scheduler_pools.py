"""The scheduler, its admission and the prefix cache on a POOLED CellCache
(issue #25: one pool per window policy, windowed pools reclaiming what no
owner can see again), no model, no export.

The synthetic forward of test_scheduler.py (logits a formula of token and
position, so a sample's tokens are predictable by ``simulate`` whatever the
batching did) declares each step and serves every layer, so the core
reclaims as a real forward makes it. Oracles: the simulation (tokens), the
cache's own counts measured while running (a brute-force peak of the cells
a request owns in each pool, against the core's worst case), the reclaim rule
as cell_pool.h states it (a prefix of length L of a sequence whose pool gave
up positions below ``below`` survives a clone iff L > below and
L - W + 1 >= below), and check_invariants after every step.
"""

from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from test_scheduler import SETTINGS, V, Bench, logits_of, request, simulate, simulate_sampled

from executorch_cellcache.cache._core import CellCache, request_worst_case_cells_in_pool
from executorch_cellcache.cache.errors import BelowReclaimedError, CapacityError
from executorch_cellcache.runtime.pools import Pools
from spec.prefix_cache import PrefixCache
from spec.scheduler import Scheduler
from spec.speculative import DraftModel, Speculative, draft_rollback_limit

W, R = 6, 2


def per_sequence(budget: int, window: int = W, margin: int = R) -> int:
    """The core's most cells one sequence owns in a windowed pool (admission.h)."""
    return request_worst_case_cells_in_pool(0, 0, 1, 2**62, window, margin, budget)


class PoolBench(Bench):
    """Bench on a pooled cache: ``windows`` per layer, ``window_cells`` per
    window. Each step serves every layer (the last one completes the step
    and the windowed pools reclaim). ``peaks[pool][request]``: the most cells
    the request's sequences owned alone in that pool, measured after the
    step placed (before its reclaim); ``placed[pool]``: (cell, seq) per token
    placed, in order."""

    def __init__(self, windows, window_cells: Dict[int, int], cells: int = 256,
                 budget: int = 4, margin: int = R, eos=(), prefix: bool = False,
                 prefix_cells=None, proposer=None):
        self.cache = CellCache(cells, len(windows), windows, window_cells=window_cells,
                               retained_margin=margin)
        self.budget = budget
        self.prefix = PrefixCache(self.cache, prefix_cells) if prefix else None
        self.events, self.plans = [], []
        self.on_plan = None
        self.sched = Scheduler(self.cache, budget, list(eos), self.events.append, self.prefix,
                               proposer)
        self.n_pools = self.cache.n_pools
        self.peaks: List[Dict[int, int]] = [{} for _ in range(self.n_pools)]
        self.placed: List[List[tuple]] = [[] for _ in range(self.n_pools)]
        self.max_reclaimed = 0

    def forward(self, plan):
        assert self.cache.declare_step(plan.seq_ids), "admission let a step run out of cells"
        for p in range(self.n_pools):
            self.placed[p] += zip(self.cache.pool(p).step_cells.tolist(), plan.seq_ids)
        for layer in range(self.cache.n_layers):
            self.cache.place_step(plan.positions, layer)
            if layer == 0:
                self._measure()
        for s in set(plan.seq_ids):
            for p in range(self.n_pools):
                self.max_reclaimed = max(self.max_reclaimed, self.cache.reclaimed(s, p)[1])
        rows = [logits_of(plan.tokens[i], plan.positions[i]) for i in plan.logits_for]
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)

    def _check_decode_first(self, plan) -> None:
        if self.sched.proposer is None:
            super()._check_decode_first(plan)
        else:  # proposals ride after their decode tokens
            assert 1 <= len(plan.tokens) <= self.budget
            assert plan.n_decode + plan.n_prefill + plan.n_proposed == len(plan.tokens)

    def _measure(self) -> None:
        for req in self.sched.running:
            seqs = [req.seq] if not req.samples else [s.seq for s in req.samples if not s.done]
            for p in range(self.n_pools):
                held = self.cache.cells_owned_only_by(seqs, p)
                self.peaks[p][id(req)] = max(self.peaks[p].get(id(req), 0), held)



def all_free(b: PoolBench) -> bool:
    return all(b.cache.pool(p).free_cells == b.cache.pool(p).capacity
               for p in range(b.n_pools)) and b.cache.n_sequences == 0


# ------------------------------------------------------------------------ chunked prefill


@pytest.mark.parametrize("windows", [[W, W], [W, None, W]])
def test_a_prompt_ten_windows_long_prefills_through_a_pool_of_one_sequence(windows):
    """A 60-token prompt (10 x W) and 30 new tokens in a windowed pool sized for
    one sequence's bound: prefilled in chunks of at most the budget, reclaimed
    as it goes, tokens equal to the simulation."""
    budget = 4
    b = PoolBench(windows, {W: per_sequence(budget)}, cells=128, budget=budget)
    prompt = [(5 * i + 3) % V for i in range(10 * W)]
    req = request(prompt, max_new_tokens=5 * W)
    b.run({0: [req]})
    assert [s.tokens for s in req.samples] == [simulate(prompt, 5 * W)]
    assert all(1 <= len(p.tokens) <= budget for p in b.plans)
    # Reclaim was active: the sequence gave up most of its 89 positions.
    assert b.max_reclaimed >= len(prompt) + 5 * W - 1 - per_sequence(budget)
    assert all_free(b)


# ------------------------------------------------------------------------ 8 sequences


def test_eight_sequences_decode_past_the_window_and_reuse_each_others_cells():
    """Gemma3-like (two sliding layers, one full): 8 requests fit together in a
    windowed pool of 8 x the per-sequence bound, all admitted in the first
    step, each decoding 5 windows past W; cells a sequence gave up are placed
    again for other sequences; the full pool keeps everything."""
    budget = 8
    bound = per_sequence(budget)
    prompts = [[(i * 11 + j) % V for j in range(3 + i)] for i in range(8)]
    full = sum(len(p) + 5 * W - 1 for p in prompts)
    b = PoolBench([W, W, None], {W: 8 * bound}, cells=full, budget=budget)
    reqs = [request(p, max_new_tokens=5 * W) for p in prompts]
    for r in reqs:
        b.sched.submit(r)
    b.step()
    assert len(b.sched.running) == 8, "every request fits its worst case at once"
    while not b.sched.idle:
        assert b.step() is not None
    for r in reqs:
        assert [s.tokens for s in r.samples] == [simulate(r.prompt, 5 * W)]
    windowed = b.cache.pool_of(0)
    owners: Dict[int, set] = {}
    for cell, seq in b.placed[windowed]:
        owners.setdefault(cell, set()).add(seq)
    assert any(len(s) > 1 for s in owners.values()), "no cell went to another sequence"
    assert len(b.placed[windowed]) > b.cache.pool(windowed).capacity  # cells were reused
    assert b.max_reclaimed > 0
    full_pool = b.cache.pool_of(2)
    assert max(b.peaks[full_pool].values()) == max(len(p) + 5 * W - 1 for p in prompts)
    assert all_free(b)


def test_forks_share_the_prompt_in_every_pool_and_diverge():
    """n=3 seeded samples of one prompt: the prompt is placed once (the
    windowed pool's peak is below 3 separate copies) and the samples diverge
    as the simulation with generators (seed, j) says."""
    budget = 4
    b = PoolBench([W, None], {W: 3 * per_sequence(budget)}, cells=256, budget=budget)
    prompt = [(3 * i + 1) % V for i in range(4 * W)]
    req = request(prompt, n=3, max_new_tokens=3 * W, temperature=1.0, seed=7)
    b.run({0: [req]})
    got = [s.tokens for s in req.samples]
    assert got == [simulate_sampled(prompt, req.params, j) for j in range(3)]
    assert len({tuple(t) for t in got}) == 3
    assert all_free(b)


# ------------------------------------------------------------------------ admission


@SETTINGS
@given(windows=st.sampled_from([[W], [W, None], [W, 3, None], [3, W]]),
       budget=st.integers(1, 6), margin=st.integers(0, 4),
       prompt_len=st.integers(1, 30), n=st.integers(1, 3), max_new=st.integers(1, 25))
def test_a_requests_peak_cells_in_each_pool_stay_within_the_cores_worst_case(
        windows, budget, margin, prompt_len, n, max_new):
    """Brute force: a request run alone, its owned cells measured in every pool
    after every placement; the peak never exceeds Pools.worst_case (the core's
    rule), which is exact for one sequence in a pool that reclaims nothing."""
    prompt = [(7 * i + 2) % V for i in range(prompt_len)]
    window_cells = {w: 300 for w in windows if w is not None}
    b = PoolBench(windows, window_cells, cells=300, budget=budget, margin=margin)
    req = request(prompt, n=n, max_new_tokens=max_new)
    b.run({0: [req]})
    assert [s.tokens for s in req.samples] == [simulate(prompt, max_new)] * n
    worst = Pools(b.cache, budget).worst_case(prompt_len, 0, n, max_new)
    for p in range(b.n_pools):
        peak = b.peaks[p][id(req)]
        assert peak <= worst[p], f"pool {p}: {peak} cells owned, worst case {worst[p]}"
        if b.cache.pool(p).window is None and n == 1:  # (samples may end at different steps)
            assert peak == prompt_len + max_new - 1


specs = st.lists(st.tuples(st.integers(1, 24), st.integers(1, 3), st.integers(1, 20),
                           st.integers(0, 6)), min_size=1, max_size=6)


@SETTINGS
@given(windows=st.sampled_from([[W, W], [W, None], [None, W, 3]]), budget=st.integers(1, 6),
       spec=specs, slack=st.floats(0, 1), prefix=st.booleans())
def test_random_batches_in_pooled_caches_never_run_out_and_give_the_simulation(
        windows, budget, spec, slack, prefix):
    """Random requests arriving at random steps, each pool sized between the
    largest request's worst case there and all of them: no step is refused
    (admission counts every pool), every sample is its simulation, every
    request finishes, and at the end every cell is free (or the prefix
    cache's)."""
    probe = PoolBench(windows, {w: 10_000 for w in windows if w is not None}, cells=10_000,
                      budget=budget)
    pools = Pools(probe.cache, budget)
    worst = [pools.worst_case(p, 0, n, m) for p, n, m, _ in spec]
    sizes = []
    for i in range(len(pools)):
        col = [w[i] for w in worst]
        sizes.append(max(col) + int(slack * (sum(col) - max(col))))
    # (the core refuses a windowed pool below one window + margin + one token)
    window_cells = {pools.pools[i].window: max(sizes[i], pools.pools[i].window + R + 1)
                    for i in range(len(pools)) if pools.pools[i].window is not None}
    full = [sizes[i] for i in range(len(pools)) if pools.pools[i].window is None]
    b = PoolBench(windows, window_cells, cells=full[0] if full else 1, budget=budget,
                  prefix=prefix)
    reqs, arrivals = [], {}
    for j, (p, n, m, at) in enumerate(spec):
        r = request([(j + 5 * i) % V for i in range(p)], n=n, max_new_tokens=m)
        reqs.append(r)
        arrivals.setdefault(at, []).append(r)
    b.run(arrivals)
    for r in reqs:
        assert [s.tokens for s in r.samples] == [simulate(r.prompt, r.params.max_new_tokens)] \
            * r.params.n
    if prefix:
        b.prefix.clear()
    assert all_free(b)


def test_a_request_too_big_for_a_window_pool_is_refused_naming_it():
    budget = 4
    b = PoolBench([W, None], {W: 2 * per_sequence(budget)}, cells=1000, budget=budget)
    with pytest.raises(CapacityError, match=r"window-6 pool") as e:
        b.sched.submit(request([1, 2, 3], n=3, max_new_tokens=50))
    assert str(3 * per_sequence(budget)) in str(e.value)
    b.sched.submit(request([1, 2, 3], n=2, max_new_tokens=400))  # fits: the pool reclaims
    with pytest.raises(CapacityError, match=r"1000"):  # the full pool's own count
        b.sched.submit(request([1, 2, 3], n=2, max_new_tokens=600))


# ------------------------------------------------------------------------ prefix cache


def test_a_next_turn_its_cached_prefix_would_keep_waiting_is_admitted_cold():
    """A window pool of one sequence's worst case: the next turn of a
    conversation clones the cached entry, whose window cells stay the entry's
    while the clone needs a whole worst case besides; with nothing running it
    is prefilled cold (it used to wait forever), and its tokens are the
    simulation's (cpp/engine/tests/engine_pools_test.cpp has the C++ twin)."""
    budget = 4
    b = PoolBench([W, None], {W: per_sequence(budget)}, cells=1000, budget=budget,
                  prefix=True)
    history = [(7 * i + 3) % V for i in range(2 * W)]
    first = request(history, max_new_tokens=8)
    b.run({0: [first]})
    turn = history + first.samples[0].tokens + [1, 2, 3]
    second = request(turn, max_new_tokens=8)
    b.run({0: [second]})
    assert second.cached_tokens == 0
    assert [s.tokens for s in second.samples] == [simulate(turn, 8)]



def holds_by_rule(cache, seq: int, upto: int) -> bool:
    """cell_pool.h's reclaim rule, restated: every windowed pool that gave up
    positions below ``below`` still serves a clone of upto iff upto > below and
    upto - W + 1 >= below."""
    for p in range(cache.n_pools):
        st_ = cache.pool(p)
        below = cache.reclaimed(seq, p)[0]
        if st_.reclaims and below and not (upto > below and upto - st_.window + 1 >= below):
            return False
    return True


def test_prefix_cache_serves_a_prefix_only_where_every_pool_holds_it():
    """A long finished sequence (its windowed pool gave up most of it) serves
    its whole length but not a short prefix; the short prefix comes from an
    entry that still holds it; every hit and miss agrees with the rule, and
    tokens never change."""
    budget = 4
    b = PoolBench([W, None], {W: 4 * per_sequence(budget)}, cells=400, budget=budget,
                  prefix=True)
    base = [(9 * i + 4) % V for i in range(8 * W)]
    long_req = request(base, max_new_tokens=10)
    short_req = request(base[:5], max_new_tokens=1)  # an entry of 5 positions: nothing reclaimed
    b.run({0: [long_req]})
    b.run({0: [short_req]})
    entries = {len(b.prefix.tokens(s)): s for s in b.prefix.seqs()}
    long_len = len(base) + 9
    assert set(entries) == {long_len, 5}
    long_seq = entries[long_len]
    # Prompt sharing 20 tokens with the long entry, 5 with the short one.
    shared = request(base[:20] + [63, 62, 61], max_new_tokens=4)
    expect_long = holds_by_rule(b.cache, long_seq, 20)
    assert b.cache.holds_prefix(long_seq, 20) == expect_long
    assert not expect_long  # the long entry's pool gave those positions up
    extend = request(b.prefix.tokens(long_seq) + [1, 2], max_new_tokens=4)
    assert holds_by_rule(b.cache, long_seq, long_len)
    b.run({0: [shared]})
    b.run({0: [extend]})
    assert shared.cached_tokens == 5   # served by the short entry
    assert extend.cached_tokens == long_len
    for r in (shared, extend):
        assert [s.tokens for s in r.samples] == [simulate(r.prompt, 4)]
    b.prefix.clear()
    assert all_free(b)


@pytest.mark.parametrize("bound", [0, 5, 12])
def test_prefix_cache_bound_holds_in_every_pool(bound):
    budget = 4
    b = PoolBench([W, None, W], {W: 4 * per_sequence(budget)}, cells=300, budget=budget,
                  prefix=True, prefix_cells=bound)
    reqs = [request([(j * 13 + i) % V for i in range(3 + 7 * j)], max_new_tokens=6)
            for j in range(5)]
    for r in reqs:
        b.run({0: [r]})
        assert max(b.prefix.reclaimable_cells_per_pool()) <= bound
        assert b.prefix.reclaimable_cells() == sum(
            b.cache.cells_owned_only_by(b.prefix.seqs(), p) for p in range(b.n_pools))
        for s in b.prefix.seqs():  # every entry can still serve its whole length
            assert b.cache.holds_prefix(s, len(b.prefix.tokens(s)))
    b.prefix.clear()
    assert all_free(b)


# ------------------------------------------------------------------------ speculation


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_a_draft_mirror_rolls_back_at_most_margin_plus_one_proposal_steps(margin):
    """The rule draft_rollback_limit encodes (max_draft <= R + 2): after k
    one-token steps a windowed pool lets a sequence take back R + 1 of them,
    not R + 2."""
    cache = CellCache(64, 2, [W, None], window_cells={W: 64}, retained_margin=margin)
    assert draft_rollback_limit(Pools(cache, 4)) == margin + 2
    assert draft_rollback_limit(Pools(CellCache(64, 2, [W, None]), 4)) is None
    seq = cache.seq_new()
    assert cache.declare_step([seq] * 4)
    for layer in range(2):
        cache.place_step(list(range(4)), layer)
    n = 4
    for _ in range(3 * W):  # one-token steps, well past the window
        assert cache.declare_step([seq])
        for layer in range(2):
            cache.place_step([n], layer)
        n += 1
    with pytest.raises(BelowReclaimedError):
        cache.seq_rm(seq, n - (margin + 2))
    assert cache.next_pos(seq) == n  # nothing changed
    cache.seq_rm(seq, n - (margin + 1))
    assert cache.next_pos(seq) == n - (margin + 1)
    cache.check_invariants()



def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@SETTINGS
@given(windows=st.sampled_from([[W, W], [W, None], [None, W, 3]]), budget=st.integers(1, 5),
       prompts=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=30),
                                  st.integers(1, 12), st.integers(0, 8)),
                        min_size=1, max_size=7),
       bound=st.one_of(st.none(), st.integers(0, 40)))
def test_pooled_prefix_cache_matches_the_brute_force_rule_and_changes_no_token(
        windows, budget, prompts, bound):
    """Prompts over a 3-token alphabet (so they share prefixes) arriving at
    random steps, with the prefix cache on a pooled cache: every match is the
    brute-force best over the entries (the longest usable common prefix of an
    entry that still holds it, by cell_pool.h's rule), every sample is its
    simulation, and the bound holds in every pool."""
    probe = CellCache(500, len(windows), windows,
                      window_cells={w: 500 for w in windows if w is not None},
                      retained_margin=R)
    pools = Pools(probe, budget)
    # Each pool fits the largest request twice over: requests wait, none is refused.
    sizes = [2 * max(x) for x in zip(*(pools.worst_case(len(p), 0, 1, m)
                                        for p, m, _ in prompts))]
    window_cells = {p.window: max(sizes[p.index], p.window + R + 1) for p in pools.pools
                    if p.window is not None}
    full = [sizes[p.index] for p in pools.pools if p.window is None]
    cells = full[0] if full else 1
    largest = max([cells, *window_cells.values()])
    b = PoolBench(windows, window_cells, cells=cells, budget=budget, prefix=True,
                  prefix_cells=None if bound is None else min(bound, largest))
    real_match = b.prefix.match

    def match(prompt):
        expect = 0
        for s in b.prefix.seqs():
            usable = min(_common(b.prefix.tokens(s), prompt), len(prompt) - 1)
            if usable > 0 and holds_by_rule(b.cache, s, usable):
                expect = max(expect, usable)
        src, got = real_match(prompt)
        event(f"prefix hit: {got > 0}")
        assert got == expect, f"matched {got} tokens, the brute-force best is {expect}"
        if src is not None:
            assert holds_by_rule(b.cache, src, got)
        return src, got

    b.prefix.match = match
    reqs, arrivals = [], {}
    for p, m, at in prompts:
        r = request(p, max_new_tokens=m)
        reqs.append(r)
        arrivals.setdefault(at, []).append(r)
    b.run(arrivals)
    for r in reqs:
        assert [s.tokens for s in r.samples] == [simulate(r.prompt, r.params.max_new_tokens)]
    if b.prefix.max_cells is not None:
        assert max(b.prefix.reclaimable_cells_per_pool()) <= b.prefix.max_cells
    b.prefix.clear()
    assert all_free(b)


class SyntheticDraft:
    """A draft program stand-in for DraftModel on a pooled CellCache of its
    own: each forward declares and serves every layer; its logits peak at the
    target's greedy token (test_scheduler.next_greedy) except for a token at
    a position p with (p + 1) % 13 == 0, where it proposes the next token up,
    which the target rejects (13: a full-length proposal run then meets a
    rejected first proposal, the deepest cut-back)."""

    def __init__(self, windows, window_cells, margin, budget):
        self.cache = CellCache(256, len(windows), windows, window_cells=window_cells,
                               retained_margin=margin)
        self.info = SimpleNamespace(max_tokens_per_step=budget)
        self.pools = Pools(self.cache, budget)

    def step(self, seq_ids, tokens, positions, logits_for):
        assert self.cache.declare_step(seq_ids)
        for layer in range(self.cache.n_layers):
            self.cache.place_step(positions, layer)
        rows = []
        for i in logits_for:
            t, p = tokens[i], positions[i]
            rows.append(logits_of(t, p) if (p + 1) % 13 else np.roll(logits_of(t, p), 1))
        return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("windows", [[W, W], [W, None]])
def test_a_pooled_draft_within_its_margin_rolls_back_without_failing(windows):
    """DraftModel on a pooled draft cache (margin R) with proposals the target
    rejects: at max_draft = R + 2 (draft_rollback_limit) every mirror cut-back
    succeeds, nothing fails and the tokens are plain greedy decoding's; at
    R + 3 some cut-back reaches below what the windowed pool holds, which is
    why the Runner refuses it at setup."""
    budget = R + 4
    results = {}
    for k in (R + 2, R + 3):
        draft = SyntheticDraft(windows, {W: 4 * per_sequence(budget)}, R, budget)
        assert draft_rollback_limit(draft.pools) == R + 2
        proposer = DraftModel(Speculative("draft", max_draft=k, draft_model="synthetic"), draft)
        b = PoolBench(windows, {W: 4 * per_sequence(budget)}, cells=512, budget=budget,
                      proposer=proposer)
        # One sample alone: its proposals may take the whole budget left, k.
        req = request([(3 * i + 1) % V for i in range(2 * W)], max_new_tokens=15 * W)
        b.run({0: [req]})
        assert [s.tokens for s in req.samples] == [simulate(req.prompt, 15 * W)]
        results[k] = (proposer.failure, b.sched.speculation)
    failure, spec = results[R + 2]
    assert failure is None and 0 < spec.accepted < spec.proposed
    failure, _ = results[R + 3]
    assert failure is not None and "BelowReclaimedError" in failure
