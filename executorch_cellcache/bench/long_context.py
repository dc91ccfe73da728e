"""Long-context decode (SPEC section 8): aggregate decode tokens/s with B
sequences of L tokens each in the pool, on the cells attention path
(``cellcache::attend``) against the dense-mask reference path, for fp32 and
fp16 K/V; one sequence decoding among 7 others' cells against alone; and the
K/V dtypes side by side on the cells path (fp32, fp16, int8: B=1 and B=8, and
the cache bytes a cell takes over all layers).

The pools are filled by placing positions through the cache's step protocol
without running forwards: the cost of a decode step depends on which cells a
token reads, not on the K/V values in them, and 8 x 2048 real prefill tokens
on the reference path would take many minutes. Programs are exported per
(attention, kv_dtype) with room for 8 x L cells, run side by side, one step
each in turn (this machine's speed drifts), every step rolled back so each
sees the same cells.
"""

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from executorch_cellcache.bench.common import BenchSetup, bench_model
from executorch_cellcache.cache.errors import CapacityError

PATHS = ("cells", "reference")
BATCH = 8
# K/V dtypes of the cells-path rows; int8 runs on the cells path only.
KV_DTYPES = ("fp32", "fp16", "int8")


@dataclass
class LongSetup:
    length: int      # tokens per sequence already in the pool
    rounds: int      # timed steps per program and configuration
    chunk: int       # tokens per placement step (cells interleave in chunks)


LONG_FULL = LongSetup(length=2048, rounds=7, chunk=256)
LONG_QUICK = LongSetup(length=48, rounds=2, chunk=16)


def n_cells(long: LongSetup) -> int:
    return BATCH * long.length + 2 * BATCH  # the pool, plus the decode tokens


def export_long(setup: BenchSetup, long: LongSetup, attention: str, kv_dtype: str, say):
    from executorch_cellcache.exporting.exporter import export

    def build(path: Path) -> float:
        return export(bench_model(setup), path, n_cells=n_cells(long),
                      max_tokens_per_step=setup.prefill_len, attention=attention,
                      kv_dtype=kv_dtype,
                      progress=lambda line: say(f"  {line}")).seconds
    return build


def export_programs(setup: BenchSetup, long: LongSetup, programs, say) -> Dict[tuple, Path]:
    """(attention path, kv dtype) -> the long-context program, from the
    bench's program cache or exported: both paths for fp32 and fp16, the
    cells path for int8."""
    out = {}
    for kv_dtype in KV_DTYPES:
        for attention in PATHS if kv_dtype != "int8" else ("cells",):
            out[attention, kv_dtype], _ = programs.get(
                "long", setup, {"n_cells": n_cells(long), "max_tokens": setup.prefill_len,
                                "attention": attention, "kv_dtype": kv_dtype},
                export_long(setup, long, attention, kv_dtype, say))
    return out


def kv_bytes_per_cell(setup: BenchSetup, kv_dtype: str) -> int:
    """Bytes one cell takes in the K and V caches of every layer, scales
    included (the buffer layout of graph/attention.py's kv_cache_buffer)."""
    from executorch_cellcache.exporting.exporter import KV_TORCH_DTYPES
    from executorch_cellcache.graph.attention import kv_cache_buffer

    m = setup.model
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    row = kv_cache_buffer(1, m["num_key_value_heads"], head_dim, KV_TORCH_DTYPES[kv_dtype])
    return 2 * m["num_hidden_layers"] * row.numel() * row.element_size()


def _fill(runner, n_seq: int, long: LongSetup) -> List[int]:
    """n_seq sequences of long.length positions, placed in interleaved chunks
    on every layer (no forward runs, see the module docstring)."""
    cache = runner.cache
    cache.clear()
    seqs = [cache.seq_new() for _ in range(n_seq)]
    for start in range(0, long.length, long.chunk):
        n = min(long.chunk, long.length - start)
        for s in seqs:
            if not cache.declare_step([s] * n):
                raise CapacityError(f"the long-context pool of {cache.capacity} cells is full")
            for layer in range(cache.n_layers):
                cache.place_step(list(range(start, start + n)), layer)
    return seqs


def _alternate(runners, steps, rounds: int) -> List[float]:
    """Median seconds of steps[i] on runners[i], taking turns; each step's
    tokens are rolled back afterwards."""
    times = [[] for _ in runners]
    for r in range(rounds + 1):
        for i, (runner, seqs) in enumerate(zip(runners, steps, strict=True)):
            pos = [runner.cache.next_pos(s) for s in seqs]
            t0 = time.perf_counter()
            runner.step(seqs, [1] * len(seqs), pos, list(range(len(seqs))))
            if r:  # round 0 warms up
                times[i].append(time.perf_counter() - t0)
            for s in seqs:
                runner.rollback(s, 1)
    return [statistics.median(t) for t in times]


