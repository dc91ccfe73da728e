"""The scheduler (tests/spec/scheduler.py) on a bare CellCache, no model, no export.

A synthetic forward declares each planned step on a one-layer cache and
returns logits that are a formula of (token, position) only: the row of a
token ``t`` at position ``p`` peaks at ``(7 t + 3 p + 1) mod V`` and falls off
geometrically around it. So a greedy sample is independently predictable by
simulating ``token_{i+1} = (7 token_i + 3 pos_i + 1) mod V`` from the prompt's
last token (``simulate``), and a seeded sample by drawing from the formula's
rows with generator (seed, j) (``simulate_sampled``): whatever the batch, the
step packing, the waiting or the prefix cache did, a sample's tokens must be
those. Packing, admission, forks, stops, cancellation and the prefix cache
are checked against the rules in the scheduler's docstring and the cache's
own counts (free cells, sequences, check_invariants).
"""

from typing import Dict, List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executorch_cellcache.cache._core import MAX_SEQUENCES, CellCache
from executorch_cellcache.cache.errors import CapacityError, InvalidConfigError
from spec.prefix_cache import PrefixCache
from spec.sampling import SamplingParams, choose, choose_tokens
from spec.scheduler import Request, Sample, Scheduler, cells_needed

V = 64  # vocabulary of the synthetic model

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def next_greedy(token: int, pos: int) -> int:
    """The synthetic model's argmax after ``token`` at ``pos`` (closed form)."""
    return (7 * token + 3 * pos + 1) % V


def logits_of(token: int, pos: int) -> np.ndarray:
    """float32 [V]: 0 at next_greedy(token, pos), -0.5 per step (mod V) after it."""
    peak = next_greedy(token, pos)
    return (-0.5 * ((np.arange(V) - peak) % V)).astype(np.float32)


def simulate(prompt: List[int], max_new: int, stops=()) -> List[int]:
    """Greedy continuation of ``prompt``: max_new tokens, or up to and
    including the first token in ``stops``."""
    token, pos, out = prompt[-1], len(prompt) - 1, []
    while len(out) < max_new:
        token = next_greedy(token, pos)
        pos += 1
        out.append(token)
        if token in stops:
            break
    return out


def simulate_sampled(prompt: List[int], params: SamplingParams, j: int) -> List[int]:
    """Sample j of a request: the formula's rows drawn with generator (seed, j)."""
    rng = np.random.default_rng([params.seed, j])
    token, pos, out = prompt[-1], len(prompt) - 1, []
    for _ in range(params.max_new_tokens):
        token = choose(logits_of(token, pos), params, rng)
        pos += 1
        out.append(token)
    return out


def request(prompt, **params) -> Request:
    return Request(list(prompt), SamplingParams(**params))


