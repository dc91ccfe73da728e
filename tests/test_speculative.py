"""Speculative decoding (SPEC section 11; tests/spec/speculative.py, sampling.verify,
the scheduler's proposals).

Oracles: prompt lookup against a brute-force search written from its rule;
the acceptance rule against exact distributions (chi-square over seeded
draws, with deliberately wrong rules that must fail the same test); end to
end, greedy output with proposals against plain decoding of the same program
(token for token) and every emitted token's log-probability against
transformers eager (1e-4), for Llama, Qwen3, Mistral and Gemma3 (windows of 6
positions, crossed inside verified runs), forks, mixed batches and prefix-cache
hits; sampled output against the exact next-token distribution computed from
transformers.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).parent))

from model_configs import ARCHS, WINDOW, make_model

import executorch_cellcache as ecc
from executorch_cellcache import InvalidConfigError
from spec import sampling
from executorch_cellcache.runtime.runner import GenerateStats
from spec.sampling import SamplingParams, distribution, verify
from spec.scheduler import Request, Scheduler
from spec.speculative import (
    DEFAULT_MAX_DRAFT,
    NgramIndex,
    Speculative,
    lookup,
)

ATOL = 1e-4
P_FLOOR = 1e-3      # a correct rule's chi-square p-value stays above this
P_WRONG = 1e-6      # a wrong rule's must fall below this


# --------------------------------------------------------------------------- prompt lookup


def brute_lookup(ctx, limit, lo, hi):
    n = len(ctx)
    for m in range(hi, lo - 1, -1):
        if m > n - 1:
            continue
        for i in range(0, n - m):
            if ctx[i:i + m] == ctx[n - m:]:
                return ctx[i + m:i + m + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=30), st.integers(0, 9), st.integers(1, 4),
       st.integers(0, 3))
def test_lookup_is_the_earliest_longest_match(ctx, limit, lo, extra):
    hi = lo + extra
    assert lookup(ctx, limit, lo, hi) == brute_lookup(ctx, limit, lo, hi)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=10),
       st.integers(0, 9), st.integers(1, 3), st.integers(0, 2))
def test_the_growing_index_answers_as_lookup_does(chunks, limit, lo, extra):
    hi = lo + extra
    index, ctx = NgramIndex(lo, hi), []
    assert index.lookup(limit) == []
    for chunk in chunks:
        index.extend(chunk)
        ctx += chunk
        assert index.context == ctx
        assert index.lookup(limit) == brute_lookup(ctx, limit, lo, hi)


def test_lookup_examples():
    #            0  1  2  3  4  5  6  7  8
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    assert lookup(ctx, 3, 2, 3) == [8, 9, 5]        # [5 6 7] at 0, followed by 8 9 5
    assert lookup(ctx, 8, 2, 3) == [8, 9, 5, 6, 7]  # runs into the suffix itself
    assert lookup([1, 2, 3, 4], 4, 1, 3) == []       # no earlier occurrence
    assert lookup([1, 2, 1, 2, 1, 2], 2, 2, 2) == [1, 2]  # earliest of three


# --------------------------------------------------------------------------- the rule


def _logits(rng, rows, vocab, scale=2.0):
    return (scale * rng.standard_normal((rows, vocab))).astype(np.float32)


def test_verify_greedy_keeps_proposals_while_the_argmax_agrees():
    rng = np.random.default_rng(0)
    logits = _logits(rng, 5, 11)
    best = logits.argmax(-1).tolist()
    greedy = SamplingParams()
    g = np.random.default_rng(1)
    assert verify(logits, best[:4], None, greedy, g) == best          # all 4 + the 5th row's
    wrong = (best[2] + 1) % 11
    assert verify(logits, best[:2] + [wrong, 3], None, greedy, g) == best[:3]
    assert verify(logits[:1], [], None, greedy, g) == best[:1]


def test_verify_with_a_deterministic_draft_draws_what_plain_sampling_draws():
    """Same seed, same tokens: row i's token is plain sampling's i-th draw, kept
    as the proposal while equal, so the first disagreement ends the run."""
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    rng = np.random.default_rng(5)
    for trial in range(200):
        logits = _logits(rng, 6, 9, scale=1.5)
        plain_rng = np.random.default_rng([trial])
        plain = [sampling.choose(row, params, plain_rng) for row in logits]
        # A proposal that follows plain sampling for a random stretch, then deviates.
        agree = int(rng.integers(0, 6))
        draft = plain[:agree] + [(plain[agree] + 1) % 9] if agree < 5 else plain[:5]
        draft = draft[:5]
        got = verify(logits[:len(draft) + 1], draft, None, params, np.random.default_rng([trial]))
        assert got == plain[:len(got)]
        assert len(got) == min(agree, len(draft)) + 1


def _first_two(rule, p_logits, q_logits, params, trials, seed):
    """Counts of the first two emitted tokens (second: -1 when one was emitted)
    when a sampled draft of 2 tokens is verified with ``rule``."""
    vocab = p_logits.shape[1]
    q = np.stack([distribution(row, params) for row in q_logits])
    counts = {}
    rng = np.random.default_rng(seed)
    for _ in range(trials):
        draft = [int(rng.choice(vocab, p=q[0])), int(rng.choice(vocab, p=q[1]))]
        out = rule(p_logits, draft, q, params, rng)
        key = (out[0], out[1] if len(out) > 1 else -1)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _first_token_pvalue(counts, p0):
    first = np.zeros(len(p0))
    for (a, _), c in counts.items():
        first[a] += c
    keep = p0 > 0
    assert first[~keep].sum() == 0, "a token outside the target's support was emitted"
    return sps.chisquare(first[keep], first[keep].sum() * p0[keep]).pvalue


def _rejection_from_p(logits, draft, q, params, rng):
    """Wrong: after a rejection, draws from p instead of max(0, p - q)."""
    p = distribution(logits[0], params)
    d = draft[0]
    if rng.random() * q[0][d] < p[d]:
        return [d]
    return [int(rng.choice(len(p), p=p))]


def _inverted_ratio(logits, draft, q, params, rng):
    """Wrong: accepts with min(1, q(d) / p(d)), the ratio upside down."""
    p = distribution(logits[0], params)
    d = draft[0]
    if rng.random() * p[d] < q[0][d]:
        return [d]
    residual = np.maximum(p - q[0], 0)
    return [int(rng.choice(len(p), p=residual / residual.sum()))]


def test_sampled_draft_rule_gives_the_target_distribution_and_wrong_rules_do_not():
    params = SamplingParams(temperature=1.0)
    p_logits = np.array([[2.0, 1.5, 0.2, -1.0, 0.5, -3.0]] * 3, np.float32)
    q_logits = np.array([[0.0, 2.5, 1.0, 0.5, -1.0, 0.0]] * 2, np.float32)
    p0 = distribution(p_logits[0], params)
    good = _first_two(verify, p_logits, q_logits, params, 15_000, 0)
    assert _first_token_pvalue(good, p0) > P_FLOOR
    # The second token, given the first was accepted: p again (rows are independent here).
    second = np.zeros(len(p0))
    for (_, b), c in good.items():
        if b >= 0:
            second[b] += c
    assert sps.chisquare(second, second.sum() * p0).pvalue > P_FLOOR
    for wrong in (_rejection_from_p, _inverted_ratio):
        bad = _first_two(wrong, p_logits, q_logits, params, 15_000, 0)
        assert _first_token_pvalue(bad, p0) < P_WRONG, wrong.__name__


def test_verify_never_returns_the_rejected_proposal():
    """The commit parses a group as draft[:a] + one token != draft[a]."""
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=1.3, top_k=5)
    for _ in range(500):
        logits = _logits(rng, 4, 7)
        q = np.stack([distribution(r, params) for r in _logits(rng, 3, 7)])
        draft = [int(rng.choice(7, p=qi)) for qi in q]
        out = verify(logits, draft, q, params, rng)
        a = len(out) - 1
        assert out[:a] == draft[:a] and (a == 3 or out[a] != draft[a])


# --------------------------------------------------------------------------- config errors


def test_bad_speculative_configs_are_refused_before_any_request(arch_exports, tmp_path):
    _, result, _ = arch_exports("llama")
    r = ecc.Runner(result.path)
    step = r.info.max_tokens_per_step
    cases = [
        (Speculative(max_draft=0), r"max_draft \(--draft-max.* \[1, 31\].* got 0"),
        (Speculative(max_draft=step), rf"max_draft \(--draft-max.* got {step}"),
        (Speculative(method="medusa"), "speculative method must be one of lookup, draft"),
        (Speculative(min_ngram=3, max_ngram=2), r"min_ngram \(3\) must not exceed max_ngram"),
        (Speculative(method="draft"), "needs a draft model"),
        (Speculative(method="draft", draft_model=str(tmp_path / "none.pte")),
         "draft model: .*does not exist"),
        ("ngram", "speculative method must be one of"),
        (3, "speculative must be None, 'lookup' or a Speculative"),
    ]
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program at all")
    cases.append((Speculative(method="draft", draft_model=str(junk)),
                  "draft model: .*not a loadable ExecuTorch program"))
    _, other, _ = arch_exports("mistral")  # vocabulary 384 against 320
    cases.append((Speculative(method="draft", draft_model=str(other.path)),
                  "vocabulary of 384 tokens, the target 320"))
    for spec, match in cases:
        with pytest.raises(InvalidConfigError, match=match):
            r.generate([[5, 6, 7]], max_new_tokens=4, speculative=spec)
        assert r.cache.free_cells == r.cache.capacity and r.cache.n_sequences == 0


def test_a_program_with_one_token_steps_cannot_speculate(tmp_path):
    path = tmp_path / "one.pte"
    ecc.export(make_model("llama"), path, n_cells=32, max_tokens_per_step=1)
    r = ecc.Runner(path)
    with pytest.raises(InvalidConfigError, match="max_tokens_per_step holds a decode token "
                                                 r"and a proposal \(>= 2\); this one's is 1"):
        r.generate([[5, 6]], max_new_tokens=3, speculative="lookup")


# --------------------------------------------------------------------------- max_draft auto


def test_auto_max_draft_comes_from_the_programs_measured_step_costs(arch_exports, monkeypatch):
    """Speculative(max_draft=None), the default: the Runner times steps of 1
    .. 32 tokens once and applies cpp/engine/draft_length.h's rule (the C++
    engine's: its worked examples are in cpp/engine/tests/draft_length_test.cpp)."""
    _, result, _ = arch_exports("llama")
    r = ecc.Runner(result.path)
    step = r.info.max_tokens_per_step
    held = r.cache.seq_new()
    r.step([held] * 3, [5, 6, 7], [0, 1, 2], [2])
    free, seqs = r.cache.free_cells, r.cache.n_sequences
    seconds = r.step_seconds(step, rounds=2)
    assert len(seconds) == step and all(s > 0 for s in seconds)
    assert (r.cache.free_cells, r.cache.n_sequences) == (free, seqs)  # left as found
    assert r.cache.next_pos(held) == 3
    r.cache.check_invariants()
    for args, match in (((0,), rf"max_tokens must be an integer in \[1, {step}\].* got 0"),
                        ((step + 1,), f"got {step + 1}"), ((4, 0), "rounds must be an integer "
                                                                   ">= 1, got 0")):
        with pytest.raises(InvalidConfigError, match=match):
            r.step_seconds(*args)
    r.cache.seq_free(held)

    # A staircase (1 token 1.0, 2-7 tokens 1.2, 8-14 1.5, more 2.6): the top of the stair
    # that pays best, 14 tokens (the C++ test works it out); a given k is kept.
    stairs = [1.0] + [1.2] * 6 + [1.5] * 7 + [2.6] * (step - 14)
    calls = []
    monkeypatch.setattr(r, "step_seconds", lambda n, rounds=5: calls.append(n) or stairs[:n])
    assert r.max_draft_for(Speculative(max_draft=4), None) == 4 and not calls
    assert r.max_draft_for(Speculative(), None) == 13 and calls == [step]
    out = r.generate([[5, 6, 7, 5, 6, 7, 5]], 8, speculative="lookup")
    assert r.last_stats.max_draft == 13 and calls == [step]  # measured once per Runner
    monkeypatch.undo()
    assert out == r.generate([[5, 6, 7, 5, 6, 7, 5]], 8)

    # No room to measure (every cell but a few held): the default, within the budget.
    r2 = ecc.Runner(result.path)
    hog = r2.cache.seq_new()
    filled = 0
    while r2.cache.free_cells >= 16:
        assert r2.cache.declare_step([hog] * 16)
        for layer in range(r2.cache.n_layers):
            r2.cache.place_step(list(range(filled, filled + 16)), layer)
        filled += 16
    assert r2.max_draft_for(Speculative(), None) == min(DEFAULT_MAX_DRAFT, step - 1)


