"""Where the time of one decode step goes: runs a cell-cache .pte with
ExecuTorch's ETDump profiler, prefills B sequences and times decode steps,
then prints the operators (and XNNPACK delegate calls) by share of a step.

  python scripts/profile_decode.py M.pte [--batch 1 8] [--prompt-len 128] [--steps 8]
  python scripts/profile_decode.py M.pte --batch 8 --prompt-len 2048 --fill place

--fill forward (default) prefills with real forwards; --fill place only stamps
the positions through the step protocol (no forwards: fast for long contexts;
a decode step's cost depends on which cells it reads, not on their values).

Uses the runtime's own profiler (ETDump, read with the devtools Inspector);
the figures are medians over the steps, per event name.
"""

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np


def _fill_by_placing(cache, seqs, prompt_len: int, chunk: int, n_layers: int) -> None:
    for start in range(0, prompt_len, chunk):
        n = min(chunk, prompt_len - start)
        for s in seqs:
            if not cache.declare_step([s] * n):
                raise SystemExit(f"the program's {cache.capacity} cells cannot hold "
                                 f"{len(seqs)} x {prompt_len} tokens")
            for layer in range(n_layers):
                cache.place_step(list(range(start, start + n)), layer)


def profile(pte: Path, batch: int, prompt_len: int, steps: int, fill: str) -> None:
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    from executorch_cellcache.runtime.runner import Runner

    runner = Runner(pte)
    # The same program, loaded again with ETDump on (Runner loads without it).
    program = Runtime.get().load_program(str(pte), enable_etdump=True)
    runner.program, runner._forward = program, program.load_method("forward")
    cache = runner.cache
    seqs = [cache.seq_new() for _ in range(batch)]
    rng = np.random.default_rng(0)
    chunk = runner.info.max_tokens_per_step
    if fill == "place":
        _fill_by_placing(cache, seqs, prompt_len, chunk, runner.info.n_layers)
    for s in seqs if fill == "forward" else ():
        toks = rng.integers(0, runner.info.vocab_size, prompt_len).tolist()
        for start in range(0, prompt_len, chunk):
            part = toks[start:start + chunk]
            runner.step([s] * len(part), part, list(range(start, start + len(part))),
                        [len(part) - 1])
    for _ in range(steps):
        runner.step(seqs, [1] * batch, [cache.next_pos(s) for s in seqs], list(range(batch)))
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "etdump.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(tmp) / "debug.bin"))
        inspector = Inspector(etdump_path=str(etdump))
    per_name = defaultdict(list)
    totals = []
    for block in (b for b in inspector.event_blocks if b.name == "Execute"):
        # One event per op of the program; perf_data.raw holds one time per forward, the
        # last `steps` of which are the decode steps.
        step = defaultdict(float)
        total = 0.0
        for event in block.events:
            if event.perf_data is None:
                continue
            times = event.perf_data.raw[-steps:]
            if event.name == "Method::execute":
                total = statistics.median(times)
                continue
            if event.name == "OPERATOR_CALL":
                # the runtime's wrapper around each non-delegated kernel call: its time is
                # that of the kernel events (native_call_*, cellcache::*) counted by name
                continue
            if event.name == "DELEGATE_CALL":
                # the XNNPACK events inside it are subtracted below: what stays is the
                # delegate's own overhead (argument passing, setup)
                step["XNNPACK delegate call overhead"] += statistics.median(times)
                continue
            # "Fully Connected (NC, QDU8, F32, QB4W) GEMM #3" -> one row per kind
            name = event.name.split(" #")[0]
            name = f"XNNPACK {name}" if event.is_delegated_op else name
            step[name] += statistics.median(times)
        step["XNNPACK delegate call overhead"] -= sum(
            ms for name, ms in step.items() if name.startswith("XNNPACK ") and
            name != "XNNPACK delegate call overhead")
        for name, ms in step.items():
            per_name[name].append(ms)
        totals.append(total)
    total = sum(totals)
    print(f"{pte.name}: B={batch}, context {prompt_len}, decode step {total:.2f} ms "
          f"(Method::execute, median of the last {steps} steps)")
    rows = sorted(((sum(v), n) for n, v in per_name.items()), reverse=True)
    for ms, name in rows[:16]:
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  {name}")
    rest = total - sum(ms for ms, _ in rows)
    print(f"  {rest:8.3f} ms {100 * rest / total:5.1f}%  (not in any profiled event)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pte", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fill", choices=("forward", "place"), default="forward",
                        help="how the context is filled (see above)")
    args = parser.parse_args()
    for b in args.batch:
        profile(args.pte, b, args.prompt_len, args.steps, args.fill)


if __name__ == "__main__":
    main()
