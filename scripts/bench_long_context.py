#!/usr/bin/env python
"""Only the long-context rows of `cellcache bench` (bench/long_context.py):
8 x 2048-token contexts on the cells attention path against the dense-mask
path, fp32 and fp16 K/V, with the bench's model and program cache (so a
later `cellcache bench` reuses these exports).

    python scripts/bench_long_context.py [--quick] [--kv-dtype fp32 fp16] [--short]
                                         [--cache-dir DIR]

--short also measures the main table's decode (B=1, B=8 after a 128-token
prompt) and prefill (256 tokens) rows on both paths with the fp32 programs:
the cells path must not make short contexts slower.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executorch_cellcache.bench import long_context  # noqa: E402
from executorch_cellcache.bench.common import FULL, QUICK, ProgramCache  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kv-dtype", nargs="+", choices=("fp32", "fp16"), default=["fp32", "fp16"])
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--cache-dir", default=os.environ.get(
        "CELLCACHE_BENCH_CACHE", Path.home() / ".cache" / "executorch-cellcache"))
    args = ap.parse_args()
    setup, long = (QUICK, long_context.LONG_QUICK) if args.quick else \
        (FULL, long_context.LONG_FULL)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    programs = ProgramCache(Path(args.cache_dir) / "bench", say)
    for kv_dtype in args.kv_dtype:
        paths = {}
        for attention in long_context.PATHS:
            paths[attention], seconds = programs.get(
                "long", setup, {"n_cells": long_context.n_cells(long),
                                "max_tokens": setup.prefill_len, "attention": attention,
                                "kv_dtype": kv_dtype},
                long_context.export_long(setup, long, attention, kv_dtype, say))
            say(f"{attention} {kv_dtype}: export {seconds:.0f} s")
        figures = long_context.measure(paths, long, kv_dtype, say)
        for key, value in figures.items():
            print(f"{key:42s} {value:12.4g}", flush=True)
        suffix = "" if kv_dtype == "fp32" else f"_{kv_dtype}"
        c, r = f"long_cells{suffix}", f"long_reference{suffix}"
        print(f"B=8 cells / reference        {figures[c + '_decode_tok_s_b8'] / figures[r + '_decode_tok_s_b8']:.2f}x")
        print(f"B=1 cells / reference        {figures[c + '_decode_tok_s_b1'] / figures[r + '_decode_tok_s_b1']:.2f}x")
        print(f"one among 7 / alone (cells)  {figures[c + '_one_among_7_step_s'] / figures[c + '_alone_step_s']:.2f}")
        print(f"one among 7 / alone (ref.)   {figures[r + '_one_among_7_step_s'] / figures[r + '_alone_step_s']:.2f}", flush=True)
        if args.short and kv_dtype == "fp32":
            short = long_context.short_rows(paths, setup, long.rounds, say)
            for key, value in short.items():
                print(f"{key:42s} {value:12.4g}", flush=True)
            for row in ("decode_tok_s_b1", "decode_tok_s_b8", "prefill_tok_s"):
                print(f"short {row}: cells / reference "
                      f"{short['short_cells_' + row] / short['short_reference_' + row]:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