class Bench:
    """A Scheduler on a one-layer CellCache with the synthetic forward. Every
    step is checked: at most ``budget`` tokens, decode tokens first (each the
    fed-back last token of a distinct running sample at its next position),
    admission never letting a step run out of cells, and the cache's
    invariants after the step."""

    def __init__(self, cells: int = 256, budget: int = 8, eos=(), prefix: bool = False,
                 prefix_cells: Optional[int] = None):
        self.cache = CellCache(cells, 1)
        self.budget = budget
        self.prefix = PrefixCache(self.cache, prefix_cells) if prefix else None
        self.events = []
        self.plans = []
        self.on_plan = None  # called with each plan before its forward
        self.sched = Scheduler(self.cache, budget, list(eos), self.events.append, self.prefix)

    def forward(self, plan) -> np.ndarray:
        """float32 [len(plan.logits_for), V]; declares and places the step."""
        assert self.cache.declare_step(plan.seq_ids), "admission let a step run out of cells"
        self.cache.place_step(plan.positions, 0)
        rows = [logits_of(plan.tokens[i], plan.positions[i]) for i in plan.logits_for]
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)

    def step(self):
        """One planned step (or None when nothing could be planned)."""
        plan = self.sched.plan()
        if not plan.tokens:
            return None
        self._check_decode_first(plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        picks, logprobs = choose_tokens(self.forward(plan), plan.sampling_rows())
        self.sched.commit(plan, picks, logprobs)
        self.plans.append(plan)
        self.cache.check_invariants()
        return plan

    def _check_decode_first(self, plan) -> None:
        active = [s for r in self.sched.running for s in r.samples if not s.done]
        assert 1 <= len(plan.tokens) <= self.budget
        assert plan.n_decode == min(len(active), self.budget)
        assert plan.n_decode + plan.n_prefill == len(plan.tokens)
        decoded = plan.consumers[:plan.n_decode]
        assert plan.logits_for[:plan.n_decode] == list(range(plan.n_decode))
        assert all(isinstance(s, Sample) and s in active for s in decoded)
        assert len(set(map(id, decoded))) == plan.n_decode
        for i, s in enumerate(decoded):
            assert plan.seq_ids[i] == s.seq and plan.tokens[i] == s.tokens[-1]
            assert plan.positions[i] == len(s.request.prompt) + len(s.tokens) - 1
        assert all(isinstance(c, Request) for c in plan.consumers[plan.n_decode:])

    def run(self, arrivals: Dict[int, List[Request]]) -> None:
        """Steps until idle; arrivals: {step number: requests submitted just
        before that step}."""
        step = 0
        while not self.sched.idle or any(k >= step for k in arrivals):
            for req in arrivals.get(step, []):
                self.sched.submit(req)
            if not self.sched.idle:
                assert self.step() is not None, "nothing planned although nothing else holds cells"
            step += 1


def run_alone(req: Request, **bench) -> List[List[int]]:
    b = Bench(**bench)
    b.run({0: [req]})
    return [s.tokens for s in req.samples]


# ------------------------------------------------------------------------ greedy, batching

prompts = st.lists(st.integers(0, V - 1), min_size=1, max_size=20)
specs = st.lists(st.tuples(prompts, st.integers(1, 3), st.integers(1, 6), st.integers(0, 6)),
                 min_size=1, max_size=6)


@SETTINGS
@given(budget=st.integers(1, 8), spec=specs, slack=st.floats(0, 1))
def test_every_sample_of_a_batch_is_its_greedy_simulation(budget, spec, slack):
    """Random requests arriving at random steps into a cache between the
    largest request and all of them: every sample equals the simulation,
    admission is FIFO, prompts are chunked in admission order, and the cache is
    empty at the end."""
    worst = [cells_needed(len(p), SamplingParams(n=n, max_new_tokens=m)) for p, n, m, _ in spec]
    cells = max(worst) + int(slack * (sum(worst) - max(worst)))
    b = Bench(cells=cells, budget=budget)
    reqs = [request(p, n=n, max_new_tokens=m) for p, n, m, _ in spec]
    arrivals: Dict[int, List[Request]] = {}
    for req, (_, _, _, at) in zip(reqs, spec):
        arrivals.setdefault(at, []).append(req)
    submitted = [r for at in sorted(arrivals) for r in arrivals[at]]
    admitted: List[Request] = []
    real_plan = b.sched.plan

    def plan():
        queued = list(b.sched.waiting)
        out = real_plan()
        now = [r for r in queued if r not in b.sched.waiting]
        assert now == queued[:len(now)], "admission is first in, first out"
        admitted.extend(now)
        return out

    def check_prompt_chunks(plan):
        # Requests in admission order, each taking what is left of the step's room:
        # a later one gets tokens only when the earlier ones got all theirs.
        room, at = budget - plan.n_decode, plan.n_decode
        for r in admitted:
            if r.samples or r not in b.sched.running:
                continue
            take = min(room, len(r.prompt) - r.prefilled)
            assert plan.seq_ids[at:at + take] == [r.seq] * take
            assert plan.positions[at:at + take] == list(range(r.prefilled, r.prefilled + take))
            assert plan.tokens[at:at + take] == r.prompt[r.prefilled:r.prefilled + take]
            room, at = room - take, at + take
        assert at == len(plan.tokens)

    b.sched.plan = plan
    b.on_plan = check_prompt_chunks
    b.run(arrivals)
    assert admitted == submitted
    for req in reqs:
        expected = simulate(req.prompt, req.params.max_new_tokens)
        assert [s.tokens for s in req.samples] == [expected] * req.params.n
        assert all(s.finish_reason == "length" for s in req.samples)
    assert len(b.events) == sum(r.params.n * r.params.max_new_tokens for r in reqs)
    assert b.cache.free_cells == cells and b.cache.n_sequences == 0
    b.cache.check_invariants()


TARGET_PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.3]),
    "top_k": st.sampled_from([None, 5]),
    "top_p": st.sampled_from([None, 0.9]),
    "seed": st.integers(0, 2 ** 32),
    "n": st.integers(1, 3),
    "max_new_tokens": st.integers(1, 8),
})


