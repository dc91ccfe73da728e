#!/usr/bin/env python
"""The on-device engine's figures (cpp/apps/engine_bench.cpp) on a program.

    python scripts/bench_engine.py M.pte [--repeats 5] [--baseline-runner OLD_RUNNER]

Runs the cellcache_engine_bench executable that `pip install` builds
(build/python/cpp/apps/; --bench-binary to point elsewhere) and prints:

- multiturn: an 8-turn conversation through Engine (256-token system prompt,
  64-token messages, 128-token greedy replies; --reply to change): prefill
  tokens and time to first token per turn, and the last turn's time to first
  token against a cold prefill of the same history (medians of alternated
  repeats);
- staggered: 8 greedy requests of 128 tokens, one submitted every 2 steps, vs.
  the same 8 submitted at once (aggregate tokens/s, alternated repeats), and
  whether each request's tokens are the same either way;
- overhead: 8 prompts decoding at once, greedy and sampled (temperature 0.8);
  the engine's time outside the forward (planning, sampling, commit and
  sinks) as a share of the step time.
- with --baseline-runner (a cellcache_runner built from an earlier revision):
  decode tokens/s of 3 prompts x n=2 x 64 tokens, that runner vs. this one's
  cellcache_runner, alternated.

Measurements, not tests: nothing here asserts a speed.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(binary, model, scenario, *args):
    run = subprocess.run([str(binary), "--model", str(model), "--scenario", scenario,
                          *map(str, args)], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"bench_engine: {scenario}: {run.stderr.strip()}")
    out = run.stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def decode_rate(runner, model, prompts_file):
    err = subprocess.run([str(runner), "--model", str(model), "--prompts", str(prompts_file),
                          "--n", "2", "--max-new-tokens", "64", "--no-stop-on-eos"],
                         check=True, capture_output=True, text=True).stderr
    m = re.search(r"decode \d+ tokens at (\d+) tok/s", err)
    if m is None:
        sys.exit(f"bench_engine: no decode figure in {runner}'s output: {err!r}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a cell-cache .pte")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bench-binary", default=ROOT / "build/python/cpp/apps/cellcache_engine_bench")
    ap.add_argument("--runner", default=None, help="this revision's cellcache_runner "
                    "(default: `cellcache runner-path`)")
    ap.add_argument("--baseline-runner", default=None,
                    help="an earlier cellcache_runner to compare decode tokens/s with")
    ap.add_argument("--scenarios", default="multiturn,staggered,overhead")
    ap.add_argument("--reply", type=int, default=128, help="multiturn: tokens per reply")
    a = ap.parse_args()
    binary = Path(a.bench_binary)
    if not binary.exists():
        sys.exit(f"bench_engine: {binary} not found; build with scripts/install.sh or pass "
                 "--bench-binary")
    scenarios = a.scenarios.split(",")
    if "multiturn" in scenarios:
        rows = run_bench(binary, a.model, "multiturn", "--repeats", a.repeats, "--reply", a.reply)
        print("multiturn: turn  history  cached  prefilled  ttft_ms")
        for r in rows:
            if r.get("summary"):
                print(f"  last turn ({r['history']} tokens): warm ttft {1e3 * r['warm_ttft_median_s']:.1f} ms"
                      f" vs cold {1e3 * r['cold_ttft_median_s']:.1f} ms: {r['ratio']:.3f}x")
            else:
                print(f"  {r['turn']:>4} {r['history']:>8} {r['cached']:>7} {r['prefill_tokens']:>10}"
                      f" {1e3 * r['ttft_s']:>8.1f}")
    if "staggered" in scenarios:
        (r,) = run_bench(binary, a.model, "staggered", "--repeats", a.repeats)
        print(f"staggered: {r['requests']} requests, one every {r['every_steps']} steps: "
              f"{r['staggered_tok_s']:.0f} tok/s vs {r['at_once_tok_s']:.0f} all at once "
              f"({r['ratio']:.3f}x); same tokens: {r['same_tokens']}")
    for temperature in ([0, 0.8] if "overhead" in scenarios else []):
        rows = run_bench(binary, a.model, "overhead", "--repeats", a.repeats,
                         "--temperature", temperature)
        share = statistics.median(r["overhead_share"] for r in rows)
        step_us = statistics.median(1e6 * (r["forward_s"] + r["overhead_s"]) / r["steps"] for r in rows)
        parts = {k: statistics.median(1e6 * r[f"{k}_s"] / r["steps"] for r in rows)
                 for k in ("plan", "sample", "commit")}
        mode = "greedy" if temperature == 0 else f"temperature {temperature}"
        print(f"overhead ({mode}): batch {rows[0]['batch']}, {step_us:.0f} us a step, engine outside the "
              f"forward {100 * share:.2f}% (per step: plan {parts['plan']:.1f} us, sample "
              f"{parts['sample']:.1f} us, commit+sinks {parts['commit']:.1f} us); decode "
              f"{statistics.median(r['decode_tok_s'] for r in rows):.0f} tok/s")
    if a.baseline_runner:
        runner = a.runner or subprocess.run([sys.executable, "-m", "executorch_cellcache",
                                             "runner-path"], check=True, capture_output=True,
                                            text=True).stdout.strip()
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("0 340 344 454\n0 34 396 854\n0 1 2 3 4\n")
        new, old = [], []
        for _ in range(a.repeats):
            old.append(decode_rate(a.baseline_runner, a.model, f.name))
            new.append(decode_rate(runner, a.model, f.name))
        print(f"decode, 3 prompts x n=2 x 64 tokens: this runner {statistics.median(new):.0f} tok/s"
              f" vs baseline {statistics.median(old):.0f} ({statistics.median(new) / statistics.median(old):.3f}x;"
              f" runs {[round(x) for x in new]} vs {[round(x) for x in old]})")


if __name__ == "__main__":
    main()
