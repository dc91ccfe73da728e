"""The runtime's thread pool with workers that spin before they sleep
(cpp/kernels/pool_executor.h, executorch_cellcache/cache/pool_executor.py).

The oracle for values is the same program run on pthreadpool's own workers
(CELLCACHE_POOL_SPIN_US=0) in another process: logits must be bitwise equal,
the pools differing only in which threads run the work. That the workers are
ours is read from the library (pools created through it, workers running) and
from the attention kernel's count of the pool threads that ran its work.
Every run is a fresh process: the pool is process-wide and made once.
"""

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ENV = "CELLCACHE_POOL_SPIN_US"

# Prefill 24 tokens (logits for each) on a fresh runner; prints what the pool
# and the library say, and the logits.
_FORWARD = textwrap.dedent("""
    import json, os, sys
    from executorch_cellcache.cache import _core, pool_executor
    from executorch_cellcache.runtime.threads import set_thread_pool_size
    default_threads = _core.runtime_thread_count()  # ExecuTorch's pool at its default size
    if int(sys.argv[2]):
        set_thread_pool_size(int(sys.argv[2]))
    from executorch_cellcache.runtime.runner import Runner

    def forward(runner):
        seq = runner.cache.seq_new()
        tokens = [(7 * i + 3) % runner.info.vocab_size for i in range(24)]
        out = runner.step([seq] * 24, tokens, list(range(24)), list(range(24)))
        runner.cache.seq_free(seq)
        return out.tolist()

    runner = Runner(sys.argv[1], prefix_cache=False)
    _core.reset_attend_threads_used()
    logits = forward(runner)
    report = {"pools": pool_executor.pools(), "workers": pool_executor.workers(),
              "spin_us": pool_executor.spin_us(), "threads": _core.runtime_thread_count(),
              "attend_threads": _core.attend_threads_used(), "default_threads": default_threads,
              "logits": logits}
    if sys.argv[3] == "fork":
        # A child after fork(): ExecuTorch gives it a new pool; the loaded
        # program keeps the parent's, whose workers did not survive the fork.
        pid = os.fork()
        if pid == 0:
            os._exit(0 if forward(runner) == logits else 3)
        _, status = os.waitpid(pid, 0)
        report["child_status"] = status
        report["parent_again"] = forward(runner) == logits
    print(json.dumps(report))
""")


def _report(script, *args, env_value=None, extra_env=(), python_flags=(), timeout=300):
    """Runs ``script`` in a fresh Python (CELLCACHE_POOL_SPIN_US = env_value,
    unset when None) and returns the JSON its last output line holds."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    env.update(extra_env)
    out = subprocess.run([sys.executable, *python_flags, "-c", script, *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(pte, env_value, threads=0, mode="plain", timeout=300):
    return _report(_FORWARD, pte, threads, mode, env_value=env_value, timeout=timeout)


@pytest.fixture(scope="module")
def own_workers(default_pte):
    """The program on pthreadpool's own workers: the values' oracle."""
    report = _run(default_pte, "0")
    assert report["pools"] == 0 and report["workers"] == 0 and report["spin_us"] == 0
    return report


@pytest.mark.slow
@pytest.mark.parametrize("env_value", [None, "", "1000", "50", "1000000"])
def test_the_runtime_pool_runs_on_these_workers_with_the_same_logits(default_pte, own_workers,
                                                                     env_value):
    report = _run(default_pte, env_value)
    assert report["spin_us"] == (int(env_value) if env_value else 1000)
    if report["threads"] > 1:
        assert report["pools"] == 1, report
        assert report["workers"] == report["threads"] - 1, report
    assert np.array_equal(np.array(report["logits"]), np.array(own_workers["logits"]))


@pytest.mark.slow
def test_a_resized_pool_gets_as_many_workers_and_every_thread_works(default_pte, own_workers):
    report = _run(default_pte, None, threads=3)
    assert report["threads"] == 3
    # ExecuTorch made a pool at its default size, then the resize made another;
    # the workers are as many as the larger of the two needs (more than 2 on a
    # machine of more than 3 cores).
    assert report["pools"] >= 1, report
    assert report["workers"] == max(3, report["default_threads"]) - 1, report
    assert report["attend_threads"] == 3, report
    assert np.array_equal(np.array(report["logits"]), np.array(own_workers["logits"]))


@pytest.mark.slow
def test_one_thread_runs_alone(default_pte, own_workers):
    # A pool of one thread is pthreadpool's own (nothing to schedule); the
    # workers of ExecuTorch's default-size pool, made before the resize, sleep.
    report = _run(default_pte, None, threads=1)
    assert report["threads"] == 1 and report["attend_threads"] <= 1
    assert np.array_equal(np.array(report["logits"]), np.array(own_workers["logits"]))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_runs_the_program_and_the_parent_goes_on(default_pte, own_workers):
    report = _run(default_pte, None, threads=2, mode="fork", timeout=120)
    assert os.WIFEXITED(report["child_status"]) and os.WEXITSTATUS(report["child_status"]) == 0, \
        report["child_status"]
    assert report["parent_again"] is True
    assert np.array_equal(np.array(report["logits"]), np.array(own_workers["logits"]))


# Forks right after forwards, when the pool's worker is still inside
# pthreadpool's loop (it spins there ~1000 pauses before returning to ours):
# a child that then exits normally destroys ExecuTorch's pool (a static) and
# waits for every worker task of it. One the parent was running at the fork
# has no thread in the child: it waited forever (4 of 10 children hung).
_FORK_AFTER_FORWARDS = textwrap.dedent("""
    import os, signal, sys
    from executorch_cellcache.runtime.runner import Runner
    runner = Runner(sys.argv[1], prefix_cache=False)
    tokens = [(7 * i + 3) % runner.info.vocab_size for i in range(24)]
    statuses = []
    for _ in range(int(sys.argv[2])):
        seq = runner.cache.seq_new()
        runner.step([seq] * 24, tokens, list(range(24)), list(range(24)))
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hung child dies of SIGALRM
            sys.exit(0)  # a child that does something else and returns
        statuses.append(os.waitpid(pid, 0)[1])
        runner.cache.seq_free(seq)
    print(statuses)
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_child_forked_right_after_a_forward_exits(default_pte):
    statuses = _report(_FORK_AFTER_FORWARDS, default_pte, 12, timeout=600)
    assert statuses == [0] * 12, [os.WTERMSIG(s) if os.WIFSIGNALED(s) else s for s in statuses]


