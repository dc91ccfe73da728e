"""Streaming chat load: `cellcache serve` against llama.cpp's `llama-server` on
the same model (a measurement, not a test).

Both servers are started here on loopback with the same thread count:

  llama-server -m GGUF -np NP -c CTX -t THREADS --port P
      NP = max(8, most clients); CTX = NP x (--prompt-budget + --max-tokens)
      rounded up to a power of two (8 x (128 + 64) -> 2048), or --ctx
  cellcache serve PTE --port Q --threads THREADS

and polled on /health until ready. Then, for each client count C, rounds
alternate ours, llama.cpp, ours, llama.cpp, ... (--repeats rounds each; the
machine's speed drifts, so neither server gets all the quiet moments). A round
sends C concurrent streaming /v1/chat/completions requests (one system message
and one of 8 short questions each, request i takes question i mod 8;
temperature 0, max_tokens --max-tokens, stream_options.include_usage) and
measures per request the time to first token (first non-empty content delta),
the total time and the decode time per token ((total - TTFT) / (tokens - 1)),
and per round the aggregate completion tokens/s: the sum of completion tokens
over the round's wall time. Completion tokens come from the final chunk's
`usage`; a server that sends none is counted by its content deltas (the report
says which). The table holds the medians over rounds (of each round's median
per request for the latencies) and the ratio ours / llama.cpp (above 1 is
better for tok/s, below 1 for the times). --json writes every request's figures.

By default every request sets `ignore_eos` (both servers accept it: vLLM's
extension, which llama-server also takes), so replies run to max_tokens on
both sides and the servers do the same amount of work. llama-server bans the
end-of-generation tokens (logit bias -inf); ours keeps sampling past EOS. With
--no-ignore-eos replies may end early and differ in length; tok/s still counts
the tokens actually streamed.

Both servers render the prompt with the model's chat template: ours with the
template the .pte carries, llama-server with the one in the GGUF's metadata.
If the two render differently the prompt token counts differ slightly; the
script prints both servers' usage.prompt_tokens for every question (from a
warm-up round before the measured ones) so a reader can see. Greedy replies may
also differ: the two files are quantized differently (e.g. 8da4w vs Q4_1).

Both servers keep prompt caches by default (our prefix cache; llama-server's
per-slot cache_prompt), and the warm-up round sends the measured prompts, so
every measured round finds its prompts cached on both sides (the usage's
cached_tokens, where a server reports it, is in --json). --no-prompt-cache
turns both off (`--no-prefix-cache`, `--no-cache-prompt`).

Our server admits a request only when its worst case (prompt + max_tokens
cells) fits the program's KV cache (`cellcache_cells_total` on /metrics); the
script warns when C such requests do not fit, since ours then queues some of
them while llama-server's slots hold them all.

  python scripts/bench_serve_chat.py --pte out/smollm2.pte \\
      --llama-server ~/llama.cpp/build/bin/llama-server \\
      [--gguf SmolLM2-135M-Instruct.gguf] [--clients 1,8] [--max-tokens 64] \\
      [--repeats 3] [--threads 2] [--json OUT]

--baseline-checkout DIR runs, instead of llama-server, `cellcache serve` from
another source tree of this project (DIR, with its _core built in place) on
the same .pte: ours against an earlier version of ours (a change must not make
serving slower).

Both servers are killed at exit (also on Ctrl-C, SIGTERM or an error); their
logs stay in a temporary folder the script names.
"""

import argparse
import asyncio
import atexit
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent

SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make food from sunlight?",
    "Give me three tips for learning to cook.",
    "What is the difference between a virus and a bacterium?",
    "Explain what a binary search does.",
    "Why do we have seasons on Earth?",
    "Write a short poem about the sea.",
]

OURS, LLAMA = "ours", "llama.cpp"


