"""What structured output costs at a 49,152-token vocabulary, in both runtimes.

1. Mask cost per token: for each schema of tests/test_structured_output.py
   (SCHEMAS, read from that file with ast, nothing imported), seeded random
   walks under the mask (--walks walks of at most --walk-len tokens, each token
   drawn uniformly among the allowed ones, a walk ends when the grammar
   completes). Timed per token:
   - C++ (XGrammar, what cellcache_runner applies in its StepHooks):
     ``CppGrammarMatcher.fill(row)`` + ``.accept(token)``;
   - llguidance (the Python runtime's constraints.py up to commit 0b1ea34):
     ``Matcher.mask()`` (bitmask fill + unpack to bool) + ``.advance(token)``.
   Every position is timed, the first included (the Python runtime computes a
   request's first mask once, ``Constraint.initial_mask``). Mean / p50 / p99
   microseconds, and the slowest tokens with the text before them.
2. B=8 decode throughput with the "nested" schema vs without, C++ runtime:
   one ``cellcache_runner --stdio`` process per measurement, 8 "text" requests
   written at once (temperature 1, seeds distinct per request and repeat,
   --max-new tokens; the free ones with "stop_on_eos": false). Output is
   flushed once per engine step; each chunk read from the pipe is timestamped,
   and decode tok/s = tokens after the chunk in which the last request got its
   first token / the wall time from that chunk to the last one (masks, hooks,
   sampling and output included). Also shown: the engine's own "decode ... tok/s"
   from the stderr summary, which times forwards only (no masks).
3. The same through the Python runtime: ``Runner.generate([prompt], n=8, ...)``
   (8 forks of one prompt: its samples draw from (seed, j)), steps timestamped
   with on_step, the same decode measure; and the engine's forward-only figure.
Constrained samples end when their JSON is complete (fewer tokens, and a batch
that thins out at the end), so tokens/s is compared, not totals. Repeats run
in ABBA order (free, schema, schema, free, ...); medians are reported.

  python scripts/bench_structured_output.py --model /tmp/fresh/out/smollm2.pte
"""
import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from executorch_cellcache import Runner
from executorch_cellcache.cache import _core

ROOT = Path(__file__).resolve().parent.parent


