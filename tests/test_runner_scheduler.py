"""The engine the server drives (``runner.engine``, the C++ engine over the
program's forward), stepped request by request: requests with their own
parameters joining late equal each alone, cancel in every state and from a
token callback, a sample ended by its text watch, stop-token events,
logprobs against transformers' log-softmax, and bad requests refused at
submit. tests/test_scheduler.py tests the scheduler's rules on a bare cache.

Programs, prompts and helpers: conftest.py and tests/runner_support.py.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import (
    CELLS, EOS_PROMPT, PROMPTS, STEP, TIGHT_CELLS, WAIT_NEW, WAIT_PROMPTS, Req, drive,
    make_request,
)

import executorch_cellcache as ecc
from executorch_cellcache import CapacityError, InvalidConfigError

pytestmark = pytest.mark.slow


def test_requests_with_their_own_parameters_joining_late_equal_each_alone(runner):
    specs = [
        (PROMPTS[0], dict(max_new_tokens=5, stop_on_eos=False)),
        (PROMPTS[3], dict(max_new_tokens=7, n=2, temperature=0.9, top_p=0.95, seed=3,
                          stop_on_eos=False)),
        (PROMPTS[1], dict(max_new_tokens=9, n=3, temperature=0.7, top_k=20, seed=11,
                          stop_on_eos=False)),
        (PROMPTS[2], dict(max_new_tokens=4, stop_on_eos=False)),
    ]
    reqs = [make_request(p, **kw) for p, kw in specs]
    # Two arrive at once, one while they decode, one after the others' prefills.
    drive(runner, {0: reqs[:2], 3: [reqs[2]], 6: [reqs[3]]})
    for req, (prompt, kw) in zip(reqs, specs):
        kw = dict(kw)
        alone = runner.generate([prompt], **kw)[0]
        assert [s.tokens for s in req.samples] == alone
        assert all(s.finish_reason == "length" for s in req.samples)
    assert runner.cache.free_cells == CELLS and runner.cache.n_sequences == 0


def test_cancel_frees_a_request_in_every_state(tight_pte):
    runner = ecc.Runner(tight_pte, prefix_cache=False)
    engine = runner.engine
    kw = dict(max_new_tokens=WAIT_NEW, stop_on_eos=False)
    decoding, prefilling, waiting = (make_request(p, **kw) for p in WAIT_PROMPTS[:3])
    long_prompt = make_request(PROMPTS[3][:30], max_new_tokens=3, stop_on_eos=False)
    decoding.submit(runner)
    engine.step()                              # its prompt (12 tokens) in one step
    engine.step()
    assert len(decoding.samples[0].tokens) == 2
    long_prompt.submit(runner)                 # 30 + 2 cells: waits (21 + 32 > 48)
    waiting.submit(runner)
    engine.cancel(waiting.id)                  # never admitted
    engine.cancel(decoding.id)                 # mid-decode: freed before the next step plans
    engine.step()                              # ... which prefills the long prompt's first chunk
    assert waiting.samples[0].finish_reason == "cancelled" and not waiting.samples[0].tokens
    assert decoding.samples[0].finish_reason == "cancelled"
    assert len(decoding.samples[0].tokens) == 2
    assert engine.last_plan_counts()[0] == STEP and not long_prompt.samples[0].tokens
    assert runner.cache.free_cells == TIGHT_CELLS - STEP and runner.cache.n_sequences == 1
    engine.cancel(long_prompt.id)              # mid-prefill
    assert engine.step()                       # the cancel applied, nothing left to run
    assert long_prompt.samples[0].finish_reason == "cancelled"
    assert runner.cache.free_cells == TIGHT_CELLS and runner.cache.n_sequences == 0
    assert engine.idle and engine.live_requests == 0
    with pytest.raises(InvalidConfigError, match="already finished"):
        engine.cancel(decoding.id)             # twice: refused, nothing happens
    # The cache serves the next request as if nothing happened.
    fresh = make_request(WAIT_PROMPTS[0], **kw)
    drive(runner, {0: [fresh]})
    solo = ecc.Runner(tight_pte).generate([WAIT_PROMPTS[0]], **kw)[0]
    assert [s.tokens for s in fresh.samples] == solo


def test_cancel_from_a_token_callback_stops_before_the_next_step(runner):
    """A cancel from a token callback is applied before the next step plans:
    the tokens of the step being delivered arrive, none after them."""
    runner.clear()
    other = make_request(PROMPTS[1], max_new_tokens=6, stop_on_eos=False)
    victim = make_request(PROMPTS[0], max_new_tokens=6, n=3, stop_on_eos=False)

    def on_event(ev):
        if ev.sample_index == 0 and len(victim.samples[0].tokens) == 2:
            runner.engine.cancel(victim.id)

    victim.on_event = on_event
    drive(runner, {0: [victim, other]})
    # Sample 0's second token cancelled the request: every sample stopped at two.
    assert [len(s.tokens) for s in victim.samples] == [2, 2, 2]
    assert all(s.finish_reason == "cancelled" for s in victim.samples)
    assert [s.tokens for s in other.samples] == runner.generate(
        [PROMPTS[1]], max_new_tokens=6, stop_on_eos=False)[0]
    runner.clear()
    assert runner.cache.free_cells == CELLS and runner.cache.n_sequences == 0


def test_a_text_watch_ends_only_its_sample(runner):
    """Runner.submit's ``text`` watch (the server's stop strings) sees each
    token as it is taken; True ends that sample there, "stop", and the
    others run on."""
    runner.clear()
    seen = [0, 0, 0]

    def ends(sample, token, stop_token):
        seen[sample] += 1
        return sample == 1 and seen[sample] == 3

    req = Req(PROMPTS[2], ends=ends, max_new_tokens=8, n=3, stop_on_eos=False)
    drive(runner, {0: [req]})
    full = runner.generate([PROMPTS[2]], max_new_tokens=8, stop_on_eos=False)[0][0]
    assert [s.tokens for s in req.samples] == [full, full[:3], full]
    assert [s.finish_reason for s in req.samples] == ["length", "stop", "length"]
    runner.clear()
    assert runner.cache.free_cells == CELLS


def test_stop_token_finish_reason(runner, oracle_and_paths):
    eos = oracle_and_paths[3]
    req = make_request(EOS_PROMPT, max_new_tokens=8)
    events = drive(runner, {0: [req]})
    [sample] = req.samples
    assert sample.tokens[-1] == eos and sample.finish_reason == "stop"
    assert [e.stop_token for e in events] == [False] * (len(sample.tokens) - 1) + [True]
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])


def test_logprobs_match_transformers_log_softmax(runner, oracle):
    k = 4
    prompt = PROMPTS[1]
    req = make_request(prompt, max_new_tokens=5, logprobs=k, stop_on_eos=False)
    plain = make_request(prompt, max_new_tokens=5, stop_on_eos=False)
    events = drive(runner, {0: [req, plain]})
    mine = [e for e in events if e.request is req]
    assert all(e.logprobs is None for e in events if e.request is plain)
    tokens = req.samples[0].tokens
    with torch.no_grad():
        logits = oracle(torch.tensor([prompt + tokens])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)
    for j, e in enumerate(mine):
        row = expected[len(prompt) + j - 1]
        assert e.logprobs.logprob == pytest.approx(float(row[e.token]), abs=1e-4)
        assert len(e.logprobs.top) == k
        values = [lp for _, lp in e.logprobs.top]
        assert values == sorted(values, reverse=True)
        for tok, lp in e.logprobs.top:
            assert lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert values[-1] >= float(torch.topk(row, k).values[-1]) - 1e-4
        assert e.logprobs.top[0][0] == e.token  # greedy picks the most likely


def test_requests_with_bad_parameters_are_refused_at_submit(runner):
    free = runner.cache.free_cells
    for params, match in [(dict(n=0), "n must be"), (dict(logprobs=21), "logprobs"),
                          (dict(max_new_tokens=0), "max_new_tokens"),
                          (dict(stop_on_eos=1), "stop_on_eos")]:
        with pytest.raises(InvalidConfigError, match=match):
            make_request(PROMPTS[0], **params).submit(runner)
    with pytest.raises(InvalidConfigError, match="empty"):
        make_request([], max_new_tokens=2).submit(runner)
    with pytest.raises(CapacityError, match="257 cells"):
        make_request(PROMPTS[0], max_new_tokens=253).submit(runner)
    assert runner.engine.idle and runner.engine.live_requests == 0
    assert runner.cache.free_cells == free
