#!/usr/bin/env python
"""Differential of the two schedulers: the Python one
(tests/spec/scheduler.py + prefix_cache.py, the executable spec) and the C++
engine (cpp/engine/scheduler.cpp + prefix_cache.cpp + engine.cpp, as
``_core.Engine``) run the same request stream over the same synthetic model
and must plan identical steps.

    python scripts/engine_differential.py --streams 100000 --seed 1

prints a summary (streams, steps, tokens, hits, evictions, cancels,
mismatches, seconds); on a mismatch it prints the smallest failing stream it
can find by dropping events (as a case file for tests/cases/scheduler/) and
exits 1. tests/test_engine_differential.py imports this module (the stream
generator, the two drivers and the checks) and runs the JSON cases of
tests/cases/scheduler/ and 1,000 random streams.

A stream (the format of tests/cases/scheduler/*.json):

  config:  cells, max_tokens_per_step, vocab, eos_ids, prefix_cache (bool),
           prefix_cache_cells (int or null), model (see Model), and optionally
           speculative: {"method": "lookup" or "draft", "max_draft",
           "min_ngram", "max_ngram"} (runtime/speculative.py's Speculative;
           absent = off), with method "draft" also "draft": {"cells",
           "max_tokens_per_step", "model", "fail_at"}: the draft model, a
           Model with its own one-layer cache, whose forward number fail_at
           (from 0; absent = never) raises.
  events:  in order; each {"step": k, ...} is applied before step k plans:
           {"submit": label, "prompt": [...], "n", "max_new_tokens",
            "stop_token_ids", "stop_on_eos", "temperature", "seed", "top_k",
            "top_p", "speculate"} (defaults: SamplingParams', speculate true),
           or {"cancel": label}.
  expect:  optional facts checked on both runtimes (see check_expect).

Step k, in both runtimes: apply step k's events in order (the C++ engine
queues them and applies them at the start of step()), then, unless idle, plan
and run one forward over a one-layer CellCache (the forward declares and
places the step itself), choose the tokens (Python: runtime/sampling.py
choose_tokens; C++: the engine's own) and commit. The run ends once every
event is applied and the scheduler is idle.

Independent oracles, checked on each runtime alone (``check_rules``): every
greedy sample is the model's greedy continuation of its prompt (Model.simulate)
up to max_new_tokens or its first stop token, a cancelled one a proper prefix
of it; a submit is refused exactly when prompt + n * (max_new_tokens - 1)
exceeds the cells; cached tokens never reach the prompt's last token; every
step fits the budget and the cache; at the end the cache holds only the
prefix cache's entries, and after clearing them no cell and no sequence id.
The differential (``compare``) then asks for the same forwards step by step
(seq_ids, tokens, positions, logits_for), the same tokens, stop flags and
finish reasons per (request, sample), the same cached-token counts, the same
answers to cancels, the same free cells, sequences and live requests after
every step and the same prefix-cache statistics and LRU order; with
speculative decoding on (prompt lookup: runtime/speculative.py and
cpp/engine/speculative.h), the forwards carry each sample's proposals after
its decode token (their rows in logits_for), and the speculation counters
(proposed and accepted tokens, decode groups, tokens decode groups gave)
must agree after every step too; with a draft model (Python's DraftModel
over a stub Runner, the engine's DraftModel over a Python draft forward),
so must every draft forward, the draft cache's free cells and sequences
after every step, and whether the draft failed.

Sampled requests draw from different generators in the two runtimes, so a
stream with one is not compared plan by plan: only its greedy requests'
tokens and finish reasons are compared, and each sampled request is checked
within each runtime against the same request run alone (the (seed, sample)
rule; tests/test_engine_differential.py).
"""

import argparse
import copy
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the package, when not installed (an installed one wins)
sys.path.insert(0, str(ROOT / "tests"))  # spec/: the Python scheduler, the executable spec

from executorch_cellcache.cache import _core  # noqa: E402
from executorch_cellcache.cache._core import CellCache  # noqa: E402
from executorch_cellcache.cache.errors import CapacityError, InvalidConfigError  # noqa: E402
from executorch_cellcache.runtime.pools import Pools  # noqa: E402
from spec.prefix_cache import PrefixCache  # noqa: E402
from spec.sampling import SamplingParams, choose_tokens  # noqa: E402
from spec.scheduler import Request, Scheduler  # noqa: E402
from spec.speculative import (  # noqa: E402
    DraftModel,
    PromptLookup,
    Speculative,
)

MAX_STEPS = 5000  # a run still busy after this many steps is a failure (no progress)

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "n", "max_new_tokens",
                 "stop_token_ids", "stop_on_eos")


# ---------------------------------------------------------------------------- the model


class Model:
    """The synthetic model: the logits of token ``t`` at position ``p`` are a
    function of (t, p) only. Row: 0 at ``peak(t, p)``, then -0.25 per step
    (mod vocab) after it, so the argmax is unique and a sampled row is a
    spread of every token.

    config {"kind": "linear", "a", "b", "c"}: peak = (a t + b p + c) mod vocab
    (hand-computable, for the case files; b = 0 makes it position-free, so
    tokens cycle and prompt lookup's proposals are accepted); {"kind":
    "hash", "salt", "stop", "stop_every", "copy"}: a 32-bit integer hash of
    (t, p, salt), and one pair in ``stop_every`` peaks at token ``stop`` (an
    EOS id, so samples stop); of the other pairs a share ``copy`` (default 0)
    peaks at a hash of t alone, so continuations fall into short cycles that
    prompt lookup proposes and the model partly confirms."""

    def __init__(self, vocab: int, config: Optional[dict] = None):
        config = dict(config or {"kind": "linear"})
        self.vocab = vocab
        self.kind = config.get("kind", "linear")
        self.a, self.b, self.c = config.get("a", 7), config.get("b", 3), config.get("c", 1)
        self.salt = config.get("salt", 0)
        self.stop = config.get("stop", 0)
        self.stop_every = config.get("stop_every", 8)
        self.copy = config.get("copy", 0.0)
        self._peaks: Dict[Tuple[int, int], int] = {}
        self._ramp = np.arange(vocab)

    def peak(self, t: int, p: int) -> int:
        key = (t, p)
        got = self._peaks.get(key)
        if got is not None:
            return got
        if self.kind == "linear":
            got = (self.a * t + self.b * p + self.c) % self.vocab
        else:
            x = ((t + 1) * 0x9E3779B1 ^ (p + 1) * 0x85EBCA77 ^ (self.salt + 1) * 0xC2B2AE3D) \
                & 0xFFFFFFFF
            x ^= x >> 16
            x = (x * 0x7FEB352D) & 0xFFFFFFFF
            x ^= x >> 15
            x = (x * 0x846CA68B) & 0xFFFFFFFF
            x ^= x >> 16
            if x % self.stop_every == 0:
                got = self.stop
            elif self.copy and ((x >> 4) & 0xFF) < self.copy * 256:
                got = _hash32(t + 1, self.salt + 7) % self.vocab  # position-free
            else:
                got = (x >> 8) % self.vocab
        self._peaks[key] = got
        return got

    def rows(self, tokens, positions) -> np.ndarray:
        """float32 [len(tokens), vocab]."""
        peaks = np.array([self.peak(int(t), int(p)) for t, p in zip(tokens, positions)])
        return (-0.25 * ((self._ramp[None, :] - peaks[:, None]) % self.vocab)).astype(np.float32)

    def simulate(self, prompt: List[int], max_new: int, stops=()) -> List[int]:
        """The greedy continuation: max_new tokens, or up to and including the
        first token in ``stops``."""
        token, pos, out = prompt[-1], len(prompt) - 1, []
        while len(out) < max_new:
            token = self.peak(token, pos)
            pos += 1
            out.append(token)
            if token in stops:
                break
        return out


