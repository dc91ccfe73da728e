"""Fixtures shared by several test modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEFAULT_CELLS = 512
DEFAULT_STEP = 32

# Modules that take minutes (exports of every architecture and quantization, the real
# model's export, a wheel's C++ build, the benchmark, the docs' examples; the chat page's
# browser and the emulated aarch64 runner when their builds are not there yet), started
# first, longest first (a loaded full run, 2026-12-07): pytest-xdist's --dist loadfile
# deals whole modules to the workers in collection order (pytest.ini turns its reordering
# by test count off), so a long module collected last runs alone while the other worker
# idles. test_speculative.py is left in its place: it reuses test_export_models.py's
# programs (conftest.arch_exports) once they are made.
LONG_MODULES = ("test_export_models.py", "test_gguf.py", "test_quantize.py", "test_wheel.py",
                "test_bench.py", "test_default_model_eval.py", "test_readme_examples.py",
                "test_structured_output.py", "test_serve_chat_page.py", "test_aarch64.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as collected


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The file ``make(path)`` writes, made once per test run: pytest-xdist's
    workers (scripts/test.sh runs one per core) share one copy, the first to
    ask making it under a file lock while the others wait (pytest-xdist's
    recipe for session fixtures). ``make`` writes a temporary name, renamed
    when it returns, so a failed make leaves nothing another worker would take."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base directory, above every worker's own
    path = root / "made_once" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.exists():
            partial = path.with_name(f"partial-{path.name}")
            make(partial)
            partial.replace(path)
    return path


def cli_export(path: Path, *args) -> None:
    """``cellcache export ARGS --out PATH`` as a user runs it (``python -m
    executorch_cellcache``, in a subprocess): it must succeed without a
    traceback, write the program and say so."""
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    r = subprocess.run([sys.executable, "-m", "executorch_cellcache", "export", *map(str, args),
                        "--out", str(path)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert path.is_file() and path.stat().st_size > 0
    assert f"wrote {path}" in r.stdout, r.stdout


@pytest.fixture(scope="session")
def default_pte(tmp_path_factory):
    """The embedded default model (trained, BPE tokenizer) exported once per run:
    512 cells, 32 tokens per step. Exported by the command line (``cellcache
    export``, checked by cli_export), which tests/test_cli.py then runs its
    commands on: the same program as ``ecc.export(None, path, n_cells=512,
    max_tokens_per_step=32)``."""
    return made_once(tmp_path_factory, "default.pte", lambda path: cli_export(
        path, "--cells", DEFAULT_CELLS, "--max-tokens-per-step", DEFAULT_STEP))


# Prompts of the runner tests, as text and as the default model's token ids.
DEFAULT_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived",
]


@pytest.fixture(scope="session")
def default_prompts():
    """DEFAULT_TEXTS as the default model's token ids, each starting with its BOS (0)."""
    from executorch_cellcache.exporting.default_model import CHECKPOINT
    from executorch_cellcache.runtime.tokenizer import HFTokenizer

    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    encoded = [tok.encode(t) for t in DEFAULT_TEXTS]
    assert all(p[0] == 0 for p in encoded)
    return encoded


@pytest.fixture(scope="session")
def default_8da4w_pte(tmp_path_factory):
    """The embedded default model 8da4w (group 32) with an int8 embedding and
    the K/V dtype a quantized export defaults to, exported once per run: 512
    cells, 32 tokens per step."""
    import executorch_cellcache as ecc

    return made_once(tmp_path_factory, "default-8da4w.pte", lambda path: ecc.export(
        None, path, n_cells=DEFAULT_CELLS, max_tokens_per_step=DEFAULT_STEP, quantize="8da4w",
        embedding_quantize="8"))


@pytest.fixture(scope="session")
def default_int8_kv_pte(tmp_path_factory):
    """The embedded default model with int8 K/V (issue 24) and fp32 weights,
    exported once per run: 512 cells, 32 tokens per step."""
    import executorch_cellcache as ecc

    return made_once(tmp_path_factory, "default-int8-kv.pte", lambda path: ecc.export(
        None, path, n_cells=DEFAULT_CELLS, max_tokens_per_step=DEFAULT_STEP, kv_dtype="int8"))


# ------------------------------------------------------- a cell pool per window policy, once
POOL_FULL_CELLS = 320   # the full-attention pool
POOL_WINDOW_CELLS = 120  # each windowed pool (window model_configs.WINDOW)
POOL_MARGIN = 4         # retained_margin
POOL_STEP = 8           # max_tokens_per_step