# --------------------------------------------------------------------------- end to end


def _looping_prompts(vocab, seed, runner=None):
    """Prompts that repeat themselves (prompt lookup finds matches at once) and
    one that does not, all longer than the sliding window. With ``runner``,
    the first is X + G + X where G is the program's greedy continuation of X,
    so a lookup proposal after the second X is likely to be accepted."""
    g = np.random.default_rng(seed)
    a = g.integers(3, vocab, 14).tolist()
    b = g.integers(3, vocab, 9).tolist()
    first = a + a[:5]
    if runner is not None:
        first = a + runner.generate([a], 10, stop_on_eos=False)[0][0] + a
    return [first, b + b + b[:3], g.integers(3, vocab, 11).tolist()]


def _run(runner, prompts, params, spec, speculate=None):
    """Drives ``runner.engine`` to the end with ``spec``; per prompt, per
    sample, the (token, logprob) pairs, plus the engine's stats."""
    from runner_support import Req, drive

    runner.use_speculative(spec)
    runner.engine.reset_stats()
    reqs = []
    for i, p in enumerate(prompts):
        req = Req(p, **{f: getattr(params, f) for f in (
            "n", "max_new_tokens", "stop_on_eos", "logprobs", "temperature", "seed")})
        req.speculate = True if speculate is None else speculate[i]
        reqs.append(req)
    events = drive(runner, {0: reqs})
    out = [[[(e.token, e.logprobs.logprob) for e in events
             if e.request is req and e.sample_index == j] for j in range(params.n)]
           for req in reqs]
    runner.use_speculative(None)
    return out, runner.engine.stats()