@SETTINGS
@given(prompt=prompts, params=TARGET_PARAMS, companions=specs, at=st.integers(0, 6),
       budgets=st.tuples(st.integers(1, 8), st.integers(1, 8)))
def test_a_request_alone_and_in_a_batch_gives_the_same_tokens(prompt, params, companions, at,
                                                              budgets):
    """Greedy or seeded: sample j's tokens are a function of (prompt, params,
    seed, j) only: equal alone and among companions arriving around it, and
    equal to the simulation with generator (seed, j)."""
    target = SamplingParams(**params)
    alone = run_alone(Request(list(prompt), target), cells=512, budget=budgets[0])
    if target.temperature == 0:
        expected = [simulate(prompt, target.max_new_tokens)] * target.n
    else:
        expected = [simulate_sampled(prompt, target, j) for j in range(target.n)]
    assert alone == expected

    b = Bench(cells=512, budget=budgets[1])
    req = Request(list(prompt), target)
    arrivals: Dict[int, List[Request]] = {at: [req]}
    for p, n, m, when in companions:
        arrivals.setdefault(when, []).append(
            request(p, n=n, max_new_tokens=m, temperature=0.9, seed=when))
    b.run(arrivals)
    assert [s.tokens for s in req.samples] == expected


def test_seeded_samples_differ_from_each_other_and_with_the_seed():
    params = dict(temperature=1.3, seed=7, n=4, max_new_tokens=10)
    first = run_alone(request([5, 6, 7], **params))
    assert len({tuple(t) for t in first}) > 1
    assert run_alone(request([5, 6, 7], **{**params, "seed": 8})) != first
    assert run_alone(request([5, 6, 7], **params)) == first


# ------------------------------------------------------------------------ step packing


def test_decode_tokens_round_robin_when_they_exceed_the_budget():
    b = Bench(budget=4)
    req = request([3, 9], n=6, max_new_tokens=4)
    b.sched.submit(req)
    b.step()                                         # the prompt; six samples start
    seqs = [s.seq for s in req.samples]
    assert len(set(seqs)) == 6
    rounds = [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]
    positions = [[2, 2, 2, 2], [2, 2, 3, 3], [3, 3, 3, 3]]
    for order, pos in zip(rounds, positions):
        plan = b.step()
        assert plan.seq_ids == [seqs[j] for j in order]
        assert plan.positions == pos
        assert plan.n_decode == 4 and plan.n_prefill == 0
    # Every sample got 3 tokens in those 4 steps (one from the prompt, two decoded).
    assert [len(s.tokens) for s in req.samples] == [3] * 6
    b.run({})
    assert [s.tokens for s in req.samples] == [simulate([3, 9], 4)] * 6


