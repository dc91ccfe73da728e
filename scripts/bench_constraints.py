"""What structured output costs (runtime/constraints.py, SPEC section 13): the
token mask per sampled token, and B=8 decode throughput with a JSON schema vs
without.

(a) Mask time per sampled token: the runner's own calls, ``Matcher.mask()``
    (the C++ grammar layer (XGrammar) fills the next-token row; in
    generate a step's masks come from one ``fill_masks`` call, see the
    model driver) and ``Matcher.advance()`` (the matcher consumes the token),
    medians and 90th
    percentiles, at two vocabularies: the default model's 1,024 tokens (its
    shipped tokenizer.json) and 49,152 tokens (SmolLM-135M's size; see
    below). Two drivers:
    - uniform: samples of the bench's JSON schema driven token by token, each
      token drawn uniformly (seeded) from what the mask allows, until
      --mask-tokens tokens are timed; also times applying a mask to a logits
      row (``np.where``, what a sampled row costs) and a greedy row's choice
      (``sampling.masked_greedy``: the row's argmax, masked only when that token
      is not allowed; on these random logits it rarely is, inside a JSON
      object's structure). The first token of a sample comes
      from ``Constraint.initial_mask()``, computed once per request: untimed.
      A uniform draw favours long tokens, so strings fill in few tokens.
    - model: every mask and advance call inside a real ``generate`` (B=8,
      temperature 1, the schema, --new-tokens tokens each), timed by wrapping
      the methods (``Vocabulary.masks``, one call a step for all its samples,
      and ``Matcher.mask`` outside it; per call, its rows, and per row): the
      default model's program (1,024 tokens;
      --default-program, else exported to a temporary folder, ~30 s) and the
      135M program of (b) with the 49,152-token tokenizer. A model writes
      strings a few characters a token, where a mask costs the most.

(b) B=8 decode tokens/s: 8 prompts of --prompt-len tokens, then
    --new-tokens tokens each, with the bench's JSON schema and without (the
    same prompts, seed and lengths), at temperature 1 and greedy
    (--temperatures), on a 135M-shaped 8da4w program (the bench's FULL model:
    Llama, 30 layers, hidden 576, vocab 49,152, random weights) with the
    49,152-token tokenizer attached. The schema asks for 8
    items, more than --new-tokens tokens hold, so constrained samples run to
    the length limit like plain ones. A step's time is wall time from the end
    of one step to the end of the next (``on_step``): planning, the forward,
    the 8 masks, sampling and the matchers' advance; only steps that decoded
    exactly 8 tokens and prefilled nothing count. Inside those steps the
    time spent computing masks and choosing tokens (the runner's
    token choice: masks applied, argmax or sampling; EngineStats sample_seconds) is summed per step
    (medians reported). Runs alternate (schema,
    plain, schema, plain, ...) after one warm-up run of each; the medians of
    --rounds runs and their ratio (with / without; target >= 0.9) are
    reported per temperature.
    Why greedy too: sampling (cpp/engine/sampling.cpp) sorts the whole
    row (a stable argsort, float64) for every sampled token, ~4-5 ms a row at
    49,152 tokens on this machine, more than the forward's share of a B=8 step;
    a masked row is mostly -inf and sorts several times faster. So at
    temperature 1 the schema run is the faster one, and the ratio says more
    about that sort than about the mask; greedy (an argmax, for both) leaves
    the mask's own cost: the 8 masks, applying them and the 8 advances a step.

The program: --program PATH, else the bench cache's 8da4w program
(``cellcache bench --quantize 8da4w`` exports it; key: the FULL setup, 4096
cells, 256 tokens a step, 8da4w group 32) when it is cached for the current
exporter source, else the newest cached program with those options exported
by an earlier exporter source (said in the output: the runtime path measured
here, masks and sampling, does not depend on the exporter). Without any,
the script stops and says so (exporting it takes ~50 minutes on 2 cores).
The bench program has random weights and no tokenizer: the 49,152-token one
is attached to the Runner (``runner.info.tokenizer_json``, which is where
``Runner.constraint`` builds its grammar vocabulary from); its special
tokens <unk> <s> </s> are ids 0 1 2, the program's BOS (1) and EOS (2).

The 49,152-token tokenizer: no SmolLM tokenizer can be downloaded here, so a
byte-level BPE with exactly 49,152 tokens (3 special tokens, the 256 byte
symbols, 48,893 merges) is trained with the ``tokenizers`` library
(BpeTrainer, ByteLevel pre-tokenizer and decoder, like GPT-2's and SmolLM's)
on Python's pydoc_data.topics (465k characters of English and code) plus 7 MB
of synthetic code-like text: seeded random identifiers (snake_case,
camelCase, CapWords, word+number) joined from the words of those topics, so
that there are enough distinct pre-tokenized words for 48,893 merges. About
10 s; cached as <cache-dir>/bench/constraints-tokenizer-49152.json
(--tokenizer PATH uses another tokenizer.json of exactly 49,152 tokens).

    python scripts/bench_constraints.py [--program PTE] [--json OUT.json]
    python scripts/bench_constraints.py --skip-decode   # (a), uniform driver only
"""

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 49152
SPECIAL = ["<unk>", "<s>", "</s>"]   # ids 0 1 2: the bench program's BOS 1 and EOS 2
BATCH = 8

