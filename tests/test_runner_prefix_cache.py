"""The prefix cache under a Runner (tests/spec/prefix_cache.py with a real
program): bounds, requests that cannot fit, eviction that waits for cells a
running request shares, long cached tails, seeded samples from a cached
prefix, clear(), and what cancelled and stopped requests leave behind; every
output equals a run without the prefix cache.

Programs, prompts and helpers: conftest.py and tests/runner_support.py.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import (
    CELLS, PROMPTS, SAMPLING, STEP, TIGHT_CELLS, WAIT_PROMPTS, make_request, Req, drive,
)

import executorch_cellcache as ecc
from executorch_cellcache.runtime.runner import GenerateStats
from executorch_cellcache import CapacityError

pytestmark = pytest.mark.slow


def test_prefix_cache_bound_smaller_than_a_request_keeps_its_first_cells(roomy_pte, runner):
    bounded = ecc.Runner(roomy_pte, prefix_cache_cells=10)
    prompt = PROMPTS[3]  # 40 tokens
    kw = {"max_new_tokens": 5, "n": 2, "stop_on_eos": False}
    assert bounded.generate([prompt], **kw) == runner.generate([prompt], **kw)
    assert bounded.last_stats.prefix_cache_cells == 10
    assert bounded.cache.free_cells == CELLS - 10
    longer = prompt + [11, 12]
    assert bounded.generate([longer], **kw) == runner.generate([longer], **kw)
    assert bounded.last_stats.cached_tokens == [10]
    assert bounded.cache.free_cells == CELLS - 10


def test_cached_prefix_of_a_request_that_cannot_fit_is_refused_and_kept(tight_pte):
    r = ecc.Runner(tight_pte)
    prompt = WAIT_PROMPTS[0]
    first = r.generate([prompt], max_new_tokens=4, stop_on_eos=False)
    held, entries = r.cache.free_cells, r.prefix_cache.seqs()
    # The prompt's cells are cached, but prompt + fed-back tokens exceed the whole cache.
    with pytest.raises(CapacityError, match=rf"needs up to {len(prompt) + 2 + 39} cells"):
        r.generate([prompt + [5, 6]], max_new_tokens=40)
    assert r.cache.free_cells == held and r.prefix_cache.seqs() == entries
    r.cache.check_invariants()
    again = r.generate([prompt], max_new_tokens=4, stop_on_eos=False)
    assert again == first and r.last_stats.cached_tokens == [len(prompt) - 1]


def test_eviction_waits_for_cells_a_running_request_shares(tight_pte):
    """B needs cells held by the cached prefix that running A cloned: B waits
    for A (eviction never frees A's cells), then evicts and runs; both give
    the tokens of runs without a prefix cache."""
    r = ecc.Runner(tight_pte)
    x = [(3 * i + 7) % 300 + 10 for i in range(30)]
    r.generate([x], max_new_tokens=1)
    a, b = x + [5, 6], WAIT_PROMPTS[2]  # worst cases 2 + 3 and 14 + 3 cells
    events = []
    out = r.generate([a, b], max_new_tokens=4, stop_on_eos=False,
                     on_token=lambda p, s, t: events.append(p))
    assert r.last_stats.cached_tokens == [30, 0]
    assert events == [0, 0, 0, 0, 1, 1, 1, 1]  # B started after A ended
    cold = ecc.Runner(tight_pte, prefix_cache=False)
    assert out == [cold.generate([a], 4, stop_on_eos=False)[0],
                   cold.generate([b], 4, stop_on_eos=False)[0]]
    assert r.prefix_cache.stats.evictions >= 1
    r.cache.check_invariants()


def test_a_cached_prefix_whose_entry_holds_a_long_tail_is_still_served(tight_pte):
    """The entry holding the prompt also holds 29 generated tokens the new
    request does not share; only evicting that entry makes room. The prefix is
    cloned first, so eviction frees just the tail and the request still
    reuses the prompt."""
    r = ecc.Runner(tight_pte)
    prompt = WAIT_PROMPTS[0]                       # 12 tokens
    r.generate([prompt], max_new_tokens=30, stop_on_eos=False)
    assert r.cache.free_cells == TIGHT_CELLS - 41  # 12 + 29 fed back
    longer = prompt + [5]                          # needs 1 + 29 more cells
    out = r.generate([longer], max_new_tokens=30, stop_on_eos=False)
    assert r.last_stats.cached_tokens == [12]
    assert out == ecc.Runner(tight_pte, prefix_cache=False).generate(
        [longer], max_new_tokens=30, stop_on_eos=False)
    r.cache.check_invariants()


def test_seeded_samples_are_the_same_from_a_cached_prefix(roomy_pte, runner):
    cached = ecc.Runner(roomy_pte)
    kw = {"max_new_tokens": 8, "n": 3, "stop_on_eos": False, "seed": 5, **SAMPLING}
    cached.generate([PROMPTS[3]], **kw)
    longer = PROMPTS[3] + [17, 18, 19]
    assert cached.generate([longer], **kw) == runner.generate([longer], **kw)
    assert cached.last_stats.cached_tokens == [40]


def test_cache_clear_also_empties_the_prefix_cache(roomy_pte, runner):
    r = ecc.Runner(roomy_pte)
    kw = {"max_new_tokens": 4, "stop_on_eos": False}
    expected = runner.generate(PROMPTS[:2], **kw)
    assert r.generate(PROMPTS[:2], **kw) == expected
    assert len(r.prefix_cache) == 2
    r.cache.clear()  # behind the runner's back: cached ids are gone
    assert len(r.prefix_cache) == 0 and r.prefix_cache.reclaimable_cells() == 0
    assert r.generate(PROMPTS[:2], **kw) == expected
    assert r.last_stats.cached_tokens == [0, 0]
    r.clear()
    assert r.cache.n_sequences == 0 and r.cache.free_cells == CELLS


def test_cancelled_and_stopped_requests_leave_prefixes_that_serve_later_ones(roomy_pte, runner):
    """With the prefix cache, a request cancelled mid-prefill leaves the prompt
    tokens it placed, and a sample ended by its text watch (a stop string)
    leaves its prompt and fed-back tokens; later requests reuse exactly those
    and match runs without a prefix cache."""
    cached = ecc.Runner(roomy_pte)
    prefilling = make_request(PROMPTS[3], max_new_tokens=4, stop_on_eos=False)  # 40 tokens
    seen = [0]

    def stop_at_three(sample, token, stop_token):
        seen[0] += 1
        return seen[0] == 3
    stopped = Req(PROMPTS[2], ends=stop_at_three, max_new_tokens=8, stop_on_eos=False)
    prefilling.submit(cached)
    cached.engine.step()                          # one 16-token chunk placed
    cached.engine.cancel(prefilling.id)
    drive(cached, {0: [stopped]})
    assert prefilling.samples[0].finish_reason == "cancelled"
    assert len(stopped.samples[0].tokens) == 3
    assert stopped.samples[0].finish_reason == "stop"
    kw = {"max_new_tokens": 5, "stop_on_eos": False}
    later = [PROMPTS[3] + [21], PROMPTS[2] + stopped.samples[0].tokens + [22]]
    assert cached.generate(later, **kw) == runner.generate(later, **kw)
    assert cached.last_stats.cached_tokens == [STEP, len(PROMPTS[2]) + 2]


def test_cancel_from_a_token_callback_leaves_what_each_sample_placed(roomy_pte, runner):
    """Sample 0's second token cancels its request; the cancel applies before
    the next step, when every sample has its second token chosen but only its
    first placed: each sequence is cached with exactly the tokens it holds."""
    cached = ecc.Runner(roomy_pte)
    victim = make_request(PROMPTS[0], max_new_tokens=6, n=3, stop_on_eos=False)

    def on_event(ev):
        if ev.sample_index == 0 and len(victim.samples[0].tokens) == 2:
            cached.engine.cancel(victim.id)
    victim.on_event = on_event
    drive(cached, {0: [victim]})
    assert [len(s.tokens) for s in victim.samples] == [2, 2, 2]
    assert all(s.finish_reason == "cancelled" for s in victim.samples)
    assert len(cached.prefix_cache) == 1
    later = [PROMPTS[0] + victim.samples[0].tokens + [23]]
    kw = {"max_new_tokens": 4, "stop_on_eos": False}
    assert cached.generate(later, **kw) == runner.generate(later, **kw)
    assert cached.last_stats.cached_tokens == [len(PROMPTS[0]) + 1]