def test_prompt_chunks_fill_the_budget_in_admission_order_after_decode_tokens():
    b = Bench(budget=4)
    a = request([10, 11, 12, 13, 14, 15], max_new_tokens=3)
    c = request([20, 21, 22, 23, 24], max_new_tokens=3)
    b.sched.submit(a)
    b.sched.submit(c)

    p1 = b.step()
    assert (p1.seq_ids, p1.tokens, p1.positions) == ([a.seq] * 4, [10, 11, 12, 13], [0, 1, 2, 3])
    assert p1.logits_for == [] and p1.consumers == []
    p2 = b.step()
    assert p2.seq_ids == [a.seq] * 2 + [c.seq] * 2
    assert (p2.tokens, p2.positions) == ([14, 15, 20, 21], [4, 5, 0, 1])
    assert p2.logits_for == [1] and p2.consumers == [a]
    p3 = b.step()                                    # a's decode token, then c's last 3
    assert p3.seq_ids == [a.samples[0].seq] + [c.seq] * 3
    assert p3.tokens[1:] == [22, 23, 24] and p3.positions == [6, 2, 3, 4]
    assert p3.logits_for == [0, 3] and p3.consumers == [a.samples[0], c]
    assert (p3.n_decode, p3.n_prefill) == (1, 3)
    p4 = b.step()     # decode order starts where the last step's (one token) stopped
    assert p4.positions == [5, 7] and p4.consumers == [c.samples[0], a.samples[0]]
    p5 = b.step()                                    # a finished with its 3rd token
    assert p5.positions == [6] and p5.consumers == [c.samples[0]]
    assert b.sched.idle
    assert a.samples[0].tokens == simulate(a.prompt, 3)
    assert c.samples[0].tokens == simulate(c.prompt, 3)


def test_decode_tokens_leave_no_room_for_a_waiting_prompt():
    b = Bench(budget=3)
    busy = request([1, 2], n=3, max_new_tokens=3)
    b.sched.submit(busy)
    b.step()
    late = request([4, 5], max_new_tokens=2)
    b.sched.submit(late)
    plan = b.step()                                  # admitted, but 3 decode tokens fill it
    assert plan.n_decode == 3 and plan.n_prefill == 0 and late.seq is not None
    b.run({})
    assert late.samples[0].tokens == simulate([4, 5], 2)


# ------------------------------------------------------------------------ admission


def test_admission_waits_for_the_worst_case_cells_of_running_requests():
    b = Bench(cells=20, budget=8)
    first = request(list(range(8)), n=2, max_new_tokens=3)   # worst 8 + 2 x 2 = 12
    second = request(list(range(30, 36)), max_new_tokens=4)  # worst 6 + 3 = 9 > 20 - 12
    b.sched.submit(first)
    b.sched.submit(second)
    b.step()
    # 12 cells are free, more than second's 9 now, but not once first's worst case is counted.
    assert b.cache.free_cells == 12 and second in b.sched.waiting and second.seq is None
    while first.samples[0].finish_reason is None:
        b.step()
        assert second.seq is None
    assert b.cache.free_cells == 20
    b.run({})
    assert second.samples[0].tokens == simulate(second.prompt, 4)


def test_a_request_that_could_never_fit_is_refused_at_submit():
    b = Bench(cells=20)
    b.sched.submit(request(list(range(8)), n=2, max_new_tokens=7))      # exactly 20
    with pytest.raises(CapacityError, match=r"needs up to 21 cells \(9 prompt tokens.*has 20"):
        b.sched.submit(request(list(range(9)), n=2, max_new_tokens=7))
    with pytest.raises(CapacityError, match=rf"n={MAX_SEQUENCES + 1} samples exceed"):
        Bench(cells=4096).sched.submit(request([1], n=MAX_SEQUENCES + 1, max_new_tokens=1))
    assert len(b.sched.waiting) == 1


def test_admission_counts_cells_held_outside_the_scheduler():
    b = Bench(cells=16)
    outside = b.cache.seq_new()
    assert b.cache.declare_step([outside] * 10)
    b.cache.place_step(list(range(10)), 0)
    req = request([1, 2, 3, 4], max_new_tokens=4)                      # worst 7 > 6 free
    b.sched.submit(req)
    assert b.step() is None and req in b.sched.waiting
    b.cache.seq_free(outside)
    b.run({})
    assert req.samples[0].tokens == simulate([1, 2, 3, 4], 4)


def test_n_samples_fork_the_prompt_and_share_its_cells():
    b = Bench(cells=64, budget=16)
    prompt = list(range(40, 50))
    req = request(prompt, n=4, max_new_tokens=3)
    b.sched.submit(req)
    b.step()
    assert len(req.samples) == 4 and b.cache.n_sequences == 4
    assert req.samples[0].seq == req.seq                      # sample 0 is the prompt's
    assert b.cache.free_cells == 64 - len(prompt)             # clones copy nothing
    for s in req.samples:
        assert b.cache.seq_len(s.seq) == len(prompt)
    b.step()                                                  # each feeds back one token
    assert b.cache.free_cells == 64 - len(prompt) - 4
    b.run({})
    assert [s.tokens for s in req.samples] == [simulate(prompt, 3)] * 4
    assert b.cache.free_cells == 64 and b.cache.n_sequences == 0