def _hash32(a: int, b: int) -> int:
    x = (a * 0x9E3779B1 ^ (b + 1) * 0xC2B2AE3D) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def speculative_of(config: dict) -> Optional[Speculative]:
    """The stream's speculative-decoding config, or None (off)."""
    spec = config.get("speculative")
    if spec is None:
        return None
    spec = {k: v for k, v in spec.items() if k != "draft"}
    if spec.get("method") == "draft":
        spec["draft_model"] = "synthetic"
    return Speculative(**spec)


def draft_of(config: dict) -> Optional[dict]:
    """The draft model's config (cells, max_tokens_per_step, model), or None."""
    return (config.get("speculative") or {}).get("draft")


def _draft_forward(cache, model: "Model", budget: int, trace: "Trace", now: List[int],
                   fail_at: Optional[int] = None):
    """The draft's forward, for both runtimes: records it, checks it, declares
    and places it on the draft's cache; a step that does not fit raises
    CapacityError, forward number fail_at RuntimeError (the draft then stops
    proposing)."""
    def forward(seq_ids, tokens, positions, logits_for):
        trace.draft_forwards.append((now[0], list(seq_ids), list(tokens), list(positions),
                                     list(logits_for)))
        if fail_at is not None and len(trace.draft_forwards) == fail_at + 1:
            raise RuntimeError("synthetic draft failure")
        n = len(tokens)
        if not 1 <= n <= budget or not logits_for:
            trace.errors.append(f"step {now[0]}: a draft forward of {n} tokens (budget "
                                f"{budget}), logits_for {list(logits_for)}")
        if not cache.declare_step(list(seq_ids)):
            raise CapacityError(f"a draft step of {n} tokens does not fit in the "
                                f"{cache.free_cells} free cells")
        cache.place_step(list(positions), 0)
        return model.rows([tokens[i] for i in logits_for], [positions[i] for i in logits_for])
    return forward


def model_of(config: dict) -> Model:
    return Model(config["vocab"], config.get("model"))


def submits(stream: dict) -> List[dict]:
    return [e for e in stream["events"] if "submit" in e]


def params_of(ev: dict) -> SamplingParams:
    kw = {k: ev[k] for k in SAMPLING_KEYS if k in ev}
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    return SamplingParams(**kw)


def is_sampled(ev: dict) -> bool:
    return ev.get("temperature", 0.0) > 0


def stops_of(ev: dict, eos_ids) -> set:
    stops = set(ev.get("stop_token_ids", ()))
    if ev.get("stop_on_eos", True):
        stops |= set(eos_ids)
    return stops


def worst_cells(ev: dict) -> int:
    p = params_of(ev)
    return len(ev["prompt"]) + p.n * (p.max_new_tokens - 1)


# ---------------------------------------------------------------------------- traces


@dataclass
class Trace:
    """What one runtime did with a stream, in comparable form."""
    runtime: str
    forwards: List[Tuple[int, list, list, list, list]] = field(default_factory=list)
    # (step, seq_ids, tokens, positions, logits_for) of every forward
    token_events: List[Tuple[int, str, int, int, bool]] = field(default_factory=list)
    # (step, label, sample, token, stop_token) in delivery order
    accepted: Dict[str, bool] = field(default_factory=dict)      # submit accepted
    cancels: List[Tuple[int, str, Optional[bool]]] = field(default_factory=list)
    # (step, label, accepted: the request had not finished before the step
    # and no cancel of it was queued earlier in the step (the engine's rule:
    # its cancel() only queues, and refuses a second one); None: never submitted)
    after: List[Tuple[int, int, int, int]] = field(default_factory=list)
    # (step, free cells, sequences, live requests) after every step
    samples: Dict[str, List[List[int]]] = field(default_factory=dict)
    finish: Dict[str, List[Optional[str]]] = field(default_factory=dict)
    cached: Dict[str, int] = field(default_factory=dict)
    prefix: Optional[dict] = None      # prefix-cache stats and entries at the end
    end: Optional[Tuple[int, int]] = None          # (free cells, sequences) at the end
    cleared: Optional[Tuple[int, int]] = None      # the same after clearing the prefix cache
    speculation: List[Tuple[int, int, int, int, int]] = field(default_factory=list)
    # (step, proposed, accepted, decode groups, decode tokens), cumulative, after every step
    draft_forwards: List[Tuple[int, list, list, list, list]] = field(default_factory=list)
    draft_after: List[Tuple[int, int, int, bool]] = field(default_factory=list)
    # (step, draft cache free cells, sequences, the draft failed) after every step
    errors: List[str] = field(default_factory=list)  # rule breaks seen while running
    # Coverage (the Python driver's view): requests left waiting by a plan, and
    # steps whose decode tokens exceeded the budget (round-robin).
    waited: set = field(default_factory=set)
    round_robin_steps: int = 0

    @property
    def steps(self) -> int:
        return len(self.forwards)


