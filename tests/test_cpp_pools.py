"""cellcache_runner serves a pooled program (issue #25 phase 2): a tiny Mistral
(every layer sliding) and Gemma3 (sliding and full layers) of
tests/model_configs.py exported with a pool per window policy (conftest.py
``pooled_pte``: a windowed pool too small to keep 8 sequences' positions, so
cells are reclaimed and reused), 8 prompts decoding several windows past
WINDOW. The oracle is transformers eager: the greedy continuation of each
prompt alone, computed here by argmax over the full sequence each step.
"""

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
    from conftest import POOL_WINDOW_CELLS

    pte = pooled_pte(arch)
    prompts, want = oracle(arch)
    got, stderr = _run(runner_exe, tmp_path, pte, prompts, *flags)
    n = int(flags[1]) if flags[:1] == ["--n"] else 1
    assert got == [[w] * n for w in want]
    # Reclaim was needed: the positions placed exceed the windowed pool.
    assert sum(len(p) + MAX_NEW - 1 for p in prompts) > POOL_WINDOW_CELLS
    assert "error" not in stderr
