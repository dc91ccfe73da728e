"""cellcache_runner serves a pooled program (issue #25 phase 2): a tiny Mistral
(every layer sliding) and Gemma3 (sliding and full layers) of
tests/model_configs.py exported with a pool per window policy (conftest.py
``pooled_pte``: a windowed pool too small to keep 8 sequences' positions, so
cells are reclaimed and reused), 8 prompts decoding several windows past
WINDOW, and a --stdio conversation whose turns reuse the previous turn's
cells. The oracle is transformers eager: the greedy continuation of each
prompt alone, computed here by argmax over the full sequence each step.
"""

import json
import re
import subprocess

import pytest
import torch

pytestmark = pytest.mark.slow

MAX_NEW = 30  # with prompts of 4-11 tokens: positions up to 40, 6 windows of 6 past W


def _prompts(vocab):
    prompts = [[(37 * i + 11 * j) % (vocab - 3) + 3 for j in range(4 + i)] for i in range(8)]
    prompts[7] = prompts[6] + [5, 6]  # shares prompt 6 whole: a prefix-cache candidate
    return prompts


def _eager_greedy(model, prompt, max_new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def oracle():
    """get(arch) -> eager greedy continuations of _prompts, computed once."""
    from model_configs import make_model

    done = {}

    def get(arch):
        if arch not in done:
            model = make_model(arch)
            model.set_attn_implementation("eager")
            prompts = _prompts(model.config.vocab_size)
            done[arch] = prompts, [_eager_greedy(model, p, MAX_NEW) for p in prompts]
        return done[arch]

    return get


def _run(runner_exe, tmp_path, pte, prompts, *flags):
    path = tmp_path / "prompts.txt"
    path.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
    out = subprocess.run([runner_exe, "--model", str(pte), "--prompts", str(path),
                          "--max-new-tokens", str(MAX_NEW), "--no-stop-on-eos", *flags],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = {}
    for line in out.stdout.splitlines():
        key, ids = line.split(":")
        i, j = map(int, key.split())
        results.setdefault(i, []).append([int(t) for t in ids.split()])
    return [results[i] for i in range(len(prompts))], out.stderr


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize("flags", [[], ["--n", "2"], ["--speculative", "lookup", "--draft-max",
                                                      "4"]], ids=["n1", "forks", "lookup"])
def test_the_runner_decodes_a_pooled_program_as_transformers(runner_exe, pooled_pte, oracle,
                                                            tmp_path, arch, flags):
    from conftest import POOL_FULL_CELLS, POOL_WINDOW_CELLS
    from model_configs import WINDOW

    pte = pooled_pte(arch)
    prompts, want = oracle(arch)
    got, stderr = _run(runner_exe, tmp_path, pte, prompts, *flags)
    n = int(flags[1]) if flags[:1] == ["--n"] else 1
    assert got == [[w] * n for w in want]
    # Reclaim was needed: the positions placed exceed the windowed pool.
    assert sum(len(p) + MAX_NEW - 1 for p in prompts) > POOL_WINDOW_CELLS
    assert "error" not in stderr
    # The summary's peaks: pool 0 (the window pool, layer 0's) within its cells,
    # and for Gemma3 each pool named.
    peak = int(re.search(rf"peak cells (\d+) of {POOL_WINDOW_CELLS}", stderr).group(1))
    assert 0 < peak <= POOL_WINDOW_CELLS
    if arch == "gemma3":
        assert re.search(rf"peak cells {peak} of {POOL_WINDOW_CELLS} \(window-{WINDOW} pool: "
                         rf"{peak} of {POOL_WINDOW_CELLS}, full-attention pool: \d+ of "
                         rf"{POOL_FULL_CELLS}\)", stderr), stderr


def _turn(proc, rid, prompt, max_new):
    """Sends one --stdio request and reads its answers up to its finish line:
    (tokens, usage)."""
    proc.stdin.write(json.dumps({"id": rid, "prompt": prompt, "max_new_tokens": max_new,
                                 "stop_on_eos": False}) + "\n")
    proc.stdin.flush()
    tokens = []
    while True:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        answer = json.loads(line)
        assert answer.get("id") == rid and "error" not in answer, answer
        if "token" in answer:
            tokens.append(answer["token"])
        if "finish" in answer:
            return tokens, answer["usage"]


def test_a_stdio_conversation_on_a_pooled_program_reuses_what_its_pools_hold(runner_exe,
                                                                             pooled_pte):
    """Gemma3 with a pool per window policy, through --stdio: each turn sends
    the history plus new tokens; the previous turn's entry serves it whole
    (its windowed pool holds the window at its end), and the tokens are
    transformers' greedy ones. A request sharing only the conversation's
    first tokens gets nothing cached: the windowed pool gave up those cells."""
    from model_configs import WINDOW, make_model

    model = make_model("gemma3")
    model.set_attn_implementation("eager")
    proc = subprocess.Popen([runner_exe, "--model", str(pooled_pte("gemma3")), "--stdio"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        history = [(5 * j + 7) % 300 + 3 for j in range(8)]
        previous = None
        for turn in range(4):
            got, usage = _turn(proc, f"turn{turn}", history, 8)
            assert got == _eager_greedy(model, history, 8), f"turn {turn}"
            want_cached = 0 if previous is None else len(previous) + 8 - 1
            assert usage["cached_tokens"] == want_cached, f"turn {turn}"
            previous = list(history)
            history += got + [40 + turn, 41, 42]
        assert len(history) > 6 * WINDOW
        branch = history[:WINDOW + 2] + [7, 8, 9]
        got, usage = _turn(proc, "branch", branch, 6)
        assert usage["cached_tokens"] == 0
        assert got == _eager_greedy(model, branch, 6)
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        stderr = proc.stderr.read()
        held = re.search(r"(\d+) cells held at exit, (\d+) of them by the prefix cache", stderr)
        assert held and held.group(1) == held.group(2), stderr  # nothing leaked
    finally:
        proc.kill()