def say(line: str = "") -> None:
    print(line, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ servers


class Server:
    """A server process in a session of its own (killed with its children)."""

    def __init__(self, name: str, cmd: List[str], port: int, log: Path,
                 env: Optional[Dict[str, str]] = None):
        self.name, self.cmd, self.port, self.log, self.env = name, cmd, port, log, env
        self.base = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.model_id: Optional[str] = None

    def start(self) -> None:
        out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=self.env)
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, http, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it "
                                   f"was ready; its log ({self.log}) ends:\n{self.log_tail()}")
            try:
                if http.get(f"{self.base}/health").status_code == 200:
                    r = http.get(f"{self.base}/v1/models")
                    if r.status_code == 200:
                        self.model_id = r.json()["data"][0]["id"]
                        return
            except Exception:  # connection refused while it starts, or a half-written reply
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; its log "
                                   f"({self.log}) ends:\n{self.log_tail()}")
            time.sleep(0.25)


def ours_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "?"

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return (f"executorch-cellcache {v('executorch-cellcache')}"
            f"{f' (git {commit})' if commit else ''}, executorch {v('executorch')}")


def llama_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()
             if ln.strip().startswith(("version:", "built with"))]
    return "; ".join(lines) or (r.stdout + r.stderr).strip().splitlines()[-1]


def cellcache_cmd() -> List[str]:
    exe = Path(sys.executable).parent / "cellcache"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("cellcache")
    return [found] if found else [sys.executable, "-m", "executorch_cellcache"]


def ours_cells(http, server: Server) -> Optional[int]:
    try:
        for line in http.get(f"{server.base}/metrics").text.splitlines():
            if line.startswith("cellcache_cells_total"):
                return int(float(line.split()[-1]))
    except Exception:
        pass
    return None


def llama_props(http, server: Server) -> Dict:
    try:
        props = http.get(f"{server.base}/props").json()
    except Exception:
        return {}
    gen = props.get("default_generation_settings", {})
    return {"total_slots": props.get("total_slots"), "n_ctx_per_slot": gen.get("n_ctx"),
            "build_info": props.get("build_info")}


# ------------------------------------------------------------------ clients


