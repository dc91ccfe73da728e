"""``cellcache bench --speculative``: what speculative decoding costs and wins.

- Verify cost: a step carrying k = 1..9 tokens of each of B sequences (one
  decode token and up to 8 proposals; B = 1 and 8) after a prompt, against the
  step carrying one token each, on the bench's main program at the chosen
  quantization (the SmolLM-135M-shaped Llama): how much more a forward costs
  when it checks k tokens instead of computing one. Steps are rolled back
  (``seq_rm``) after each timing, alternated, medians.
- Copy task (the input-grounded case prompt lookup is for): the trained
  default model repeats held-out passages it was shown
  (exporting/copy_task.py). Plain greedy decoding against prompt lookup (k
  auto: chosen from measured step costs, cpp/engine/draft_length.h; and k = 7
  at B=1, the fixed default before), one request at a time (B=1) and eight at
  once (B=8): generated tokens/s (the two take turns group by group, the
  order alternating; medians of rounds), identical output checked, acceptance
  rate and tokens per forward.
- Draft model: the default model's 8da4w program drafting for its fp32
  program on the same task (B=1).

Programs are exported once into the bench cache (ProgramCache).
"""

import hashlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from executorch_cellcache.bench.common import (BenchSetup, ProgramCache, alternating_medians,
                                               machine)
from executorch_cellcache.bench import ours as ours_bench

VERIFY_TOKENS = tuple(range(1, 10))   # tokens per sequence in a verify step
VERIFY_BATCHES = (1, 8)
COPY_NEW_TOKENS = 96
DEFAULT_CELLS = 4096
DEFAULT_STEP = 64


@dataclass
class CopyResult:
    batch: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    identical: bool
    acceptance_rate: float
    tokens_per_forward: float
    tokens: int
    max_draft: int = 0  # k the proposer used

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s


@dataclass
class SpeculativeResult:
    verify_program: str = ""
    # batch -> {tokens per sequence: step seconds}
    verify_seconds: Dict[int, Dict[int, float]] = field(default_factory=dict)
    lookup: List[CopyResult] = field(default_factory=list)
    draft: List[CopyResult] = field(default_factory=list)
    prompts: int = 0

    def verify_ratio(self, batch: int, k: int) -> float:
        return self.verify_seconds[batch][k] / self.verify_seconds[batch][1]


def verify_cost(runner, prompt_len: int, rounds: int, say) -> Dict[int, Dict[int, float]]:
    """batch -> {k: median seconds of a step carrying k tokens of each of
    ``batch`` sequences}, each sequence first prefilled with prompt_len tokens."""
    rng = np.random.default_rng(0)
    vocab = runner.info.vocab_size
    out = {}
    for batch in VERIFY_BATCHES:
        runner.clear()
        seqs = [runner.cache.seq_new() for _ in range(batch)]
        ours_bench._prefill(runner, seqs, prompt_len, vocab)

        def step(k, seqs=seqs):
            ids, toks, pos = [], [], []
            for s in seqs:
                start = runner.cache.next_pos(s)
                ids += [s] * k
                pos += list(range(start, start + k))
                toks += rng.integers(0, vocab, k).tolist()
            runner.step(ids, toks, pos, list(range(len(toks))))
            for s in seqs:
                runner.rollback(s, k)

        ks = [k for k in VERIFY_TOKENS if batch * k <= runner.info.max_tokens_per_step]
        say(f"  verify cost, {batch} sequence(s): k = {ks[0]}..{ks[-1]} tokens each")
        out[batch] = alternating_medians({k: (lambda k=k: step(k)) for k in ks}, rounds)
        runner.clear()
    return out


def _timed_generate(runner, prompts, max_new, spec):
    t0 = time.perf_counter()
    out = runner.generate(prompts, max_new, speculative=spec)
    return out, time.perf_counter() - t0, runner.last_stats