# ------------------------------------------------------------------------ stops


def _prompt_with_fresh_token(at: int):
    """A prompt whose greedy continuation's token ``at`` appears there first."""
    for first in range(V):
        prompt = [first, 5]
        sim = simulate(prompt, 12)
        if sim[at] not in sim[:at]:
            return prompt, sim
    raise AssertionError("no such prompt")


@pytest.mark.parametrize("eos, stop_on_eos, stop_ids, stops", [
    ((), True, "stop", True),          # the request's stop id
    ("stop", True, (), True),          # the program's EOS
    ("stop", False, (), False),        # EOS ignored
    ("stop", False, "stop", True),     # a stop id is honoured without stop_on_eos
    ((), True, (), False),
], ids=["stop-id", "eos", "eos-off", "stop-id-eos-off", "none"])
def test_a_sample_stops_at_a_stop_token_and_keeps_it(eos, stop_on_eos, stop_ids, stops):
    prompt, sim = _prompt_with_fresh_token(3)
    stop = sim[3]
    b = Bench(eos=[stop] if eos == "stop" else [])
    req = request(prompt, n=2, max_new_tokens=12, stop_on_eos=stop_on_eos,
                  stop_token_ids=[stop] if stop_ids == "stop" else [])
    b.run({0: [req]})
    expected = sim[:4] if stops else sim
    assert [s.tokens for s in req.samples] == [expected] * 2
    assert [s.finish_reason for s in req.samples] == ["stop" if stops else "length"] * 2
    for j in range(2):
        mine = [e for e in b.events if e.sample_index == j]
        assert [e.token for e in mine] == expected
        assert [e.stop_token for e in mine] == [False] * (len(expected) - 1) + [stops]
        assert [e.finish_reason for e in mine] == \
            [None] * (len(expected) - 1) + ["stop" if stops else "length"]
    assert b.cache.free_cells == b.cache.capacity and b.cache.n_sequences == 0


def test_a_stop_token_first_ends_every_sample_at_once():
    prompt = [9, 4]
    first = simulate(prompt, 1)[0]
    b = Bench()
    req = request(prompt, n=3, max_new_tokens=8, stop_token_ids=(first, 60))
    b.run({0: [req]})
    assert [s.tokens for s in req.samples] == [[first]] * 3
    assert len(b.plans) == 1 and b.cache.free_cells == b.cache.capacity


def test_max_new_tokens_one_never_feeds_a_token_back():
    b = Bench(cells=8)
    req = request(list(range(8)), n=3, max_new_tokens=1)     # worst case: the 8 prompt cells
    b.run({0: [req]})
    assert [s.tokens for s in req.samples] == [simulate(list(range(8)), 1)] * 3
    assert [s.finish_reason for s in req.samples] == ["length"] * 3
    assert len(b.plans) == 1 and b.cache.free_cells == 8 and b.cache.n_sequences == 0


@pytest.mark.parametrize("bad", [[1.5], ["a"], "ab", [-1], [True], 3, None, {4}],
                         ids=["float", "str-item", "str", "negative", "bool", "int", "none",
                              "set"])
def test_bad_stop_token_ids_are_refused_at_submit(bad):
    b = Bench()
    with pytest.raises(InvalidConfigError,
                       match=r"stop_token_ids must be a sequence of token ids \(integers >= 0\)"):
        b.sched.submit(request([1, 2], stop_token_ids=bad))
    assert b.sched.idle


def test_stop_token_ids_are_kept_as_a_tuple_of_ints():
    assert SamplingParams(stop_token_ids=[3, np.int64(4)]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=np.array([5])).stop_token_ids == (5,)
    assert type(SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids[0]) is int
    SamplingParams(stop_token_ids=(0, 7)).validate()


# ------------------------------------------------------------------------ cancel


