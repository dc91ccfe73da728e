#!/usr/bin/env python
"""Paired decode A/B of cell-cache programs, each run by the code of a chosen
checkout: decode tok/s at B sequences after prompts of L tokens, the programs
taking turns step by step (this machine's speed drifts over minutes; ratios
are only meaningful within one run).

    python scripts/bench_decode_ab.py --export OUT.pte [--quantize 8da4w
        --embedding-quantize 8]
    python scripts/bench_decode_ab.py A.pte B.pte[@CHECKOUT][+VAR=VALUE] ...
        [--batches 1 8] [--prompt-lens 128 480] [--rounds 11]
        [--steps-per-turn 4] [--turn-gap-ms 5] [--json OUT]
        [--llama-cpp BUILD --gguf-quantize 8da4w [--gen-len 32]]

--export writes the bench's 135M model (bench/common.py FULL: SmolLM-135M
shapes, random weights) with the code this script is run with (PYTHONPATH),
so an older checkout's exporter can write the "before" program.

Each program runs in a worker process of its own, on this checkout's
runtime, or on CHECKOUT's (a folder holding an executorch_cellcache package
built in place, e.g. a git worktree of an older commit) after an @: so a
before/after pair compares kernels and runtimes too, not only graphs. For
each (L, B) a worker prefills B sequences with the same L random tokens; a
timed step decodes one token for each and rolls it back, so every step sees
the same context. The parent asks one worker at a time (the others wait
idle), rotating the order each round. A turn is --steps-per-turn steps in a
row (decoding runs steps back to back; the first of a turn is not timed, it
follows the other programs' turns), then --turn-gap-ms of quiet, so the
runtime's pool workers, which spin up to CELLCACHE_POOL_SPIN_US after their
last work (cpp/kernels/pool_executor.h), sleep before the next program's turn
instead of competing with it. Medians of the timed steps of --rounds rounds
after one warm-up round. Ratios are against the first program.

+VAR=VALUE (repeatable) sets an environment variable for that program's
worker alone, e.g. B.pte+CELLCACHE_POOL_SPIN_US=0 for the pool's own workers.

--llama-cpp adds llama.cpp (its llama-batched-bench, or the build folder holding
it) on the bench model's weights written to GGUF as `cellcache bench
--llama-cpp` writes them (--gguf-quantize 8da4w: Q4_0, 8da8w: Q8_0, none: F32;
the embedding as the programs': --embedding-quantize), as many threads as
ours: after each (L, B)'s rounds, --llama-cpp-rounds runs of llama-batched-bench
(-npp L -ntg --gen-len -npl B: its decode rate over --gen-len tokens after the
prompt) alternate with as many rounds of ours; ratios ours / llama.cpp.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def export_bench_model(out: Path, quantize, embedding_quantize) -> None:
    from executorch_cellcache.bench.common import FULL, bench_model
    from executorch_cellcache.exporting.exporter import export

    fields = dict(n_cells=FULL.n_cells, max_tokens_per_step=FULL.prefill_len,
                  quantize=quantize, embedding_quantize=embedding_quantize)
    result = export(bench_model(FULL), out, progress=lambda line: print(f"  {line}"), **fields)
    print(f"wrote {out} ({result.size_bytes / 1e6:.1f} MB) in {result.seconds:.0f} s")


def worker(pte: str) -> None:
    """Serves one program on stdin/stdout: 'setup L B1,B2,..' prefills those
    batches (answers 'ok'; errors end the worker); 'step B K' runs K decode
    steps in a row and answers their seconds. Written against the Runner API alone (not bench/ours.py's
    steppers) so a checkout older than this script can serve as the runtime."""
    import numpy as np

    from executorch_cellcache.runtime.runner import Runner

    runner = Runner(pte, prefix_cache=False)
    chunk = runner.info.max_tokens_per_step
    batches, length = {}, 0
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "setup":
            length, sizes = int(args[0]), [int(b) for b in args[1].split(",")]
            runner.cache.clear()
            tokens = np.random.default_rng(1).integers(0, runner.info.vocab_size,
                                                       length).tolist()
            batches = {}
            for b in sizes:
                batches[b] = [runner.cache.seq_new() for _ in range(b)]
                for s in batches[b]:
                    for start in range(0, length, chunk):
                        part = tokens[start:start + chunk]
                        runner.step([s] * len(part), part,
                                    list(range(start, start + len(part))), [len(part) - 1])
            print("ok", flush=True)
        elif cmd == "step":
            seqs = batches[int(args[0])]
            times = []
            for _ in range(int(args[1])):
                t0 = time.perf_counter()
                runner.step(seqs, [1] * len(seqs), [length] * len(seqs), list(range(len(seqs))))
                times.append(time.perf_counter() - t0)
                for s in seqs:
                    runner.rollback(s, 1)
            print(" ".join(map(str, times)), flush=True)


def _llama_cpp(args):
    """(binary, gguf path, threads): the bench model written to GGUF once
    (cached beside the programs' cache), the binary checked by a short run."""
    from executorch_cellcache.bench import llama_cpp, program_cache
    from executorch_cellcache.bench.common import FULL, bench_model
    from executorch_cellcache.runtime.threads import thread_pool_size

    try:
        binary = llama_cpp.check_binary(llama_cpp.resolve_binary(args.llama_cpp))
    except llama_cpp.LlamaCppError as e:
        raise SystemExit(f"llama.cpp: {e}")
    quantize = None if args.gguf_quantize == "none" else args.gguf_quantize

    def build(path: Path) -> float:
        t0 = time.perf_counter()
        llama_cpp.write_gguf(bench_model(FULL), path, quantize, args.embedding_quantize)
        return time.perf_counter() - t0
    gguf, _ = program_cache(None, print).get(
        "gguf", FULL, llama_cpp.gguf_options(quantize, args.embedding_quantize), build,
        suffix=".gguf")
    return binary, gguf, thread_pool_size()   # the workers' pools are this size too


def _against_llama_cpp(llama, workers, length: int, b: int, args) -> list:
    """Rounds of llama-batched-bench at (L, B) alternating with rounds of
    ours (each worker: --rounds steps, their median); medians, ours / llama.cpp."""
    from executorch_cellcache.bench import llama_cpp

    binary, gguf, threads = llama
    ours = {w.name: [] for w in workers}
    theirs = []
    for _ in range(args.llama_cpp_rounds):
        for w in workers:
            ours[w.name].append(statistics.median(
                t for _ in range(args.rounds) for t in steps(w, b, args.steps_per_turn)))
        try:
            row = llama_cpp.run_batched_bench(binary, gguf, length, args.gen_len, [b],
                                              threads)[b]
        except llama_cpp.LlamaCppError as e:
            print(f"llama.cpp: {e}; its rows are missing")
            return []
        theirs.append(row.decode_tok_s)
    them = statistics.median(theirs)
    rows = [{"program": "llama.cpp", "prompt_len": length, "batch": b, "tok_s": them}]
    print(f"L={length:4d} B={b}  {'llama.cpp (' + gguf.name + ')':50s} {them:7.1f} tok/s",
          flush=True)
    for w in workers:
        tok_s = b / statistics.median(ours[w.name])
        rows.append({"program": w.name, "prompt_len": length, "batch": b, "tok_s": tok_s,
                     "vs_llama_cpp": tok_s / them})
        print(f"L={length:4d} B={b}  {w.name:50s} {tok_s:7.1f} tok/s  "
              f"x{tok_s / them:.3f} llama.cpp (rounds alternated)", flush=True)
    return rows


def steps(worker, b: int, k: int) -> list:
    """The timed seconds of one turn: k steps in a row, the first untimed
    unless k is 1."""
    times = [float(t) for t in worker.ask(f"step {b} {k}").split()]
    return times[1:] if k > 1 else times


class Worker:
    def __init__(self, spec: str):
        spec, *assignments = spec.split("+")
        extra_env = {}
        for a in assignments:
            var, eq, value = a.partition("=")
            if not eq or not var:
                raise SystemExit(f"{a!r}: expected +VAR=VALUE after the program")
            extra_env[var] = value
        path, _, checkout = spec.partition("@")
        self.pte = Path(path)
        self.checkout = Path(checkout) if checkout else REPO
        if not self.pte.is_file():
            raise SystemExit(f"{self.pte}: no such file")
        if not (self.checkout / "executorch_cellcache").is_dir():
            raise SystemExit(f"{self.checkout}: holds no executorch_cellcache package")
        self.name = f"{self.pte.name}" + (f"@{self.checkout}" if checkout else "") + \
            "".join(f"+{a}" for a in assignments)
        env = {**os.environ, "PYTHONPATH": str(self.checkout), **extra_env}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                      str(self.pte.resolve())], cwd="/", env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"the worker of {self.name} ended (see its error above)")
        return answer.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("programs", nargs="*", help="PATH.pte or PATH.pte@CHECKOUT")
    ap.add_argument("--export", type=Path, metavar="OUT", help="export the bench model and exit")
    ap.add_argument("--quantize", choices=["8da4w", "8da8w"])
    ap.add_argument("--embedding-quantize", metavar="SPEC")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 480])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps-per-turn", type=int, default=4,
                    help="steps a program runs in a row each turn; the first is not timed")
    ap.add_argument("--turn-gap-ms", type=float, default=5.0,
                    help="quiet between turns, longer than the pool workers' spin")
    ap.add_argument("--json", type=Path, metavar="OUT")
    ap.add_argument("--llama-cpp", metavar="BUILD")
    ap.add_argument("--gguf-quantize", choices=["8da4w", "8da8w", "none"], default="8da4w")
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--llama-cpp-rounds", type=int, default=5)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.export:
        export_bench_model(args.export, args.quantize, args.embedding_quantize)
        return 0
    if not args.programs:
        ap.error("give .pte files to compare, or --export OUT")
    if args.steps_per_turn < 1 or args.turn_gap_ms < 0:
        ap.error("--steps-per-turn must be >= 1 and --turn-gap-ms >= 0")
    llama = _llama_cpp(args) if args.llama_cpp else None
    workers = [Worker(spec) for spec in args.programs]
    rows = []
    for length in args.prompt_lens:
        for b in args.batches:
            for w in workers:   # one batch at a time: the cache need not hold them all
                w.ask(f"setup {length} {b}")
            times = {w.name: [] for w in workers}
            for r in range(args.rounds + 1):
                k = r % len(workers)
                for w in workers[k:] + workers[:k]:
                    time.sleep(args.turn_gap_ms / 1e3)
                    t = steps(w, b, args.steps_per_turn)
                    if r:
                        times[w.name] += t
            med = {n: statistics.median(t) for n, t in times.items()}
            base = med[workers[0].name]
            for w in workers:
                m = med[w.name]
                rows.append({"program": w.name, "prompt_len": length, "batch": b,
                             "step_ms": m * 1e3, "tok_s": b / m, "speedup_vs_first": base / m})
                print(f"L={length:4d} B={b}  {w.name:50s} {m * 1e3:7.2f} ms  {b / m:7.1f} tok/s"
                      f"  x{base / m:.3f}", flush=True)
            if llama is not None:
                rows += _against_llama_cpp(llama, workers, length, b, args)
    for w in workers:
        w.proc.stdin.close()
        w.proc.wait()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
