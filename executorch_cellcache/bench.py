"""``cellcache bench``: the performance table of SPEC section 5.

Side by side in one run, on one machine, with one model (a SmolLM-135M-shaped
Llama in fp32 with seeded random weights; ``--quick``: a tiny one):
our cell-cache program, the stock ExecuTorch export (transformers'
static-cache wrapper lowered with XNNPACK) and transformers eager. Every
figure is a median of repeats after a warm-up. Exported programs are cached on
disk, keyed by model config, options and package version.
"""

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from executorch_cellcache.errors import CapacityError

PACKAGE_VERSION = "0.1.0"


@dataclass
class BenchSetup:
    model: Dict[str, int]      # LlamaConfig fields
    prompt_len: int            # decode benchmarks start after this prompt
    prefill_len: int           # the prefill benchmark's prompt
    fork_n: int
    fork_new_tokens: int
    n_cells: int
    small_cells: int           # the used-extent comparison's small cache
    used_cells: int            # cells in use for that comparison
    stock_cache_len: int
    batch_sizes: List[int]
    decode_steps: int
    repeats: int


FULL = BenchSetup(
    model=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, tie_word_embeddings=True),
    prompt_len=128, prefill_len=256, fork_n=8, fork_new_tokens=32, n_cells=4096,
    small_cells=128, used_cells=128, stock_cache_len=512, batch_sizes=[1, 2, 4, 8],
    decode_steps=8, repeats=3)

QUICK = BenchSetup(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=1024, tie_word_embeddings=True),
    prompt_len=16, prefill_len=32, fork_n=4, fork_new_tokens=8, n_cells=512,
    small_cells=32, used_cells=32, stock_cache_len=64, batch_sizes=[1, 2, 4, 8],
    decode_steps=4, repeats=1)

TARGETS = {  # key: (comparison, target, description)
    "b1_vs_stock": (">=", 1.2, "B=1 decode tok/s, ours / stock ExecuTorch"),
    "b8_over_b1": (">=", 6.0, "aggregate decode tok/s, B=8 / B=1"),
    "prefill_vs_stock": (">=", 1.5, "prefill tok/s, ours / stock"),
    "fork_cells_ratio": ("<=", 0.25, "peak cells of n samples / n independent copies"),
    "cache_ops_share": ("<", 0.02, "place+mask share of a B=8 decode step"),
    "used_extent_ratio": ("<=", 1.2, "decode step, small used extent: big / small cache"),
    "b1_bandwidth_fraction": ("", None, "B=1 decode / memory-bandwidth bound"),
    "export_time_vs_stock": ("<=", 1.0, "export seconds, ours / stock"),
}


