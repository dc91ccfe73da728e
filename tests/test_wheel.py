"""`pip install` as a user gets it: a wheel built from this tree, installed into
a fresh venv with nothing but the wheel's own requirements (no
requirements.txt), then the CLI from that venv on the default model: `export`
(a tiny program), `generate`, `serve` (health, one completion, then stopped),
`eval`, and the C++ runner the wheel carries.

The wheel is built as `pip install .` builds it: `pip wheel --no-deps` in an
isolated build environment made from pyproject.toml's build requirements (the
executorch wheel's CMake package among them), from a copy of the tree, so the
developer's build/ is never touched and nothing of the development venv leaks
in (the C++ runner must load the fresh venv's ExecuTorch libraries). Meanwhile
the fresh venv installs setup.py's RUNTIME_REQUIREMENTS, which the test checks
are exactly the wheel's Requires-Dist, then the wheel itself. pip finds
packages as it does for scripts/install.sh (its configured index and
find-links).

Marked ``wheel`` (a few minutes: a full C++ build): ``-m "not wheel"`` leaves it
out. It skips only when no wheel can be built here (no C++ compiler); with CI
set it fails instead.
"""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from missing import missing

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = ("c++", "g++", "clang++")  # CMake's default C++ compiler is one of these
# What a copy of the tree leaves out when it is not a git checkout (git ls-files
# lists tracked and untracked-but-not-ignored files otherwise).
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "out", "__pycache__", "*.egg-info",
                                     "*.so", "*.pte", ".pytest_cache", ".hypothesis")
INSTALLED_ONLY = ("bin", "lib", "include")  # under the package: what an editable install copies


def _setup_constant(name: str):
    """A literal that setup.py assigns at the top level (read without running it)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py defines no {name}")


def runtime_requirements():
    return _setup_constant("RUNTIME_REQUIREMENTS")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_requirements_pin_what_requirements_txt_pins():
    """One set of versions: every runtime requirement pinned in setup.py has the
    same pin in requirements.txt (the development environment), and the other
    way round for the packages both name."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pins[_name(line)] = line.replace(" ", "")
    for req in runtime_requirements():
        assert _name(req) in pins, f"{req} is a runtime requirement missing from requirements.txt"
        if "==" in req or "==" in pins[_name(req)]:
            assert req.replace(" ", "") == pins[_name(req)], (req, pins[_name(req)])


def test_every_extra_module_the_cli_names_is_in_that_extra():
    from executorch_cellcache.cli.extras import EXTRA_MODULES

    extras = _setup_constant("EXTRAS")
    for module, extra in EXTRA_MODULES.items():
        assert module in [_name(r) for r in extras[extra]], (module, extra, extras)


def _one_error_line(capsys, command):
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"cellcache {command}: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def test_a_missing_extra_is_one_line_naming_it_before_any_work(monkeypatch, capsys, tmp_path):
    from executorch_cellcache.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rc = main(["bench", "--quick", "--plot", str(tmp_path / "plot.png"),
               "--cache-dir", str(tmp_path)])
    assert rc == 2
    line = _one_error_line(capsys, "bench")
    assert line.endswith("matplotlib is not installed: it comes with the [bench] extra, pip "
                         "install -e '.[bench]' in the clone the package was installed from"), \
        line
    assert list(tmp_path.iterdir()) == []  # nothing ran: no program exported or cached


def test_a_missing_requirement_is_one_line(monkeypatch, capsys, tmp_path):
    from executorch_cellcache.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", str(tmp_path / "m.pte")]) == 2
    line = _one_error_line(capsys, "serve")
    assert "uvicorn is not installed, and executorch-cellcache needs it: reinstall" in line


def _cannot_build() -> str:
    """Why no wheel can be built here ("" when one can): the build environment
    brings CMake, ninja, pybind11 and executorch; the compiler must be here."""
    if os.environ.get("CXX") or any(shutil.which(c) for c in COMPILERS):
        return ""
    return f"cannot build a wheel here: no C++ compiler ({', '.join(COMPILERS)}, $CXX)"