def test_cancel_frees_a_waiting_a_prefilling_and_a_decoding_request():
    b = Bench(cells=40, budget=4)
    decoding = request(list(range(4)), max_new_tokens=10)         # worst 13
    prefilling = request(list(range(10, 22)), max_new_tokens=3)   # worst 14
    waiting = request(list(range(30, 45)), max_new_tokens=2)      # worst 16: 13 + 14 + 16 > 40
    b.sched.submit(decoding)
    b.step()
    b.step()
    assert len(decoding.samples[0].tokens) == 2
    b.sched.submit(prefilling)
    b.sched.submit(waiting)
    b.step()                                 # decoding's token + 3 prompt tokens
    assert prefilling.prefilled == 3 and not prefilling.samples
    assert waiting in b.sched.waiting
    b.sched.cancel(waiting)
    assert waiting.cancelled and waiting not in b.sched.waiting
    b.sched.cancel(prefilling)
    assert b.cache.n_sequences == 1 and b.cache.free_cells == 40 - 6
    b.sched.cancel(decoding)
    assert decoding.samples[0].finish_reason == "cancelled"
    assert b.sched.idle and b.sched.finished == [waiting, prefilling, decoding]
    assert b.cache.free_cells == 40 and b.cache.n_sequences == 0
    b.cache.check_invariants()
    b.sched.cancel(decoding)                 # twice: nothing happens
    assert b.sched.finished == [waiting, prefilling, decoding]
    fresh = request(list(range(30, 45)), max_new_tokens=5)
    b.run({0: [fresh]})
    assert fresh.samples[0].tokens == simulate(fresh.prompt, 5)


def test_a_cancel_during_the_commit_skips_the_rest_of_the_request_rows_only():
    """The victim's prompt ends in the same step as another request's: a
    callback cancels the victim on its sample 0's first token; samples 1 and 2
    get nothing, and the other request takes its own picks (after the
    victim's three in the flat layout)."""
    b = Bench(budget=16)
    victim = request([1, 2, 3], n=3, max_new_tokens=5)
    other = request([7, 8], n=2, max_new_tokens=5, temperature=1.3, seed=3)
    seen = []

    def on_token(ev):
        seen.append((ev.request is victim, ev.sample_index, ev.token))
        if ev.request is victim:
            b.sched.cancel(victim)

    b.sched.on_token = on_token
    b.sched.submit(victim)
    b.sched.submit(other)
    plan = b.step()
    assert plan.consumers == [victim, other] and plan.widths() == [3, 2]
    assert [len(s.tokens) for s in victim.samples] == [1, 0, 0]
    assert [s.finish_reason for s in victim.samples] == ["cancelled"] * 3
    b.run({})
    assert [s.tokens for s in other.samples] == [simulate_sampled([7, 8], other.params, j)
                                                 for j in range(2)]
    assert seen[0] == (True, 0, simulate([1, 2, 3], 1)[0])
    assert b.cache.free_cells == b.cache.capacity and b.cache.n_sequences == 0


def test_a_request_cancelled_by_an_earlier_row_keeps_its_place_in_the_picks():
    """Three prompts end in one step: the first one's token cancels the
    second (n=3) before its row is reached; its three picks are skipped and the
    third request takes the two after them."""
    b = Bench(budget=16)
    trigger = request([1, 2], max_new_tokens=2)
    victim = request([3, 4], n=3, max_new_tokens=2)
    after = request([5, 6], n=2, max_new_tokens=4, temperature=1.3, seed=11)

    def on_token(ev):
        if ev.request is trigger:
            b.sched.cancel(victim)

    b.sched.on_token = on_token
    for req in (trigger, victim, after):
        b.sched.submit(req)
    plan = b.step()
    assert plan.consumers == [trigger, victim, after] and plan.widths() == [1, 3, 2]
    assert victim.cancelled and not victim.samples
    b.run({})
    assert trigger.samples[0].tokens == simulate([1, 2], 2)
    assert [s.tokens for s in after.samples] == [simulate_sampled([5, 6], after.params, j)
                                                 for j in range(2)]
    assert b.cache.free_cells == b.cache.capacity and b.cache.n_sequences == 0


# ------------------------------------------------------------------------ commit's contract