def _events_by_step(stream: dict) -> Dict[int, List[dict]]:
    out: Dict[int, List[dict]] = {}
    for ev in stream["events"]:
        out.setdefault(int(ev["step"]), []).append(ev)
    return out


def _declare(cache, model: Model, seq_ids, tokens, positions, logits_for, budget: int,
             errors: List[str], step: int) -> np.ndarray:
    """The forward both runtimes call: checks the step, declares and places it
    on the one-layer cache, returns the model's rows for logits_for."""
    n = len(tokens)
    if not 1 <= n <= budget or len(seq_ids) != n or len(positions) != n:
        errors.append(f"step {step}: a forward of {n} tokens (budget {budget})")
    if not logits_for or any(not 0 <= i < n for i in logits_for):
        errors.append(f"step {step}: logits_for {list(logits_for)} for {n} tokens")
    if not cache.declare_step(list(seq_ids)):
        raise RuntimeError(f"step {step}: admission let a step run out of cells "
                           f"(declare_step refused {n} tokens, {cache.free_cells} free)")
    cache.place_step(list(positions), 0)
    return model.rows([tokens[i] for i in logits_for], [positions[i] for i in logits_for])


def _prefix_snapshot_py(prefix: PrefixCache) -> dict:
    s = prefix.stats
    return {"requests": s.requests, "hits": s.hits, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "evictions": s.evictions,
            "entries": len(prefix), "reclaimable_cells": prefix.reclaimable_cells(),
            "seqs": list(prefix.seqs())}


def run_python(stream: dict) -> Trace:
    """The stream through runtime/scheduler.py (plan -> forward -> choose_tokens
    -> commit)."""
    cfg = stream["config"]
    model = model_of(cfg)
    budget, eos = cfg["max_tokens_per_step"], list(cfg.get("eos_ids", []))
    tr = Trace("python")
    cache = CellCache(cfg["cells"], 1, [None])
    prefix = PrefixCache(cache, cfg.get("prefix_cache_cells")) \
        if cfg.get("prefix_cache", True) else None
    now = [0]

    def on_token(ev):
        tr.token_events.append((now[0], ev.request.tag, ev.sample_index, ev.token,
                                ev.stop_token))

    spec = speculative_of(cfg)
    proposer = draft_cache = None
    if spec is not None:
        spec.validate(budget)
        proposer = PromptLookup(spec)
    dcfg = draft_of(cfg)
    if dcfg is not None:
        draft_cache = CellCache(dcfg["cells"], 1, [None])
        draft_step = _draft_forward(draft_cache, Model(cfg["vocab"], dcfg.get("model")),
                                    dcfg["max_tokens_per_step"], tr, now, dcfg.get("fail_at"))
        stub = SimpleNamespace(  # what DraftModel uses of a draft Runner
            cache=draft_cache,
            pools=Pools(draft_cache, dcfg["max_tokens_per_step"]),
            info=SimpleNamespace(max_tokens_per_step=dcfg["max_tokens_per_step"]),
            step=lambda *a: torch.from_numpy(draft_step(*a)))
        proposer = DraftModel(spec, stub)
    sched = Scheduler(cache, budget, eos, on_token, prefix, proposer)
    counters = [0, 0]  # decode groups, decode tokens (Runner.advance's GenerateStats rule)
    by_step = _events_by_step(stream)
    last = max(by_step, default=-1)
    reqs: Dict[str, Request] = {}
    try:
        k = 0
        while k <= last or not sched.idle:
            if k >= MAX_STEPS:
                tr.errors.append(f"still busy after {MAX_STEPS} steps")
                break
            now[0] = k
            done_before = {label for label, req in reqs.items() if req.finished}
            cancel_queued = set()  # the engine refuses a second cancel queued in one step
            for ev in by_step.get(k, []):
                if "submit" in ev:
                    label = ev["submit"]
                    req = Request(list(ev["prompt"]), params_of(ev), tag=label, label=label,
                                  speculate=ev.get("speculate", True))
                    try:
                        sched.submit(req)
                        reqs[label] = req
                        tr.accepted[label] = True
                    except CapacityError:
                        tr.accepted[label] = False
                else:
                    label = ev["cancel"]
                    req = reqs.get(label)
                    if req is None:
                        tr.cancels.append((k, label, None))
                        continue
                    tr.cancels.append((k, label, label not in done_before and
                                       label not in cancel_queued))
                    cancel_queued.add(label)
                    sched.cancel(req)
            if not sched.idle:
                plan = sched.plan()
                if not plan.tokens:
                    tr.errors.append(f"step {k}: nothing planned while {len(sched.waiting)} "
                                     f"wait and {len(sched.running)} run")
                    break
                tr.waited.update(r.tag for r in sched.waiting)
                tr.round_robin_steps += sum(
                    1 for r in sched.running for s in r.samples if not s.done) > budget
                logits_for = plan.logits_for or [len(plan.tokens) - 1]
                tr.forwards.append((k, list(plan.seq_ids), list(plan.tokens),
                                    list(plan.positions), list(logits_for)))
                logits = _declare(cache, model, plan.seq_ids, plan.tokens, plan.positions,
                                  logits_for, budget, tr.errors, k)
                picks, logprobs = choose_tokens(logits[:len(plan.logits_for)],
                                                plan.sampling_rows())
                emitted = sched.decode_emitted
                sched.commit(plan, picks, logprobs)
                counters[0] += plan.n_decode
                counters[1] += sched.decode_emitted - emitted
            cache.check_invariants()
            tr.after.append((k, cache.free_cells, cache.n_sequences,
                             len(sched.waiting) + len(sched.running)))
            tr.speculation.append((k, sched.speculation.proposed, sched.speculation.accepted,
                                   counters[0], counters[1]))
            if draft_cache is not None:
                draft_cache.check_invariants()
                tr.draft_after.append((k, draft_cache.free_cells, draft_cache.n_sequences,
                                       proposer.failure is not None))
            k += 1
    except Exception as e:  # recorded: the comparison and the rules report it
        tr.errors.append(f"raised {type(e).__name__}: {e} "
                         f"({traceback.extract_tb(e.__traceback__)[-1].name})")
    for label, req in reqs.items():
        n = req.params.n
        if req.samples:
            tr.samples[label] = [list(s.tokens) for s in req.samples]
            tr.finish[label] = [s.finish_reason for s in req.samples]
        else:
            tr.samples[label] = [[] for _ in range(n)]
            tr.finish[label] = ["cancelled" if req.cancelled else None] * n
        tr.cached[label] = req.cached_tokens
    _finish_trace(tr, cache, _prefix_snapshot_py(prefix) if prefix is not None else None,
                  prefix.clear if prefix is not None else None)
    return tr


