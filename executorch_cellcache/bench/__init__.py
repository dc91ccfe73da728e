"""``cellcache bench``: the performance table of SPEC sections 5 and 7.

Side by side in one run, on one machine, with one model (a SmolLM-135M-shaped
Llama with seeded random weights; ``--quick``: a tiny one): our cell-cache
program, ExecuTorch's own LLM flow (``export_llm``: KV cache +
``llama::custom_sdpa``, XNNPACK; the stock anchor) at the same quantization,
the static-cache ExecuTorch export (transformers' recipe; second stock row, fp32 runs),
transformers eager and, given a build (``llama_cpp``), llama.cpp's
llama-batched-bench on the same weights in GGUF. ``quantize``: the table for
our quantized program vs export_llm at the same quantization (and our own fp32
program). Every figure is a median of repeats after a warm-up; programs
compared with each other take turns step by step (llama.cpp: run by run).
Exported programs are cached on disk, keyed by model config, options and
package version. ``run_model`` (``cellcache bench --model``): the rows that
apply to a user's own checkpoint or .pte (``user_model``).

Modules: ``common`` (setups, medians, the program cache), ``ours``,
``export_llm``, ``stock``, ``eager``, ``llama_cpp`` (one per system measured), ``prefix``
(the prefix cache), ``long_context`` (the cells attention path against the
dense-mask one with 8 x 2048-token contexts, and the K/V dtypes side by side) and ``table`` (targets, table,
JSON, plot). May import every layer below the CLI.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from executorch_cellcache.bench.common import (FULL, QUICK, BenchSetup, ProgramCache,
                                               alternating_medians, bench_model,
                                               bytes_read_per_token, memory_bandwidth,
                                               weight_bytes)
from executorch_cellcache.bench import llama_cpp as llama_cpp_bench
from executorch_cellcache.bench import long_context
from executorch_cellcache.bench.eager import eager_decode_step_time
from executorch_cellcache.bench.export_llm import (ExportLlmRunner, export_export_llm,
                                                   max_seq_length)
from executorch_cellcache.bench import ours as ours_bench
from executorch_cellcache.bench import stock as stock_bench
from executorch_cellcache.bench.prefix import chat_session_cells, prefix_ttft
from executorch_cellcache.bench.table import (LLAMA_CPP_RATIOS, QUANTIZED_TARGETS, TARGETS,
                                              BenchResult, plot, table, write_json)

__all__ = ["run", "run_model", "run_long_context", "program_cache", "table", "write_json", "plot", "FULL", "QUICK", "TARGETS",
           "QUANTIZED_TARGETS", "BenchResult", "Quantization"]


@dataclass(frozen=True)
class Quantization:
    quantize: Optional[str] = None
    group_size: int = 32
    embedding_quantize: Optional[str] = None

    def export_options(self) -> dict:
        return {"quantize": self.quantize, "group_size": self.group_size,
                "embedding_quantize": self.embedding_quantize}


@dataclass
class Programs:
    ours: Path
    ours_export: float
    ours_fp32: Path           # == ours when not quantized
    small: Optional[Path]     # the used-extent comparison's small cache (fp32 runs only)
    stock: Optional[Path]     # fp32 runs only: it is not quantized
    stock_export: float
    export_llm: Optional[Path]  # None in --quick (its export is too slow for the suite)
    export_llm_export: float
    # (attention path, kv dtype) -> the long-context program (fp32-weight runs only)
    long: Dict[Tuple[str, str], Path] = field(default_factory=dict)
    long_setup: Optional[long_context.LongSetup] = None


def export_programs(setup: BenchSetup, quant: Quantization, programs: ProgramCache,
                    with_export_llm: bool, say) -> Programs:
    """Every program the table needs, from the cache or exported."""
    max_tokens = setup.prefill_len
    fp32_opts = ours_bench.main_program_options(setup)
    ours_fp32, fp32_export = ours_bench.main_program(setup, programs, say)
    ours, ours_export = ours_fp32, fp32_export
    small = None
    quantized = bool(quant.quantize or quant.embedding_quantize)
    if quantized:
        ours, ours_export = programs.get(
            "ours", setup, {**fp32_opts, **quant.export_options()},
            ours_bench.export_ours(setup, setup.n_cells, max_tokens, say,
                                   **quant.export_options()))
    else:
        small, _ = programs.get(
            "ours", setup, {"n_cells": setup.small_cells, "max_tokens": setup.small_cells,
                            "attention": "cells"},
            ours_bench.export_ours(setup, setup.small_cells, setup.small_cells, say))
    stock, stock_export = None, float("nan")
    if not quantized:
        stock, stock_export = programs.get(
            "stock", setup, {"cache_len": setup.stock_cache_len, "max_seq": setup.prefill_len},
            stock_bench.export_stock(setup, say))
    export_llm, export_llm_export = None, float("nan")
    if with_export_llm:
        export_llm, export_llm_export = programs.get(
            "export_llm", setup, {"cache_len": setup.stock_cache_len,
                                  "max_seq": max_seq_length(setup),
                                  **quant.export_options()},
            export_export_llm(setup, quant.quantize, quant.group_size,
                              quant.embedding_quantize, say))
    out = Programs(ours, ours_export, ours_fp32, small, stock, stock_export, export_llm,
                   export_llm_export)
    if not quantized:
        out.long_setup = long_context.LONG_QUICK if setup is QUICK else long_context.LONG_FULL
        out.long = long_context.export_programs(setup, out.long_setup, programs, say)
    return out


def program_cache(cache_dir: Optional[Path], say) -> ProgramCache:
    """The on-disk cache of exported programs: ``cache_dir``, else
    $CELLCACHE_BENCH_CACHE, else ~/.cache/executorch-cellcache (its bench/)."""
    cache_dir = Path(cache_dir or os.environ.get("CELLCACHE_BENCH_CACHE",
                                                 Path.home() / ".cache" / "executorch-cellcache"))
    return ProgramCache(cache_dir / "bench", say)


def run(quick: bool = False, cache_dir: Optional[Path] = None,
        say: Callable[[str], None] = print,
        quant: Quantization = Quantization(),
        with_export_llm: Optional[bool] = None,
        llama_cpp: Optional[Path] = None) -> BenchResult:
    """``with_export_llm``: measure export_llm too (default: not in --quick).
    ``llama_cpp``: a llama.cpp build (its llama-batched-bench, or the build
    directory holding it) to measure alongside ours; when it is unusable or
    fails, one line says so, the rest runs and the table marks its rows missing."""
    setup = QUICK if quick else FULL
    with_export_llm = not quick if with_export_llm is None else with_export_llm
    quantized = bool(quant.quantize or quant.embedding_quantize)
    r = BenchResult(quantized=quantized)
    llama_binary = None
    if llama_cpp is not None:  # before any work: a bad path says so at once
        try:
            llama_binary = llama_cpp_bench.check_binary(llama_cpp)
            llama_cpp_bench.gguf_types(quant.quantize, quant.embedding_quantize)
        except (llama_cpp_bench.LlamaCppError, ImportError) as e:
            llama_binary = None
            _llama_cpp_missing(r, _llama_cpp_reason(e), say)
    cache = program_cache(cache_dir, say)
    p = export_programs(setup, quant, cache, with_export_llm, say)

    from executorch_cellcache.runtime.runner import Runner

    f = r.figures
    ours = Runner(p.ours)
    stock = stock_bench.StockRunner(p.stock) if p.stock else None
    export_llm = ExportLlmRunner(p.export_llm) if p.export_llm else None
    rounds = max(5, setup.decode_steps * setup.repeats)

    say("measuring B=1 decode, the programs taking turns step by step")
    steps = {"ours": ours_bench.decode_stepper(ours, setup, setup.prompt_len)}
    if stock:
        steps["stock"] = stock_bench.decode_stepper(stock, setup)
    if export_llm:
        steps["export_llm"] = stock_bench.decode_stepper(export_llm, setup)
    ours_fp32 = Runner(p.ours_fp32) if quantized else None
    if ours_fp32:
        steps["ours_fp32"] = ours_bench.decode_stepper(ours_fp32, setup, setup.prompt_len)
    for name, seconds in alternating_medians(steps, rounds).items():
        f[f"{name}_decode_tok_s_b1"] = 1 / seconds
    say("  " + ", ".join(f"{name} {f[f'{name}_decode_tok_s_b1']:.1f}" for name in steps) +
        " tok/s")
    say("measuring prefill, the programs taking turns")
    fills = {"ours": ours_bench.prefiller(ours, setup)}
    if stock:
        fills["stock"] = stock_bench.prefiller(stock, setup)
    if export_llm:
        fills["export_llm"] = stock_bench.prefiller(export_llm, setup)
    for name, seconds in alternating_medians(fills, max(3, setup.repeats)).items():
        f[f"{name}_prefill_tok_s"] = setup.prefill_len / seconds
    say("  " + ", ".join(f"{name} {f[f'{name}_prefill_tok_s']:.0f}" for name in fills) +
        " tok/s")

    say("measuring our decode at batch sizes " + ", ".join(map(str, setup.batch_sizes)) +
        ", the batch sizes taking turns step by step")
    batches = ours_bench.batch_steppers(ours, list(setup.batch_sizes), setup, setup.prompt_len)
    for b, seconds in alternating_medians(batches, rounds).items():
        f[f"ours_decode_tok_s_b{b}_batch"] = b / seconds
    ours.cache.clear()
    say("  " + ", ".join(f"B={b} {f[f'ours_decode_tok_s_b{b}_batch']:.1f}"
                         for b in setup.batch_sizes) + " tok/s")
    if llama_binary is not None:
        f.update(_llama_cpp_figures(r, llama_binary, ours, setup, quant, cache, say))
    say("measuring fork cells and cache-op share")
    f["ours_fork_peak_cells"] = ours_bench.fork_cells(ours, setup)
    f["independent_copies_cells"] = setup.fork_n * (setup.prefill_len + setup.fork_new_tokens)
    say(f"measuring the prefix cache ({setup.prefix_len}-token system prompt)")
    f.update(prefix_ttft(ours, setup))
    f.update(chat_session_cells(ours, setup))
    f["cache_ops_seconds_b8"] = ours_bench.cache_ops_seconds(ours, setup, 8)
    f["decode_step_seconds_b8"] = 8 / f["ours_decode_tok_s_b8_batch"]
    if p.small:
        say(f"measuring the used-extent effect ({setup.used_cells} used cells)")
        small = Runner(p.small)
        (f["decode_step_seconds_big_cache"],
         f["decode_step_seconds_small_cache"]) = ours_bench.same_extent_step_times(
            [ours, small], setup, setup.used_cells)

    say("measuring transformers eager and memory bandwidth")
    model = bench_model(setup)
    for b in (1, 8):
        f[f"eager_decode_tok_s_b{b}"] = b / eager_decode_step_time(model, b, setup)
    f["weight_bytes_fp32"] = weight_bytes(model)
    f["ours_pte_bytes"] = p.ours.stat().st_size
    f["ours_fp32_pte_bytes"] = p.ours_fp32.stat().st_size
    f["bandwidth_bytes_s"] = memory_bandwidth()
    # A decode step streams the program's weights once, but for the embedding table
    # when it is stored apart from lm_head (one row of it is read a token).
    f["ours_bytes_per_token"] = bytes_read_per_token(
        f["ours_pte_bytes"], setup, quant.quantize, quant.embedding_quantize)
    f["bandwidth_bound_tok_s"] = f["bandwidth_bytes_s"] / f["ours_bytes_per_token"]
    f["ours_export_seconds"] = p.ours_export
    if stock:
        f["stock_export_seconds"] = p.stock_export
    if export_llm:
        f["export_llm_pte_bytes"] = p.export_llm.stat().st_size
        f["export_llm_export_seconds"] = p.export_llm_export
    else:
        r.notes.append("export_llm rows skipped in --quick: its export takes minutes even "
                       "for the tiny model")
    if export_llm:
        r.notes.append("export_llm runs its own Llama definition with its own random weights "
                       "(params.json from the bench model's config; untied lm_head): same "
                       "shapes, so the same speed")
        r.notes.append(f"K/V storage: ours {ours.info.kv_dtype} (export's default for these "
                       f"weights), export_llm fp32 (its default)")
    if quantized:
        r.notes.append("used-extent row: measured by the fp32 run (a cache property); "
                       "static-cache rows: fp32 run only (that recipe is not quantized); "
                       "long-context rows: fp32 weights run only")
    if p.long:
        f.update(_long_context_figures(setup, p.long, p.long_setup, say))
    r.ratios = _ratios(f, quantized)
    return r


def run_model(model: str, quick: bool = False, cache_dir: Optional[Path] = None,
              say: Callable[[str], None] = print, quant: Quantization = Quantization(),
              llama_cpp: Optional[Path] = None) -> BenchResult:
    """``cellcache bench --model``: decode tok/s at B=1 and B=8 after 128-token
    prompts and the prefill of a 512-token prompt (``quick``: 16 and 32) on our
    program of ``model`` (a checkpoint folder, a .gguf, a packaged model name:
    exported once at ``quant`` and cached; or a cell-cache .pte, measured as it
    is), as ``run`` measures them; ``llama_cpp``: llama.cpp on the same weights
    (user_model says which file), taking turns with ours. Bad input raises
    before any work: FileNotFoundError / ValueError / InvalidConfigError, one
    line each."""
    from dataclasses import replace

    from executorch_cellcache.bench import user_model
    from executorch_cellcache.runtime.runner import Runner

    sizes = user_model.QUICK_SIZES if quick else user_model.FULL_SIZES
    m = user_model.resolve(model)
    quantized = bool(quant.quantize or quant.embedding_quantize)
    runner = None
    if m.kind == "pte":
        if quantized:
            raise ValueError(f"{m.path} is measured as it was exported; --quantize and "
                             f"--embedding-quantize choose how a checkpoint is exported: "
                             f"leave them out")
        runner = Runner(m.path)  # InvalidConfigError: not a (loadable) cell-cache program
        user_model.check_program(runner, sizes)
        quantized = bool(runner.info.quantize or runner.info.embedding_quantize)
    if llama_cpp is not None:
        user_model.llama_cpp_refusal(m)
    r = BenchResult(quantized=quantized)
    llama_binary = None
    if llama_cpp is not None:  # before any work: a bad path says so at once
        try:
            llama_binary = llama_cpp_bench.check_binary(llama_cpp)
            if m.kind == "checkpoint":  # written to GGUF at our quantization
                llama_cpp_bench.gguf_types(quant.quantize, quant.embedding_quantize)
        except (llama_cpp_bench.LlamaCppError, ImportError) as e:
            llama_binary = None
            _llama_cpp_missing(r, _llama_cpp_reason(e), say)
    cache = program_cache(cache_dir, say)
    f = r.figures
    if runner is None:
        pte, f["ours_export_seconds"] = user_model.export_program(m, sizes, quant, cache, say)
        runner = Runner(pte)
    together = user_model.check_program(runner, sizes)
    info = runner.info
    setup = replace(sizes, model={"vocab_size": info.vocab_size})
    rounds = max(5, setup.decode_steps * setup.repeats)

    say(f"measuring decode at B={'/'.join(map(str, setup.batch_sizes))} after "
        f"{setup.prompt_len}-token prompts, the batch sizes taking turns step by step"
        + ("" if together else " (one after another: the program's cells hold one batch)"))
    for b, seconds in ours_bench.batch_medians(runner, setup.batch_sizes, setup,
                                               setup.prompt_len, rounds, together).items():
        f[f"ours_decode_tok_s_b{b}_batch"] = b / seconds
    say("  " + ", ".join(f"B={b} {f[f'ours_decode_tok_s_b{b}_batch']:.1f}"
                         for b in setup.batch_sizes) + " tok/s")
    say(f"measuring the prefill of a {setup.prefill_len}-token prompt")
    seconds = alternating_medians({"ours": ours_bench.prefiller(runner, setup)},
                                  max(3, setup.repeats))["ours"]
    f["ours_prefill_tok_s"] = setup.prefill_len / seconds
    runner.cache.clear()
    say(f"  {f['ours_prefill_tok_s']:.0f} tok/s")
    if llama_binary is not None:
        f.update(_llama_cpp_figures(r, llama_binary, runner, setup, quant, cache, say,
                                    gguf=user_model.gguf_source(m, sizes, quant, cache),
                                    together=together))
    f["ours_pte_bytes"] = runner.path.stat().st_size
    weights = info.quantize or "fp32"
    if info.embedding_quantize:
        weights += f", embedding {info.embedding_quantize}"
    r.notes.append(f"model: {m.given} ({m.path}): {info.model_type}, {info.n_layers} layers, "
                   f"vocab {info.vocab_size}; ours: {runner.path}, weights {weights}, "
                   f"{info.n_cells} cells, {info.kv_dtype} K/V, {info.max_tokens_per_step}-token "
                   f"steps")
    if not together:
        r.notes.append(f"the program's {info.n_cells} cells hold one batch size's prompts at a "
                       f"time: B=1 and B=8 measured one after another, not taking turns")
    r.notes.append(user_model.SKIPPED)
    r.ratios = {"b8_over_b1": f["ours_decode_tok_s_b8_batch"] / f["ours_decode_tok_s_b1_batch"],
                **_llama_cpp_ratios(f)}
    return r


def _llama_cpp_reason(e: Exception) -> str:
    if isinstance(e, ImportError):
        return (f"{e.name or 'gguf'} is not installed, and executorch-cellcache needs it: "
                f"reinstall the package (scripts/install.sh)")
    return str(e)


def _llama_cpp_missing(r: BenchResult, reason: str, say) -> None:
    say(f"llama.cpp rows missing: {reason}")
    r.missing.update({k: reason for k in LLAMA_CPP_RATIOS})
    r.notes.append(f"llama.cpp rows missing: {reason}")


def _bench_model_gguf(setup: BenchSetup, quant: Quantization,
                      programs: ProgramCache) -> Tuple[Path, str]:
    """The bench model's weights in GGUF (cached in ``programs``), and what they
    are, for the note."""
    def build(path: Path) -> float:
        import time

        t0 = time.perf_counter()
        llama_cpp_bench.write_gguf(bench_model(setup), path, quant.quantize,
                                   quant.embedding_quantize)
        return time.perf_counter() - t0
    path, _ = programs.get("llama_cpp_gguf", setup, llama_cpp_bench.gguf_options(
        quant.quantize, quant.embedding_quantize), build, suffix=".gguf")
    types = "/".join(t.name for t in llama_cpp_bench.gguf_types(quant.quantize,
                                                                 quant.embedding_quantize))
    return path, f"the bench model's own weights in GGUF (linear/embedding {types}; norms F32)"


def _llama_cpp_figures(r: BenchResult, binary: Path, ours, setup: BenchSetup,
                       quant: Quantization, programs: ProgramCache, say,
                       gguf: Optional[Callable[[], Tuple[Path, str]]] = None,
                       together: bool = True) -> Dict[str, float]:
    """llama.cpp's decode (B=1, B=8 after ``setup.prompt_len``-token prompts) and
    prefill (``setup.prefill_len`` tokens) on the same weights in GGUF, ours
    measured the same way in the same rounds, the two taking turns round by
    round; {} (and the rows marked missing) when llama.cpp fails. ``gguf``: a
    function giving (the GGUF file llama.cpp runs, what it is for the note);
    default: the bench model's weights written to GGUF. ``together``: our batch
    sizes take turns step by step (else one after another: see
    ours.batch_medians)."""
    from executorch_cellcache.runtime.threads import thread_pool_size

    batches = llama_cpp_bench.decode_batches(setup.batch_sizes)
    gen_len = 2 * setup.decode_steps
    rounds = max(5, setup.repeats)
    threads = thread_pool_size()

    def ours_round() -> Dict[str, float]:
        out = {f"decode_tok_s_b{b}": b / seconds for b, seconds in ours_bench.batch_medians(
            ours, batches, setup, setup.prompt_len, gen_len, together).items()}
        fill = ours_bench.prefiller(ours, setup)  # empties the cache first
        out["prefill_tok_s"] = setup.prefill_len / alternating_medians({"p": fill}, 1)["p"]
        ours.cache.clear()
        return out

    try:
        gguf_path, what = gguf() if gguf else _bench_model_gguf(setup, quant, programs)
        say(f"measuring llama.cpp ({binary}, {threads} threads): B="
            + "/".join(map(str, batches)) + f" decode after {setup.prompt_len}-token prompts "
            f"and {setup.prefill_len}-token prefill, taking turns with ours, {rounds} rounds")
        f = llama_cpp_bench.measure(binary, gguf_path, ours_round, setup.prompt_len,
                                    setup.prefill_len, gen_len, batches, threads, rounds, say)
    except (llama_cpp_bench.LlamaCppError, ImportError, OSError) as e:
        ours.cache.clear()
        _llama_cpp_missing(r, f"writing the GGUF: {e}" if isinstance(e, OSError)
                           else _llama_cpp_reason(e), say)
        return {}
    f["llama_cpp_gguf_bytes"] = gguf_path.stat().st_size
    f["llama_cpp_threads"] = threads
    r.notes.append(
        f"llama.cpp: llama-batched-bench on {what}, its defaults otherwise (f16 K/V, flash "
        f"attention auto), {threads} threads like ours; after a warm-up round, each of {rounds} "
        f"rounds runs ours "
        f"(ours_alongside_llama_cpp_*: {gen_len} steps per batch size, one prefill) then "
        f"llama.cpp ({gen_len} decode steps, one prefill); medians; *_vs_llama_cpp ratios "
        f"use these paired figures")
    if gguf is None and quant.quantize == "8da4w" and quant.group_size != 32:
        r.notes.append(f"llama.cpp's Q4_0 has groups of 32 weights; ours {quant.group_size}")
    return f


def _llama_cpp_ratios(f) -> Dict[str, float]:
    return {key: f[ours] / f[theirs] for key, (ours, theirs) in LLAMA_CPP_RATIOS.items()
            if ours in f and theirs in f}


def _long_context_figures(setup: BenchSetup, programs, long, say) -> Dict[str, float]:
    f = {}
    for kv_dtype in ("fp32", "fp16"):
        f.update(long_context.measure({a: programs[a, kv_dtype] for a in long_context.PATHS},
                                      long, kv_dtype, say))
    f.update(long_context.measure_kv_dtypes(
        {d: programs["cells", d] for d in long_context.KV_DTYPES}, setup, long, say))
    return f


def run_long_context(quick: bool = False, cache_dir: Optional[Path] = None,
                     say: Callable[[str], None] = print) -> BenchResult:
    """Only the long-context rows of the fp32 table (``cellcache bench
    --long-context``): cells vs dense-mask paths for fp32 and fp16 K/V, one
    sequence among 7 against alone, and fp32 / fp16 / int8 K/V side by side
    on the cells path with their bytes per cell."""
    setup = QUICK if quick else FULL
    long = long_context.LONG_QUICK if quick else long_context.LONG_FULL
    programs = long_context.export_programs(setup, long, program_cache(cache_dir, say), say)
    r = BenchResult()
    r.figures = _long_context_figures(setup, programs, long, say)
    r.ratios = {**long_context.ratios(r.figures), **long_context.kv_dtype_ratios(r.figures)}
    return r


def _ratios(f, quantized: bool):
    b1, b8 = f["ours_decode_tok_s_b1"], f["ours_decode_tok_s_b8_batch"]
    ratios = {}
    if "export_llm_decode_tok_s_b1" in f:
        ratios["b1_vs_export_llm"] = b1 / f["export_llm_decode_tok_s_b1"]
        ratios["prefill_vs_export_llm"] = f["ours_prefill_tok_s"] / f["export_llm_prefill_tok_s"]
        ratios["b8_vs_export_llm_b1"] = b8 / f["export_llm_decode_tok_s_b1"]
        ratios["export_time_vs_export_llm"] = \
            f["ours_export_seconds"] / f["export_llm_export_seconds"]
    ratios.update(_llama_cpp_ratios(f))
    if "stock_decode_tok_s_b1" in f:
        ratios["b1_vs_stock"] = b1 / f["stock_decode_tok_s_b1"]
        ratios["prefill_vs_stock"] = f["ours_prefill_tok_s"] / f["stock_prefill_tok_s"]
    ratios["b8_over_b1"] = b8 / f["ours_decode_tok_s_b1_batch"]
    if quantized:
        ratios["b1_vs_ours_fp32"] = b1 / f["ours_fp32_decode_tok_s_b1"]
        ratios["pte_vs_ours_fp32"] = f["ours_pte_bytes"] / f["ours_fp32_pte_bytes"]
    ratios["fork_cells_ratio"] = f["ours_fork_peak_cells"] / f["independent_copies_cells"]
    ratios["prefix_ttft_ratio"] = f["prefix_ttft_cached_seconds"] / f["prefix_ttft_cold_seconds"]
    ratios["chat_cells_ratio"] = f["chat_sessions_cells"] / f["chat_sessions_private_cells"]
    ratios["cache_ops_share"] = f["cache_ops_seconds_b8"] / f["decode_step_seconds_b8"]
    if "decode_step_seconds_big_cache" in f:
        ratios["used_extent_ratio"] = f["decode_step_seconds_big_cache"] / \
            f["decode_step_seconds_small_cache"]
    ratios["b1_bandwidth_fraction"] = b1 / f["bandwidth_bound_tok_s"]
    if "stock_export_seconds" in f:
        ratios["export_time_vs_stock"] = f["ours_export_seconds"] / f["stock_export_seconds"]
    if "long_cells_decode_tok_s_b8" in f:
        ratios.update(long_context.ratios(f))
        ratios.update(long_context.kv_dtype_ratios(f))
    return ratios