def test_commit_refuses_picks_of_the_wrong_layout_and_changes_nothing():
    b = Bench(budget=8)
    a = request([1, 2], n=2, max_new_tokens=3)
    c = request([3, 4], max_new_tokens=3)
    b.sched.submit(a)
    b.sched.submit(c)
    plan = b.sched.plan()
    logits = b.forward(plan)
    assert plan.widths() == [2, 1]
    for picks, match in [([5, 5], "commit needs 3 picks.*2 logits groups, got 2"),
                         ([5, 5, 5, 5], "commit needs 3 picks"),
                         ([5, 5.0, 5], r"picks must be token ids \(integers >= 0\)"),
                         ([5, True, 5], "picks must be token ids"),
                         ([5, -1, 5], "picks must be token ids")]:
        with pytest.raises(InvalidConfigError, match=match):
            b.sched.commit(plan, picks)
        assert not a.samples and not c.samples and a.prefilled == 0
    with pytest.raises(InvalidConfigError, match=r"logprobs must be parallel to picks \(3\)"):
        b.sched.commit(plan, [5, 5, 5], [None])
    picks, logprobs = choose_tokens(logits, plan.sampling_rows())
    b.sched.commit(plan, np.array(picks), logprobs)             # numpy ids are fine
    assert [s.tokens for s in a.samples] == [[picks[0]], [picks[1]]]
    assert c.samples[0].tokens == [picks[2]] and a.prefilled == 2


def test_choose_tokens_refuses_logits_without_one_row_per_plan_row():
    params = SamplingParams()
    rows = [(params, [params.generator(0)])] * 2
    with pytest.raises(InvalidConfigError, match=r"logits \[2, vocab\].*got shape \(3, 4\)"):
        choose_tokens(np.zeros((3, 4), np.float32), rows)
    with pytest.raises(InvalidConfigError, match=r"got shape \(4,\)"):
        choose_tokens(np.zeros(4, np.float32), rows)


def test_logprobs_are_the_log_softmax_of_the_consumed_row():
    b = Bench()
    req = request([11, 12], max_new_tokens=4, logprobs=3)
    plain = request([13], max_new_tokens=2)
    b.run({0: [req, plain]})
    assert all(e.logprobs is None for e in b.events if e.request is plain)
    mine = [e for e in b.events if e.request is req]
    token, pos = 12, 1
    for e in mine:
        row = logits_of(token, pos).astype(np.float64)
        log_softmax = row - np.log(np.exp(row).sum())
        assert e.logprobs.logprob == pytest.approx(log_softmax[e.token], abs=1e-9)
        order = sorted(range(V), key=lambda v: (-log_softmax[v], v))[:3]
        assert [t for t, _ in e.logprobs.top] == order
        token, pos = e.token, pos + 1


# ------------------------------------------------------------------------ prefix cache


def test_prefix_cache_hits_reuse_cells_and_change_no_token():
    b = Bench(cells=64, budget=4, prefix=True)
    base = list(range(20, 30))
    first = request(base, max_new_tokens=4)
    b.run({0: [first]})
    fed = first.samples[0].tokens[:3]                   # fed back, so cached with the prompt
    assert b.prefix.tokens(b.prefix.seqs()[0]) == base + fed
    cases = [(base + fed + [1, 2], len(base) + 3),      # the whole entry
             (base[:6] + [63, 62], 6),                   # a shorter common prefix
             (base, len(base) - 1)]                      # its last token is always computed
    for prompt, cached in cases:
        plans_before = len(b.plans)
        req = request(prompt, max_new_tokens=3)
        b.run({0: [req]})
        assert req.cached_tokens == cached
        assert req.samples[0].tokens == simulate(prompt, 3)
        prefilled = sum(p.n_prefill for p in b.plans[plans_before:])
        assert prefilled == len(prompt) - cached
    assert b.prefix.stats.hits == 3
    assert b.cache.free_cells == 64 - b.prefix.reclaimable_cells()
    assert b.cache.n_sequences == len(b.prefix)
    b.cache.check_invariants()