def load_schemas(path):
    """SCHEMAS of the test module, as literals (no import of pytest & co.)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SCHEMAS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no SCHEMAS in {path}")


def program_info(runner, model):
    out = subprocess.run([runner, "--model", model, "--print-info"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def walks(new_walk, step, n_walks, walk_len, seed, vocab):
    """Random walks; step(state, rng) -> (ns, token, done). Returns per-token
    microseconds and (us, walk, pos, token) events."""
    times, events = [], []
    for w in range(n_walks):
        rng = np.random.default_rng([seed, w])
        state = new_walk()
        for pos in range(walk_len):
            ns, tok, done = step(state, rng)
            times.append(ns / 1e3)
            events.append((ns / 1e3, w, pos, tok))
            if done or tok in vocab["eos"]:
                break
    return np.array(times), events


def cpp_walker(compiler, text, V):
    def new():
        return {"m": compiler.matcher("json_schema", text), "row": np.zeros(V, np.uint8)}

    def step(s, rng):
        t0 = time.perf_counter_ns()
        s["m"].fill(s["row"])
        t1 = time.perf_counter_ns()
        tok = int(rng.choice(np.flatnonzero(s["row"])))
        t2 = time.perf_counter_ns()
        done = s["m"].accept(tok)
        return (t1 - t0) + (time.perf_counter_ns() - t2), tok, done
    return new, step


def llg_walker(llg, lltok, schema, V):
    """llguidance as constraints.py used it at commit 0b1ea34 (Matcher.mask:
    one bitmask fill + unpack to bool; Matcher.advance: consume_token)."""
    grammar = llg.JsonCompiler(whitespace_flexible=False).compile(json.dumps(schema))

    def new():
        return {"m": llg.LLMatcher(lltok, grammar),
                "bits": llg.numpy.allocate_token_bitmask(1, V)}

    def step(s, rng):
        t0 = time.perf_counter_ns()
        llg.numpy.fill_next_token_bitmask(s["m"], s["bits"], 0)
        mask = np.unpackbits(s["bits"].view(np.uint8), axis=1, count=V,
                             bitorder="little").view(bool)[0]
        t1 = time.perf_counter_ns()
        tok = int(rng.choice(np.flatnonzero(mask)))
        t2 = time.perf_counter_ns()
        if not s["m"].consume_token(tok):
            raise RuntimeError(f"llguidance refused {tok}: {s['m'].get_error()}")
        return (t1 - t0) + (time.perf_counter_ns() - t2), tok, s["m"].is_stopped()
    return new, step


def decode_rate(chunks, n_requests):
    """chunks: [(t, [(request, n_tokens), ...])] in arrival order. Tokens after
    the chunk that gave the last request its first token, per wall second."""
    seen, start = set(), None
    for i, (_, toks) in enumerate(chunks):
        seen.update(r for r, k in toks if k)
        if len(seen) == n_requests:
            start = i
            break
    if start is None or start == len(chunks) - 1:
        return float("nan")
    n = sum(k for _, toks in chunks[start + 1:] for _, k in toks)
    return n / (chunks[-1][0] - chunks[start][0])


def cpp_run(args, schema, rep):
    lines = []
    for i in range(8):
        req = {"id": i, "text": args.prompt, "temperature": 1.0, "seed": 1000 * rep + i,
               "max_new_tokens": args.max_new}
        req.update({"json_schema": schema} if schema else {"stop_on_eos": False})
        lines.append(json.dumps(req) + "\n")
    p = subprocess.Popen([args.runner, "--model", args.model, "--stdio"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write("".join(lines).encode())
    p.stdin.close()
    chunks, buf, total = [], b"", 0
    fd = p.stdout.fileno()
    while True:
        data = os.read(fd, 1 << 20)
        t = time.perf_counter()
        if not data:
            break
        buf += data
        *done, buf = buf.split(b"\n")
        toks = []
        for line in done:
            o = json.loads(line)
            if "token" in o:
                toks.append((o["id"], 1))
            elif "finish" in o:
                total += o["usage"]["completion_tokens"]
            elif "error" in o:
                raise SystemExit(f"runner refused a request: {o}")
        if toks:
            chunks.append((t, toks))
    err = p.stderr.read().decode()
    p.wait()
    m = re.search(r"decode (\d+) tokens at (\d+) tok/s", err)
    return decode_rate(chunks, 8), float(m.group(2)) if m else float("nan"), total / 8


def py_run(args, runner, ids, schema, rep):
    chunks, pending = [], []

    def on_token(prompt, sample, token):
        pending.append((sample, 1))

    def on_step(_stats):
        if pending:
            chunks.append((time.perf_counter(), list(pending)))
            pending.clear()
    out = runner.generate([ids], args.max_new, n=8, temperature=1.0, seed=rep,
                          stop_on_eos=schema is not None, json_schema=schema,
                          on_token=on_token, on_step=on_step)
    s = runner.last_stats
    forward = s.decode_step_tokens / s.decode_seconds if s.decode_seconds else float("nan")
    return decode_rate(chunks, 8), forward, sum(len(o) for o in out[0]) / 8


def pct(a, q):
    return float(np.percentile(a, q))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--model", default="/tmp/fresh/out/smollm2.pte", help="the .pte (a 49k "
                    "vocabulary: SmolLM2-135M; `cellcache export --model smollm2 --out P`)")
    ap.add_argument("--runner", help="cellcache_runner (default: the package's runner-path)")
    ap.add_argument("--schemas", default=str(ROOT / "tests/test_structured_output.py"),
                    help="file whose SCHEMAS dict is read")
    ap.add_argument("--walks", type=int, default=20, help="random walks per schema (20)")
    ap.add_argument("--walk-len", type=int, default=128, help="most tokens per walk (128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-llguidance", action="store_true",
                    help="skip llguidance (pip install llguidance) in part 1")
    ap.add_argument("--repeats", type=int, default=5, help="runs per config and runtime (5)")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per sample (64)")
    ap.add_argument("--schema", default="nested", help="schema of parts 2 and 3 (nested)")
    ap.add_argument("--prompt", default="Give me a JSON record:")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (1,2,3)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.runner is None:
        args.runner = subprocess.run(["python", "-m", "executorch_cellcache", "runner-path"],
                                     check=True, capture_output=True, text=True).stdout.strip()
    schemas = load_schemas(args.schemas)
    info = program_info(args.runner, args.model)
    V, eos, tj = info["vocab_size"], info["eos_ids"], info["tokenizer_json"]
    tok = _core.CppTokenizer(info["tokenizer_kind"], tj)
    print(f"program {args.model}: vocab {V}, eos {eos}; runner {args.runner}")

    if "1" in parts:
        print(f"\n1. mask cost per token (fill+accept / mask+advance), us, {args.walks} walks "
              f"of <= {args.walk_len} tokens, vocab {V}")
        print(f"{'schema':10} {'lib':11} {'tokens':>6} {'mean':>8} {'p50':>8} {'p99':>8} "
              f"{'max':>8} {'compile ms':>10}")
        libs = {"xgrammar": None}
        t = time.perf_counter()
        libs["xgrammar"] = _core.CppGrammarCompiler(info["tokenizer_kind"], tj, V, eos)
        print(f"(XGrammar vocabulary: {1e3 * (time.perf_counter() - t):.0f} ms", end="")
        try:
            import llguidance
            import llguidance.numpy  # noqa: F401
        except ImportError:
            if not args.no_llguidance:
                print("(llguidance is not installed: pip install llguidance to compare)")
            args.no_llguidance = True
        if not args.no_llguidance:
            t = time.perf_counter()
            libs["llguidance"] = llguidance.LLTokenizer(tj, n_vocab=V, eos_token=eos[0])
            print(f"; llguidance vocabulary: {1e3 * (time.perf_counter() - t):.0f} ms", end="")
        print(")")
        slow = {lib: [] for lib in libs}
        for name, schema in schemas.items():
            for lib, vocab in libs.items():
                t = time.perf_counter()
                if lib == "xgrammar":
                    new, step = cpp_walker(vocab, json.dumps(schema), V)
                    new()   # matcher() compiles the schema (each walk compiles anew)
                else:
                    new, step = llg_walker(llguidance, vocab, schema, V)
                compile_ms = 1e3 * (time.perf_counter() - t)
                us, events = walks(new, step, args.walks, args.walk_len, args.seed,
                                   {"eos": set(eos)})
                print(f"{name:10} {lib:11} {len(us):6d} {us.mean():8.1f} {pct(us, 50):8.1f} "
                      f"{pct(us, 99):8.1f} {us.max():8.1f} {compile_ms:10.1f}")
                slow[lib] += [(e, name, events) for e in sorted(events, reverse=True)[:3]]
        for lib, rows in slow.items():
            print(f"slowest {lib} tokens (us, schema, walk, position: text before | token):")
            for (us, w, pos, t_), name, events in sorted(rows, reverse=True)[:6]:
                before = b"".join(tok.token_bytes(e[3]) for e in events if e[1] == w
                                  and e[2] < pos).decode(errors="replace")
                print(f"  {us:8.1f} {name:8} w{w:<2d} pos {pos:3d}: {before[-40:]!r} | "
                      f"{tok.token_bytes(t_).decode(errors='replace')!r}")

    results = {}
    schema = schemas[args.schema]
    runner = ids = None
    if "3" in parts:
        runner = Runner(args.model)
        ids = list(tok.encode(args.prompt))
        from executorch_cellcache.runtime import constraints
        print("Python runtime's constraints:", constraints.__doc__.strip().splitlines()[0])
    runs = [("C++", "2", lambda s, r: cpp_run(args, s, r)),
            ("Python", "3", lambda s, r: py_run(args, runner, ids, s, r))]
    runs = [(n, f) for n, p, f in runs if p in parts]
    if runs:
        print(f"\nB=8 decode, {args.max_new} new tokens, temperature 1, schema "
              f"{args.schema!r} vs free; {args.repeats} repeats, ABBA order")
        for r in range(args.repeats):
            order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
            for rt, fn in runs:
                for cfg in order:
                    res = fn(schema if cfg == "schema" else None, r)
                    results.setdefault((rt, cfg), []).append(res)
                    print(f"  rep {r} {rt:6} {cfg:6}: wall decode {res[0]:6.1f} tok/s, forward-only "
                          f"{res[1]:6.1f} tok/s (wall/fwd {res[0] / res[1]:.3f}), mean "
                          f"tokens/sample {res[2]:5.1f}", flush=True)
        print(f"\n{'runtime':8} {'config':7} {'wall tok/s':>10} {'fwd tok/s':>10} "
              f"{'tok/sample':>10} {'wall/fwd':>8}  (medians; wall/fwd: the share of a "
              f"step's time that is the forward, drift-free)")
        for rt, _ in runs:
            med = {cfg: [statistics.median(x[i] for x in results[(rt, cfg)]) for i in range(3)]
                   for cfg in ("free", "schema")}
            share = {cfg: statistics.median(x[0] / x[1] for x in results[(rt, cfg)])
                     for cfg in ("free", "schema")}
            for cfg in ("free", "schema"):
                print(f"{rt:8} {cfg:7} {med[cfg][0]:10.1f} {med[cfg][1]:10.1f} "
                      f"{med[cfg][2]:10.1f} {share[cfg]:8.3f}")
            ratios = [s[0] / f[0] for f, s in zip(results[(rt, "free")], results[(rt, "schema")])]
            print(f"{rt:8} ratio   {med['schema'][0] / med['free'][0]:10.3f} "
                  f"{med['schema'][1] / med['free'][1]:10.3f} {'':10} "
                  f"{share['schema'] / share['free']:8.3f}  (schema/free of medians; "
                  f"per-repeat wall ratios {' '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