def _finish_trace(tr: Trace, cache, prefix_snapshot, clear) -> None:
    try:
        tr.prefix = prefix_snapshot
        tr.end = (cache.free_cells, cache.n_sequences)
        if clear is not None:
            clear()
        tr.cleared = (cache.free_cells, cache.n_sequences)
        cache.check_invariants()
    except Exception as e:
        tr.errors.append(f"at the end: raised {type(e).__name__}: {e}")


def run_cpp(stream: dict) -> Trace:
    """The stream through the C++ engine (_core.Engine): events queued with
    submit/cancel, then step()."""
    cfg = stream["config"]
    model = model_of(cfg)
    budget, eos = cfg["max_tokens_per_step"], list(cfg.get("eos_ids", []))
    tr = Trace("cpp")
    cache = CellCache(cfg["cells"], 1, [None])
    now = [0]

    def forward(seq_ids, tokens, positions, logits_for):
        tr.forwards.append((now[0], list(seq_ids), list(tokens), list(positions),
                            list(logits_for)))
        return _declare(cache, model, seq_ids, tokens, positions, logits_for, budget,
                        tr.errors, now[0])

    label_of: Dict[int, str] = {}
    done: Dict[str, List[Optional[str]]] = {}

    def on_token(rid, j, token, logprob, top, stop_token, finish):
        label = label_of[rid]
        if done[label][j] is not None:
            tr.errors.append(f"step {now[0]}: {label} sample {j} got a token after finishing")
        tr.token_events.append((now[0], label, j, token, bool(stop_token)))
        tr.samples[label][j].append(token)

    def on_finish(rid, j, reason, usage):
        prompt_tokens, cached_tokens = usage.prompt_tokens, usage.cached_tokens
        completion_tokens = usage.completion_tokens
        label = label_of[rid]
        if done[label][j] is not None:
            tr.errors.append(f"step {now[0]}: {label} sample {j} finished twice")
        done[label][j] = reason
        tr.cached[label] = cached_tokens
        if completion_tokens != len(tr.samples[label][j]) or \
                prompt_tokens != len(prompts[label]):
            tr.errors.append(f"step {now[0]}: {label} sample {j} usage ({prompt_tokens}, "
                             f"{completion_tokens}) but {len(prompts[label])} prompt tokens "
                             f"and {len(tr.samples[label][j])} delivered")

    prompts: Dict[str, List[int]] = {}
    kwargs = {"prefix_cache": bool(cfg.get("prefix_cache", True))}
    if cfg.get("prefix_cache_cells") is not None:
        kwargs["prefix_cache_cells"] = cfg["prefix_cache_cells"]
    spec = speculative_of(cfg)
    engine = _core.Engine(cache, forward, cfg["vocab"], budget, eos, **kwargs)
    dcfg = draft_of(cfg)
    draft_cache = None
    if spec is not None:
        draft = {}
        if dcfg is not None:
            draft_cache = CellCache(dcfg["cells"], 1, [None])
            draft = dict(draft_cache=draft_cache,
                         draft_max_tokens_per_step=dcfg["max_tokens_per_step"],
                         draft_forward=_draft_forward(
                             draft_cache, Model(cfg["vocab"], dcfg.get("model")),
                             dcfg["max_tokens_per_step"], tr, now, dcfg.get("fail_at")))
        engine.set_speculative(_core.SpeculativeOptions(
            spec.method, max_draft=spec.max_draft, min_ngram=spec.min_ngram,
            max_ngram=spec.max_ngram), **draft)
    by_step = _events_by_step(stream)
    last = max(by_step, default=-1)
    ids: Dict[str, int] = {}
    try:
        k = 0
        while k <= last or not engine.idle:
            if k >= MAX_STEPS:
                tr.errors.append(f"still busy after {MAX_STEPS} steps")
                break
            now[0] = k
            for ev in by_step.get(k, []):
                if "submit" in ev:
                    label = ev["submit"]
                    p = params_of(ev)
                    try:
                        params = _core.SamplingParams(
                            temperature=float(p.temperature), top_k=p.top_k, top_p=p.top_p,
                            seed=p.seed, n=p.n, max_new_tokens=p.max_new_tokens,
                            stop_token_ids=list(p.stop_token_ids), stop_on_eos=p.stop_on_eos)
                        rid = engine.submit(list(ev["prompt"]), params, on_token, on_finish,
                                            speculate=ev.get("speculate", True))
                    except InvalidConfigError:
                        tr.accepted[label] = False
                        continue
                    tr.accepted[label] = True
                    ids[label], label_of[rid] = rid, label
                    prompts[label] = list(ev["prompt"])
                    tr.samples[label] = [[] for _ in range(p.n)]
                    done[label] = [None] * p.n
                    tr.cached[label] = 0
                else:
                    label = ev["cancel"]
                    if label not in ids:
                        tr.cancels.append((k, label, None))
                        continue
                    try:
                        engine.cancel(ids[label])
                        tr.cancels.append((k, label, True))
                    except InvalidConfigError:
                        tr.cancels.append((k, label, False))
            seen = len(tr.forwards)
            worked = engine.step()
            if len(tr.forwards) > seen:
                _, *fwd = tr.forwards[-1]
                plan = engine.last_plan()
                if [list(x) for x in plan] != fwd:
                    tr.errors.append(f"step {k}: last_plan() {plan} is not the forward's {fwd}")
            elif not worked and not engine.idle:
                tr.errors.append(f"step {k}: step() said idle while the engine is not")
            cache.check_invariants()
            tr.after.append((k, cache.free_cells, cache.n_sequences, engine.live_requests))
            st = engine.stats()
            tr.speculation.append((k, st.proposed_tokens, st.accepted_tokens,
                                   st.decode_groups, st.decode_tokens))
            if draft_cache is not None:
                draft_cache.check_invariants()
                tr.draft_after.append((k, draft_cache.free_cells, draft_cache.n_sequences,
                                       bool(st.speculation_failure)))
            k += 1
    except Exception as e:
        tr.errors.append(f"raised {type(e).__name__}: {e}")
    tr.finish = done
    stats = engine.prefix_cache_stats()
    if stats is not None:
        stats = {**stats, "reclaimable_cells": engine.prefix_cache_reclaimable_cells(),
                 "seqs": list(engine.prefix_cache_seqs())}
    if engine.stats().steps != len(tr.forwards):
        tr.errors.append(f"stats() counts {engine.stats().steps} steps, the forward ran "
                         f"{len(tr.forwards)}")
    _finish_trace(tr, cache, stats, engine.clear_prefix_cache)
    del engine
    return tr