def _assert_cache_consistent(runner):
    pc = runner.prefix_cache
    for seq in pc.seqs():
        assert runner.cache.next_pos(seq) == runner.cache.seq_len(seq) == len(pc.tokens(seq))
    assert runner.cache.free_cells == runner.cache.capacity - pc.reclaimable_cells()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_proposals_is_plain_decoding_and_transformers(arch_exports, arch):
    oracle, result, _ = arch_exports(arch)
    vocab = oracle.config.vocab_size
    plain_runner = ecc.Runner(result.path, prefix_cache=False)
    prompts = _looping_prompts(vocab, 7, plain_runner)
    params = SamplingParams(n=2, max_new_tokens=20, stop_on_eos=False, logprobs=0)
    plain, _ = _run(plain_runner, prompts, params, None)
    specs = {"lookup": Speculative("lookup", max_draft=6),
             "draft": Speculative("draft", max_draft=7, draft_model=str(result.path))}
    for name, spec in specs.items():
        r = ecc.Runner(result.path)
        # Third prompt plain: a batch of speculating and plain samples.
        got, st_ = _run(r, prompts, params, spec, speculate=[True, True, False])
        assert st_.proposed_tokens > 0, name
        # A random model rarely repeats itself; this Llama does, so lookup gets accepted.
        assert st_.accepted_tokens > 0 or (name == "lookup" and arch != "llama"), name
        for i, (want_i, got_i) in enumerate(zip(plain, got)):
            for j in range(2):
                assert [t for t, _ in got_i[j]] == [t for t, _ in want_i[j]], (name, i, j)
        # Every emitted token's log-probability against transformers eager.
        for i, prompt in enumerate(prompts):
            seq = prompt + [t for t, _ in got[i][0]]
            with torch.no_grad():
                ref = torch.log_softmax(oracle(torch.tensor([seq])).logits[0].double(), -1)
            for k, (t, lp) in enumerate(got[i][0]):
                assert abs(ref[len(prompt) - 1 + k, t].item() - lp) <= ATOL, (name, i, k)
        _assert_cache_consistent(r)
        # Again: every prompt hits the prefix cache, same tokens.
        again, _ = _run(r, prompts, params, spec)
        assert [[[t for t, _ in s] for s in p] for p in again] == \
            [[[t for t, _ in s] for s in p] for p in plain], name
        _assert_cache_consistent(r)
        assert len(prompts[0]) > WINDOW


