"""Load measurement of `cellcache serve` (issue 12; a measurement, not a test).

The bench model (bench/common.py FULL: SmolLM-135M-shaped Llama, random
weights, 4096 cells; its export is cached by `cellcache bench`'s ProgramCache
and reused here) serves the same 8 streaming completion requests (random
128-token prompts, greedy, 64 new tokens) from 1, 4 and 8 concurrent clients
over HTTP on loopback. Reported per load: time to first token, inter-token
latency (medians) and aggregate generated tokens/s. Side by side in the same
run, alternated round by round (the machine's speed drifts):
- `Runner.generate` with the same 8 requests in one call (the batching the
  server must keep: target >= 0.9x at 8 clients);
- one request at a time through our Runner, the stand-in for ExecuTorch's
  example server, which serves one request at a time.
Targets: 8 clients >= 3x one client's aggregate, >= 0.9x Runner.generate.

The program carries no tokenizer, so the server renders each token as " <id>"
(one text chunk per token).

  python scripts/bench_serve.py [--quick] [--repeats 3] [--pte BENCH.pte] [--json OUT]
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np


class IdTokenizer:
    """Token ids as text: " 17 4 9" (the bench program carries no tokenizer)."""

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)

    def token_bytes(self, token):
        return f" {token}".encode()

    def token_name(self, token):
        return None


def _serve(pte: str, port: int) -> None:
    import uvicorn

    from executorch_cellcache.serving.app import create_app

    uvicorn.run(create_app(pte, tokenizer=IdTokenizer()), host="127.0.0.1", port=port,
                log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, base, prompt, new_tokens, out):
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens, text = [], 0, ""
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    times.append(time.perf_counter())
                    text += c["text"]
    out.append({"ttft": times[0] - t0, "gaps": list(np.diff(times)), "tokens": tokens,
                "ids": [int(t) for t in text.split()]})


async def _load(base, prompts, new_tokens, clients):
    import httpx

    results, gate = [], asyncio.Semaphore(clients)

    async def run(prompt):
        async with gate:
            await _one(client, base, prompt, new_tokens, results)

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft": statistics.median(r["ttft"] for r in results),
            "itl": statistics.median(g for r in results for g in r["gaps"]),
            "ids": sorted(r["ids"] for r in results)}


def _runner_batch(runner, prompts, new_tokens):
    t0 = time.perf_counter()
    out = runner.generate(prompts, new_tokens)
    wall = time.perf_counter() - t0
    return {"tok_s": sum(len(s[0]) for s in out) / wall, "ids": sorted(s[0] for s in out)}


def _runner_one_at_a_time(runner, prompts, new_tokens):
    t0 = time.perf_counter()
    out = [runner.generate([p], new_tokens)[0] for p in prompts]
    wall = time.perf_counter() - t0
    return {"tok_s": sum(len(s[0]) for s in out) / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny bench model, one repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--cache-dir", default=os.environ.get(
        "CELLCACHE_BENCH_CACHE", str(Path.home() / ".cache" / "executorch-cellcache")))
    ap.add_argument("--pte", help="an exported bench program to use instead of the cached one "
                                  "(FULL setup, no tokenizer)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()

    from executorch_cellcache.bench.common import FULL, QUICK, ProgramCache
    from executorch_cellcache.bench.ours import main_program
    from executorch_cellcache.runtime.runner import Runner

    def say(line):
        print(line, file=sys.stderr, flush=True)

    setup = QUICK if args.quick else FULL
    repeats = 1 if args.quick else args.repeats
    programs = ProgramCache(Path(args.cache_dir) / "bench", say)
    pte = Path(args.pte) if args.pte else main_program(setup, programs, say)[0]
    rng = np.random.default_rng(0)
    vocab = setup.model["vocab_size"]
    prompt_len = min(args.prompt_len, setup.prefill_len)
    prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(8)]

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(str(pte), port),
                                                          daemon=True)
    server.start()
    runner = Runner(pte)
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        # Warm up both sides (first forwards allocate), then alternate the loads.
        asyncio.run(_load(base, prompts[:2], 4, 2))
        runner.generate(prompts[:2], 4)
        rows = {k: [] for k in ("serve_1", "serve_4", "serve_8", "runner_batch",
                                "runner_one_at_a_time")}
        for rep in range(repeats):
            say(f"round {rep + 1}/{repeats}")
            for clients in (1, 4, 8):
                rows[f"serve_{clients}"].append(
                    asyncio.run(_load(base, prompts, args.new_tokens, clients)))
            rows["runner_batch"].append(_runner_batch(runner, prompts, args.new_tokens))
            rows["runner_one_at_a_time"].append(
                _runner_one_at_a_time(runner, prompts, args.new_tokens))
    finally:
        server.terminate()
        server.join(30)

    expected = rows["runner_batch"][0]["ids"]
    same = all(r["ids"] == expected for k, rs in rows.items() if k.startswith("serve")
               for r in rs)

    def med(key, field):
        return statistics.median(r[field] for r in rows[key])

    fig = {k: {"tok_s": med(k, "tok_s")} for k in rows}
    for c in (1, 4, 8):
        fig[f"serve_{c}"].update(ttft_s=med(f"serve_{c}", "ttft"), itl_s=med(f"serve_{c}", "itl"))
    print(f"bench model: {setup.model['num_hidden_layers']} layers, hidden "
          f"{setup.model['hidden_size']}, {setup.n_cells} cells; 8 requests of {prompt_len} "
          f"prompt tokens, {args.new_tokens} new tokens, greedy; medians of {repeats}")
    print(f"{'load':<34}{'tok/s':>8}{'TTFT ms':>10}{'ITL ms':>9}")
    for c in (1, 4, 8):
        f = fig[f"serve_{c}"]
        print(f"{f'serve, {c} streaming client(s)':<34}{f['tok_s']:>8.1f}"
              f"{f['ttft_s'] * 1e3:>10.0f}{f['itl_s'] * 1e3:>9.1f}")
    print(f"{'Runner.generate, 8 in one call':<34}{fig['runner_batch']['tok_s']:>8.1f}")
    print(f"{'Runner, one request at a time':<34}{fig['runner_one_at_a_time']['tok_s']:>8.1f}")
    s1, s8, rb = fig["serve_1"]["tok_s"], fig["serve_8"]["tok_s"], fig["runner_batch"]["tok_s"]
    print(f"8 clients vs 1 client: {s8 / s1:.2f}x (target >= 3)")
    print(f"8 clients vs Runner.generate batch: {s8 / rb:.2f}x (target >= 0.9)")
    print(f"8 clients vs one at a time (ExecuTorch example server's way): "
          f"{s8 / fig['runner_one_at_a_time']['tok_s']:.2f}x")
    print(f"server tokens equal Runner.generate's: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": fig, "same_tokens": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
