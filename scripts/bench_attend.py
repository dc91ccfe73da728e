#!/usr/bin/env python
"""Micro-benchmark of cellcache::attend: attention cost follows a token's own
cells, not the pool (SPEC section 8).

    python scripts/bench_attend.py [--length 2048] [--repeats 30] [--kv-dtype fp32]

One layer of a SmolLM-135M-shaped model (9 query heads, 3 KV heads, head_dim
64). Eight sequences of --length tokens are prefilled in interleaved chunks
(continuous-batching layout: their cells alternate in the pool). Timed, one
decode step each, medians of --repeats, configurations alternated round-robin
(the machine's speed drifts):
  alone       one sequence of L in a pool holding only it (1 token)
  among 7     the same, in the pool with 7 other sequences' cells (1 token)
  8 x alone   eight such steps, each on its own pool (eight caches' memory,
              as the batch reads: a single small pool stays in CPU cache)
  batch of 8  all 8 sequences decode in one step (8 tokens)
  dense       the reference path (mask + scores over the used extent) for
              the batch of 8, for scale
Ratios printed: batch of 8 / (8 x alone) (target <= 1.2) and among 7 / alone
(target <= 1.1). The op runs its C++ kernel on the ExecuTorch runtime's thread
pool, as in an exported program. Measurements, not tests.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executorch_cellcache import CellCache  # noqa: E402
from executorch_cellcache.cache import _core  # noqa: E402
from executorch_cellcache.graph import ops  # noqa: E402
from executorch_cellcache.graph.attention import dense_attend  # noqa: E402

N_HEADS, N_KV, HD = 9, 3, 64
CHUNK = 64


class Setup:
    """A cache with `n_seq` sequences of `length` tokens, interleaved, and a
    declared, placed decode step of the sequences in `decoders`."""

    def __init__(self, n_seq, length, decoders, kv_dtype):
        n_cells = n_seq * length + n_seq
        self.cache = CellCache(n_cells, 1, [None])
        self.handle = torch.tensor([self.cache.handle], dtype=torch.int64)
        seqs = [self.cache.seq_new() for _ in range(n_seq)]
        for start in range(0, length, CHUNK):
            for s in seqs:  # one chunk of each sequence in turn: cells interleave
                n = min(CHUNK, length - start)
                assert self.cache.declare_step([s] * n)
                self.cache.place_step(list(range(start, start + n)), 0)
        g = torch.Generator().manual_seed(0)
        self.k = torch.randn(n_cells, N_KV, HD, generator=g).to(kv_dtype)
        self.v = torch.randn(n_cells, N_KV, HD, generator=g).to(kv_dtype)
        step = [seqs[i] for i in decoders]
        assert self.cache.declare_step(step)
        self.cells = ops.place(self.handle, torch.full((len(step),), length), 0)
        self.q = torch.randn(len(step), N_HEADS, HD, generator=g)
        self.extent = torch.empty(self.cache.used_end, dtype=torch.uint8)

    def attend(self):
        return ops.attend(self.handle, self.q, self.k, self.v, self.cells, 0, HD ** -0.5, 0.0)

    def dense(self):
        mask = ops.mask(self.handle, self.cells, 0, self.extent)
        return dense_attend(self.q, self.k, self.v, mask, HD ** -0.5)


def measure(runs, repeats):
    """Medians (seconds) of each callable, called round-robin."""
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm up
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--kv-dtype", choices=("fp32", "fp16"), default="fp32")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.kv_dtype]
    L = args.length
    print(f"building caches: 8 x {L} tokens ({args.kv_dtype} K/V) ...", file=sys.stderr)
    alone = [Setup(1, L, [0], dtype) for _ in range(8)]  # eight pools: eight caches' memory
    among = Setup(8, L, [3], dtype)
    batch = Setup(8, L, list(range(8)), dtype)

    def eight_alone():
        for a in alone:
            a.attend()

    med = measure({"alone": alone[0].attend, "among 7": among.attend,
                   "8 x alone": eight_alone, "batch of 8": batch.attend}, args.repeats)
    # Apart: torch's own threads (the dense path's bmm) keep spinning after it
    # and would slow whatever runs next on a small machine.
    med.update(measure({"dense, batch of 8": batch.dense}, args.repeats))
    print(f"cellcache::attend, one layer (9/3 heads, hd 64), {args.kv_dtype} K/V, L={L}, "
          f"medians of {args.repeats}, runtime pool of {_core.runtime_thread_count()} threads")
    print(f"{'case':22s} {'ms':>9s}")
    for name, t in med.items():
        print(f"{name:22s} {t * 1e3:9.3f}")
    print(f"batch of 8 / (8 x alone) = {med['batch of 8'] / med['8 x alone']:.2f}  "
          f"(target <= 1.2)")
    print(f"among 7 / alone          = {med['among 7'] / med['alone']:.2f}  (target <= 1.1)")
    print(f"dense / cells, batch 8   = {med['dense, batch of 8'] / med['batch of 8']:.1f}x")


if __name__ == "__main__":
    main()