@pytest.mark.slow
def test_greedy_with_proposals_is_plain_decoding_on_a_quantized_program(default_8da4w_pte):
    """On an 8da4w program an ulp of difference in attention turns, after int8
    activation rounding, into logits ~1e-2 apart, enough to flip a near-tied
    argmax; so a token's attention must not depend on what else its step holds
    (proposals after it, other sequences, the thread count: cpp/attention
    attend_core.cpp make_pieces). Before that rule, the default model's 8da4w
    program decoding held-out copy prompts (they are what prompt lookup is
    for) left plain decoding at the 16th new token of one of 16 (logits 1.8e-3
    apart there)."""
    from executorch_cellcache.exporting.copy_task import heldout_copy_prompts

    runner = ecc.Runner(default_8da4w_pte, prefix_cache=False)
    accepted = 0
    for c in heldout_copy_prompts(16):
        prompt = runner.tokenizer.encode(c.prompt)
        plain = runner.generate([prompt], 96)
        # A fixed k: "auto" measures step costs, which a loaded machine skews.
        assert runner.generate([prompt], 96, speculative=Speculative("lookup", max_draft=7)) \
            == plain, c.prompt
        accepted += runner.last_stats.accepted_tokens
    assert accepted > 16 * 40  # proposals rode along and most were kept


