"""What every benchmark shares: the bench setups (the model and sizes), medians
of repeats, the seeded model, and the on-disk cache of exported programs."""

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

PACKAGE_VERSION = "0.1.0"


def machine() -> Dict[str, object]:
    """Where and when figures were measured, for the JSON a bench writes:
    UTC time, the CPU's model name (/proc/cpuinfo), cores, the ExecuTorch
    pool's threads, and the source's git commit (-dirty: with changes) in a checkout."""
    import datetime
    import os
    import platform
    import subprocess

    from executorch_cellcache.runtime.threads import thread_pool_size

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cores": os.cpu_count(), "runtime_threads": thread_pool_size(),
            "commit": commit}


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
    prefix_len: int            # the shared system prompt of the prefix-cache figures


FULL = BenchSetup(
    model=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, tie_word_embeddings=True),
    prompt_len=128, prefill_len=256, fork_n=8, fork_new_tokens=32, n_cells=4096,
    small_cells=128, used_cells=128, stock_cache_len=512, batch_sizes=[1, 2, 4, 8],
    decode_steps=8, repeats=3, prefix_len=1000)


QUICK = BenchSetup(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=1024, tie_word_embeddings=True),
    prompt_len=16, prefill_len=32, fork_n=4, fork_new_tokens=8, n_cells=512,
    small_cells=32, used_cells=32, stock_cache_len=64, batch_sizes=[1, 2, 4, 8],
    decode_steps=4, repeats=1, prefix_len=64)


def median_time(fn: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(setup: BenchSetup):
    from transformers import LlamaConfig, LlamaForCausalLM

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM(LlamaConfig(**setup.model)).eval()
    finally:
        torch.random.set_rng_state(state)
    return model


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# The code that decides what our exporter writes: a program of these kinds
# exported before any of it changed is stale. export_llm's and the
# static-cache recipe's programs depend on their options and versions only.
_EXPORTER_KINDS = ("ours", "long")
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_EXPORTER_SOURCES = ("graph/*.py", "exporting/*.py", "cache/metadata.py")


def _exporter_digest() -> str:
    h = hashlib.sha256()
    files = [f for pattern in _EXPORTER_SOURCES for f in sorted(_PACKAGE_DIR.glob(pattern))]
    files += sorted((_PACKAGE_DIR.parent / "ops").glob("*.yaml"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


class ProgramCache:
    """Exported programs on disk: <dir>/<key>.pte plus <key>.json (export
    seconds). The key covers the kind, the model, the options, the package and
    torch versions, and for our own programs the exporter's source. ``suffix``:
    another file type built the same way (llama.cpp's .gguf)."""

    def __init__(self, directory: Path, say):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.say = say

    def get(self, kind: str, setup: BenchSetup, options: dict,
            build: Callable[[Path], float], suffix: str = ".pte"):
        parts = [kind, setup.model, options, PACKAGE_VERSION, torch.__version__]
        if kind in _EXPORTER_KINDS:
            parts.append(_exporter_digest())
        key_src = json.dumps(parts, sort_keys=True)
        key = f"{kind}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
        pte, meta = self.dir / f"{key}{suffix}", self.dir / f"{key}.json"
        if pte.exists() and meta.exists():
            self.say(f"using cached {kind} program {pte}")
            return pte, json.loads(meta.read_text())["export_seconds"]
        self.say(f"exporting {kind} program ({options}); cached afterwards in {self.dir}")
        seconds = build(pte)
        meta.write_text(json.dumps({"export_seconds": seconds, "options": options}))
        return pte, seconds


def bytes_read_per_token(pte_bytes: int, setup: "BenchSetup", quantize: Optional[str],
                         embedding_quantize: Optional[str]) -> int:
    """Weight bytes one decode token reads from a program of ``pte_bytes``
    exported from the bench model: all of it but the embedding table where
    that is stored apart from lm_head (a tied model quantized either way:
    quantize.quantize_model unties them); then a token reads one row of it.
    The table's bytes: vocab x hidden values of its bits plus an fp32 scale per
    group (per row when the group is 0), as torchao stores them (approximate
    by the zero points' bytes where torchao keeps them)."""
    from executorch_cellcache.exporting.quantize import parse_embedding

    vocab, hidden = setup.model["vocab_size"], setup.model["hidden_size"]
    separate = not setup.model.get("tie_word_embeddings", False) or quantize or \
        embedding_quantize
    if not separate:
        return pte_bytes
    fmt = parse_embedding(embedding_quantize)
    if fmt is None:
        table = vocab * hidden * 4
    else:
        groups = hidden // fmt.group_size if fmt.group_size else 1
        table = vocab * hidden * fmt.bits // 8 + vocab * groups * 4
    return pte_bytes - table + table // vocab


def memory_bandwidth() -> float:
    """Bytes/s of a streaming read with every core: numpy sums over chunks of
    256 MiB, one thread per core (numpy releases the GIL in a reduction);
    median of 5. One thread alone reads well below what a program whose
    kernels run on every core streams."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(64 * 1024 * 1024, dtype=np.float32)
    workers = os.cpu_count() or 1
    chunks = np.array_split(a, workers * 4)
    with ThreadPoolExecutor(workers) as pool:
        t = median_time(lambda: list(pool.map(np.sum, chunks)), 5)
    return a.nbytes / t


def alternating_medians(steps: Dict[str, Callable[[], None]], rounds: int,
                        warmup: int = 1) -> Dict[str, float]:
    """Median seconds of each step function, the functions taking turns one
    call each per round (this machine's speed drifts over minutes, so programs
    compared with each other are timed interleaved). The order rotates by one
    each round, so each function follows each other equally often: a step
    right after a program that streamed 650 MB of fp32 weights through the
    caches ran 10% slower than the same step after a 105 MB one."""
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + max(1, rounds)):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}