@pytest.fixture(scope="session")
def pooled_pte(tmp_path_factory):
    """get(arch) -> the .pte of tests/model_configs.py's ``arch`` (seeded, as
    make_model(arch)) with a pool per window policy (issue #25): the windowed
    pool of POOL_WINDOW_CELLS cells, fewer than 8 sequences' windows and
    steps, so reclaimed cells are reused; made once per run for every worker."""
    import executorch_cellcache as ecc
    from model_configs import WINDOW, make_model

    def get(arch):
        return made_once(tmp_path_factory, f"{arch}-pools.pte", lambda path: ecc.export(
            make_model(arch), path, n_cells=POOL_FULL_CELLS, max_tokens_per_step=POOL_STEP,
            window_cells={WINDOW: POOL_WINDOW_CELLS}, retained_margin=POOL_MARGIN))
    return get


# ---------------------------------------------------------------- every architecture, once
ARCH_CELLS = 128
ARCH_STEP = 32     # max_tokens_per_step


@pytest.fixture(scope="session")
def arch_exports(tmp_path_factory):
    """get(arch) -> (eager oracle, export result, CPU seconds): each architecture
    of tests/model_configs.py (seeded, windows shorter than the test sequences)
    exported once per run with ARCH_CELLS cells and ARCH_STEP tokens a step, for
    every worker (made_once; the result and the exporting worker's CPU seconds
    beside the program, pickled). Each worker builds its own oracle: make_model
    is seeded. Used by tests/test_export_models.py and tests/test_speculative.py."""
    import dataclasses
    import pickle
    import time

    from model_configs import make_model

    from executorch_cellcache import export

    cache = {}

    def get(arch):
        if arch not in cache:
            oracle = make_model(arch)
            oracle.set_attn_implementation("eager")
            name = f"arch-{arch}.pte"

            def make(path):
                # export deep-copies the model, so the oracle's config is never touched.
                cpu0 = time.process_time()
                result = export(oracle, path, n_cells=ARCH_CELLS, max_tokens_per_step=ARCH_STEP)
                cpu = time.process_time() - cpu0
                result = dataclasses.replace(result, path=path.with_name(name))  # once renamed
                path.with_name(f"{name}.result").write_bytes(pickle.dumps((result, cpu)))

            path = made_once(tmp_path_factory, name, make)
            assert oracle.config._attn_implementation == "eager"
            result, cpu = pickle.loads(path.with_name(f"{name}.result").read_bytes())
            cache[arch] = (oracle, result, cpu)
        return cache[arch]

    return get


# ---------------------------------------------------------------- the Runner tests' programs
# (tests/test_runner_*.py; constants and helpers in tests/runner_support.py)


@pytest.fixture(scope="session")
def oracle_and_paths(tmp_path_factory):
    """(eager transformers oracle, roomy .pte, tight .pte, eos id): a seeded tiny
    Llama exported once per run with 256 and 48 cells, 16 tokens per step."""
    from runner_support import export_programs

    return export_programs(lambda name, make: made_once(tmp_path_factory, f"runner-{name}",
                                                        make))


@pytest.fixture(scope="session")
def oracle(oracle_and_paths):
    return oracle_and_paths[0]


@pytest.fixture(scope="session")
def roomy_pte(oracle_and_paths):
    return oracle_and_paths[1]


@pytest.fixture(scope="session")
def tight_pte(oracle_and_paths):
    return oracle_and_paths[2]


@pytest.fixture(scope="module")
def runner(roomy_pte):
    """The roomy program's Runner, one per module, without the prefix cache:
    the runner tests count prefill tokens, steps and free cells after each call
    (the prefix cache has its own tests). test_serve.py and
    test_default_model_eval.py define a ``runner`` of their own."""
    import executorch_cellcache as ecc

    return ecc.Runner(roomy_pte, prefix_cache=False)


@pytest.fixture(scope="module")
def baseline(runner):
    """(generate kwargs, their output on PROMPTS[:2]) before a test tries bad
    input: runner_support.still_works checks the runner still gives it."""
    from runner_support import PROMPTS

    kw = {"max_new_tokens": 6, "n": 2, "stop_on_eos": False}
    return kw, runner.generate(PROMPTS[:2], **kw)


@pytest.fixture(scope="session")
def runner_exe():
    """The C++ runner: $CELLCACHE_RUNNER when set (a build of one's own), else
    `python -m executorch_cellcache runner-path` (the installed one)."""
    exe = os.environ.get("CELLCACHE_RUNNER")
    if exe:
        assert os.access(exe, os.X_OK), f"CELLCACHE_RUNNER={exe} is not an executable"
        return exe
    out = subprocess.run([sys.executable, "-m", "executorch_cellcache", "runner-path"],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"runner-path failed: {out.stderr}"
    return out.stdout.strip()