@pytest.mark.slow
def test_stops_and_lengths_inside_accepted_runs(arch_exports):
    """A stop token inside a run ends the sample there; the prefix cache keeps
    only the emitted tokens; max_new_tokens is never exceeded."""
    oracle, result, _ = arch_exports("llama")
    prompt = _looping_prompts(oracle.config.vocab_size, 3)[0]
    plain = ecc.Runner(result.path, prefix_cache=False).generate([prompt], 24, stop_on_eos=False)
    tokens = plain[0][0]
    stop = next(t for k, t in enumerate(tokens) if k >= 4 and t not in tokens[:k])
    cut = tokens.index(stop) + 1
    spec = Speculative("draft", max_draft=8, draft_model=str(result.path))
    r = ecc.Runner(result.path)
    for max_new in (24, 7, 9):
        want = tokens[:min(cut, max_new)]
        out = r.generate([prompt], max_new, stop_on_eos=False, stop_token_ids=[stop],
                         speculative=spec)
        assert out == [[want]], max_new
        assert r.last_stats.accepted_tokens > 0
        _assert_cache_consistent(r)
    # The cached entry holds exactly prompt + emitted tokens (all but the last were fed).
    continued = r.generate([prompt + tokens[:cut]], 4, stop_on_eos=False)
    assert r.last_stats.cached_tokens == [len(prompt) + cut - 1]
    fresh = ecc.Runner(result.path, prefix_cache=False).generate([prompt + tokens[:cut]], 4,
                                                                stop_on_eos=False)
    assert continued == fresh