# ---------------------------------------------------------------------------- checks


def check_rules(stream: dict, tr: Trace) -> List[str]:
    """Independent oracles on one runtime's trace (see the module docstring)."""
    cfg = stream["config"]
    model = model_of(cfg)
    cells, eos = cfg["cells"], cfg.get("eos_ids", [])
    out = [f"{tr.runtime}: {e}" for e in tr.errors]
    for ev in submits(stream):
        label = ev["submit"]
        fits = worst_cells(ev) <= cells
        if tr.accepted.get(label) != fits:
            out.append(f"{tr.runtime}: submit of {label} (worst case {worst_cells(ev)} cells "
                       f"of {cells}) {'accepted' if tr.accepted.get(label) else 'refused'}")
            continue
        if not fits:
            continue
        p = params_of(ev)
        finish = tr.finish.get(label, [None] * p.n)
        if any(f is None for f in finish):
            out.append(f"{tr.runtime}: {label} never finished ({finish})")
        cached = tr.cached.get(label, 0)
        if not 0 <= cached <= len(ev["prompt"]) - 1 or (cached and not cfg.get("prefix_cache",
                                                                                True)):
            out.append(f"{tr.runtime}: {label} cached_tokens {cached} of a "
                       f"{len(ev['prompt'])}-token prompt")
        if is_sampled(ev):
            continue
        sim = model.simulate(list(ev["prompt"]), p.max_new_tokens, stops_of(ev, eos))
        want_finish = "stop" if sim[-1] in stops_of(ev, eos) else "length"
        for j, (toks, f) in enumerate(zip(tr.samples.get(label, []), finish)):
            if f == "cancelled":
                ok = len(toks) < len(sim) and toks == sim[:len(toks)]
            else:
                ok = toks == sim and f == want_finish
            if not ok:
                out.append(f"{tr.runtime}: {label} sample {j} got {toks} ({f}); the model's "
                           f"greedy continuation is {sim} ({want_finish})")
    # A token event's stop flag: set exactly on a sample's last token when it
    # finished "stop" (the stop token is kept as its last token).
    last_of: Dict[Tuple[str, int], int] = {}
    for i, e in enumerate(tr.token_events):
        last_of[(e[1], e[2])] = i
    for i, e in enumerate(tr.token_events):
        finish = tr.finish.get(e[1], [])
        want = last_of[(e[1], e[2])] == i and e[2] < len(finish) and finish[e[2]] == "stop"
        if e[4] != want:
            out.append(f"{tr.runtime}: token event {e} has stop flag {e[4]}, expected {want}")
            break
    if tr.end is not None and tr.prefix is not None:
        if tr.end != (cells - tr.prefix["reclaimable_cells"], tr.prefix["entries"]):
            out.append(f"{tr.runtime}: at the end the cache has {tr.end} (free cells, "
                       f"sequences) but the prefix cache holds {tr.prefix['entries']} entries "
                       f"of {tr.prefix['reclaimable_cells']} cells")
        bound = cfg.get("prefix_cache_cells")
        if bound is not None and tr.prefix["reclaimable_cells"] > bound:
            out.append(f"{tr.runtime}: the prefix cache holds {tr.prefix['reclaimable_cells']} "
                       f"cells, over its bound {bound}")
    if tr.draft_after and not tr.errors and tr.draft_after[-1][2] != 0:
        out.append(f"{tr.runtime}: the draft cache holds {tr.draft_after[-1][2]} sequences "
                   f"after every request finished (mirrors not released)")
    if tr.cleared != (cells, 0):
        out.append(f"{tr.runtime}: after clearing the prefix cache (free cells, sequences) = "
                   f"{tr.cleared}, not ({cells}, 0)")
    return out