def test_prefix_cache_entries_are_evicted_when_admission_needs_their_cells():
    b = Bench(cells=24, budget=8, prefix=True)
    a = request(list(range(10)), max_new_tokens=5)       # leaves an entry of 14 cells
    b.run({0: [a]})
    assert b.cache.free_cells == 24 - 14 and len(b.prefix) == 1
    c = request(list(range(40, 52)), max_new_tokens=4)   # worst 15 > 10 free: evicts a's
    b.run({0: [c]})
    assert b.prefix.stats.evictions == 1 and c.cached_tokens == 0
    assert c.samples[0].tokens == simulate(c.prompt, 4)
    assert b.prefix.seqs() == [c.samples[0].seq]
    assert b.cache.free_cells == 24 - 15
    b.cache.check_invariants()


def test_eviction_never_frees_cells_a_running_request_shares():
    """``a`` clones the cached prefix x; ``c`` needs cells that only evicting x
    would free, but x's cells are a's too: c waits until a ends, then evicts."""
    b = Bench(cells=48, budget=16, prefix=True)
    x = [(3 * i + 7) % V for i in range(30)]
    b.run({0: [request(x, max_new_tokens=1)]})
    a = request(x + [5, 6], max_new_tokens=4)            # cached 30, worst 2 + 3
    c = request(list(range(14)), max_new_tokens=4)       # worst 17 > 48 - 30 - 5
    b.events.clear()
    b.run({0: [a, c]})
    assert a.cached_tokens == 30 and c.cached_tokens == 0
    assert [e.request is a for e in b.events] == [True] * 4 + [False] * 4
    assert a.samples[0].tokens == simulate(a.prompt, 4)
    assert c.samples[0].tokens == simulate(c.prompt, 4)
    assert b.prefix.stats.evictions >= 1
    b.cache.check_invariants()


def test_a_cancelled_prefill_leaves_its_placed_tokens_to_the_prefix_cache():
    b = Bench(cells=64, budget=4, prefix=True)
    prompt = list(range(10, 20))
    victim = request(prompt, max_new_tokens=3)
    b.sched.submit(victim)
    b.step()
    b.step()                                             # 8 prompt tokens placed
    b.sched.cancel(victim)
    assert b.prefix.tokens(b.prefix.seqs()[0]) == prompt[:8]
    later = request(prompt + [1], max_new_tokens=3)
    b.run({0: [later]})
    assert later.cached_tokens == 8 and later.samples[0].tokens == simulate(later.prompt, 3)


BASES = [[(5 * i + k) % V for i in range(12)] for k in range(3)]
prefixed_prompts = st.builds(lambda b, k, tail: BASES[b][:k] + tail, st.integers(0, 2),
                             st.integers(0, 12), st.lists(st.integers(0, V - 1), max_size=4)
                             ).filter(bool)


@SETTINGS
@given(budget=st.integers(1, 8), bound=st.one_of(st.none(), st.integers(0, 48)),
       spec=st.lists(st.tuples(prefixed_prompts, st.integers(1, 2), st.integers(1, 5),
                               st.integers(0, 8)), min_size=1, max_size=8))
def test_prefix_cache_never_changes_a_token(budget, bound, spec):
    """Requests sharing prefixes through a 48-cell cache with a prefix cache
    (bounded or not): every sample equals the simulation, a hit never exceeds
    the prompt minus its last token, and at the end the cache holds exactly
    the prefix cache's entries."""
    b = Bench(cells=48, budget=budget, prefix=True, prefix_cells=bound)
    reqs, arrivals = [], {}
    for prompt, n, m, at in spec:
        req = request(prompt, n=n, max_new_tokens=m)
        reqs.append(req)
        arrivals.setdefault(at, []).append(req)
    b.run(arrivals)
    for req in reqs:
        assert [s.tokens for s in req.samples] == \
            [simulate(req.prompt, req.params.max_new_tokens)] * req.params.n
        assert 0 <= req.cached_tokens <= len(req.prompt) - 1
    assert b.cache.n_sequences == len(b.prefix)
    assert b.cache.free_cells == 48 - b.prefix.reclaimable_cells()
    if bound is not None:
        assert b.prefix.reclaimable_cells() <= bound
    b.cache.check_invariants()