# --------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def sampled_pair(arch_exports, tmp_path_factory):
    """(target oracle, target .pte, draft model, draft .pte): a tiny Llama and,
    as its draft, the same model with a flattened, perturbed output layer, so
    the draft's distributions overlap the target's without equalling them."""
    oracle, result, _ = arch_exports("llama")
    draft_model = make_model("llama")
    with torch.no_grad():
        w = draft_model.lm_head.weight
        w.mul_(0.6).add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    draft = tmp_path_factory.mktemp("draft") / "draft.pte"
    ecc.export(draft_model, draft, n_cells=256, max_tokens_per_step=32)
    return oracle, result.path, draft_model, draft


def _second_tokens(runner, prompt, params, spec, calls):
    """{first token: [second tokens]} over ``calls`` seeded runs (the second
    token is the first one a proposal can carry)."""
    pairs = {}
    proposed = accepted = 0
    for c in range(calls):
        out = runner.generate([prompt], params.max_new_tokens, n=params.n,
                              temperature=params.temperature, top_k=params.top_k, seed=c,
                              stop_on_eos=False, speculative=spec)
        proposed += runner.last_stats.proposed_tokens
        accepted += runner.last_stats.accepted_tokens
        for s in out[0]:
            pairs.setdefault(s[0], []).append(s[1])
    assert proposed > 0 and 0 < accepted < proposed, (proposed, accepted)
    return pairs


def _second_token_pvalue(model, prompt, params, pairs):
    """Chi-square p-value of the second tokens against ``model``'s exact
    distribution given the first (tokens it never draws must not appear)."""
    stat, dof = 0.0, 0
    for first, seconds in pairs.items():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [first]])).logits[0, -1].float().numpy()
        p = distribution(logits, params)
        support = np.flatnonzero(p)
        counts = np.bincount(seconds, minlength=len(p))
        if counts[p == 0].sum():
            return 0.0
        expected = len(seconds) * p[support]
        stat += float((((counts[support] - expected) ** 2) / expected).sum())
        dof += len(support) - 1
    return sps.chi2.sf(stat, dof)


@pytest.mark.slow
def test_sampling_with_a_draft_model_follows_plain_sampling(sampled_pair):
    """The engine's sampled verification (Leviathan et al.) gives the target's
    distribution, not the draft's: the second tokens pass the chi-square test
    against the target and fail it against the draft that proposed them
    (the test's power; the rule itself is checked token by token against a
    wrong residual in test_verify_*)."""
    oracle, target, draft_model, draft = sampled_pair
    params = SamplingParams(temperature=1.0, top_k=4, n=8, max_new_tokens=3)
    prompt = [11, 12, 13, 14, 15]
    r = ecc.Runner(target, prefix_cache=False)
    spec = Speculative("draft", max_draft=2, draft_model=str(draft))
    pairs = _second_tokens(r, prompt, params, spec, 160)
    assert _second_token_pvalue(oracle, prompt, params, pairs) > P_FLOOR
    assert _second_token_pvalue(draft_model, prompt, params, pairs) < P_WRONG


# --------------------------------------------------------------------------- the server