def measure(paths: Dict[str, Path], long: LongSetup, kv_dtype: str, say) -> Dict[str, float]:
    """paths: attention path -> its program (same kv_dtype). Returns figures
    keyed long_<path>[_fp16]_decode_tok_s_b{1,8} and
    long_<path>[_fp16]_one_among_7_step_s / _alone_step_s."""
    from executorch_cellcache.runtime.runner import Runner

    suffix = "" if kv_dtype == "fp32" else f"_{kv_dtype}"
    # Two runners per path (a program loaded twice has two caches): one pool
    # of 8 sequences, one of a sequence alone, so "one among 7" and "alone"
    # are timed in the same rounds.
    runners = [Runner(paths[p]) for p in PATHS]
    alone_runners = [Runner(paths[p]) for p in PATHS]
    f = {}
    say(f"long context ({kv_dtype} K/V): B=8 x {long.length} tokens, cells vs reference")
    seqs = [_fill(r, BATCH, long) for r in runners]
    b8 = _alternate(runners, seqs, long.rounds)
    say(f"long context ({kv_dtype} K/V): one sequence among 7 others' cells and alone")
    alone_seqs = [_fill(r, 1, long) for r in alone_runners]
    t = _alternate(runners + alone_runners, [s[:1] for s in seqs] + alone_seqs, long.rounds)
    one, alone = t[:len(PATHS)], t[len(PATHS):]
    for p, t8, t1, ta in zip(PATHS, b8, one, alone, strict=True):
        f[f"long_{p}{suffix}_decode_tok_s_b8"] = BATCH / t8
        f[f"long_{p}{suffix}_decode_tok_s_b1"] = 1 / ta
        f[f"long_{p}{suffix}_one_among_7_step_s"] = t1
        f[f"long_{p}{suffix}_alone_step_s"] = ta
    runners += alone_runners
    for r in runners:
        r.cache.clear()
    return f


def measure_kv_dtypes(paths: Dict[str, Path], setup: BenchSetup, long: LongSetup,
                      say) -> Dict[str, float]:
    """paths: kv dtype -> its cells-path program. The dtypes take turns step
    by step, first with 8 sequences of long.length tokens in each pool, then
    with one. Returns long_kv_<dtype>_decode_tok_s_b{1,8} and
    kv_bytes_per_cell_<dtype>."""
    from executorch_cellcache.runtime.runner import Runner

    dtypes = list(paths)
    runners = [Runner(paths[d]) for d in dtypes]
    f = {}
    for batch in (BATCH, 1):
        say(f"long context, cells path: {', '.join(dtypes)} K/V taking turns, B={batch} x "
            f"{long.length} tokens")
        seqs = [_fill(r, batch, long) for r in runners]
        for d, t in zip(dtypes, _alternate(runners, seqs, long.rounds), strict=True):
            f[f"long_kv_{d}_decode_tok_s_b{batch}"] = batch / t
    for r in runners:
        r.cache.clear()
    for d in dtypes:
        f[f"kv_bytes_per_cell_{d}"] = kv_bytes_per_cell(setup, d)
    return f


def short_rows(paths: Dict[str, Path], setup: BenchSetup, rounds: int, say) -> Dict[str, float]:
    """The main table's decode and prefill rows (B=1 and B=8 after a
    setup.prompt_len prompt, a setup.prefill_len prefill) on both attention
    paths, side by side: short contexts must not get slower on the cells path."""
    from executorch_cellcache.runtime.runner import Runner
    import numpy as np

    runners = [Runner(paths[p]) for p in PATHS]
    vocab = setup.model["vocab_size"]
    f = {}
    say(f"short contexts: B=1 and B=8 after {setup.prompt_len} tokens, cells vs reference")
    for batch in (1, BATCH):
        steps = []
        for r in runners:
            r.cache.clear()
            seqs = [r.cache.seq_new() for _ in range(batch)]
            rng = np.random.default_rng(1)
            for s in seqs:
                toks = rng.integers(0, vocab, setup.prompt_len).tolist()
                r.step([s] * len(toks), toks, list(range(len(toks))), [len(toks) - 1])
            steps.append(seqs)
        for p, t in zip(PATHS, _alternate(runners, steps, rounds), strict=True):
            f[f"short_{p}_decode_tok_s_b{batch}"] = batch / t
    tokens = np.random.default_rng(2).integers(0, vocab, setup.prefill_len).tolist()
    times = [[] for _ in runners]
    for r_i in range(rounds + 1):
        for i, r in enumerate(runners):
            r.cache.clear()
            s = r.cache.seq_new()
            t0 = time.perf_counter()
            r.step([s] * len(tokens), tokens, list(range(len(tokens))), [len(tokens) - 1])
            if r_i:
                times[i].append(time.perf_counter() - t0)
    for p, t in zip(PATHS, times, strict=True):
        f[f"short_{p}_prefill_tok_s"] = len(tokens) / statistics.median(t)
    for r in runners:
        r.cache.clear()
    return f


def ratios(f: Dict[str, float]) -> Dict[str, float]:
    return {
        "long_b8_cells_vs_reference": f["long_cells_decode_tok_s_b8"] /
        f["long_reference_decode_tok_s_b8"],
        "long_b1_cells_vs_reference": f["long_cells_decode_tok_s_b1"] /
        f["long_reference_decode_tok_s_b1"],
        "long_one_among_7_vs_alone": f["long_cells_one_among_7_step_s"] /
        f["long_cells_alone_step_s"],
        "long_b8_fp16_cells_vs_reference": f["long_cells_fp16_decode_tok_s_b8"] /
        f["long_reference_fp16_decode_tok_s_b8"],
        "long_b8_fp16_vs_fp32_cells": f["long_cells_fp16_decode_tok_s_b8"] /
        f["long_cells_decode_tok_s_b8"],
    }


def kv_dtype_ratios(f: Dict[str, float]) -> Dict[str, float]:
    return {
        "long_b8_int8_vs_fp16_cells": f["long_kv_int8_decode_tok_s_b8"] /
        f["long_kv_fp16_decode_tok_s_b8"],
        "long_b1_int8_vs_fp16_cells": f["long_kv_int8_decode_tok_s_b1"] /
        f["long_kv_fp16_decode_tok_s_b1"],
        "kv_bytes_int8_vs_fp16": f["kv_bytes_per_cell_int8"] / f["kv_bytes_per_cell_fp16"],
    }
