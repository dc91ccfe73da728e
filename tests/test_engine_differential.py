"""The Python scheduler (tests/spec/scheduler.py, prefix_cache.py) against the C++
engine (cpp/engine/scheduler.cpp, prefix_cache.cpp, engine.cpp as
``_core.Engine``): both run the same request streams over the same synthetic
model and must plan identical steps.

The drivers, the stream generator and the checks live in
scripts/engine_differential.py (its docstring states the stream format and
every check); this module runs

- the shared cases of tests/cases/scheduler/*.json, each through both
  runtimes: the model's greedy continuation (an independent oracle) for every
  greedy sample, the case's hand-derived ``expect`` facts on each runtime, and
  the differential (forwards step by step, tokens, stop flags, finish
  reasons, cached tokens, cancels, cells and sequences after every step,
  prefix-cache statistics and LRU order, speculation counters); after
  clearing the prefix cache neither cache holds a cell or a sequence id;
- 2,000 random streams (small caches, random arrivals and cancels, shared
  prefixes, n 1-4, stop ids, prefix cache on/off/bounded; half of them
  speculate over a model that copies, with prompt lookup or a draft model
  (its own small cache, sometimes failing), so proposals are placed, partly
  accepted and rolled back, and stops land inside accepted runs) with the
  same checks; on a failure the smallest failing stream found by dropping
  events is shown;
- the (seed, sample) rule within each runtime: a sampled request's tokens are
  the same alone and in a stream (the runtimes' generators differ, so sampled
  tokens are never compared across them), and they are the draws of
  generator (seed, j) from the model's rows: numpy's default_rng([seed, j])
  through runtime/sampling.py's choose in Python; in C++ an independent
  Python model of std::mt19937_64 seeded by std::seed_seq{seed, seed >> 32,
  j} and of cpp/engine/sampling.h's documented draw (with prompt lookup on in
  half the streams: a deterministic proposal changes no draw);
- the engine's integer arguments: a bool or a float is a TypeError, nothing
  queued or cancelled; numpy integers and arrays read as Python ints;
- the differential's own teeth: a scheduler with a broken rule (LRU order,
  round-robin, FIFO, the cells bound, speculation's draft_limit and backoff, rollback
  before caching, proposal budget, a draft mirror never freed) is caught.
"""

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from executorch_cellcache import CellCache
from executorch_cellcache.cache import _core
from spec import prefix_cache as prefix_cache_module
from spec import scheduler as scheduler_module
from spec import speculative as speculative_module
from spec.sampling import choose
from test_core_edges import _NOT_INTS

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = Path(__file__).parent / "cases" / "scheduler"
CASE_FILES = sorted(p.name for p in CASES_DIR.glob("*.json"))

_spec = importlib.util.spec_from_file_location("engine_differential",
                                               ROOT / "scripts" / "engine_differential.py")
ed = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("engine_differential", ed)
_spec.loader.exec_module(ed)

STREAMS = 2000
SEED = 20261202


def need_engine():
    assert hasattr(_core, "Engine"), (
        "executorch_cellcache.cache._core has no Engine: the extension predates "
        "cpp/bindings/engine_bindings.cpp; rebuild the package")


