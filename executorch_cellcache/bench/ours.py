"""Our cell-cache program: export, decode at batch sizes, prefill, fork cells,
the cache ops' share of a step, and the used-extent comparison."""

import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

from executorch_cellcache.bench.common import BenchSetup, median_time, bench_model
from executorch_cellcache.cache.errors import CapacityError


def main_program(setup: BenchSetup, programs, say):
    """(path, export seconds) of the bench's main fp32 program (``setup.n_cells``
    cells, prefill-sized steps, the cells attention path), from ``programs``
    (a ProgramCache) or exported; every bench script shares this one key."""
    return programs.get("ours", setup, main_program_options(setup),
                        export_ours(setup, setup.n_cells, setup.prefill_len, say))


def main_program_options(setup: BenchSetup) -> dict:
    return {"n_cells": setup.n_cells, "max_tokens": setup.prefill_len, "attention": "cells"}


def export_ours(setup: BenchSetup, n_cells: int, max_tokens: int, say, **quantization):
    """``quantization``: export's quantize / group_size / embedding_quantize."""
    from executorch_cellcache.exporting.exporter import export

    def build(path: Path) -> float:
        return export(bench_model(setup), path, n_cells=n_cells, max_tokens_per_step=max_tokens,
                      progress=lambda line: say(f"  {line}"), **quantization).seconds
    return build


def _prefill(runner, seqs: List[int], prompt_len: int, vocab: int) -> None:
    """Prefills each sequence with prompt_len tokens, in chunks that fit a step."""
    rng = np.random.default_rng(1)
    chunk = runner.info.max_tokens_per_step
    for seq in seqs:
        tokens = rng.integers(0, vocab, prompt_len).tolist()
        for start in range(0, prompt_len, chunk):
            part = tokens[start:start + chunk]
            runner.step([seq] * len(part), part, list(range(start, start + len(part))),
                        [len(part) - 1])


def batch_steppers(runner, batches: List[int], setup: BenchSetup,
                   prompt_len: int) -> Dict[int, Callable[[], None]]:
    """One decode-step function per batch size b, for ``alternating_medians``:
    b sequences after a prompt_len-token prompt each, every batch's sequences
    in the runner's cache at once. A call decodes one token for each of its
    b sequences and rolls them back, so every call sees the same context."""
    runner.cache.clear()
    steppers = {}
    for b in batches:
        seqs = [runner.cache.seq_new() for _ in range(b)]
        _prefill(runner, seqs, prompt_len, setup.model["vocab_size"])

        def step(seqs=seqs, b=b):
            runner.step(seqs, [1] * b, [prompt_len] * b, list(range(b)))
            for s in seqs:
                runner.rollback(s, 1)
        steppers[b] = step
    return steppers


def decode_stepper(runner, setup: BenchSetup, prompt_len: int) -> Callable[[], None]:
    """A function doing one B=1 decode step after a prompt_len-token prompt;
    each call is rolled back, so every call sees the same context."""
    return batch_steppers(runner, [1], setup, prompt_len)[1]


def batch_medians(runner, batches: List[int], setup: BenchSetup, prompt_len: int, rounds: int,
                  together: bool = True) -> Dict[int, float]:
    """Median seconds of a decode step at each batch size (``batch_steppers``):
    the batch sizes taking turns step by step (``together``), or, for a
    program whose cache cannot hold every batch's prompts at once (a user's
    .pte, ``cellcache bench --model``), one batch size after another."""
    from executorch_cellcache.bench.common import alternating_medians

    if together:
        return alternating_medians(batch_steppers(runner, batches, setup, prompt_len), rounds)
    out = {}
    for b in batches:
        out.update(alternating_medians(batch_steppers(runner, [b], setup, prompt_len), rounds))
    return out


def prefiller(runner, setup: BenchSetup):
    """A function prefilling one prefill_len-token prompt into an empty cache:
    one step, or steps of the program's max_tokens_per_step when that is
    smaller (a user's .pte)."""
    tokens = np.random.default_rng(2).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()

    def run():
        runner.cache.clear()
        s = runner.cache.seq_new()
        chunk = runner.info.max_tokens_per_step
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            runner.step([s] * len(part), part, list(range(start, start + len(part))),
                        [len(part) - 1])
    return run


def same_extent_step_times(runners, setup: BenchSetup, used_cells: int, rounds: int = 21):
    """Median seconds of a one-token decode step with `used_cells` cells in use,
    for each runner. The runners take turns step by step (this machine's speed
    drifts over minutes) and each step is rolled back, so every step sees the
    same used cells."""
    seqs = []
    for runner in runners:
        runner.cache.clear()
        seqs.append(runner.cache.seq_new())
        _prefill(runner, seqs[-1:], used_cells - 1, setup.model["vocab_size"])
    times = [[] for _ in runners]
    for r in range(rounds + 1):
        for i, (runner, s) in enumerate(zip(runners, seqs, strict=True)):
            t0 = time.perf_counter()
            runner.step([s], [1], [used_cells - 1], [0])
            if r:  # round 0 warms up
                times[i].append(time.perf_counter() - t0)
            runner.rollback(s, 1)
    for runner in runners:
        runner.cache.clear()
    return [statistics.median(t) for t in times]


def fork_cells(runner, setup: BenchSetup) -> int:
    runner.cache.clear()
    prompt = np.random.default_rng(3).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()
    runner.generate([prompt], setup.fork_new_tokens, n=setup.fork_n, stop_on_eos=False)
    runner.cache.clear()
    return runner.last_stats.peak_cells


def _declare(cache, seq_ids) -> None:
    if not cache.declare_step(seq_ids):
        raise CapacityError(f"the benchmark's {len(seq_ids)}-token step does not fit in "
                            f"{cache.free_cells} free cells")


def cache_ops_seconds(runner, setup: BenchSetup, batch: int) -> float:
    """place (every layer) + the attention plan (every distinct window; on the
    reference path: the mask) for one decode step of `batch` sequences on a
    cache shaped like the runner's, through the binding (an upper bound: it
    includes the Python call overhead)."""
    from executorch_cellcache.cache import _core

    info = runner.info
    cache = info.new_cache()  # one pool per window policy for a pooled program
    seqs = [cache.seq_new() for _ in range(batch)]
    for s in seqs:
        _declare(cache, [s] * setup.prompt_len)
        for layer in range(info.n_layers):
            cache.place_step(np.arange(setup.prompt_len), layer)
    windows = {}
    for layer, w in enumerate(info.windows):
        windows.setdefault(w, layer)

    def step():
        pos = np.array([cache.next_pos(s) for s in seqs], dtype=np.int64)
        _declare(cache, seqs)
        extent = cache.planned_used_end
        for layer in range(info.n_layers):
            cells = _core.place_op(cache.handle, pos, layer)
            if windows.get(info.windows[layer]) == layer:
                if info.attention == "reference":
                    _core.mask_op(cache.handle, cells, layer, extent)
                else:
                    cache.attend_plan(layer)
    return median_time(step, max(5, setup.repeats * 5))