def _first_diff(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(stream: dict, py: Trace, cc: Trace) -> List[str]:
    """Differences between the two runtimes' traces (empty = identical)."""
    out = []
    sampled = any(is_sampled(ev) for ev in submits(stream))
    if not sampled:
        if py.forwards != cc.forwards:
            i = _first_diff(py.forwards, cc.forwards)
            a = py.forwards[i] if i < len(py.forwards) else None
            b = cc.forwards[i] if i < len(cc.forwards) else None
            out.append(f"forward {i} differs (step, seq_ids, tokens, positions, logits_for): "
                       f"python {a}, cpp {b} ({len(py.forwards)} vs {len(cc.forwards)} "
                       f"forwards)")
        if py.token_events != cc.token_events:
            i = _first_diff(py.token_events, cc.token_events)
            out.append(f"token event {i} differs (step, request, sample, token, stop): python "
                       f"{py.token_events[i:i + 3]}, cpp {cc.token_events[i:i + 3]}")
        if py.after != cc.after:
            i = _first_diff(py.after, cc.after)
            out.append(f"after step {i} (step, free cells, sequences, live requests): python "
                       f"{py.after[i] if i < len(py.after) else None}, cpp "
                       f"{cc.after[i] if i < len(cc.after) else None}")
        if py.cached != cc.cached:
            out.append(f"cached tokens: python {py.cached}, cpp {cc.cached}")
        if py.prefix != cc.prefix:
            out.append(f"prefix cache at the end: python {py.prefix}, cpp {cc.prefix}")
        if py.end != cc.end:
            out.append(f"cache at the end (free cells, sequences): python {py.end}, cpp {cc.end}")
        if py.cancels != cc.cancels:
            out.append(f"cancels (step, request, took effect): python {py.cancels}, "
                       f"cpp {cc.cancels}")
        for what, a, b in (("draft forward", py.draft_forwards, cc.draft_forwards),
                           ("draft cache after step (step, free cells, sequences, failed)",
                            py.draft_after, cc.draft_after)):
            if a != b:
                i = _first_diff(a, b)
                out.append(f"{what} {i} differs: python {a[i] if i < len(a) else None}, cpp "
                           f"{b[i] if i < len(b) else None} ({len(a)} vs {len(b)})")
        if py.speculation != cc.speculation:
            i = _first_diff(py.speculation, cc.speculation)
            out.append(f"speculation counters after step {i} (step, proposed, accepted, decode "
                       f"groups, decode tokens): python "
                       f"{py.speculation[i] if i < len(py.speculation) else None}, cpp "
                       f"{cc.speculation[i] if i < len(cc.speculation) else None}")
    if py.accepted != cc.accepted:
        out.append(f"accepted submits: python {py.accepted}, cpp {cc.accepted}")
    for ev in submits(stream):
        label = ev["submit"]
        if sampled and is_sampled(ev):
            continue
        if sampled and any(c[1] == label for c in py.cancels):
            continue  # when a cancel lands depends on the sampled companions
        for what, a, b in (("tokens", py.samples, cc.samples), ("finish", py.finish, cc.finish)):
            if a.get(label) != b.get(label):
                out.append(f"{label} {what}: python {a.get(label)}, cpp {b.get(label)}")
    if bool(py.errors) != bool(cc.errors):
        out.append(f"errors: python {py.errors}, cpp {cc.errors}")
    return out


def run_stream(stream: dict) -> Tuple[Trace, Trace, List[str]]:
    """Both runtimes; (python trace, cpp trace, problems)."""
    py, cc = run_python(stream), run_cpp(stream)
    problems = check_rules(stream, py) + check_rules(stream, cc) + compare(stream, py, cc)
    return py, cc, problems


# ---------------------------------------------------------------------------- expectations


def _forward_at(tr: Trace, step: int):
    for f in tr.forwards:
        if f[0] == step:
            return f
    return None


def check_expect(stream: dict, tr: Trace) -> List[str]:
    """A case's ``expect`` facts on one runtime's trace. Keys:
      forwards: number of forwards; no_forward_at: [steps without a forward];
      forward: {step: {seq_ids/tokens/positions/logits_for: [...]}} (given keys only);
      first_token_step: {label: step of its first token (any sample)};
      tokens: {label: [[tokens] per sample]}; n_tokens: {label: [count per sample]};
      finish: {label: [reason per sample]}; cached_tokens: {label: k};
      accepted: {label: bool}; cancels: [took effect, per cancel event in order];
      free_cells_after / n_sequences_after / live_after: {step: value};
      prefix: {stat: value} (requests, hits, prompt_tokens, cached_tokens, evictions,
              entries, reclaimable_cells); end: [free cells, sequences] before clearing;
      speculation: {proposed, accepted, decode_groups, decode_tokens} at the end (given
              keys only); draft_forwards: number of draft-model forwards;
      draft_forward: {index: {seq_ids/tokens/positions/logits_for: [...]}} (the draft's
              forwards, counted from 0); draft_end: [free cells, sequences] of the
              draft's cache after the last step."""
    exp = stream.get("expect", {})
    out = []

    def bad(what, want, got):
        if want != got:
            out.append(f"{tr.runtime}: expect {what} = {want}, got {got}")

    if "forwards" in exp:
        bad("forwards", exp["forwards"], len(tr.forwards))
    for step in exp.get("no_forward_at", []):
        bad(f"no forward at step {step}", None, _forward_at(tr, step))
    for step, want in exp.get("forward", {}).items():
        f = _forward_at(tr, int(step))
        got = None if f is None else dict(zip(("seq_ids", "tokens", "positions", "logits_for"),
                                              f[1:]))
        for key, value in want.items():
            bad(f"forward at step {step} {key}", value, got and got[key])
    for label, step in exp.get("first_token_step", {}).items():
        got = next((e[0] for e in tr.token_events if e[1] == label), None)
        bad(f"first token step of {label}", step, got)
    for label, want in exp.get("tokens", {}).items():
        bad(f"tokens of {label}", want, tr.samples.get(label))
    for label, want in exp.get("n_tokens", {}).items():
        bad(f"token counts of {label}", want, [len(t) for t in tr.samples.get(label, [])])
    for label, want in exp.get("finish", {}).items():
        bad(f"finish of {label}", want, tr.finish.get(label))
    for label, want in exp.get("cached_tokens", {}).items():
        bad(f"cached_tokens of {label}", want, tr.cached.get(label))
    for label, want in exp.get("accepted", {}).items():
        bad(f"accepted {label}", want, tr.accepted.get(label))
    if "cancels" in exp:
        bad("cancels took effect", exp["cancels"], [c[2] for c in tr.cancels])
    for key, col in (("free_cells_after", 1), ("n_sequences_after", 2), ("live_after", 3)):
        for step, want in exp.get(key, {}).items():
            got = next((a[col] for a in tr.after if a[0] == int(step)), None)
            bad(f"{key} step {step}", want, got)
    for key, want in exp.get("prefix", {}).items():
        bad(f"prefix {key}", want, tr.prefix and tr.prefix.get(key))
    if "end" in exp:
        bad("end (free cells, sequences)", tuple(exp["end"]), tr.end)
    if "draft_forwards" in exp:
        bad("draft forwards", exp["draft_forwards"], len(tr.draft_forwards))
    for index, want in exp.get("draft_forward", {}).items():
        i = int(index)
        f = tr.draft_forwards[i] if i < len(tr.draft_forwards) else None
        got = None if f is None else dict(zip(("seq_ids", "tokens", "positions", "logits_for"),
                                              f[1:]))
        for key, value in want.items():
            bad(f"draft forward {index} {key}", value, got and got[key])
    if "draft_end" in exp:
        bad("draft_end (free cells, sequences)", tuple(exp["draft_end"]),
            tr.draft_after[-1][1:3] if tr.draft_after else None)
    last = tr.speculation[-1][1:] if tr.speculation else (0, 0, 0, 0)
    for key, want in exp.get("speculation", {}).items():
        got = dict(zip(("proposed", "accepted", "decode_groups", "decode_tokens"), last))
        bad(f"speculation {key}", want, got.get(key))
    return out


# ---------------------------------------------------------------------------- random streams


SPECULATIVE_MODES = ("mixed", "always", "never")


def _speculate(cfg: dict, rng: random.Random) -> None:
    """Turns speculative decoding on in a stream's config (a budget >= 2, k,
    n-gram lengths) and makes its model copy (Model's ``copy``) so proposals
    are made and partly accepted: prompt lookup, or in a third of the
    streams a draft model (the target's model, one that differs at some
    positions, or another one) with a cache of 4-48 cells (so it sometimes
    has no room) and a budget of 1-8; one draft in 5 fails at one of its
    first 12 forwards."""
    budget = cfg["max_tokens_per_step"] = max(2, cfg["max_tokens_per_step"])
    min_ngram = rng.choice([1, 1, 2])
    cfg["speculative"] = {"method": "lookup", "max_draft": rng.randint(1, budget - 1),
                          "min_ngram": min_ngram,
                          "max_ngram": min_ngram + rng.choice([0, 1, 2])}
    cfg["model"]["copy"] = rng.choice([0.5, 0.75, 0.9])
    if rng.random() < 1 / 3:
        model = dict(cfg["model"])
        variant = rng.random()
        if variant < 0.4:
            model["stop_every"] = rng.choice([5, 7, 9])  # agrees but where stops differ
        elif variant < 0.7:
            model["salt"] = rng.randrange(1 << 20)       # agrees by chance
        cfg["speculative"]["method"] = "draft"
        cfg["speculative"]["draft"] = {"cells": rng.randint(4, 48),
                                       "max_tokens_per_step": rng.randint(1, 8), "model": model}
        if rng.random() < 0.2:
            cfg["speculative"]["draft"]["fail_at"] = rng.randint(0, 11)


def random_stream(rng: random.Random, speculative: str = "mixed") -> dict:
    """One random request stream: a small cache (requests wait, entries are
    evicted), a budget of 1-8 tokens, the prefix cache on (bounded or not) or
    off, 1-8 greedy requests (n 1-4, 1-6 new tokens, stop ids, stop_on_eos)
    arriving at random steps, prompts sharing prefixes (common bases, or an
    earlier prompt plus its greedy continuation: a chat's next turn), and
    cancels at random steps (some of them of finished requests, some twice);
    now and then a request too big for the cache (both must refuse it).
    One stream in 10 is longer (up to 16 requests over 30 steps); one in 100
    is crowded (crowded_stream).
    speculative: "mixed" (half the streams), "always" or "never" run prompt
    lookup (_speculate: a budget of 2-8, up to 12 new tokens, one request in
    10 opting out with "speculate": false); "never" draws exactly the streams
    of a generator without speculation."""
    if speculative not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {speculative!r}")
    spec = speculative == "always" or (speculative == "mixed" and rng.random() < 0.5)
    roll = rng.random()
    if roll < 0.01:
        return crowded_stream(rng, spec)
    long = roll < 0.11
    vocab = rng.choice([16, 24, 32])
    eos = rng.choice([[0], [0], [0], [0, 1], []])
    cells = rng.randint(6, 40)
    prefix = rng.random() < 0.75
    cfg = {"cells": cells, "max_tokens_per_step": rng.randint(1, 8), "vocab": vocab,
           "eos_ids": eos, "prefix_cache": prefix,
           "prefix_cache_cells": rng.randint(0, cells) if prefix and rng.random() < 0.35
           else None,
           "model": {"kind": "hash", "salt": rng.randrange(1 << 20), "stop": 0,
                     "stop_every": rng.choice([6, 8, 12])}}
    if spec:
        cfg["model"]["stop_every"] *= 2  # longer runs to propose into
        _speculate(cfg, rng)
    model = model_of(cfg)
    bases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 10))] for _ in range(2)]
    events, made = [], []
    for i in range(rng.randint(8, 16) if long else rng.randint(1, 8)):
        kind = rng.random()
        tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        stop_ids = None
        if spec and rng.random() < 0.35:
            # The model's own text (it falls into a cycle): lookup's proposals
            # are accepted in long runs, and a stop id taken from it ends a
            # sample inside one.
            start = rng.randrange(vocab)
            prompt = [start] + model.simulate([start], rng.randint(3, 12))
            if rng.random() < 0.5:
                stop_ids = [rng.choice(prompt[len(prompt) // 2:])]
        elif kind < 0.4:
            prompt = rng.choice(bases)[:rng.randint(1, 10)] + tail
        elif kind < 0.65 and made:
            prev = rng.choice(made)
            cont = model.simulate(prev["prompt"], prev["max_new_tokens"],
                                  stops_of(prev, eos))
            prompt = prev["prompt"] + cont[:rng.randint(0, len(cont))] + tail
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        if not prompt:
            prompt = [rng.randrange(vocab)]
        ev = {"step": rng.randint(0, 30 if long else 12), "submit": f"r{i}", "prompt": prompt,
              "n": rng.choice([1, 1, 1, 2, 2, 3, 4]),
              "max_new_tokens": rng.randint(1, 12 if spec else 6)}
        if spec and rng.random() < 0.1:
            ev["speculate"] = False
        if stop_ids is not None:
            ev["stop_token_ids"] = stop_ids
        elif rng.random() < 0.3:
            ev["stop_token_ids"] = sorted({rng.randrange(vocab) for _ in range(rng.randint(1, 2))})
        if rng.random() < 0.15:
            ev["stop_on_eos"] = False
        if worst_cells(ev) > cells and rng.random() > 0.1:  # mostly: shrink it to fit
            while worst_cells(ev) > cells and ev["max_new_tokens"] > 1:
                ev["max_new_tokens"] -= 1
            while worst_cells(ev) > cells and ev["n"] > 1:
                ev["n"] -= 1
            ev["prompt"] = ev["prompt"][:cells]
        events.append(ev)
        made.append(ev)
        if rng.random() < 0.3:
            events.append({"step": ev["step"] + rng.randint(0, 12), "cancel": ev["submit"]})
            if rng.random() < 0.15:
                events.append({"step": events[-1]["step"] + rng.randint(0, 3),
                               "cancel": ev["submit"]})
    events.sort(key=lambda e: e["step"])  # stable: same-step events keep their order
    return {"config": cfg, "events": events}


def crowded_stream(rng: random.Random, spec: bool = False) -> dict:
    """Hundreds of short requests arriving in 11 steps (1-3 token prompts over
    20 first tokens, n 1-8, 1-3 new tokens) in a cache of 400-900 cells: the
    256 sequence ids run
    out, in running samples or in prefix-cache entries, before the cells do."""
    cells = rng.randint(400, 900)
    prefix = rng.random() < 0.8
    cfg = {"cells": cells, "max_tokens_per_step": rng.randint(8, 32), "vocab": 300,
           "eos_ids": [0], "prefix_cache": prefix,
           "prefix_cache_cells": rng.randint(0, cells) if prefix and rng.random() < 0.3
           else None,
           "model": {"kind": "hash", "salt": rng.randrange(1 << 20), "stop": 0,
                     "stop_every": 8}}
    if spec:
        _speculate(cfg, rng)
    events = []
    for i in range(rng.randint(250, 350)):
        first = rng.randrange(1, 21)
        prompt = [first] + [rng.randrange(1, 300) for _ in range(rng.randint(0, 2))]
        ev = {"step": rng.randint(0, 10), "submit": f"r{i}", "prompt": prompt,
              "n": rng.choice([1, 2, 4, 8]), "max_new_tokens": rng.randint(1, 3)}
        events.append(ev)
        if rng.random() < 0.1:
            events.append({"step": ev["step"] + rng.randint(0, 5), "cancel": ev["submit"]})
    events.sort(key=lambda e: e["step"])
    return {"config": cfg, "events": events}


def stream_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def shrink(stream: dict, fails: Callable[[dict], bool]) -> dict:
    """The smallest stream found by dropping events (a submit with its
    cancels, or one cancel) while ``fails`` still holds."""
    best = copy.deepcopy(stream)
    changed = True
    while changed:
        changed = False
        for i in range(len(best["events"])):
            if i >= len(best["events"]):
                break
            ev = best["events"][i]
            if "submit" in ev:
                label = ev["submit"]
                events = [e for e in best["events"]
                          if e.get("submit") != label and e.get("cancel") != label]
            else:
                events = best["events"][:i] + best["events"][i + 1:]
            candidate = {**best, "events": events}
            if events and fails(candidate):
                best, changed = candidate, True
    return best


@dataclass
class Summary:
    streams: int = 0
    steps: int = 0
    tokens: int = 0
    hits: int = 0
    evictions: int = 0
    cancels: int = 0
    waits: int = 0
    round_robin_steps: int = 0
    refused: int = 0
    speculative_streams: int = 0
    proposed: int = 0
    accepted: int = 0
    mismatches: int = 0
    first_failure: Optional[Tuple[int, List[str]]] = None

    def add(self, py: Trace) -> None:
        self.streams += 1
        self.steps += len(py.forwards)
        self.tokens += len(py.token_events)
        if py.prefix is not None:
            self.hits += py.prefix["hits"]
            self.evictions += py.prefix["evictions"]
        self.cancels += sum(1 for c in py.cancels if c[2])
        self.refused += sum(1 for ok in py.accepted.values() if not ok)
        self.waits += len(py.waited)
        self.round_robin_steps += py.round_robin_steps
        if py.speculation and py.speculation[-1][1]:
            self.speculative_streams += 1
            self.proposed += py.speculation[-1][1]
            self.accepted += py.speculation[-1][2]


def run_streams(count: int, seed: int, stop_at_first: bool = False,
                progress: Optional[Callable[[Summary], None]] = None,
                speculative: str = "mixed") -> Summary:
    summary = Summary()
    for i in range(count):
        stream = random_stream(random.Random(stream_seed(seed, i)), speculative)
        py, _, problems = run_stream(stream)
        summary.add(py)
        if problems:
            summary.mismatches += 1
            if summary.first_failure is None:
                summary.first_failure = (i, problems)
            if stop_at_first:
                break
        if progress is not None and (i + 1) % 10000 == 0:
            progress(summary)
    return summary


def failing(stream: dict) -> bool:
    return bool(run_stream(stream)[2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-going", action="store_true",
                    help="count every mismatching stream instead of stopping at the first")
    ap.add_argument("--speculative", choices=SPECULATIVE_MODES, default="mixed",
                    help="prompt lookup in half the streams (mixed, the default), in every "
                         "one, or in none")
    args = ap.parse_args(argv)
    if not hasattr(_core, "Engine"):
        print("error: this build of executorch_cellcache.cache._core has no Engine "
              "(rebuild the package)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def progress(s: Summary) -> None:
        print(f"  ... {s.streams} streams, {s.mismatches} mismatching, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    s = run_streams(args.streams, args.seed, stop_at_first=not args.keep_going,
                    progress=progress, speculative=args.speculative)
    seconds = time.perf_counter() - t0
    print(f"streams {s.streams}, steps {s.steps}, tokens {s.tokens}, hits {s.hits}, "
          f"evictions {s.evictions}, cancels {s.cancels}, refused {s.refused}, "
          f"waits {s.waits}, round-robin steps {s.round_robin_steps}, "
          f"speculating streams {s.speculative_streams}, proposed {s.proposed}, "
          f"accepted {s.accepted}, mismatches {s.mismatches}, seconds {seconds:.1f}")
    if s.first_failure is None:
        return 0
    index, problems = s.first_failure
    stream = random_stream(random.Random(stream_seed(args.seed, index)), args.speculative)
    small = shrink(stream, failing)
    print(f"first mismatching stream: index {index} (seed {args.seed}); "
          f"{len(stream['events'])} events, smallest failing: {len(small['events'])}")
    for p in run_stream(small)[2]:
        print(f"  {p}")
    print(format_stream(small))
    return 1


def format_stream(stream: dict) -> str:
    """A stream as a case file's JSON, one event a line."""
    lines = [f' "config": {json.dumps(stream["config"])},', ' "events": [']
    lines += [f'  {json.dumps(e)},' for e in stream["events"]]
    lines[-1] = lines[-1].rstrip(",")
    return "{\n" + "\n".join(lines) + "\n ]\n}"


if __name__ == "__main__":
    sys.exit(main())