def _median_time(fn: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(setup: BenchSetup):
    from transformers import LlamaConfig, LlamaForCausalLM

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM(LlamaConfig(**setup.model)).eval()
    finally:
        torch.random.set_rng_state(state)
    return model


def _weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class ProgramCache:
    """Exported programs on disk: <dir>/<key>.pte plus <key>.json (export seconds)."""

    def __init__(self, directory: Path, say):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.say = say

    def get(self, kind: str, setup: BenchSetup, options: dict,
            build: Callable[[Path], float]):
        key_src = json.dumps([kind, setup.model, options, PACKAGE_VERSION, torch.__version__],
                             sort_keys=True)
        key = f"{kind}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
        pte, meta = self.dir / f"{key}.pte", self.dir / f"{key}.json"
        if pte.exists() and meta.exists():
            self.say(f"using cached {kind} program {pte}")
            return pte, json.loads(meta.read_text())["export_seconds"]
        self.say(f"exporting {kind} program ({options}); cached afterwards in {self.dir}")
        seconds = build(pte)
        meta.write_text(json.dumps({"export_seconds": seconds, "options": options}))
        return pte, seconds


# ---------------------------------------------------------------- ours

def _export_ours(setup: BenchSetup, n_cells: int, max_tokens: int, say):
    from executorch_cellcache.exporter import export

    def build(path: Path) -> float:
        return export(_model(setup), path, n_cells=n_cells, max_tokens_per_step=max_tokens,
                      progress=lambda line: say(f"  {line}")).seconds
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


def _decode_step_time(runner, batch: int, setup: BenchSetup, prompt_len: int) -> float:
    """Median seconds of one decode step of `batch` sequences after a prompt."""
    cache = runner.cache
    cache.clear()
    seqs = [cache.seq_new() for _ in range(batch)]
    _prefill(runner, seqs, prompt_len, setup.model["vocab_size"])

    def steps():
        for _ in range(setup.decode_steps):
            runner.step(seqs, [1] * batch, [cache.next_pos(s) for s in seqs],
                        list(range(batch)))
    total = _median_time(steps, setup.repeats)
    cache.clear()
    return total / setup.decode_steps


def _same_extent_step_times(runners, setup: BenchSetup, used_cells: int, rounds: int = 21):
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


def _prefill_time(runner, setup: BenchSetup) -> float:
    cache = runner.cache
    tokens = np.random.default_rng(2).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()

    def run():
        cache.clear()
        s = cache.seq_new()
        runner.step([s] * len(tokens), tokens, list(range(len(tokens))), [len(tokens) - 1])
    t = _median_time(run, setup.repeats)
    cache.clear()
    return t


def _fork_cells(runner, setup: BenchSetup) -> int:
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


def _cache_ops_seconds(runner, setup: BenchSetup, batch: int) -> float:
    """place (every layer) + mask (every distinct window) for one decode step of
    `batch` sequences on a cache shaped like the runner's, through the binding
    (an upper bound: it includes the Python call overhead)."""
    from executorch_cellcache import CellCache, _core

    info = runner.info
    cache = CellCache(info.n_cells, info.n_layers, info.windows)
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
                _core.mask_op(cache.handle, cells, layer, extent)
    return _median_time(step, max(5, setup.repeats * 5))


# ---------------------------------------------------------------- stock

def _export_stock(setup: BenchSetup, say):
    def build(path: Path) -> float:
        from torch.export import Dim
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        from executorch_cellcache.lowering import lower_exported

        t0 = time.perf_counter()
        model = _model(setup)
        model.generation_config.use_cache = True
        model.generation_config.cache_implementation = "static"
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1,
                                                        max_cache_len=setup.stock_cache_len)
        seq = Dim("seq", min=1, max=setup.prefill_len)
        say("  torch.export (transformers' static-cache recipe, strict) ...")
        with torch.no_grad():
            ep = wrapper.export(input_ids=torch.zeros(1, 2, dtype=torch.int64),
                                cache_position=torch.arange(2),
                                dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
        program = lower_exported(ep, progress=lambda line: say(f"  {line}"), reinplace=False)
        path.write_bytes(program.buffer)
        return time.perf_counter() - t0
    return build


class StockRunner:
    """The stock program: forward(input_ids [1, seq], None, cache_position [seq])."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime

        self.method = Runtime.get().load_program(str(path)).load_method("forward")

    def forward(self, tokens: List[int], start: int):
        ids = torch.tensor([tokens], dtype=torch.int64)
        return self.method.execute([ids, torch.arange(start, start + len(tokens))])[0]


# ---------------------------------------------------------------- eager

def _eager_decode_step_time(model, batch: int, setup: BenchSetup) -> float:
    from transformers import DynamicCache

    rng = np.random.default_rng(4)
    ids = torch.tensor(rng.integers(0, setup.model["vocab_size"], (batch, setup.prompt_len)))

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(setup.decode_steps):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - t0) / setup.decode_steps
    run()
    return statistics.median(run() for _ in range(max(1, setup.repeats)))


def _memory_bandwidth() -> float:
    """Bytes/s of a streaming read (numpy sum over 256 MiB), median of 5."""
    a = np.ones(64 * 1024 * 1024, dtype=np.float32)
    t = _median_time(lambda: a.sum(), 5)
    return a.nbytes / t


# ---------------------------------------------------------------- the table

@dataclass
class BenchResult:
    figures: Dict[str, float] = field(default_factory=dict)
    ratios: Dict[str, float] = field(default_factory=dict)


def run(quick: bool = False, cache_dir: Optional[Path] = None,
        say: Callable[[str], None] = print) -> BenchResult:
    setup = QUICK if quick else FULL
    cache_dir = Path(cache_dir or os.environ.get("CELLCACHE_BENCH_CACHE",
                                                 Path.home() / ".cache" / "executorch-cellcache"))
    programs = ProgramCache(cache_dir / "bench", say)
    max_tokens = setup.prefill_len
    ours_path, ours_export = programs.get(
        "ours", setup, {"n_cells": setup.n_cells, "max_tokens": max_tokens},
        _export_ours(setup, setup.n_cells, max_tokens, say))
    small_path, _ = programs.get(
        "ours", setup, {"n_cells": setup.small_cells, "max_tokens": setup.small_cells},
        _export_ours(setup, setup.small_cells, setup.small_cells, say))
    stock_path, stock_export = programs.get(
        "stock", setup, {"cache_len": setup.stock_cache_len, "max_seq": setup.prefill_len},
        _export_stock(setup, say))

    from executorch_cellcache.runner import Runner

    r = BenchResult()
    f = r.figures
    ours = Runner(ours_path)
    say("measuring our decode at batch sizes " + ", ".join(map(str, setup.batch_sizes)))
    for b in setup.batch_sizes:
        f[f"ours_decode_tok_s_b{b}"] = b / _decode_step_time(ours, b, setup, setup.prompt_len)
    say("measuring prefill, fork cells and cache-op share")
    f["ours_prefill_tok_s"] = setup.prefill_len / _prefill_time(ours, setup)
    f["ours_fork_peak_cells"] = _fork_cells(ours, setup)
    f["independent_copies_cells"] = setup.fork_n * (setup.prefill_len + setup.fork_new_tokens)
    step_b8 = 8 / f["ours_decode_tok_s_b8"]
    f["cache_ops_seconds_b8"] = _cache_ops_seconds(ours, setup, 8)
    f["decode_step_seconds_b8"] = step_b8

    say(f"measuring the used-extent effect ({setup.used_cells} used cells)")
    small = Runner(small_path)
    (f["decode_step_seconds_big_cache"],
     f["decode_step_seconds_small_cache"]) = _same_extent_step_times([ours, small], setup,
                                                                     setup.used_cells)

    say("measuring the stock ExecuTorch program")
    stock = StockRunner(stock_path)
    prompt = np.random.default_rng(5).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()
    f["stock_prefill_tok_s"] = setup.prefill_len / _median_time(
        lambda: stock.forward(prompt, 0), setup.repeats)
    stock.forward(prompt[:setup.prompt_len], 0)

    def stock_decode():
        for i in range(setup.decode_steps):
            stock.forward([1], setup.prompt_len + i)
    f["stock_decode_tok_s_b1"] = setup.decode_steps / _median_time(stock_decode, setup.repeats)

    say("measuring transformers eager and memory bandwidth")
    model = _model(setup)
    for b in (1, 8):
        f[f"eager_decode_tok_s_b{b}"] = b / _eager_decode_step_time(model, b, setup)
    f["weight_bytes"] = _weight_bytes(model)
    f["bandwidth_bytes_s"] = _memory_bandwidth()
    f["bandwidth_bound_tok_s"] = f["bandwidth_bytes_s"] / f["weight_bytes"]
    f["ours_export_seconds"] = ours_export
    f["stock_export_seconds"] = stock_export

    r.ratios = {
        "b1_vs_stock": f["ours_decode_tok_s_b1"] / f["stock_decode_tok_s_b1"],
        "b8_over_b1": f["ours_decode_tok_s_b8"] / f["ours_decode_tok_s_b1"],
        "prefill_vs_stock": f["ours_prefill_tok_s"] / f["stock_prefill_tok_s"],
        "fork_cells_ratio": f["ours_fork_peak_cells"] / f["independent_copies_cells"],
        "cache_ops_share": f["cache_ops_seconds_b8"] / f["decode_step_seconds_b8"],
        "used_extent_ratio": f["decode_step_seconds_big_cache"] /
        f["decode_step_seconds_small_cache"],
        "b1_bandwidth_fraction": f["ours_decode_tok_s_b1"] / f["bandwidth_bound_tok_s"],
        "export_time_vs_stock": ours_export / stock_export,
    }
    return r


def _meets(key: str, value: float) -> str:
    op, target, _ = TARGETS[key]
    if target is None:
        return ""
    ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
    return "yes" if ok else "NO"


def table(result: BenchResult) -> str:
    lines = [f"{'metric':<24} {'value':>10}  {'target':>8}  met  what",
             "-" * 96]
    for key, value in result.ratios.items():
        op, target, what = TARGETS[key]
        tgt = f"{op}{target}" if target is not None else "-"
        lines.append(f"{key:<24} {value:>10.3f}  {tgt:>8}  {_meets(key, value):>3}  {what}")
    lines.append("")
    for key, value in result.figures.items():
        lines.append(f"{key:<32} {value:>14.4g}")
    return "\n".join(lines)


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps({**result.ratios, "figures": result.figures,
                                "targets": {k: [v[0], v[1]] for k, v in TARGETS.items()}},
                               indent=2))


def plot(result: BenchResult, setup_batches: List[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = result.figures
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(setup_batches, [f[f"ours_decode_tok_s_b{x}"] for x in setup_batches], "o-",
           label="cell cache (ExecuTorch)")
    a.plot([1, 8], [f["eager_decode_tok_s_b1"], f["eager_decode_tok_s_b8"]], "s--",
           label="transformers eager")
    a.plot([1], [f["stock_decode_tok_s_b1"]], "^", label="stock ExecuTorch")
    a.set_xlabel("concurrent sequences")
    a.set_ylabel("aggregate decode tokens/s")
    a.legend()
    b.bar(["big cache", "small cache"],
          [f["decode_step_seconds_big_cache"] * 1e3, f["decode_step_seconds_small_cache"] * 1e3])
    b.set_ylabel("decode step ms (same used cells)")
    fig.tight_layout()
    fig.savefig(path)