def copy_speed(target, prompts: List[List[int]], batch: int, spec, rounds: int,
               max_new: int = COPY_NEW_TOKENS) -> CopyResult:
    """Plain vs ``spec`` on ``prompts``, ``batch`` requests per generate call:
    the two take turns group by group (which goes first alternates), so a
    drift of the machine's speed within a round weighs on both; medians of the
    rounds' totals."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    times = {"plain": [], "spec": []}
    outs = {"plain": [], "spec": []}
    tokens = proposed = accepted = decode = groups_n = max_draft = 0
    for r in range(rounds + 1):  # round 0 warms up
        totals = {"plain": 0.0, "spec": 0.0}
        for i, g in enumerate(groups):
            for mode in (("plain", "spec") if (r + i) % 2 else ("spec", "plain")):
                out, seconds, st = _timed_generate(target, g, max_new,
                                                   spec if mode == "spec" else None)
                totals[mode] += seconds
                if r == 1:
                    outs[mode].append(out)
                    if mode == "spec":
                        proposed += st.proposed_tokens
                        accepted += st.accepted_tokens
                        decode += st.decode_tokens
                        groups_n += st.decode_groups
                        max_draft = st.max_draft
                    else:
                        tokens += sum(len(s) for p in out for s in p)
        if r:
            for mode, total in totals.items():
                times[mode].append(total)
    plain_t, spec_t = statistics.median(times["plain"]), statistics.median(times["spec"])
    return CopyResult(batch, tokens / plain_t, tokens / spec_t, outs["plain"] == outs["spec"],
                      accepted / proposed if proposed else 0.0,
                      decode / groups_n if groups_n else 0.0, tokens, max_draft)


def default_programs(programs: ProgramCache, setup: BenchSetup, say):
    """(fp32 .pte, 8da4w .pte) of the embedded default model, 4096 cells, 64
    tokens a step, cached under the checkpoint's digest."""
    from executorch_cellcache.exporting import default_model
    from executorch_cellcache.exporting.exporter import export

    digest = hashlib.sha256(
        (Path(default_model.CHECKPOINT) / "model.safetensors").read_bytes()).hexdigest()[:16]
    out = []
    for quant in ({}, {"quantize": "8da4w", "group_size": 32, "embedding_quantize": "8"}):
        def build(path, quant=quant):
            return export(None, path, n_cells=DEFAULT_CELLS, max_tokens_per_step=DEFAULT_STEP,
                          progress=lambda line: say(f"  {line}"), **quant).seconds
        path, _ = programs.get("default", setup, {"checkpoint": digest, "n_cells": DEFAULT_CELLS,
                                                  "max_tokens": DEFAULT_STEP, **quant}, build)
        out.append(path)
    return out


def run(setup: BenchSetup, programs: ProgramCache, quant, quick: bool, say,
        verify_program: Optional[Path] = None) -> SpeculativeResult:
    from executorch_cellcache.exporting.copy_task import heldout_copy_prompts
    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.speculative import Speculative

    res = SpeculativeResult()
    if verify_program is None:
        opts = {**ours_bench.main_program_options(setup), **quant.export_options()}
        verify_program, _ = programs.get(
            "ours", setup, opts, ours_bench.export_ours(setup, setup.n_cells, setup.prefill_len,
                                                         say, **quant.export_options()))
    res.verify_program = str(verify_program)
    say(f"verify cost on {verify_program}")
    res.verify_seconds = verify_cost(Runner(verify_program, prefix_cache=False),
                                     setup.prompt_len, 5 if quick else 15, say)

    fp32, q8da4w = default_programs(programs, setup, say)
    target = Runner(fp32, prefix_cache=False)
    n = 8 if quick else 16
    prompts = [target.tokenizer.encode(c.prompt) for c in heldout_copy_prompts(n)]
    res.prompts = n
    rounds = 2 if quick else 5
    lookup = Speculative("lookup")
    for batch in (1, 8):
        say(f"copy task, prompt lookup, B={batch}")
        res.lookup.append(copy_speed(target, prompts, batch, lookup, rounds))
    say("copy task, prompt lookup with k = 7 (the fixed default before auto), B=1")
    res.lookup.append(copy_speed(target, prompts, 1, Speculative("lookup", max_draft=7), rounds))
    say("copy task, draft model (the 8da4w program drafting for the fp32 one), B=1")
    draft = Speculative("draft", max_draft=4, draft_model=str(q8da4w))
    res.draft.append(copy_speed(target, prompts, 1, draft, rounds))
    return res


def table(res: SpeculativeResult) -> str:
    lines = [f"Verify cost: step time with k tokens per sequence / with 1 "
             f"({Path(res.verify_program).name})"]
    for batch, secs in res.verify_seconds.items():
        cells = "  ".join(f"k={k}: {res.verify_ratio(batch, k):.2f}x" for k in secs)
        lines.append(f"  B={batch}: {cells}  (1 token: {1e3 * secs[1]:.2f} ms)")
    lines.append(f"Copy task, default model, {res.prompts} held-out passages, greedy "
                 f"(tokens/s, medians of alternated rounds):")
    for name, rows in (("prompt lookup", res.lookup), ("draft model (8da4w for fp32)",
                                                       res.draft)):
        for c in rows:
            lines.append(
                f"  {name:28s} B={c.batch}, up to {c.max_draft:2d} a step: plain "
                f"{c.plain_tokens_per_s:7.0f}  speculative "
                f"{c.spec_tokens_per_s:7.0f}  = {c.speedup:.2f}x; acceptance "
                f"{c.acceptance_rate:.0%}, {c.tokens_per_forward:.2f} tokens per forward, "
                f"output {'identical' if c.identical else 'DIFFERENT'} ({c.tokens} tokens)")
    return "\n".join(lines)


def as_json(res: SpeculativeResult) -> dict:
    def copy(c: CopyResult) -> dict:
        return {**c.__dict__, "speedup": c.speedup}
    return {"machine": machine(), "verify_program": res.verify_program,
            "verify_seconds": {str(b): {str(k): v for k, v in s.items()}
                               for b, s in res.verify_seconds.items()},
            "verify_ratio": {str(b): {str(k): res.verify_ratio(b, k) for k in s}
                             for b, s in res.verify_seconds.items()},
            "prompts": res.prompts,
            "lookup": [copy(c) for c in res.lookup], "draft": [copy(c) for c in res.draft]}