def load(name):
    with open(CASES_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def alone(stream, ev):
    """The stream's config with only ``ev``, submitted at step 0."""
    return {"config": stream["config"], "events": [{**ev, "step": 0}]}


def explain(stream, problems):
    small = ed.shrink(stream, ed.failing)
    return ("\n".join(problems[:10]) + "\nsmallest failing stream:\n" +
            ed.format_stream(small) + "\nits problems:\n" +
            "\n".join(ed.run_stream(small)[2]))


# ---------------------------------------------------------------------------- the cases


def test_the_case_suite_covers_the_rules():
    assert len(CASE_FILES) >= 10
    streams = [load(n) for n in CASE_FILES]
    events = [e for s in streams for e in s["events"]]
    assert any(s["config"]["prefix_cache"] for s in streams)
    assert any(not s["config"]["prefix_cache"] for s in streams)
    assert any(s["config"].get("prefix_cache_cells") is not None for s in streams)
    assert any(e.get("n", 1) > 1 for e in events)
    assert any(e.get("stop_token_ids") for e in events)
    assert any(e.get("stop_on_eos") is False for e in events)
    assert any(e.get("seed") is not None for e in events)
    assert any("cancel" in e for e in events)
    assert any(e.get("speculate") is False for e in events)
    spec = [s for s in streams if s["config"].get("speculative")]
    assert len(spec) >= 5 and all("speculation" in s["expect"] for s in spec)
    assert any(s["config"]["speculative"]["method"] == "draft" for s in spec)
    assert all("expect" in s and "description" in s for s in streams)
    for s in streams:  # well-formed: the C++ engine refuses ids outside the vocabulary
        for e in s["events"]:
            assert all(0 <= t < s["config"]["vocab"] for t in e.get("prompt", []))


@pytest.mark.parametrize("name", CASE_FILES)
def test_case(name):
    stream = load(name)
    py = ed.run_python(stream)
    problems = ed.check_rules(stream, py) + ed.check_expect(stream, py)
    need_engine()
    cc = ed.run_cpp(stream)
    problems += ed.check_rules(stream, cc) + ed.check_expect(stream, cc)
    problems += ed.compare(stream, py, cc)
    for ev in ed.submits(stream):
        if ed.is_sampled(ev):
            for run, tr in ((ed.run_python, py), (ed.run_cpp, cc)):
                solo = run(alone(stream, ev))
                if solo.samples[ev["submit"]] != tr.samples[ev["submit"]]:
                    problems.append(f"{tr.runtime}: sampled {ev['submit']} got "
                                    f"{tr.samples[ev['submit']]} in the case, "
                                    f"{solo.samples[ev['submit']]} alone")
    assert not problems, "\n".join(problems)
    for tr in (py, cc):
        assert tr.cleared == (stream["config"]["cells"], 0)


# ---------------------------------------------------------------------------- random streams


def test_random_streams_agree():
    """>= 1,000 seeded random streams through both runtimes."""
    need_engine()
    s = ed.Summary()
    for i in range(STREAMS):
        stream = ed.random_stream(random.Random(ed.stream_seed(SEED, i)))
        py, _, problems = ed.run_stream(stream)
        s.add(py)
        assert not problems, f"stream {i} (seed {SEED}):\n" + explain(stream, problems)
    # The streams exercise what they are meant to (a generator that stopped
    # making hits, evictions, waits or cancels would test little).
    assert s.steps > 10 * STREAMS and s.tokens > 10 * STREAMS
    assert s.hits > STREAMS / 4 and s.evictions > STREAMS / 4
    assert s.waits > STREAMS / 4 and s.cancels > STREAMS / 10
    assert s.round_robin_steps > STREAMS / 10 and s.refused > 0
    # About half propose; proposals are partly accepted.
    assert s.speculative_streams > STREAMS / 5
    assert s.proposed > STREAMS and s.proposed / 10 < s.accepted < s.proposed / 2


def test_the_stream_generator_is_deterministic():
    a = ed.random_stream(random.Random(ed.stream_seed(SEED, 7)))
    b = ed.random_stream(random.Random(ed.stream_seed(SEED, 7)))
    assert a == b and a != ed.random_stream(random.Random(ed.stream_seed(SEED, 8)))


# ------------------------------------------------------------------ the (seed, sample) rule


def sampled_stream(rng: random.Random) -> dict:
    """A random stream whose requests are about half sampled (temperature,
    top_k, top_p, seeds; some share a seed), with no cancels: the tokens of
    each must not depend on the others. Half of them run prompt lookup."""
    stream = ed.random_stream(rng)
    spec = stream["config"].get("speculative")
    if spec and spec.pop("draft", None) is not None:
        # A sampled draft changes the draws (the same distribution, other
        # tokens); prompt lookup's deterministic proposals change none.
        spec["method"] = "lookup"
    events = [e for e in stream["events"] if "submit" in e]
    for ev in events:
        if rng.random() < 0.5:
            ev["temperature"] = rng.choice([0.6, 1.0, 1.5])
            ev["seed"] = rng.choice([0, 1, 2 ** 40 + 3])
            if rng.random() < 0.4:
                ev["top_k"] = rng.randint(1, 8)
            if rng.random() < 0.4:
                ev["top_p"] = rng.choice([0.5, 0.9, 1.0])
    return {**stream, "events": events}


def simulate_sampled(model, ev, j, eos, rng, choose_token):
    """Sample j of request ev decoded alone over the model's rows: tokens drawn
    by choose_token(row, params, rng), stopping at a stop token or
    max_new_tokens."""
    params = ed.params_of(ev)
    stops = ed.stops_of(ev, eos)
    token, pos, out = ev["prompt"][-1], len(ev["prompt"]) - 1, []
    while len(out) < params.max_new_tokens:
        token = choose_token(model.rows([token], [pos])[0], params, rng)
        pos += 1
        out.append(token)
        if token in stops:
            break
    return out


class Mt19937_64:
    """std::mt19937_64 seeded from std::seed_seq{words} (the C++ standard's
    algorithms, [rand.util.seedseq] and [rand.eng.mers])."""
    N, M, MASK = 312, 156, (1 << 64) - 1

    def __init__(self, words):
        w32 = 0xFFFFFFFF
        n, s = 2 * self.N, len(words)
        b = [0x8B8B8B8B] * n
        t = 11  # n >= 623
        p = (n - t) // 2
        q = p + t
        m = max(s + 1, n)

        def T(x):
            return x ^ (x >> 27)
        for k in range(m):
            r1 = (1664525 * T(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & w32
            r2 = (r1 + (s if k == 0 else (k % n + words[k - 1] if k <= s else k % n))) & w32
            b[(k + p) % n] = (b[(k + p) % n] + r1) & w32
            b[(k + q) % n] = (b[(k + q) % n] + r2) & w32
            b[k % n] = r2
        for k in range(m, m + n):
            r3 = (1566083941 * T((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & w32)) & w32
            r4 = (r3 - k % n) & w32
            b[(k + p) % n] ^= r3
            b[(k + q) % n] ^= r4
            b[k % n] = r4
        self.x = [b[2 * i] | (b[2 * i + 1] << 32) for i in range(self.N)]
        self.i = self.N

    def __call__(self) -> int:
        if self.i >= self.N:
            x, N, M = self.x, self.N, self.M
            for i in range(N):
                y = (x[i] & 0xFFFFFFFF80000000) | (x[(i + 1) % N] & 0x7FFFFFFF)
                x[i] = x[(i + M) % N] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
            self.i = 0
        y = self.x[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & self.MASK

    def uniform(self, hi: float) -> float:
        """std::uniform_real_distribution<double>(0, hi): generate_canonical
        takes one 64-bit draw, converted to double and divided by 2^64."""
        r = float(self()) / 2.0 ** 64
        if r >= 1.0:
            r = math.nextafter(1.0, 0.0)
        return r * hi


NEGLIGIBLE_Z = np.float32(50.0)  # sampling.cpp's kNegligibleZ
F = np.float32


def cpp_exp_nonpositive(z):
    """sampling.cpp's exp_nonpositive, the same float32 operations in order."""
    n = (z * F(1.44269504088896341) + F(12582912.0)) - F(12582912.0)
    r = (z - n * F(0.693359375)) - n * F(-2.12194440e-4)
    p = F(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        p = p * r + F(c)
    e = p * (r * r) + r + F(1.0)
    return e * np.ldexp(F(1.0), int(n)).astype(np.float32)


def cpp_choose(row, params, rng: Mt19937_64) -> int:
    """cpp/engine/sampling.h's rule, written from its comment and
    sampling.cpp's stated arithmetic: z = (logit - max) * float(1 / T) in
    float32; tokens with z below -50 are never candidates; without
    top_k/top_p one draw over exp_nonpositive(z) in id order (summed in
    double per block of 256 tokens in four interleaved lanes, the draw
    walking blocks first); else the candidates sorted by logit (stable, descending), cut to
    top_k, then to the smallest head reaching top_p, renormalized, one draw."""
    row = np.asarray(row, dtype=np.float32)
    best = int(np.argmax(row))
    if params.temperature == 0 or len(row) == 1 or params.temperature < 1e-30:
        return best
    top = row[best]
    inv_t = F(1.0 / params.temperature)
    z = [(v - top) * inv_t for v in row]
    if params.top_k is None and params.top_p is None:
        e = [float(cpp_exp_nonpositive(v)) if v >= -NEGLIGIBLE_Z else 0.0 for v in z]
        blocks = [e[b:b + 256] for b in range(0, len(e), 256)]  # sampling.cpp's kBlock
        sums = []
        for block in blocks:
            lane = [0.0, 0.0, 0.0, 0.0]
            for i, v in enumerate(block):
                lane[i % 4] += v
            sums.append((lane[0] + lane[1]) + (lane[2] + lane[3]))
        total = 0.0
        for v in sums:
            total += v
        u = rng.uniform(total)
        for b, block in enumerate(blocks):
            if u < sums[b]:
                for i, v in enumerate(block):
                    if u < v:
                        return 256 * b + i
                    u -= v
                return 256 * b + max(i for i, v in enumerate(block) if v > 0)
            u -= sums[b]
        return max(i for i, v in enumerate(e) if v > 0)
    logits = [float(v) for v in row]
    order = sorted((i for i in range(len(row)) if z[i] >= -NEGLIGIBLE_Z),
                   key=lambda i: (-logits[i], i))
    order = order[:params.top_k or len(order)]
    probs = [math.exp(float(z[i])) for i in order]
    total = 0.0
    for v in probs:
        total += v
    probs = [v / total for v in probs]
    keep = len(order)
    if params.top_p is not None:
        cum = 0.0
        for i, v in enumerate(probs):
            cum += v
            if cum >= params.top_p:
                keep = i + 1
                break
    mass = 0.0
    for v in probs[:keep]:
        mass += v
    u = rng.uniform(mass)
    for i in range(keep):
        if u < probs[i]:
            return order[i]
        u -= probs[i]
    return order[keep - 1]


def simulate_python_sampled(model, ev, j, eos):
    """Python's rule: sample j draws from np.random.default_rng([seed, j])
    with runtime/sampling.py's choose."""
    rng = np.random.default_rng([ed.params_of(ev).seed, j])
    return simulate_sampled(model, ev, j, eos, rng, choose)


def simulate_cpp_sampled(model, ev, j, eos):
    """The C++ engine's rule: sample j draws from std::mt19937_64 seeded with
    std::seed_seq{seed low 32 bits, seed high 32 bits, j}, with cpp_choose."""
    seed = ed.params_of(ev).seed
    return simulate_sampled(model, ev, j, eos, Mt19937_64([seed & 0xFFFFFFFF, seed >> 32, j]),
                            cpp_choose)


def test_the_mt19937_64_oracle_matches_the_standard():
    # The standard's check value: the 10000th draw of a default-seeded
    # std::mt19937_64 (seed 5489, set by the linear recurrence, not seed_seq).
    g = Mt19937_64([0])
    x = [5489]
    for i in range(1, Mt19937_64.N):
        x.append((6364136223846793005 * (x[-1] ^ (x[-1] >> 62)) + i) & Mt19937_64.MASK)
    g.x, g.i = x, Mt19937_64.N
    for _ in range(9999):
        g()
    assert g() == 9981545732273789042


@pytest.mark.parametrize("runtime", ["python", "cpp"])
def test_a_sampled_request_gets_the_same_tokens_alone_and_in_a_stream(runtime):
    if runtime == "cpp":
        need_engine()
    run = ed.run_python if runtime == "python" else ed.run_cpp
    checked = 0
    for i in range(60):
        stream = sampled_stream(random.Random(ed.stream_seed(SEED + 1, i)))
        tr = run(stream)
        assert not ed.check_rules(stream, tr), ed.check_rules(stream, tr)
        for ev in ed.submits(stream):
            label = ev["submit"]
            if not ed.is_sampled(ev) or not tr.accepted[label]:
                continue
            solo = run(alone(stream, ev)).samples[label]
            assert tr.samples[label] == solo, (label, stream)
            model = ed.model_of(stream["config"])
            eos = stream["config"]["eos_ids"]
            oracle = simulate_python_sampled if runtime == "python" else simulate_cpp_sampled
            assert solo == [oracle(model, ev, j, eos) for j in range(ev.get("n", 1))], \
                (label, stream)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("runtime", ["python", "cpp"])
def test_seeded_samples_differ_between_samples_and_seeds(runtime):
    """The rule's other half: the sample index and the seed do reach the
    generator (so the test above compares something)."""
    if runtime == "cpp":
        need_engine()
    run = ed.run_python if runtime == "python" else ed.run_cpp
    cfg = {"cells": 128, "max_tokens_per_step": 8, "vocab": 32, "eos_ids": [],
           "prefix_cache": False, "model": {"kind": "hash", "salt": 3}}
    ev = {"step": 0, "submit": "s", "prompt": [1, 2, 3], "n": 4, "max_new_tokens": 10,
          "temperature": 1.5, "seed": 7}
    first = run({"config": cfg, "events": [ev]}).samples["s"]
    assert len({tuple(t) for t in first}) == 4
    assert run({"config": cfg, "events": [ev]}).samples["s"] == first
    assert run({"config": cfg, "events": [{**ev, "seed": 8}]}).samples["s"] != first


# ---------------------------------------------------------------------------- teeth


def first_caught(limit=400, speculative="mixed"):
    """Index of the first random stream where the differential (or a rule)
    reports a problem, or None."""
    for i in range(limit):
        stream = ed.random_stream(random.Random(ed.stream_seed(SEED + 2, i)), speculative)
        if ed.run_stream(stream)[2]:
            return i
    return None


def _lru_broken(self, entry):
    self._clock += 1
    entry.last_used = self._clock          # no move_to_end: eviction order is insertion order


def _round_robin_broken(real_plan):
    def plan(self):
        self._next_decode = 0              # always start from the first sample
        return real_plan(self)
    return plan


def _fifo_broken(real_admit):
    def admit(self):
        real_admit(self)                   # then admit one more behind a blocked head
        if len(self.waiting) > 1:
            self.waiting.rotate(-1)
            real_admit(self)
            self.waiting.rotate(1)
    return admit


def _draft_limit_broken(self, sample, draft, tokens, logprobs):
    limit = sample.draft_limit
    real_emit_run(self, sample, draft, tokens, logprobs)
    sample.draft_limit = limit              # never adapts


def _no_backoff(self, sample, draft, tokens, logprobs):
    real_emit_run(self, sample, draft, tokens, logprobs)
    sample.draft_wait = 0                   # proposes again right after a miss


def _leave_without_rollback(self, tokens, seq):
    if self.prefix is None:
        self.cache.seq_free(seq)
    else:                                   # keeps the proposals placed after a stop too
        held = self.cache.next_pos(seq)
        self.prefix.insert((list(tokens) + [0] * held)[:held], seq)


def _proposals_first(real_proposals):
    def proposals(self, decode, left):
        return real_proposals(self, decode, self.budget - len(decode))  # ignores prompt chunks
    return proposals


real_emit_run = scheduler_module.Scheduler._emit_run
SPECULATION_MUTATIONS = ("draft_limit", "draft_backoff", "rollback", "proposal_budget",
                         "draft_release")


@pytest.mark.parametrize("mutation", ["lru", "round_robin", "fifo", "bound",
                                      *SPECULATION_MUTATIONS])
def test_the_differential_catches_a_broken_python_rule(mutation, monkeypatch):
    need_engine()
    assert first_caught(limit=50) is None
    if mutation == "lru":
        monkeypatch.setattr(prefix_cache_module.PrefixCache, "_touch", _lru_broken)
    elif mutation == "round_robin":
        monkeypatch.setattr(scheduler_module.Scheduler, "plan",
                            _round_robin_broken(scheduler_module.Scheduler.plan))
    elif mutation == "fifo":
        monkeypatch.setattr(scheduler_module.Scheduler, "_admit",
                            _fifo_broken(scheduler_module.Scheduler._admit))
    elif mutation == "bound":
        real = prefix_cache_module.PrefixCache.enforce_bound
        monkeypatch.setattr(prefix_cache_module.PrefixCache, "enforce_bound",
                            lambda self, keep=None: None if self.max_cells else real(self, keep))
    elif mutation == "draft_limit":
        monkeypatch.setattr(scheduler_module.Scheduler, "_emit_run", _draft_limit_broken)
    elif mutation == "draft_backoff":
        monkeypatch.setattr(scheduler_module.Scheduler, "_emit_run", _no_backoff)
    elif mutation == "rollback":
        monkeypatch.setattr(scheduler_module.Scheduler, "_leave", _leave_without_rollback)
    elif mutation == "proposal_budget":
        monkeypatch.setattr(scheduler_module.Scheduler, "_proposals",
                            _proposals_first(scheduler_module.Scheduler._proposals))
    else:  # a finished sample's mirror stays in the draft's cache
        monkeypatch.setattr(speculative_module.DraftModel, "release",
                            lambda self, sample: self.mirrors.pop(sample, None))
    assert first_caught(speculative="always" if mutation in SPECULATION_MUTATIONS else "mixed") \
        is not None


def test_compare_reports_every_kind_of_difference():
    stream = load("packing_in_admission_order.json")
    py = ed.run_python(stream)
    assert ed.compare(stream, py, ed.run_python(stream)) == []
    import copy
    for mutate, fragment in [
            (lambda t: t.forwards[2][3].reverse(), "forward 2 differs"),
            (lambda t: t.token_events.pop(), "token event"),
            (lambda t: t.after.__setitem__(1, (1, 0, 0, 0)), "after step 1"),
            (lambda t: t.cached.__setitem__("a", 1), "cached tokens"),
            (lambda t: t.finish.__setitem__("c", ["stop"]), "c finish"),
            (lambda t: t.samples["a"][0].append(1), "a tokens"),
            (lambda t: t.accepted.__setitem__("a", False), "accepted submits"),
            (lambda t: t.errors.append("boom"), "errors")]:
        other = copy.deepcopy(py)
        mutate(other)
        assert any(fragment in p for p in ed.compare(stream, py, other)), fragment


# ---------------------------------------------------------------------------- integer arguments

VOCAB, BUDGET = 16, 8


def _forward(cache, budget=BUDGET):
    """The linear model's forward, declaring each step on ``cache``."""
    model, errors = ed.Model(VOCAB), []

    def forward(seq_ids, tokens, positions, logits_for):
        return ed._declare(cache, model, seq_ids, tokens, positions, logits_for, budget,
                           errors, 0)
    return forward


_SPECULATIVE_ARGS = ("speculative", "max_draft", "min_ngram", "max_ngram", "draft_vocab_size",
                     "draft_max_tokens_per_step")


def _engine(**kwargs):
    """_core.Engine over a 64-cell cache (a draft of its own when ``draft``),
    speculating when asked (Engine.set_speculative); the keyword arguments
    replace the valid ones."""
    cache = CellCache(64, 1, [None])
    args = dict(vocab_size=VOCAB, max_tokens_per_step=BUDGET, eos_ids=[0])
    spec = {}
    if kwargs.pop("draft", False):
        draft_cache = CellCache(64, 1, [None])
        spec.update(speculative="draft", draft_cache=draft_cache,
                    draft_forward=_forward(draft_cache, 4), draft_max_tokens_per_step=4)
    for name in _SPECULATIVE_ARGS:
        if name in kwargs:
            spec[name] = kwargs.pop(name)
    args.update(kwargs)
    engine = _core.Engine(cache, _forward(cache), **args)
    if spec:
        options = _core.SpeculativeOptions(
            spec.pop("speculative"),
            **{k: spec.pop(k) for k in ("max_draft", "min_ngram", "max_ngram") if k in spec})
        engine.set_speculative(options, **spec)
    return cache, engine


def _submit(engine, prompt, on_token, on_finish, speculate=True, **params):
    """engine.submit with SamplingParams(**params)."""
    return engine.submit(prompt, _core.SamplingParams(**params), on_token, on_finish,
                         speculate=speculate)


def _run(engine, submits):
    """Submits each (prompt, keyword arguments), steps until idle; every
    token and finish event, in order."""
    events = []
    for prompt, kwargs in submits:
        _submit(engine, prompt, lambda *e: events.append(("token",) + e[:4]),
                lambda rid, j, reason, u: events.append(
                    ("finish", rid, j, reason, u.prompt_tokens, u.cached_tokens,
                     u.completion_tokens)), **kwargs)
    for _ in range(200):
        if not engine.step():
            break
    assert engine.idle
    return events


_ENGINE_ARGS = {
    "vocab_size": lambda x: dict(vocab_size=x),
    "max_tokens_per_step": lambda x: dict(max_tokens_per_step=x),
    "eos_ids": lambda x: dict(eos_ids=[0, x]),
    "prefix_cache_cells": lambda x: dict(prefix_cache_cells=x),
    "max_draft": lambda x: dict(speculative="lookup", max_draft=x),
    "min_ngram": lambda x: dict(speculative="lookup", min_ngram=x),
    "max_ngram": lambda x: dict(speculative="lookup", max_ngram=x),
    "draft_vocab_size": lambda x: dict(draft=True, draft_vocab_size=x),
    "draft_max_tokens_per_step": lambda x: dict(draft=True, draft_max_tokens_per_step=x),
}
_SUBMIT_ARGS = {
    "prompt": lambda x: dict(prompt=[1, x]),
    "top_k": lambda x: dict(top_k=x),
    "seed": lambda x: dict(seed=x),
    "n": lambda x: dict(n=x),
    "max_new_tokens": lambda x: dict(max_new_tokens=x),
    "stop_token_ids": lambda x: dict(stop_token_ids=[5, x]),
    "logprobs": lambda x: dict(logprobs=x),
}


# pybind11 read True as 1 (submit(n=True) queued one sample, cancel(True)
# cancelled request 1) and, converting, truncated np.float32: every integer
# argument of _core.Engine is a bindings::Int (tests/test_core_edges.py's values).
@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
@pytest.mark.parametrize("arg", sorted(_ENGINE_ARGS))
def test_a_bool_or_float_is_refused_where_the_engine_is_built_from_an_integer(arg, value):
    need_engine()
    _engine(**_ENGINE_ARGS[arg](VOCAB if arg == "draft_vocab_size" else 2))  # valid otherwise
    with pytest.raises(TypeError, match="incompatible (constructor|function) arguments"):
        _engine(**_ENGINE_ARGS[arg](value))


@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
@pytest.mark.parametrize("arg", sorted(_SUBMIT_ARGS))
def test_a_bool_or_float_is_refused_where_submit_takes_an_integer(arg, value):
    need_engine()
    cache, engine = _engine()
    kwargs = {"prompt": [1, 2, 3], **_SUBMIT_ARGS[arg](value)}
    with pytest.raises(TypeError, match="incompatible (constructor|function) arguments"):
        _submit(engine, kwargs.pop("prompt"), print, print, **kwargs)
    assert engine.idle and engine.live_requests == 0 and cache.n_sequences == 0
    # Nothing queued: the next request is request 1 and runs alone.
    events = _run(engine, [([1, 2, 3], dict(max_new_tokens=3))])
    assert [e[:2] for e in events] == [("token", 1)] * 3 + [("finish", 1)]


@pytest.mark.parametrize("value", _NOT_INTS, ids=repr)
def test_a_bool_or_float_is_refused_as_the_request_to_cancel(value):
    need_engine()
    _, engine = _engine()
    events = []
    rid = _submit(engine, [1, 2, 3], lambda *e: None, lambda *e: events.append(e),
                  max_new_tokens=3)
    assert rid == 1
    with pytest.raises(TypeError, match="incompatible function arguments"):
        engine.cancel(value)
    while engine.step():
        pass
    assert [(e[0], e[2]) for e in events] == [(1, "length")]


# Converting, pybind11 read None, 0, 2 and 1.5 as bools and True as a float:
# the yes/no arguments are bindings::Bool (True, False, numpy bool_), the real
# ones bindings::Real (ints and floats, numpy's too; no bool).
_NOT_BOOLS = [None, 0, 1, 2, 1.5, np.int64(1), np.float32(0), "yes", [True]]
_NOT_REALS = [True, False, np.bool_(True), "0.5", None, [0.5]]


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
def test_only_a_bool_turns_the_prefix_cache_on_or_off(value):
    need_engine()
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        _engine(prefix_cache=value)


@pytest.mark.parametrize("arg,value", [(a, v) for a in ("stop_on_eos", "speculate")
                                       for v in _NOT_BOOLS] +
                         [(a, v) for a in ("temperature", "top_p")
                          for v in _NOT_REALS if v is not None], ids=repr)
def test_submit_takes_bools_and_numbers_only_where_it_asks_for_them(arg, value):
    need_engine()
    cache, engine = _engine()
    with pytest.raises(TypeError, match="incompatible (constructor|function) arguments"):
        _submit(engine, [1, 2, 3], print, print, **{arg: value})
    assert engine.idle and engine.live_requests == 0 and cache.n_sequences == 0


@pytest.mark.parametrize("value", _NOT_REALS, ids=repr)
def test_a_bool_is_not_a_number_to_the_bindings(value):
    for call in (lambda: _core.float_to_half(value),
                 lambda: _core.choose_max_draft([0.01, value]),
                 lambda: _core.choose_max_draft([0.01, 0.012], proposal_seconds=value),
                 lambda: _core.choose_max_draft([0.01, 0.012], acceptance=value)):
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call()


def test_numpy_bools_and_numbers_read_as_python_ones():
    need_engine()
    plain = dict(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=5, stop_on_eos=False,
                 speculate=True)
    numpy = dict(temperature=np.float32(0.7).item(), top_p=np.float64(0.9), seed=3,
                 max_new_tokens=5, stop_on_eos=np.bool_(False), speculate=np.bool_(True))
    _, a = _engine(prefix_cache=False)
    _, b = _engine(prefix_cache=np.bool_(False))
    assert _run(b, [([1, 2, 3], numpy)]) == _run(a, [([1, 2, 3], plain)])
    assert _core.float_to_half(np.float32(1.5)) == _core.float_to_half(1.5) == 0x3E00
    assert _core.float_to_half(2) == 0x4000
    assert _core.choose_max_draft([1, 1]) == _core.choose_max_draft([1.0, 1.0])


def test_the_engine_reads_numpy_integers_and_arrays_as_python_ints():
    need_engine()
    i64 = np.int64
    as_ints = dict(temperature=1.0, top_k=4, seed=7, n=2, max_new_tokens=5,
                   stop_token_ids=[9], logprobs=1)
    as_numpy = dict(temperature=1.0, top_k=np.int32(4), seed=np.uint64(7), n=i64(2),
                    max_new_tokens=i64(5), stop_token_ids=np.array([9]), logprobs=i64(1))
    _, python = _engine()
    _, numpy = _engine(vocab_size=i64(VOCAB), max_tokens_per_step=np.int32(BUDGET),
                       eos_ids=np.array([0]), prefix_cache_cells=i64(32))
    expected = _run(python, [([1, 2, 3], as_ints), ([4, 5], {})])
    assert sum(e[0] == "token" for e in expected) > 4
    assert _run(numpy, [(np.array([1, 2, 3]), as_numpy), ([i64(4), 5], {})]) == expected
    rid = _submit(numpy, np.array([1, 2], dtype=np.int32), print, print)
    numpy.cancel(i64(rid))
    while numpy.step():
        pass
