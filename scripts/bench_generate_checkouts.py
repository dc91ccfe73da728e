"""`cellcache generate` decode speed of this source tree against another one
(a measurement, not a test): did a change make generation slower?

Runs the same `cellcache generate` command from both trees (the other one as
PYTHONPATH=DIR, its _core built in place), alternating ours, baseline, ours,
... for --repeats rounds after one warm-up each (the machine's speed drifts:
neither tree gets all the quiet moments), reads the decode and prefill tokens/s
off each run's summary line, and prints medians and the ratio ours /
baseline (above 1: ours is faster).

  python scripts/bench_generate_checkouts.py --baseline-checkout /work/base \\
      --repeats 5 -- PROGRAM.pte --prompt "..." --n 2 --max-new-tokens 64
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

SUMMARY = re.compile(r"prefill (\d+) tokens at (\d+) tok/s, decode (\d+) tokens at (\d+) tok/s")


def run(env, args):
    cmd = [sys.executable, "-m", "executorch_cellcache", "generate", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    m = SUMMARY.search(r.stderr)
    if r.returncode or m is None:
        raise SystemExit(f"{subprocess.list2cmdline(cmd)} failed ({r.returncode}):\n"
                         f"{r.stderr[-2000:]}")
    return {"prefill_tok_s": int(m.group(2)), "decode_tokens": int(m.group(3)),
            "decode_tok_s": int(m.group(4)), "stdout": r.stdout}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-checkout", required=True, metavar="DIR",
                    help="the other source tree (its executorch_cellcache/ with _core built)")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds per tree")
    ap.add_argument("generate", nargs=argparse.REMAINDER,
                    help="-- then `cellcache generate`'s arguments")
    args = ap.parse_args()
    gen = args.generate[1:] if args.generate[:1] == ["--"] else args.generate
    if not gen:
        ap.error("give `cellcache generate`'s arguments after --")
    base = Path(args.baseline_checkout).resolve()
    if not (base / "executorch_cellcache").is_dir():
        ap.error(f"{base} holds no executorch_cellcache package")
    trees = {"ours": dict(os.environ), "baseline": {**os.environ, "PYTHONPATH": str(base)}}
    runs = {name: [] for name in trees}
    for name, env in trees.items():  # warm-up: page cache, CPU caches
        run(env, gen)
    for r in range(args.repeats):
        for name, env in trees.items():
            runs[name].append(run(env, gen))
            print(f"round {r + 1} {name:<8} decode {runs[name][-1]['decode_tok_s']} tok/s, "
                  f"prefill {runs[name][-1]['prefill_tok_s']} tok/s", flush=True)
    med = {n: {k: statistics.median(x[k] for x in runs[n])
               for k in ("decode_tok_s", "prefill_tok_s")} for n in runs}
    same = runs["ours"][0]["stdout"] == runs["baseline"][0]["stdout"]
    print(f"\nmedians over {args.repeats} rounds (generate {subprocess.list2cmdline(gen)}):")
    for k in ("decode_tok_s", "prefill_tok_s"):
        print(f"  {k:<14} ours {med['ours'][k]:.0f}  baseline {med['baseline'][k]:.0f}  "
              f"ratio {med['ours'][k] / med['baseline'][k]:.2f}x")
    print(f"  same output: {'yes' if same else 'no (sampled outputs may differ)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
