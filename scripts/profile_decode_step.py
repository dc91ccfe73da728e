#!/usr/bin/env python
"""Per-operator profile of one decode step of a cell-cache .pte (ExecuTorch
ETDump + devtools Inspector), with B sequences of L tokens in the pool.

    python scripts/profile_decode_step.py M.pte [--batch 8] [--length 2048] [--steps 3]

The pool is filled by placing positions through the step protocol without
running forwards (as bench/long_context.py does: the cost depends on which
cells are read, not on their values). Prints, per operator (delegate calls
folded into one row), the median over --steps of its total time in a step.
"""

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import executorch_cellcache  # noqa: E402,F401  (registers the kernels)
from executorch_cellcache.cache import metadata  # noqa: E402
from executorch_cellcache.cache._core import CellCache  # noqa: E402


class _Program:
    """metadata.read's view of a pybindings module."""

    def __init__(self, module):
        self.module = module
        self.method_names = module.method_names()

    def load_method(self, name):
        module = self.module

        class _Method:
            def execute(self, inputs):
                return module.run_method(name, inputs)
        return _Method()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pte")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from executorch.devtools import Inspector
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    module = _load_for_executorch(args.pte, enable_etdump=True)
    info = metadata.read(_Program(module))
    cache = CellCache(info.n_cells, info.n_layers, info.windows)
    seqs = [cache.seq_new() for _ in range(args.batch)]
    for start in range(0, args.length, args.chunk):
        n = min(args.chunk, args.length - start)
        for s in seqs:
            assert cache.declare_step([s] * n), "the pool is too small"
            for layer in range(info.n_layers):
                cache.place_step(list(range(start, start + n)), layer)
    handle = torch.tensor([cache.handle], dtype=torch.int64)
    for _ in range(args.steps + 1):  # the first step warms up
        assert cache.declare_step(seqs)
        pos = [cache.next_pos(s) for s in seqs]
        module.run_method("forward", [
            torch.ones(len(seqs), dtype=torch.int64), torch.tensor(pos),
            torch.arange(len(seqs)), handle,
            torch.empty(cache.planned_used_end, dtype=torch.uint8)])
        for s, p in zip(seqs, pos):
            cache.seq_rm(s, p)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.etdp"
        module.write_etdump_result_to_file(str(path))
        inspector = Inspector(etdump_path=str(path))
    per_step = defaultdict(list)  # operator -> [total ms of each forward]
    for block in inspector.event_blocks:
        if block.name != "Execute" and "forward" not in block.name.lower():
            continue
        runs = None
        for ev in block.events:
            if ev.perf_data is None:
                continue
            raw = ev.perf_data.raw
            runs = len(raw) if runs is None else runs
            name = "XNNPACK delegate" if "DELEGATE" in ev.name.upper() else ev.name
            totals = per_step.setdefault(name, [0.0] * len(raw))
            for i, t in enumerate(raw):
                totals[i] += t
    rows = []
    for name, totals in per_step.items():
        med = statistics.median(totals[1:] if len(totals) > 1 else totals)
        rows.append((med, name))
    rows.sort(reverse=True)
    execute = dict((n, m) for m, n in rows).get("Method::execute", 0.0)
    groups = defaultdict(float)
    for med, name in rows:
        if name.startswith("cellcache::"):
            groups["cellcache ops"] += med
        elif name.startswith("native_call_"):
            groups["other portable ops"] += med
        elif name == "XNNPACK delegate":
            groups["XNNPACK delegate calls"] += med
        # (the rest: OPERATOR_CALL wrappers and the delegate's inner ops)
    print(f"{Path(args.pte).name}: one decode step, B={args.batch} x {args.length} tokens, "
          f"median of {args.steps} (ms); Method::execute {execute:.2f} ms")
    for kind, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:48s} {ms:10.2f}")
    print("top operators:")
    for med, name in rows[:args.top]:
        print(f"  {name:48s} {med:10.3f}")


if __name__ == "__main__":
    main()