@pytest.mark.slow
def test_server_speculates_with_plain_output_stop_strings_usage_and_metrics(default_pte):
    """`cellcache serve --speculative lookup`: greedy text equals a plain
    server's, also when a stop string falls inside an accepted run; usage and
    /metrics count proposed and accepted tokens."""
    import httpx
    from test_serve_app import _metric, _serving, _wait

    from executorch_cellcache.serving.app import create_app

    passage = ("The for statement is used to iterate over the elements of a sequence "
               "(such as a string, tuple or list) or other iterable object.")
    prompt = passage + "\n\n" + passage[:40]
    body = {"model": "default", "prompt": prompt, "max_tokens": 48, "temperature": 0}
    outputs = {}
    for spec in (None, Speculative("lookup", max_draft=6)):
        with _serving(create_app(default_pte, speculative=spec)) as base:
            _wait(base)
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
            text = r["choices"][0]["text"]
            details = r["usage"]["completion_tokens_details"]
            if spec is None:
                assert details == {"accepted_prediction_tokens": 0,
                                   "rejected_prediction_tokens": 0}
                stop = text[len(text) // 2:len(text) // 2 + 4]
                cut = text[:text.index(stop)]
            else:
                proposed = details["accepted_prediction_tokens"] + \
                    details["rejected_prediction_tokens"]
                assert proposed > 0
                assert _metric(base, "cellcache_speculative_proposed_tokens_total") == proposed
                assert _metric(base, "cellcache_speculative_accepted_tokens_total") == \
                    details["accepted_prediction_tokens"]
                assert _metric(base, "cellcache_speculative_tokens_per_forward") >= 1.0
                assert _metric(base, "cellcache_speculative_max_draft") == 6
            outputs[spec is None] = text
            r = httpx.post(f"{base}/v1/completions", json={**body, "stop": [stop]},
                           timeout=120).json()
            assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
            # A stop string inside an accepted run: only the emitted proposals count
            # (OpenAI: accepted prediction tokens appeared in the completion).
            usage = r["usage"]
            assert usage["completion_tokens_details"]["accepted_prediction_tokens"] <= \
                usage["completion_tokens"]
    assert outputs[True] == outputs[False]


@pytest.mark.slow
def test_serve_refuses_a_bad_speculative_config_at_load(default_pte):
    import threading

    from test_serve_app import _serving

    from executorch_cellcache.serving.app import create_app

    failed = threading.Event()
    app = create_app(default_pte, on_load_failure=failed.set,
                     speculative=Speculative("lookup", max_draft=500))
    with _serving(app):
        assert failed.wait(60)
    assert "max_draft (--draft-max" in app.state.load_error


@pytest.mark.slow
def test_a_draft_that_fails_in_a_server_stops_speculation_not_the_server(default_pte,
                                                                         monkeypatch):
    """The draft model's forward raises from its eighth call on (its first
    proposals, a prompt catch-up and four one-token steps, are verified
    before): requests go on with plain decoding's output (greedy), /metrics
    says the draft failed, and later requests are served without proposals."""
    import httpx
    from test_serve_app import _metric, _serving, _wait

    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.serving.app import create_app

    passage = "The for statement is used to iterate over the elements of a sequence."
    body = {"model": "default", "prompt": passage + "\n\n" + passage[:24], "max_tokens": 32,
            "temperature": 0}
    with _serving(create_app(default_pte)) as base:
        _wait(base)
        plain = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    calls = {"n": 0}
    FAIL_AT = 8
    real = Runner._engine_forward

    def failing(self, *args):
        if self.prefix_cache is None:  # the draft's Runner (the served one caches prefixes)
            calls["n"] += 1
            if calls["n"] >= FAIL_AT:
                raise RuntimeError("synthetic draft failure")
        return real(self, *args)

    monkeypatch.setattr(Runner, "_engine_forward", failing)
    spec = Speculative("draft", max_draft=4, draft_model=str(default_pte))
    with _serving(create_app(default_pte, speculative=spec)) as base:
        _wait(base)
        assert _metric(base, "cellcache_speculative_draft_failed") == 0
        for _ in range(2):
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
            assert r["choices"][0]["text"] == plain["choices"][0]["text"]
        assert calls["n"] == FAIL_AT   # failed once, never asked again
        assert _metric(base, "cellcache_speculative_draft_failed") == 1
        assert _metric(base, "cellcache_speculative_proposed_tokens_total") > 0  # before it