def _copy_tree(dest: Path) -> None:
    """The working tree as a wheel build sees it (committed or not), without
    build outputs or the editable install's copies."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True) if (ROOT / ".git").exists() else None
    if listed is not None and listed.returncode == 0:
        for rel in filter(None, listed.stdout.decode().split("\0")):
            src = ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(ROOT, dest, ignore=COPY_IGNORE, dirs_exist_ok=True)
        for folder in INSTALLED_ONLY:
            shutil.rmtree(dest / "executorch_cellcache" / folder, ignore_errors=True)


def _user_env(venv: Path) -> dict:
    """The environment of a user who activated the fresh venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CELLCACHE_RUNNER")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finished(proc, what: str, timeout: float, ok=(0,)):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode in ok, f"{what} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{what}:\n{err[-3000:]}"
    return out, err


def _requires_dist(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines
                if line.startswith("Requires-Dist:")]
    extras = [line.split(":", 1)[1].strip() for line in lines
              if line.startswith("Provides-Extra:")]
    return names, requires, extras


def _serve_check(cellcache: str, pte: Path, env: dict, cwd: Path):
    """Starts `cellcache serve`, waits for /health, asks for one completion,
    stops it with SIGINT (Ctrl-C: a clean shutdown, then status 130)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([cellcache, "serve", str(pte), "--port", str(port), "--threads", "1"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"serve exited ({proc.returncode}): {proc.stderr.read()}"
            assert time.monotonic() < deadline, "serve never became healthy"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"model": pte.stem, "prompt": "The for statement", "max_tokens": 4})
        request = urllib.request.Request(f"{base}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            completion = json.load(r)
        assert completion["usage"]["completion_tokens"] >= 1, completion
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    out, err = _finished(proc, "serve", timeout=60, ok=(0, 130))
    assert "Application shutdown complete" in out, out
    assert "executorch:" not in err, err  # the runtime's own log lines stay hidden


def _setup_functions(*names):
    """setup.py's top-level functions `names`, with its imports (defined without
    running setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            or isinstance(n, ast.FunctionDef) and n.name in names]
    namespace = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(keep, type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace


def test_a_second_pip_install_from_the_same_checkout_configures(tmp_path):
    """`pip install .` twice from one checkout: the second finds build/python's
    CMake cache naming the first's temporary build environment's ninja (gone),
    which CMake refuses; setup.py starts that cache afresh (a core-only
    configure stands in for the build: seconds, not minutes)."""
    setup = _setup_functions("_cmake", "_ninja", "_cache_entry", "start_afresh_if_tools_are_gone")
    cmake, ninja = setup["_cmake"](), setup["_ninja"]()
    first_env = tmp_path / "pip-build-env" / "bin"
    first_env.mkdir(parents=True)
    shutil.copy2(ninja, first_env / "ninja")
    build = tmp_path / "build" / "python"
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
                 "-DCELLCACHE_CORE_ONLY=ON"]
    first = subprocess.run([*configure, f"-DCMAKE_MAKE_PROGRAM={first_env / 'ninja'}"],
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    shutil.rmtree(first_env.parent)  # pip removes its build environment
    # What the second install met: CMake will not run the cached ninja.
    stale = subprocess.run(configure, capture_output=True, text=True)
    assert stale.returncode != 0 and "ninja" in stale.stderr, stale.stderr
    assert setup["start_afresh_if_tools_are_gone"](build) is True
    second = subprocess.run([*configure, f"-DCMAKE_MAKE_PROGRAM={ninja}"], capture_output=True,
                            text=True)
    assert second.returncode == 0, second.stderr
    # A cache whose tools are all there is kept (a developer's rebuilds stay incremental).
    assert setup["start_afresh_if_tools_are_gone"](build) is False
    assert (build / "CMakeCache.txt").exists()
    # A checkout copied elsewhere with its build folder: CMake refuses the cache too
    # (and rewrites its folder as it does, so a second copy shows the fix).
    def moved_configure(name):
        moved = tmp_path / name / "build" / "python"
        shutil.copytree(build, moved)
        return moved, [*configure[:4], str(moved), *configure[5:],
                       f"-DCMAKE_MAKE_PROGRAM={ninja}"]

    refused, command = moved_configure("copy")
    refusal = subprocess.run(command, capture_output=True, text=True)
    assert refusal.returncode != 0 and "is different than the directory" in refusal.stderr
    moved, command = moved_configure("moved")
    assert setup["start_afresh_if_tools_are_gone"](moved) is True
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
@pytest.mark.wheel
def test_wheel_installs_into_a_fresh_venv_and_the_cli_runs(tmp_path):
    why = _cannot_build()
    if why:
        missing(why)
    start = time.monotonic()

    def phase(name):
        print(f"[wheel test] {name}: {time.monotonic() - start:.0f} s", flush=True)
    src, dist, venv, work = (tmp_path / name for name in ("src", "dist", "venv", "work"))
    for folder in (src, dist, work):
        folder.mkdir()
    _copy_tree(src)
    quiet = ["-q", "--disable-pip-version-check"]
    build_log = tmp_path / "wheel-build.log"
    # The tokenizer/grammar libraries: the development build's (scripts/text_deps.py,
    # minutes to build, the same pinned sdists), not built again in the copy.
    text_deps = ROOT / "build" / "text-deps" / "install"
    with open(build_log, "w") as log:
        build = subprocess.Popen(
            [sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "-w", str(dist),
             str(src)], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "CELLCACHE_TEXT_DEPS_DIR": str(text_deps)})
    # Meanwhile: a fresh venv with the wheel's requirements (checked against the wheel
    # below). --no-compile: bytecode is compiled on first import, for what is imported.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    deps = subprocess.run([*pip, "install", *quiet, "--no-compile", *runtime_requirements()],
                          capture_output=True, text=True, timeout=1200)
    assert deps.returncode == 0, deps.stderr[-3000:]
    phase("fresh venv with the runtime requirements")
    if build.wait(timeout=1800) != 0:
        log = build_log.read_text()
        errors = [line for line in log.splitlines() if re.search(r"error|FAILED", line)]
        pytest.fail("pip wheel failed:\n" + "\n".join(errors[:40]) + "\n...\n" + log[-3000:])
    phase("wheel built")

    (wheel,) = dist.glob("executorch_cellcache-*.whl")
    names, requires, extras = _requires_dist(wheel)
    assert sorted(r for r in requires if "extra ==" not in r) == \
        sorted(runtime_requirements()), requires
    assert {"bench", "test"} <= set(extras), extras
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no LICENSE in the wheel"
    for part in ("executorch_cellcache/bin/cellcache_runner",
                 "executorch_cellcache/exporting/default_checkpoint/model.safetensors",
                 "executorch_cellcache/graph/cellcache_ops.yaml",
                 "executorch_cellcache/cache/program_metadata.yaml"):
        assert part in names, f"the wheel lacks {part}"
    installed = subprocess.run([*pip, "install", *quiet, "--no-compile", str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    phase("wheel installed")

    env = _user_env(venv)
    cellcache = str(venv / "bin" / "cellcache")
    pte = work / "tiny.pte"

    def start_cli(*args):
        return subprocess.Popen([cellcache, *map(str, args)], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    out, _ = _finished(start_cli("export", "--cells", 256, "--max-tokens-per-step", 16,
                                 "--out", pte), "export", timeout=900)
    assert f"wrote {pte}" in out
    assert str(venv) in subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import executorch_cellcache; print(executorch_cellcache.__file__)"],
        cwd=work, env=env, capture_output=True, text=True).stdout, "not the venv's package"
    phase("export")

    generate = start_cli("generate", pte, "--prompt", "The for statement", "--max-new-tokens",
                         8, "--threads", 1)
    evaluate = start_cli("eval", pte)
    runner_path = start_cli("runner-path")
    _serve_check(cellcache, pte, env, work)
    out, err = _finished(generate, "generate", timeout=600)
    assert out.strip() and re.search(r"^prefill \d+ tokens", err, re.M), err
    out, _ = _finished(evaluate, "eval", timeout=600)
    assert re.fullmatch(r"\d+ tokens scored \(window 256, stride 128\): mean NLL \d+\.\d+, "
                        r"perplexity \d+\.\d+\n", out), out
    runner, _ = _finished(runner_path, "runner-path", timeout=120)
    assert runner.strip().startswith(str(venv)), runner
    info = subprocess.run([runner.strip(), "--model", str(pte), "--print-info"],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["n_cells"] == 256
    if shutil.which("ldd"):  # the runner's ExecuTorch is the venv's, not a build machine's
        libs = subprocess.run(["ldd", runner.strip()], capture_output=True, text=True).stdout
        (line,) = [x for x in libs.splitlines() if "libexecutorch.so" in x]
        assert str(venv) in line, line
    phase("generate, serve, eval, runner")
