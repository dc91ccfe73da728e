"""`--threads N`: the ExecuTorch runtime's thread pool (XNNPACK, the optimized
kernels and cellcache::attend run on it), on `cellcache generate/eval/serve/
bench` (runtime/threads.py) and on the C++ runner (cpp/kernels/kernel_threads.h).

The pool is process-wide and a resize replaces it under any program already
loaded, so every resize here happens in a subprocess, before a program loads.
Taking effect is checked on the pool itself (its thread count after the
command, from the same process; the C++ runner's ExecuTorch log line) and the
output must not change (greedy tokens are the same on any number of threads).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.cli import main
from executorch_cellcache.runtime.threads import set_thread_pool_size
from test_core_edges import _NOT_INTS

COMMANDS = ("generate", "eval", "serve", "bench")
# A size the pool does not have by default, so setting it is a real resize.
OTHER = _core.runtime_thread_count() + 1
PROMPT = "The for statement"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_threads(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads N threads of the ExecuTorch runtime's pool" in text
    assert "default: ExecuTorch's choice, one per core" in text


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("value", ["0", "-1", "two", "1025"])
def test_threads_outside_the_range_is_one_line_usage_error(command, value, capsys):
    argv = [command] + ([] if command == "bench" else ["m.pte"]) + ["--threads", value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"cellcache {command}: error: argument --threads: "), err[0]


def test_the_cli_ceiling_is_the_runtime_ceiling():
    from executorch_cellcache.cli import options

    assert options.MAX_THREADS == _core.MAX_RUNTIME_THREADS == 1024


@pytest.mark.parametrize("value", [0, -3, True, 1.5, "2", 1025, 10**9])
def test_set_thread_pool_size_refuses_what_is_not_a_thread_count(value):
    before = _core.runtime_thread_count()
    with pytest.raises(InvalidConfigError, match=r"threads must be an integer in \[1, 1024\]"):
        set_thread_pool_size(value)
    assert _core.runtime_thread_count() == before


@pytest.mark.parametrize("value", [0, -3, 1025, 10**9])
def test_the_core_refuses_a_pool_size_outside_the_range(value):
    before = _core.runtime_thread_count()
    assert _core.set_runtime_thread_count(value) is False
    assert _core.runtime_thread_count() == before


# pybind11 read True as 1 (set_runtime_thread_count(True) left one thread) and,
# converting, truncated np.float32; OTHER as a float would be a real resize.
@pytest.mark.parametrize("value", _NOT_INTS + [float(OTHER), np.float32(OTHER)], ids=repr)
def test_the_core_refuses_a_bool_or_float_pool_size(value):
    before = _core.runtime_thread_count()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _core.set_runtime_thread_count(value)
    assert _core.runtime_thread_count() == before


def test_the_core_takes_a_numpy_integer_pool_size():
    before = _core.runtime_thread_count()
    assert _core.set_runtime_thread_count(np.int64(before)) is True  # its size: a no-op
    assert _core.runtime_thread_count() == before


def _python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_set_thread_pool_size_resizes_the_pool_our_kernels_run_on():
    r = _python("""
        import sys
        from executorch_cellcache.cache import _core
        from executorch_cellcache.runtime.threads import set_thread_pool_size, thread_pool_size
        n = int(sys.argv[1])
        set_thread_pool_size(n)
        set_thread_pool_size(n)  # the same size again: nothing to do
        print(thread_pool_size(), _core.runtime_thread_count())
        set_thread_pool_size(1)
        print(thread_pool_size())
    """, OTHER)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(OTHER), str(OTHER), "1"]
    assert "Resetting threadpool" not in r.stderr  # ExecuTorch's info lines stay hidden


@pytest.mark.slow
def test_generate_and_eval_resize_the_pool_before_loading_and_output_is_unchanged(default_pte,
                                                                                tmp_path):
    """The CLI in one process, then the pool's size from that process."""
    text = tmp_path / "eval.txt"
    text.write_text("The with statement is used to wrap the execution of a block.\n" * 4)
    script = """
        import sys
        from executorch_cellcache import cli
        from executorch_cellcache.cache import _core
        rc = cli.main(sys.argv[1:])
        print(f"rc={rc} pool={_core.runtime_thread_count()}")
    """
    gen = ["generate", default_pte, "--prompt", PROMPT, "--prompt", "A class definition",
           "--max-new-tokens", 8]
    plain, threaded = _python(script, *gen), _python(script, *gen, "--threads", OTHER)
    for r in (plain, threaded):
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert plain.stdout.splitlines()[-1] == f"rc=0 pool={OTHER - 1}"
    assert threaded.stdout.splitlines()[-1] == f"rc=0 pool={OTHER}"
    assert threaded.stdout.splitlines()[:-1] == plain.stdout.splitlines()[:-1]  # same tokens

    ev = _python(script, "eval", default_pte, "--text", text, "--window", 32, "--threads", 1)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert ev.stdout.splitlines()[-1] == "rc=0 pool=1"
    assert "tokens scored (window 32" in ev.stdout


# ---------------------------------------------------------------- the C++ runner


def _runner(runner_exe, *args, stdin=None):
    return subprocess.run([runner_exe, *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_runner_threads_below_one_is_one_error_line(runner_exe, value):
    r = _runner(runner_exe, "--model", "m.pte", "--stdio", "--threads", value)
    assert r.returncode == 2
    assert r.stderr == f"cellcache_runner: error: --threads expects a positive integer, got " \
                       f"'{value}'\n"


def test_runner_threads_above_the_ceiling_is_one_error_line(runner_exe):
    r = _runner(runner_exe, "--model", "m.pte", "--stdio", "--threads", "1025")
    assert r.returncode == 2
    assert r.stderr == "cellcache_runner: error: --threads must be at most 1024, got 1025\n"


def test_runner_help_states_threads(runner_exe):
    r = _runner(runner_exe, "--help")
    assert r.returncode == 0
    assert "--threads T              threads of the ExecuTorch runtime's pool" in r.stdout


@pytest.mark.slow
def test_runner_resizes_the_pool_and_output_is_unchanged(runner_exe, default_pte, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("0 340 344 454\n0 34 396 854\n")
    args = ["--model", default_pte, "--prompts", prompts, "--max-new-tokens", 8]
    plain = _runner(runner_exe, *args, "--verbose")
    threaded = _runner(runner_exe, *args, "--threads", OTHER, "--verbose")
    quiet = _runner(runner_exe, *args, "--threads", OTHER)
    for r in (plain, threaded, quiet):
        assert r.returncode == 0, r.stderr[-3000:]
    assert threaded.stdout == plain.stdout == quiet.stdout
    assert f"Resetting threadpool to {OTHER} threads" in threaded.stderr  # ExecuTorch's own line
    assert "Resetting threadpool" not in plain.stderr + quiet.stderr
    line = json.dumps({"id": 1, "prompt": [0, 340, 344, 454], "max_new_tokens": 2})
    stdio = _runner(runner_exe, "--model", default_pte, "--stdio", "--threads", 1,
                    stdin=line + "\n")
    assert stdio.returncode == 0, stdio.stderr
    assert '"finish":"length"' in stdio.stdout