@pytest.mark.parametrize("value", ["abc", "-1", "1000001", "1e3", "0x10", " 5", "5 ", "+5",
                                   "99999999999999999999999"])
def test_a_bad_spin_is_a_clear_error_at_import(value):
    env = {**os.environ, ENV: value}
    out = subprocess.run([sys.executable, "-c", "import executorch_cellcache"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("executorch_cellcache.cache.errors.InvalidConfigError: "
                           f"{ENV} must be an integer number of microseconds in [0, 1000000]"), last
    assert f"got '{value}'" in last


def test_the_cpp_runner_refuses_a_bad_spin_in_one_line(runner_exe, tmp_path):
    env = {**os.environ, ENV: "soon"}
    out = subprocess.run([runner_exe, "--model", str(tmp_path / "absent.pte"), "--prompts",
                          str(tmp_path / "absent.txt")], capture_output=True, text=True, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{ENV} must be an integer number of microseconds" in lines[0] \
        and "got 'soon'" in lines[0], lines
    assert out.returncode != -signal.SIGSEGV


def test_the_cpp_runner_help_names_the_setting(runner_exe):
    out = subprocess.run([runner_exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert ENV in " ".join(out.stdout.split())


# Regions straight on a pool made by the hooked pthreadpool_create (ctypes
# callbacks take the GIL, so the work is tiny): every item of every region
# runs exactly once, with regions back to back and after gaps longer than the
# spin (workers asleep), on pools whose extra threads a worker must schedule
# (pthreadpool fans out two at a time), and destroying a pool returns.
_REGIONS = textwrap.dedent("""
    import ctypes, json, sys, threading, time
    from executorch_cellcache.cache import pool_executor
    lib = ctypes.CDLL(str(pool_executor._PATH))
    lib.pthreadpool_create.restype = ctypes.c_void_p
    lib.pthreadpool_create.argtypes = [ctypes.c_size_t]
    lib.pthreadpool_get_threads_count.restype = ctypes.c_size_t
    lib.pthreadpool_get_threads_count.argtypes = [ctypes.c_void_p]
    TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
    lib.pthreadpool_parallelize_1d.argtypes = [ctypes.c_void_p, TASK, ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_uint32]
    lib.pthreadpool_destroy.argtypes = [ctypes.c_void_p]
    threads, regions, items = int(sys.argv[1]), int(sys.argv[2]), 48
    counts, idents = [0] * items, set()
    def item(_, i):
        counts[i] += 1
        idents.add(threading.get_ident())
        time.sleep(50e-6)  # lets go of the GIL, so the other threads get items too
    task = TASK(item)
    pool = lib.pthreadpool_create(threads)
    size = lib.pthreadpool_get_threads_count(pool)
    for r in range(regions):
        lib.pthreadpool_parallelize_1d(pool, task, None, items, 0)
        if r % 10 == 9:
            time.sleep(0.004)  # longer than the 1000 us spin: the workers sleep
    lib.pthreadpool_destroy(pool)
    print(json.dumps({"size": size, "counts": counts, "threads_seen": len(idents),
                      "pools": pool_executor.pools(), "workers": pool_executor.workers()}))
""")


@pytest.mark.parametrize("threads", [2, 3, 6])
def test_every_item_of_every_region_runs_once_and_a_pool_is_destroyed(threads):
    report = _report(_REGIONS, threads, 60, timeout=120)
    assert report["size"] == threads
    assert report["counts"] == [60] * 48
    assert report["pools"] == 1 and report["workers"] == threads - 1, report
    assert 2 <= report["threads_seen"] <= threads  # the workers ran items, not the caller alone


# The spin itself: regions 200 us apart (longer than pthreadpool's own ~10 us
# spin, shorter than ours) on a hooked pool. A worker that spins between them
# never blocks; one that sleeps blocks once a region (a voluntary context
# switch in /proc; a yield or a preemption is not one). The task is libc's
# free() with a NULL context, a C function: ctypes callbacks would take the GIL
# and block the workers on it.
_SPIN = textwrap.dedent("""
    import ctypes, json, os, sys, threading, time
    from executorch_cellcache.cache import pool_executor
    lib = ctypes.CDLL(str(pool_executor._PATH))
    lib.pthreadpool_create.restype = ctypes.c_void_p
    lib.pthreadpool_create.argtypes = [ctypes.c_size_t]
    lib.pthreadpool_parallelize_1d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_uint32]
    lib.pthreadpool_destroy.argtypes = [ctypes.c_void_p]
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)

    def blocked():  # voluntary context switches of every thread but this one
        total, me = 0, threading.get_native_id()
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != me:
                try:
                    status = open(f"/proc/self/task/{tid}/status").read()
                except FileNotFoundError:
                    continue
                total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return total

    regions = int(sys.argv[1])
    pool = lib.pthreadpool_create(2)
    lib.pthreadpool_parallelize_1d(pool, free, None, 64, 0)
    before = blocked()
    for _ in range(regions):
        lib.pthreadpool_parallelize_1d(pool, free, None, 64, 0)
        time.sleep(200e-6)
    sleeps = blocked() - before
    lib.pthreadpool_destroy(pool)
    print(json.dumps({"sleeps": sleeps, "pools": pool_executor.pools()}))
""")


@pytest.mark.parametrize("env_value", [None, "0"])
def test_workers_spin_through_short_gaps_and_pthreadpools_own_sleep(env_value):
    regions = 300
    report = _report(_SPIN, regions, env_value=env_value, timeout=120)
    if env_value == "0":
        # The probe sees a worker that sleeps between regions.
        assert report["pools"] == 0 and report["sleeps"] >= regions // 2, report
    else:
        assert report["pools"] == 1 and report["sleeps"] < regions // 4, report


# PyTorch's libraries keep their own pthreadpool and cpuinfo: the package's
# library, loaded RTLD_GLOBAL, brings ExecuTorch's copies (its dependency
# libexecutorch_threadpool) into the global scope, where a library loaded later
# looks first. The dynamic linker's log says what each library bound to; the
# pool QNNPACK runs on in PyTorch is PyTorch's own, not one made by the hook.
_TORCH_AFTER = textwrap.dedent("""
    import json
    import executorch_cellcache  # first, as a program that uses the package does
    import torch
    from executorch_cellcache.cache import pool_executor
    ran = "qnnpack" in torch.backends.quantized.supported_engines
    if ran:
        torch.backends.quantized.engine = "qnnpack"
        x = torch.quantize_per_tensor(torch.ones(8, 64), 0.05, 128, torch.quint8)
        w = torch.quantize_per_tensor(torch.ones(32, 64), 0.05, 0, torch.qint8)
        torch.ops.quantized.linear(x, torch.ops.quantized.linear_prepack(w, None), 0.1, 128)
    print(json.dumps({"ran_qnnpack": ran, "pools": pool_executor.pools()}))
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="reads the log of glibc's dynamic linker (LD_DEBUG)")
def test_pytorch_keeps_its_own_pthreadpool_and_cpuinfo(tmp_path):
    report = _report(_TORCH_AFTER, python_flags=("-W", "ignore"), timeout=120,
                     extra_env={"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "ld")})
    # PyTorch's CPU wheels for x86-64 and arm64 carry QNNPACK; without it the
    # pool check would pass without running anything.
    assert report["ran_qnnpack"], "this torch build has no QNNPACK engine"
    assert report["pools"] == 0, report
    logs = list(tmp_path.glob("ld.*"))
    assert logs, "glibc wrote no LD_DEBUG log"
    crossed = sorted({line.split("binding file ")[1].strip()
                      for log in logs for line in log.read_text(errors="replace").splitlines()
                      if "binding file " in line and "/torch/lib/" in line.split(" to ")[0]
                      and "/executorch" in line.split(" to ")[-1]})
    assert not crossed, crossed[:10]
