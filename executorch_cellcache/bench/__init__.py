"""``cellcache bench``: the performance table of SPEC section 5.

Side by side in one run, on one machine, with one model (a SmolLM-135M-shaped
Llama in fp32 with seeded random weights; ``--quick``: a tiny one):
our cell-cache program, the stock ExecuTorch export (transformers'
static-cache wrapper lowered with XNNPACK) and transformers eager. Every
figure is a median of repeats after a warm-up. Exported programs are cached on
disk, keyed by model config, options and package version.

Modules: ``common`` (setups, medians, the program cache), ``ours``, ``stock``,
``eager`` (one per system measured), ``prefix`` (the prefix cache),
``long_context`` (the cells attention path against the dense-mask one with
8 x 2048-token contexts) and ``table`` (targets, table, JSON, plot).
May import every layer below the CLI.
"""

import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from executorch_cellcache.bench.common import (FULL, QUICK, ProgramCache, median_time, bench_model,
                                               memory_bandwidth, weight_bytes)
from executorch_cellcache.bench import long_context
from executorch_cellcache.bench.eager import eager_decode_step_time
from executorch_cellcache.bench.ours import (cache_ops_seconds, decode_step_time, export_ours,
                                             fork_cells, prefill_time, same_extent_step_times)
from executorch_cellcache.bench.prefix import chat_session_cells, prefix_ttft
from executorch_cellcache.bench.stock import StockRunner, export_stock
from executorch_cellcache.bench.table import TARGETS, BenchResult, plot, table, write_json

__all__ = ["run", "table", "write_json", "plot", "FULL", "QUICK", "TARGETS", "BenchResult"]


def run(quick: bool = False, cache_dir: Optional[Path] = None,
        say: Callable[[str], None] = print) -> BenchResult:
    setup = QUICK if quick else FULL
    cache_dir = Path(cache_dir or os.environ.get("CELLCACHE_BENCH_CACHE",
                                                 Path.home() / ".cache" / "executorch-cellcache"))
    programs = ProgramCache(cache_dir / "bench", say)
    max_tokens = setup.prefill_len
    ours_path, ours_export = programs.get(
        "ours", setup, {"n_cells": setup.n_cells, "max_tokens": max_tokens, "attention": "cells"},
        export_ours(setup, setup.n_cells, max_tokens, say))
    small_path, _ = programs.get(
        "ours", setup, {"n_cells": setup.small_cells, "max_tokens": setup.small_cells,
                        "attention": "cells"},
        export_ours(setup, setup.small_cells, setup.small_cells, say))
    long = long_context.LONG_QUICK if quick else long_context.LONG_FULL
    long_paths = {}
    for kv_dtype in ("fp32", "fp16"):
        for attention in long_context.PATHS:
            long_paths[attention, kv_dtype], _ = programs.get(
                "long", setup, {"n_cells": long_context.n_cells(long),
                                "max_tokens": setup.prefill_len, "attention": attention,
                                "kv_dtype": kv_dtype},
                long_context.export_long(setup, long, attention, kv_dtype, say))
    stock_path, stock_export = programs.get(
        "stock", setup, {"cache_len": setup.stock_cache_len, "max_seq": setup.prefill_len},
        export_stock(setup, say))

    from executorch_cellcache.runtime.runner import Runner

    r = BenchResult()
    f = r.figures
    ours = Runner(ours_path)
    say("measuring our decode at batch sizes " + ", ".join(map(str, setup.batch_sizes)))
    for b in setup.batch_sizes:
        f[f"ours_decode_tok_s_b{b}"] = b / decode_step_time(ours, b, setup, setup.prompt_len)
    say("measuring prefill, fork cells and cache-op share")
    f["ours_prefill_tok_s"] = setup.prefill_len / prefill_time(ours, setup)
    f["ours_fork_peak_cells"] = fork_cells(ours, setup)
    f["independent_copies_cells"] = setup.fork_n * (setup.prefill_len + setup.fork_new_tokens)
    say(f"measuring the prefix cache ({setup.prefix_len}-token system prompt)")
    f.update(prefix_ttft(ours, setup))
    f.update(chat_session_cells(ours, setup))
    step_b8 = 8 / f["ours_decode_tok_s_b8"]
    f["cache_ops_seconds_b8"] = cache_ops_seconds(ours, setup, 8)
    f["decode_step_seconds_b8"] = step_b8

    say(f"measuring the used-extent effect ({setup.used_cells} used cells)")
    small = Runner(small_path)
    (f["decode_step_seconds_big_cache"],
     f["decode_step_seconds_small_cache"]) = same_extent_step_times([ours, small], setup,
                                                                     setup.used_cells)

    say("measuring the stock ExecuTorch program")
    stock = StockRunner(stock_path)
    prompt = np.random.default_rng(5).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()
    f["stock_prefill_tok_s"] = setup.prefill_len / median_time(
        lambda: stock.forward(prompt, 0), setup.repeats)
    stock.forward(prompt[:setup.prompt_len], 0)

    def stock_decode():
        for i in range(setup.decode_steps):
            stock.forward([1], setup.prompt_len + i)
    f["stock_decode_tok_s_b1"] = setup.decode_steps / median_time(stock_decode, setup.repeats)

    say("measuring transformers eager and memory bandwidth")
    model = bench_model(setup)
    for b in (1, 8):
        f[f"eager_decode_tok_s_b{b}"] = b / eager_decode_step_time(model, b, setup)
    f["weight_bytes"] = weight_bytes(model)
    f["bandwidth_bytes_s"] = memory_bandwidth()
    f["bandwidth_bound_tok_s"] = f["bandwidth_bytes_s"] / f["weight_bytes"]
    f["ours_export_seconds"] = ours_export
    f["stock_export_seconds"] = stock_export

    for kv_dtype in ("fp32", "fp16"):
        f.update(long_context.measure({a: long_paths[a, kv_dtype] for a in long_context.PATHS},
                                      long, kv_dtype, say))

    r.ratios = {
        "b1_vs_stock": f["ours_decode_tok_s_b1"] / f["stock_decode_tok_s_b1"],
        "b8_over_b1": f["ours_decode_tok_s_b8"] / f["ours_decode_tok_s_b1"],
        "prefill_vs_stock": f["ours_prefill_tok_s"] / f["stock_prefill_tok_s"],
        "fork_cells_ratio": f["ours_fork_peak_cells"] / f["independent_copies_cells"],
        "prefix_ttft_ratio": f["prefix_ttft_cached_seconds"] / f["prefix_ttft_cold_seconds"],
        "chat_cells_ratio": f["chat_sessions_cells"] / f["chat_sessions_private_cells"],
        "cache_ops_share": f["cache_ops_seconds_b8"] / f["decode_step_seconds_b8"],
        "used_extent_ratio": f["decode_step_seconds_big_cache"] /
        f["decode_step_seconds_small_cache"],
        "b1_bandwidth_fraction": f["ours_decode_tok_s_b1"] / f["bandwidth_bound_tok_s"],
        "export_time_vs_stock": ours_export / stock_export,
        **long_context.ratios(f),
    }
    return r
