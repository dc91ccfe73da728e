#!/usr/bin/env python
"""A cell pool per window policy (issue #25) against one pool: memory, decode
speed, and one sequence far longer than its windowed pool.

    python scripts/bench_pools.py [--contexts 8] [--length 4096] [--window 512]
                                  [--rounds 9] [--long 16384] [--json F]

Gemma3-shaped weights (seeded, small: hidden 64, 4 query heads, 1 KV head of
64; five sliding layers of --window to each full one, as Gemma3-1B), exported
twice: one pool of contexts x (length + decode) cells for every layer, and
pools (--window-cells auto for --contexts sequences: the full layers keep
that pool, each sliding layer a pool of contexts x (W + max(R, T - 1) + T)).
- memory: K/V bytes of each program (its layers' buffers, from the
  metadata), and the resident memory each adds once its --contexts sequences
  of --length tokens are prefilled (a fresh process per program: a buffer's
  pages count once written);
- speed: decode steps of all --contexts sequences at once, the two programs
  taking turns step by step, --rounds rounds of 16 steps; medians and the
  paired ratio (pools / one pool);
- long: a Mistral-shaped model (every layer slides, window 64) generates
  --long tokens greedily for one sequence from a windowed pool of
  2 x (W + R) cells, and the same weights with one pool of --long + 16 cells
  must produce the same tokens.
Measurements, not tests.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP = 64        # max_tokens_per_step: the prefill chunk
DECODE = 16 * 10  # decode positions reserved per sequence beyond --length
VOCAB = 512


def gemma3_shaped(window: int, length: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=length + DECODE + STEP, query_pre_attn_scalar=64)
    return _seeded(Gemma3ForCausalLM(cfg))


def mistral_shaped(window: int, length: int):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=window, max_position_embeddings=length + 64)
    return _seeded(MistralForCausalLM(cfg))


def _seeded(model):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.float().eval()


KV_ROW_BYTES = 1 * 64 * 4 * 2  # a cell of one layer: KV heads x head_dim x fp32 x (K and V)


def kv_bytes(info) -> int:
    """Bytes of every layer's K and V buffers: each layer's pool's cells x
    KV_ROW_BYTES (the graph ops refuse buffers of any other length)."""
    return sum(info.pool_cells()) * KV_ROW_BYTES


def prefill(runner, seqs, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    last = {}
    for s in seqs:
        toks = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        for c in range(0, length, STEP):
            part = toks[c:c + STEP]
            out = runner.step([s] * len(part), part, list(range(c, c + len(part))),
                              [len(part) - 1])
        last[s] = int(out[0].argmax())
    return last


def rss_child(path: str, contexts: int, length: int) -> None:
    """Prints the resident bytes a program adds once loaded and prefilled."""
    from executorch_cellcache.runtime.runner import Runner

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    r = Runner(path)
    prefill(r, [r.cache.seq_new() for _ in range(contexts)], length)
    print(json.dumps({"rss_added": rss() - before}))


def memory_and_speed(args, tmp: Path) -> dict:
    from executorch_cellcache import export
    from executorch_cellcache.exporting.options import ExportOptions
    from executorch_cellcache.runtime.runner import Runner

    model = gemma3_shaped(args.window, args.length)
    cells = args.contexts * (args.length + DECODE)
    paths = {}
    for name, pools in (("one pool", None), ("pools", "auto")):
        opts = ExportOptions(n_cells=cells, max_tokens_per_step=STEP, window_cells=pools,
                             pool_sequences=args.contexts if pools else None)
        t0 = time.perf_counter()
        res = export(model, tmp / f"{name.replace(' ', '-')}.pte", opts)
        print(f"exported {name} in {time.perf_counter() - t0:.0f} s: pools "
              f"{res.info.window_cells or 'none'}", file=sys.stderr)
        paths[name] = res.path
    out = {"contexts": args.contexts, "length": args.length, "window": args.window}
    for name, path in paths.items():
        info = Runner(path).info
        child = subprocess.run([sys.executable, __file__, "--rss-child", str(path),
                                "--contexts", str(args.contexts), "--length", str(args.length)],
                               capture_output=True, text=True, check=True)
        out[name] = {"kv_bytes": kv_bytes(info), "layer_cells": info.pool_cells(),
                     "window_cells": info.window_cells,
                     "rss_added": json.loads(child.stdout.strip().splitlines()[-1])["rss_added"]}
    out["kv_ratio"] = out["pools"]["kv_bytes"] / out["one pool"]["kv_bytes"]
    out["rss_ratio"] = out["pools"]["rss_added"] / out["one pool"]["rss_added"]

    runners = {name: Runner(path) for name, path in paths.items()}
    state = {}
    for name, r in runners.items():
        seqs = [r.cache.seq_new() for _ in range(args.contexts)]
        state[name] = (seqs, prefill(r, seqs, args.length), args.length)
    times = {name: [] for name in runners}
    order = list(runners)
    for rnd in range(args.rounds):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            r = runners[name]
            seqs, nxt, pos = state[name]
            t0 = time.perf_counter()
            for _ in range(16):
                logits = r.step(seqs, [nxt[s] for s in seqs], [pos] * len(seqs),
                                list(range(len(seqs))))
                nxt = {s: int(row.argmax()) for s, row in zip(seqs, logits)}
                pos += 1
            times[name].append((time.perf_counter() - t0) / 16)
            # Roll back so every round decodes the same positions.
            for s in seqs:
                r.cache.seq_rm(s, args.length)
            state[name] = (seqs, state[name][1], args.length)
    ratios = [p / o for p, o in zip(times["pools"], times["one pool"])]
    out["step_ms"] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    out["step_ratio_median"] = statistics.median(ratios)
    out["step_ratios"] = ratios
    return out


def long_sequence(args, tmp: Path) -> dict:
    from executorch_cellcache import export
    from executorch_cellcache.cache import DEFAULT_RETAINED_MARGIN as R
    from executorch_cellcache.runtime.runner import Runner

    window, step = 64, 8
    model = mistral_shaped(window, args.long)
    pool = 2 * (window + R)
    pooled = export(model, tmp / "long-pools.pte", n_cells=pool, max_tokens_per_step=step,
                    window_cells={window: pool}).path
    single = export(model, tmp / "long-one.pte", n_cells=args.long + 16,
                    max_tokens_per_step=step).path
    tokens = {}
    seconds = {}
    for name, path in (("pools", pooled), ("one pool", single)):
        r = Runner(path)
        s = r.cache.seq_new()
        seq = [5, 9, 13, 17]
        logits = r.step([s] * 4, seq, list(range(4)), [3])
        t0 = time.perf_counter()
        while len(seq) < args.long:
            seq.append(int(logits[0].argmax()))
            logits = r.step([s], [seq[-1]], [len(seq) - 1], [0])
        seconds[name] = time.perf_counter() - t0
        tokens[name] = seq
        if name == "pools":
            reclaimed = r.cache.reclaimed(s, 0)[1]
            capacity = r.cache.pool(0).capacity
    return {"window": window, "retained_margin": R, "pool_cells": capacity,
            "tokens": args.long, "reclaimed": reclaimed,
            "same_tokens": tokens["pools"] == tokens["one pool"],
            "first_difference": next((i for i, (a, b) in enumerate(
                zip(tokens["pools"], tokens["one pool"])) if a != b), None),
            "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--skip", choices=("long", "memory"), action="append", default=[])
    ap.add_argument("--json")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.contexts, args.length)
        return 0
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "memory" not in args.skip:
            m = memory_and_speed(args, Path(tmp))
            result["gemma3_shaped"] = m
            print(f"Gemma3-shaped, {m['contexts']} x {m['length']} tokens, W={m['window']}:")
            for name in ("one pool", "pools"):
                print(f"  {name:8s} K/V {m[name]['kv_bytes'] / 2**20:8.1f} MiB   resident "
                      f"+{m[name]['rss_added'] / 2**20:8.1f} MiB   decode step "
                      f"{m['step_ms'][name]:.2f} ms   layer cells {m[name]['layer_cells']}")
            print(f"  pools / one pool: K/V {m['kv_ratio']:.3f}, resident {m['rss_ratio']:.3f}, "
                  f"decode step (paired median) {m['step_ratio_median']:.3f}")
        if "long" not in args.skip:
            long = long_sequence(args, Path(tmp))
            result["long"] = long
            print(f"Mistral-shaped (W={long['window']}, R={long['retained_margin']}): "
                  f"{long['tokens']} tokens from a windowed pool of {long['pool_cells']} cells "
                  f"(reclaimed {long['reclaimed']} positions); same tokens as one pool: "
                  f"{long['same_tokens']}; seconds {long['seconds']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