async def one_request(client, server: Server, question: str, max_tokens: int,
                      ignore_eos: bool) -> Dict:
    body = {"model": server.model_id,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = None
    deltas, text, usage, finish, timings = 0, [], None, None, None
    async with client.stream("POST", f"{server.base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: "
                               f"{(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                if line.startswith("error:"):
                    raise RuntimeError(f"{server.name}: {line}")
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{server.name}: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for c in chunk.get("choices") or []:
                content = (c.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    deltas += 1
                    text.append(content)
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
    end = time.perf_counter()
    tokens = usage.get("completion_tokens") if usage else None
    source = "usage" if tokens is not None else "deltas"
    if tokens is None:
        tokens = deltas
    ttft = (first if first is not None else end) - t0
    total = end - t0
    return {"question": QUESTIONS.index(question), "ttft_s": ttft, "total_s": total,
            "decode_s_per_token": (total - ttft) / (tokens - 1) if tokens > 1 else None,
            "completion_tokens": tokens, "tokens_from": source, "content_deltas": deltas,
            "prompt_tokens": usage.get("prompt_tokens") if usage else None,
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {})
            .get("cached_tokens"),
            "finish_reason": finish, "text": "".join(text), "usage": usage,
            "timings": timings}


async def run_round(client, server: Server, clients: int, max_tokens: int,
                    ignore_eos: bool) -> Dict:
    t0 = time.perf_counter()
    reqs = await asyncio.gather(*(
        one_request(client, server, QUESTIONS[i % len(QUESTIONS)], max_tokens, ignore_eos)
        for i in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in reqs)
    decode = [r["decode_s_per_token"] for r in reqs if r["decode_s_per_token"] is not None]
    return {"server": server.name, "clients": clients, "wall_s": wall,
            "completion_tokens": tokens, "tok_s": tokens / wall,
            "ttft_s": statistics.median(r["ttft_s"] for r in reqs),
            "total_s": statistics.median(r["total_s"] for r in reqs),
            "decode_s_per_token": statistics.median(decode) if decode else None,
            "requests": reqs}


async def measure(servers: Dict[str, Server], args, clients_list: List[int]) -> Dict:
    import httpx

    most = max(clients_list + [len(QUESTIONS)])
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits,
                                 trust_env=False) as client:
        # Warm-up: every question once on each server (the first forwards allocate, the
        # prompt caches fill), a few tokens each; gives each server's prompt_tokens.
        warm = {}
        for name, server in servers.items():
            t0 = time.perf_counter()
            warm[name] = await run_round(client, server, len(QUESTIONS), 2, args.ignore_eos)
            say(f"warm-up {name}: {len(QUESTIONS)} requests in "
                f"{time.perf_counter() - t0:.1f} s")
        rounds = []
        for clients in clients_list:
            for rep in range(args.repeats):
                for name, server in servers.items():
                    r = await run_round(client, server, clients, args.max_tokens,
                                        args.ignore_eos)
                    r["round"] = rep
                    rounds.append(r)
                    dec = r["decode_s_per_token"]
                    say(f"  C={clients} round {rep + 1}/{args.repeats} {name:<9} "
                        f"{r['tok_s']:7.1f} tok/s  TTFT {r['ttft_s'] * 1e3:7.0f} ms  "
                        f"total {r['total_s'] * 1e3:7.0f} ms  "
                        f"{'-' if dec is None else f'{dec * 1e3:.1f}'} ms/token  "
                        f"({r['completion_tokens']} tokens in {r['wall_s']:.2f} s)")
    return {"warmup": warm, "rounds": rounds}


# ------------------------------------------------------------------ report


def summarize(rounds: List[Dict], clients_list: List[int]) -> Dict:
    out = {}
    for c in clients_list:
        row = {}
        for name in (OURS, LLAMA):
            rs = [r for r in rounds if r["server"] == name and r["clients"] == c]
            dec = [r["decode_s_per_token"] for r in rs if r["decode_s_per_token"] is not None]
            row[name] = {
                "tok_s": statistics.median(r["tok_s"] for r in rs),
                "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                "total_s": statistics.median(r["total_s"] for r in rs),
                "decode_s_per_token": statistics.median(dec) if dec else None,
                "tokens_per_request": statistics.median(
                    q["completion_tokens"] for r in rs for q in r["requests"]),
                "rounds": len(rs)}
        o, l_ = row[OURS], row[LLAMA]
        row["ratio"] = {k: (o[k] / l_[k] if o[k] and l_[k] else None)
                        for k in ("tok_s", "ttft_s", "total_s", "decode_s_per_token")}
        out[str(c)] = row
    return out


def print_table(summary: Dict, repeats: int) -> None:
    def f(v, scale=1.0, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v * scale)

    say()
    say(f"medians over {repeats} round(s); TTFT/total/ms-per-token: each round's median "
        f"request; ratio = ours / llama.cpp (tok/s: >1 ours faster; times: <1 ours faster)")
    head = (f"{'C':>3}  {'server':<10}{'tok/s':>9}{'TTFT ms':>10}{'total ms':>10}"
            f"{'ms/token':>10}{'tok/req':>9}")
    say(head)
    say("-" * len(head))
    for c, row in summary.items():
        for name in (OURS, LLAMA):
            r = row[name]
            say(f"{c:>3}  {name:<10}{f(r['tok_s']):>9}{f(r['ttft_s'], 1e3, '{:.0f}'):>10}"
                f"{f(r['total_s'], 1e3, '{:.0f}'):>10}"
                f"{f(r['decode_s_per_token'], 1e3):>10}{r['tokens_per_request']:>9g}")
        q = row["ratio"]
        say(f"{c:>3}  {'ratio':<10}{f(q['tok_s'], fmt='{:.2f}x'):>9}"
            f"{f(q['ttft_s'], fmt='{:.2f}x'):>10}{f(q['total_s'], fmt='{:.2f}x'):>10}"
            f"{f(q['decode_s_per_token'], fmt='{:.2f}x'):>10}")


def default_gguf() -> str:
    from executorch_cellcache.exporting.packaged_models import resolve

    return str(resolve("smollm2"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pte", default="out/smollm2.pte", help="our exported program (with its "
                    "tokenizer and chat template; default out/smollm2.pte)")
    ap.add_argument("--gguf", help="the same model as GGUF (default: the packaged SmolLM2, "
                    "packaged_models.resolve('smollm2'))")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"),
                    help="a llama.cpp build's llama-server (default: the one on PATH)")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts (1,8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per server and client count")
    ap.add_argument("--threads", type=int, default=2, help="each server's threads")
    ap.add_argument("--prompt-budget", type=int, default=128,
                    help="prompt tokens per llama-server slot when sizing -c (default 128)")
    ap.add_argument("--ctx", type=int, help="llama-server's -c (default: from --prompt-budget)")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let replies end at EOS (default: ignore_eos on both servers)")
    ap.add_argument("--no-prompt-cache", action="store_true",
                    help="start ours with --no-prefix-cache and llama-server with "
                         "--no-cache-prompt")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds per server")
    ap.add_argument("--json", metavar="OUT", help="write the raw figures here")
    ap.add_argument("--baseline-checkout", metavar="DIR",
                    help="instead of llama-server, run `cellcache serve` from another source "
                         "tree of this project (its _core built in place; PYTHONPATH=DIR) on "
                         "the same .pte: ours against an earlier version of ours")
    args = ap.parse_args()
    global LLAMA
    if args.baseline_checkout:
        LLAMA = "baseline"

    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    if not clients_list or min(clients_list) < 1 or args.repeats < 1 or args.max_tokens < 1:
        ap.error("--clients, --repeats and --max-tokens must be positive")
    baseline = args.baseline_checkout
    if baseline and not (Path(baseline) / "executorch_cellcache").is_dir():
        ap.error(f"--baseline-checkout {baseline} holds no executorch_cellcache package")
    if not baseline and (not args.llama_server or not Path(args.llama_server).exists()):
        ap.error(f"no llama-server binary ({args.llama_server!r}); pass --llama-server PATH")
    if not Path(args.pte).exists():
        ap.error(f"no such .pte: {args.pte}")
    gguf = None if baseline else args.gguf or default_gguf()
    if gguf is not None and not Path(gguf).exists():
        ap.error(f"no such GGUF: {gguf}")

    import httpx

    n_par = max(8, max(clients_list))
    ctx = args.ctx
    if ctx is None:
        ctx = 1024
        while ctx < n_par * (args.prompt_budget + args.max_tokens):
            ctx *= 2
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_chat."))
    port_o, port_l = free_port(), free_port()
    cmd_l = [args.llama_server, "-m", gguf, "-np", str(n_par), "-c", str(ctx),
             "-t", str(args.threads), "--port", str(port_l)]
    cmd_o = cellcache_cmd() + ["serve", args.pte, "--port", str(port_o),
                               "--threads", str(args.threads)]
    if args.no_prompt_cache:
        cmd_l.append("--no-cache-prompt")
        cmd_o.append("--no-prefix-cache")
    env_l = None
    if baseline:
        cmd_l = [sys.executable, "-m", "executorch_cellcache", "serve", args.pte, "--port",
                 str(port_l), "--threads", str(args.threads)]
        if args.no_prompt_cache:
            cmd_l.append("--no-prefix-cache")
        env_l = {**os.environ, "PYTHONPATH": str(Path(baseline).resolve())}
    servers = {OURS: Server(OURS, cmd_o, port_o, logs / "ours.log"),
               LLAMA: Server(LLAMA, cmd_l, port_l, logs / f"{LLAMA}.log", env_l)}

    def stop_all():
        for s in servers.values():
            s.stop()

    atexit.register(stop_all)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    versions = {OURS: ours_version(),
                LLAMA: f"the source tree {baseline}" if baseline else
                llama_version(args.llama_server)}
    say(f"{OURS:<10} version: {versions[OURS]}")
    say(f"{LLAMA:<10} version: {versions[LLAMA]}")
    say(f"{OURS:<10} command: {subprocess.list2cmdline(cmd_o)}")
    say(f"{LLAMA:<10} command: {subprocess.list2cmdline(cmd_l)}")
    say(f"server logs: {logs}")
    try:
        for s in servers.values():
            s.start()
        info = {}
        with httpx.Client(timeout=10, trust_env=False) as http:
            t0 = time.monotonic()
            for s in servers.values():
                s.wait_ready(http, args.ready_timeout)
                say(f"{s.name} ready by {time.monotonic() - t0:.1f} s after launch (model "
                    f"'{s.model_id}')")
            info[OURS] = {"cells_total": ours_cells(http, servers[OURS])}
            info[LLAMA] = {"cells_total": ours_cells(http, servers[LLAMA])} if baseline else \
                llama_props(http, servers[LLAMA])
        say(f"{OURS:<10} KV cache cells: {info[OURS]['cells_total']}")
        if not baseline:
            say(f"{LLAMA:<10} slots: {info[LLAMA].get('total_slots')}, context per slot: "
                f"{info[LLAMA].get('n_ctx_per_slot')}")

        result = asyncio.run(measure(servers, args, clients_list))
    finally:
        stop_all()

    # Prompt tokens as each server's template renders them (warm-up round, same order).
    pt = {n: [r["prompt_tokens"] for r in result["warmup"][n]["requests"]] for n in servers}
    say()
    say("usage.prompt_tokens per question (system message + question through each server's "
        "chat template):")
    say(f"  {OURS:<10} {pt[OURS]}")
    say(f"  {LLAMA:<10} {pt[LLAMA]}")
    if pt[OURS] != pt[LLAMA]:
        say("  (they differ: the two chat templates render differently, or the tokenizers "
            "differ)")
    first = {n: next(r for r in result["rounds"] if r["server"] == n)["requests"][0]
             for n in servers}
    for n in servers:
        q = first[n]
        say(f"first measured request, {n}: prompt_tokens {q['prompt_tokens']}, "
            f"completion_tokens {q['completion_tokens']} (from {q['tokens_from']}, "
            f"{q['content_deltas']} content deltas), cached_tokens {q['cached_tokens']}, "
            f"finish {q['finish_reason']}; reply {q['text'][:70]!r}")
    sources = {n: sorted({q["tokens_from"] for r in result["rounds"] if r["server"] == n
                          for q in r["requests"]}) for n in servers}
    for n, src in sources.items():
        if src != ["usage"]:
            say(f"note: {n} sent no usage for some requests; their tokens are content deltas")
    cells = info[OURS]["cells_total"]
    if cells:
        need = max(pt[OURS] or [0]) + args.max_tokens
        for c in clients_list:
            if c * need > cells:
                say(f"note: at C={c}, {c} requests x up to {need} cells exceed our "
                    f"{cells} KV cells: our server queues some of them (llama-server's "
                    f"{n_par} slots of {ctx // n_par} hold them all)")
    per_slot = ctx // n_par
    if not baseline and max(pt[LLAMA] or [0]) + args.max_tokens > per_slot:
        say(f"note: prompt + max_tokens exceeds llama-server's {per_slot} tokens per slot; "
            f"raise --prompt-budget or --ctx")

    summary = summarize(result["rounds"], clients_list)
    print_table(summary, args.repeats)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"pte": args.pte, "gguf": gguf, "llama_server": args.llama_server,
                       "clients": clients_list, "max_tokens": args.max_tokens,
                       "repeats": args.repeats, "threads": args.threads,
                       "ignore_eos": args.ignore_eos, "prompt_cache": not args.no_prompt_cache,
                       "llama_np": n_par, "llama_ctx": ctx, "system": SYSTEM,
                       "questions": QUESTIONS},
            "versions": versions,
            "commands": {OURS: cmd_o, LLAMA: cmd_l},
            "server_info": info,
            "prompt_tokens": pt,
            "summary": summary,
            "warmup": result["warmup"],
            "rounds": result["rounds"]}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