# 8 items of 3 fields: longer than --new-tokens tokens, so every constrained sample
# decodes as many tokens as a plain one (bounded strings and integers: a sample of
# it always completes, given the tokens).
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["items"],
    "properties": {"items": {
        "type": "array", "minItems": 8, "maxItems": 8,
        "items": {
            "type": "object", "additionalProperties": False,
            "required": ["name", "qty", "ok"],
            "properties": {"name": {"type": "string", "maxLength": 16},
                           "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                           "ok": {"type": "boolean"}}}}}}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the 49,152-token tokenizer

def _training_text():
    """pydoc_data.topics, then seeded synthetic identifiers (see the module
    docstring), in chunks."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    words = sorted(set(re.findall(r"[A-Za-z]+", text)))
    rng = random.Random(0)

    def ident():
        parts = [rng.choice(words) for _ in range(rng.randint(2, 3))]
        style = rng.random()
        if style < 0.4:
            return "_".join(p.lower() for p in parts)
        if style < 0.7:
            return parts[0].lower() + "".join(p.capitalize() for p in parts[1:])
        if style < 0.85:
            return "".join(p.capitalize() for p in parts)
        return rng.choice(words) + str(rng.randint(0, 99999))

    synthetic = "\n".join(" ".join(ident() for _ in range(rng.randint(3, 10)))
                          for _ in range(60000))
    for chunk in (text, synthetic):
        for i in range(0, len(chunk), 10000):
            yield chunk[i:i + 10000]


def build_tokenizer(path: Path) -> float:
    """Trains the 49,152-token byte-level BPE and saves it to ``path``;
    returns the seconds it took."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the trained tokenizer has {tok.get_vocab_size()} tokens, not "
                           f"{VOCAB}: too little distinct training text")
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return time.perf_counter() - t0


def tokenizer_49152(args) -> tuple:
    """(tokenizer.json text, where it came from)."""
    from tokenizers import Tokenizer

    if args.tokenizer is not None:
        path, origin = args.tokenizer, f"given ({args.tokenizer})"
    else:
        path = args.cache_dir / "bench" / f"constraints-tokenizer-{VOCAB}.json"
        if path.exists():
            origin = f"cached ({path})"
        else:
            _say(f"training the {VOCAB}-token byte-level BPE (about 10 s) ...")
            seconds = build_tokenizer(path)
            origin = f"trained in {seconds:.1f} s ({path})"
    text = path.read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"{path} has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    if [tok.token_to_id(s) for s in SPECIAL] != [0, 1, 2]:
        raise SystemExit(f"{path}: {SPECIAL} must be ids 0 1 2 (the program's BOS and EOS)")
    return text, origin


# ---------------------------------------------------------------- (a) mask time per token

def _pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def mask_times(tokenizer_json: str, vocab_size: int, eos: int, tokens: int, seed: int = 0):
    """Seconds per sampled token (medians and 90th percentiles) of the
    matcher's mask and advance, and of applying the mask to a logits row."""
    from executorch_cellcache.runtime.constraints import Grammar, Vocabulary

    def greedy(row, allowed):  # a masked row's argmax, as the engine chooses it
        return int(np.argmax(np.where(allowed, row, np.float32(-np.inf))))

    t0 = time.perf_counter()
    vocab = Vocabulary(tokenizer_json, vocab_size, [eos])
    vocab_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    constraint = vocab.compile(Grammar("json_schema", SCHEMA))
    compile_seconds = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(vocab_size).astype(np.float32)
    masks, advances, per_token, applies, greedies = [], [], [], [], []
    samples = 0
    while len(masks) < tokens:
        matcher = constraint.matcher()
        allowed = constraint.initial_mask()
        samples += 1
        mask_s = None   # the first token's mask is the request's initial mask
        while not matcher.complete and len(masks) < tokens:
            t0 = time.perf_counter()
            np.where(allowed, logits, np.float32(-np.inf))
            applies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            greedy(logits, allowed)
            greedies.append(time.perf_counter() - t0)
            token = int(rng.choice(np.flatnonzero(allowed)))
            t0 = time.perf_counter()
            matcher.advance(token)
            advance_s = time.perf_counter() - t0
            if mask_s is not None:
                masks.append(mask_s)
                advances.append(advance_s)
                per_token.append(mask_s + advance_s)
            if matcher.complete:
                break
            t0 = time.perf_counter()
            allowed = matcher.mask()
            mask_s = time.perf_counter() - t0
    return {
        "vocab_size": vocab_size, "timed_tokens": len(masks), "samples": samples,
        "mask_median_s": statistics.median(masks), "mask_p90_s": _pct(masks, 90),
        "advance_median_s": statistics.median(advances), "advance_p90_s": _pct(advances, 90),
        "mask_plus_advance_median_s": statistics.median(per_token),
        "mask_plus_advance_p90_s": _pct(per_token, 90),
        "apply_median_s": statistics.median(applies),
        "greedy_median_s": statistics.median(greedies),
        "vocabulary_build_s": vocab_seconds, "schema_compile_s": compile_seconds,
    }


class CallTimes:
    """Seconds spent in the runner's constraint calls while ``timed_calls``
    is active: ``mask`` (per outermost call of ``fill_masks`` (a step's
    masks) or ``Matcher.mask``: counted once) with
    ``mask_rows`` (the masks it made) and ``advance`` (``Matcher.advance``);
    ``totals`` sums each. (Token choice is timed by the engine: EngineStats
    sample_seconds.)"""

    def __init__(self):
        self.calls = {"mask": [], "mask_rows": [], "advance": []}
        self.totals = {"mask": 0.0, "advance": 0.0}

    def add(self, name, seconds):
        self.calls[name].append(seconds)
        self.totals[name] += seconds


@contextlib.contextmanager
def timed_calls():
    """Wraps ``fill_masks``, ``Matcher.mask`` and ``Matcher.advance``
    (runtime/constraints.py) for the block; yields a CallTimes."""
    from executorch_cellcache.runtime import constraints

    times = CallTimes()
    depth = [0]
    patched = [(constraints, "fill_masks"), (constraints.Matcher, "mask"),
               (constraints.Matcher, "advance")]
    original = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def mask_call(fn, rows):
        def call(*args):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    times.add("mask", time.perf_counter() - t0)
                    times.calls["mask_rows"].append(rows(args))
        return call

    def timed(fn, name):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.add(name, time.perf_counter() - t0)
        return call

    fns = {name: fn for _, name, fn in original}
    constraints.fill_masks = mask_call(fns["fill_masks"], lambda a: len(a[0]))
    constraints.Matcher.mask = mask_call(fns["mask"], lambda a: 1)
    constraints.Matcher.advance = timed(fns["advance"], "advance")
    try:
        yield times
    finally:
        for owner, name, fn in original:
            setattr(owner, name, fn)


def model_mask_times(runner, prompts, new_tokens: int) -> dict:
    """Mask and advance times inside one B=len(prompts) generate at
    temperature 1 under SCHEMA (after a warm-up call)."""
    runner.generate(prompts, new_tokens, temperature=1.0, seed=1, json_schema=SCHEMA)
    with timed_calls() as times:
        out = runner.generate(prompts, new_tokens, temperature=1.0, seed=2, json_schema=SCHEMA)
    masks, rows, advances = (times.calls[k] for k in ("mask", "mask_rows", "advance"))
    return {"vocab_size": runner.info.vocab_size, "mask_calls": len(masks),
            "mask_rows": sum(rows), "mask_rows_per_call_median": statistics.median(rows),
            "advance_calls": len(advances),
            "mask_call_median_s": statistics.median(masks),
            "mask_call_p90_s": _pct(masks, 90),
            "mask_per_row_s": sum(masks) / sum(rows),
            "advance_median_s": statistics.median(advances),
            "advance_p90_s": _pct(advances, 90),
            "example": runner.tokenizer.decode(out[0][0])}


def _prompts(runner, count: int, length: int):
    from pydoc_data.topics import topics

    prompts = []
    for key in sorted(topics)[:count]:
        ids = runner.tokenizer.encode(topics[key])[:length]
        if len(ids) < length:
            raise SystemExit(f"topic {key!r} is too short for --prompt-len {length}")
        prompts.append(ids)
    return prompts


def default_program(args, tmp: Path) -> Path:
    if args.default_program is not None:
        if not args.default_program.exists():
            raise SystemExit(f"--default-program {args.default_program} does not exist")
        return args.default_program
    from executorch_cellcache.exporting.exporter import export

    _say("exporting the default model (fp32) for the model-driven masks ...")
    return export(None, tmp / "default.pte", n_cells=1024, max_tokens_per_step=64).path


# ---------------------------------------------------------------- (b) B=8 decode tokens/s

PROGRAM_OPTIONS = {"n_cells": 4096, "max_tokens": 256, "attention": "cells",
                   "quantize": "8da4w", "group_size": 32, "embedding_quantize": None}


def find_program(args) -> tuple:
    """(path, how it was found) of the 8da4w 135M program, or SystemExit."""
    if args.program is not None:
        if not args.program.exists():
            raise SystemExit(f"--program {args.program} does not exist")
        return args.program, "given (--program)"
    import hashlib

    import torch

    from executorch_cellcache.bench.common import FULL, PACKAGE_VERSION, _exporter_digest

    bench_dir = args.cache_dir / "bench"
    parts = ["ours", FULL.model, PROGRAM_OPTIONS, PACKAGE_VERSION, torch.__version__,
             _exporter_digest()]
    key = "ours-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    if (bench_dir / f"{key}.pte").exists():
        return bench_dir / f"{key}.pte", f"the bench cache's, current exporter ({key})"
    older = []
    for meta in bench_dir.glob("ours-*.json"):
        try:
            options = json.loads(meta.read_text()).get("options")
        except (OSError, ValueError):
            continue
        pte = meta.with_suffix(".pte")
        if options == PROGRAM_OPTIONS and pte.exists():
            older.append((pte.stat().st_mtime, pte))
    if older:
        pte = max(older)[1]
        return pte, (f"the bench cache's, exported by an earlier exporter source (the current "
                     f"key {key} is not cached)")
    raise SystemExit(
        f"no 8da4w 135M program in {bench_dir}: pass --program PATH, or export it with "
        f"`cellcache bench --quantize 8da4w` (about 50 minutes on 2 cores); --skip-decode "
        f"measures the masks alone")


def bench_runner(program: Path, tokenizer_json: str):
    """The 135M program's Runner with the 49,152-token tokenizer attached."""
    from executorch_cellcache.cache import metadata
    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.tokenizer import from_metadata

    runner = Runner(program, prefix_cache=False)   # every run prefills the same way
    info = runner.info
    if info.vocab_size != VOCAB or 2 not in info.eos_ids:
        raise SystemExit(f"{program}: vocabulary {info.vocab_size}, EOS {info.eos_ids}; "
                         f"expected {VOCAB} and EOS 2 (the bench's FULL model)")
    runner.info = dataclasses.replace(info, tokenizer_kind=metadata.TOKENIZER_HF,
                                      tokenizer_json=tokenizer_json)
    runner.tokenizer = from_metadata(metadata.TOKENIZER_HF, tokenizer_json)
    return runner


def decode_runs(runner, args) -> dict:
    info = runner.info
    program = runner.path
    prompts = _prompts(runner, BATCH, args.prompt_len)

    def run(schema, temperature) -> dict:
        step_times, mask_times, choose_times = [], [], []
        last = [0.0, 0, 0, 0.0, 0.0]

        def on_step(st):
            now = time.perf_counter()
            # Token choice is the engine's (C++): its own clock, masks applied there.
            mask, choose = times.totals["mask"], runner.engine.stats().sample_seconds
            if st.prefill_tokens == last[1] and st.decode_tokens - last[2] == BATCH:
                step_times.append(now - last[0])
                mask_times.append(mask - last[3])
                choose_times.append(choose - last[4])
            last[:] = [now, st.prefill_tokens, st.decode_tokens, mask, choose]

        with timed_calls() as times:
            last[0] = time.perf_counter()
            out = runner.generate(prompts, args.new_tokens, temperature=temperature, seed=1,
                                  stop_on_eos=False, json_schema=schema, on_step=on_step)
        st = runner.last_stats
        lengths = [len(s) for p in out for s in p]
        if not step_times:
            raise SystemExit(f"no step decoded {BATCH} tokens (sample lengths {lengths}): "
                             f"raise --new-tokens")
        return {"tokens_per_s": BATCH * len(step_times) / sum(step_times),
                "b8_steps": len(step_times), "step_median_s": statistics.median(step_times),
                "step_masks_median_s": statistics.median(mask_times),
                "step_choose_median_s": statistics.median(choose_times),
                "forward_only_tokens_per_s": st.decode_tokens_per_s,
                "sample_lengths": lengths}

    out = {"program": str(program), "model_type": info.model_type, "n_layers": info.n_layers,
           "quantize": info.quantize, "group_size": info.group_size,
           "vocab_size": info.vocab_size, "batch": BATCH, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "rounds": args.rounds, "by_temperature": {}}
    variants = {"schema": SCHEMA, "plain": None}
    for temperature in args.temperatures:
        results = {name: [] for name in variants}
        for r in range(1 + args.rounds):   # round 0: warm-up (builds the grammar vocabulary)
            for name, schema in variants.items():
                res = run(schema, temperature)
                if r:
                    results[name].append(res)
                _say(f"  temperature {temperature:g}, {'warm-up' if not r else f'round {r}'} "
                     f"{name}: {res['tokens_per_s']:.1f} tok/s over {res['b8_steps']} B=8 "
                     f"steps (forward only {res['forward_only_tokens_per_s']:.1f})")
        t = {}
        for name, runs in results.items():
            tps = [x["tokens_per_s"] for x in runs]
            t[name] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_runs": tps,
                       "step_median_s": statistics.median(x["step_median_s"] for x in runs),
                       "step_masks_median_s": statistics.median(
                           x["step_masks_median_s"] for x in runs),
                       "step_choose_median_s": statistics.median(
                           x["step_choose_median_s"] for x in runs),
                       "b8_steps_per_run": [x["b8_steps"] for x in runs],
                       "forward_only_tokens_per_s_median": statistics.median(
                           x["forward_only_tokens_per_s"] for x in runs),
                       "sample_lengths_last_run": runs[-1]["sample_lengths"]}
        t["ratio_schema_over_plain"] = \
            t["schema"]["tokens_per_s_median"] / t["plain"]["tokens_per_s_median"]
        out["by_temperature"][f"{temperature:g}"] = t
    return out


# ---------------------------------------------------------------- main

def _temperatures(text: str):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected temperatures >= 0, got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Details (how each figure is measured, the program, the tokenizer): the "
               "docstring of scripts/bench_constraints.py.")
    parser.add_argument("--program", type=Path, default=None,
                        help="the 8da4w 135M-shaped .pte for (b) (default: the bench cache's)")
    parser.add_argument("--default-program", type=Path, default=None,
                        help="a .pte of the default model for the model-driven 1,024-token "
                             "masks (default: exported to a temporary folder, ~30 s)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help=f"a tokenizer.json of exactly {VOCAB} tokens (<unk> <s> </s> = "
                             f"0 1 2) instead of the trained one")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the bench cache's folder (default $CELLCACHE_BENCH_CACHE or "
                             "~/.cache/executorch-cellcache): programs and the tokenizer")
    parser.add_argument("--mask-tokens", type=int, default=400,
                        help="(a) tokens timed per vocabulary (default 400)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="(b) runs of each variant after the warm-up (default 5)")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="(b) prompt tokens per sequence (default 16)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="(b) tokens generated per sequence (default 64)")
    parser.add_argument("--temperatures", type=_temperatures, default=[1.0, 0.0],
                        help="(b) comma-separated temperatures, each measured with and "
                             "without the schema (default 1,0: sampled and greedy)")
    parser.add_argument("--skip-decode", action="store_true",
                        help="only (a) with the uniform driver: no program needed")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write every figure to OUT as JSON")
    args = parser.parse_args(argv)
    if args.mask_tokens < 1 or args.rounds < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        parser.error("--mask-tokens, --rounds and --prompt-len must be >= 1, --new-tokens >= 2")
    args.cache_dir = args.cache_dir or Path(os.environ.get(
        "CELLCACHE_BENCH_CACHE", Path.home() / ".cache" / "executorch-cellcache"))

    from executorch_cellcache.bench.common import machine
    from executorch_cellcache.exporting import default_model

    figures = {"machine": machine(), "schema": SCHEMA}
    if not args.skip_decode:
        program, found = find_program(args)   # before anything is measured
    big_json, origin = tokenizer_49152(args)
    figures["tokenizer_49152"] = origin
    small_json = (default_model.CHECKPOINT / "tokenizer.json").read_text(encoding="utf-8")
    figures["mask_uniform"] = []
    print(f"(a) mask time per sampled token, JSON schema; uniform driver ({args.mask_tokens} "
          f"tokens each)")
    for name, text, vocab_size, eos in (("default model", small_json, 1024, 1),
                                        ("49,152-token BPE", big_json, VOCAB, 2)):
        m = mask_times(text, vocab_size, eos, args.mask_tokens)
        m["tokenizer"] = name
        figures["mask_uniform"].append(m)
        print(f"  {name:>17} ({vocab_size:5} tokens): mask {m['mask_median_s'] * 1e6:.0f} us + "
              f"advance {m['advance_median_s'] * 1e6:.0f} us = "
              f"{m['mask_plus_advance_median_s'] * 1e6:.0f} us median "
              f"(p90 {m['mask_plus_advance_p90_s'] * 1e6:.0f} us); applying the mask "
              f"{m['apply_median_s'] * 1e6:.0f} us, greedy over it "
              f"{m['greedy_median_s'] * 1e6:.0f} us; {m['timed_tokens']} tokens in "
              f"{m['samples']} samples")
    if not args.skip_decode:
        from executorch_cellcache.runtime.runner import Runner

        figures["program_found"] = found
        big = bench_runner(program, big_json)
        figures["mask_model"] = []
        print(f"(a) the same inside generate (B={BATCH}, temperature 1, {args.new_tokens} "
              f"tokens each); model driver")
        with tempfile.TemporaryDirectory() as tmp:
            small = Runner(default_program(args, Path(tmp)), prefix_cache=False)
            for name, runner in (("default model", small), ("135M, 49,152-token BPE", big)):
                m = model_mask_times(runner, _prompts(runner, BATCH, args.prompt_len),
                                     args.new_tokens)
                m["program"] = name
                figures["mask_model"].append(m)
                print(f"  {name:>22} ({m['vocab_size']:5} tokens): {m['mask_calls']} mask "
                      f"calls for {m['mask_rows']} masks (median "
                      f"{m['mask_rows_per_call_median']:g} a call): "
                      f"{m['mask_call_median_s'] * 1e6:.0f} us a call (p90 "
                      f"{m['mask_call_p90_s'] * 1e6:.0f}), {m['mask_per_row_s'] * 1e6:.0f} us a "
                      f"mask; advance {m['advance_median_s'] * 1e6:.0f} us; "
                      f"e.g. {m['example'][:60]!r}")
            del small
        print(f"(b) B={BATCH} decode, {args.prompt_len}-token prompts, {args.new_tokens} new "
              f"tokens: {program} ({found})")
        d = decode_runs(big, args)
        d["found"] = found
        figures["decode"] = d
        for temperature, t in d["by_temperature"].items():
            print(f"  temperature {temperature}: with the schema "
                  f"{t['schema']['tokens_per_s_median']:.1f} tok/s, without "
                  f"{t['plain']['tokens_per_s_median']:.1f} tok/s (medians of {args.rounds} "
                  f"alternated runs); ratio {t['ratio_schema_over_plain']:.3f} (target >= 0.9); "
                  f"B=8 step {t['schema']['step_median_s'] * 1e3:.1f} vs "
                  f"{t['plain']['step_median_s'] * 1e3:.1f} ms, forward alone "
                  f"{t['schema']['forward_only_tokens_per_s_median']:.0f} vs "
                  f"{t['plain']['forward_only_tokens_per_s_median']:.0f} tok/s; per B=8 step: "
                  f"masks {t['schema']['step_masks_median_s'] * 1e6:.0f} us, choosing "
                  f"{t['schema']['step_choose_median_s'] * 1e6:.0f} vs "
                  f"{t['plain']['step_choose_median_s'] * 1e6:.0f} us")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
