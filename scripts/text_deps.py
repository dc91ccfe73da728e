#!/usr/bin/env python3
"""Builds the engine's third-party text stack once into an install prefix.

    python scripts/text_deps.py [--prefix DIR] [--downloads DIR] [--jobs N]
                                [--toolchain-file FILE] [--smoke]

Three pinned PyPI sdists (downloaded with pip, checked against their sha256,
never vendored into git) are built by cmake/text_deps/CMakeLists.txt into
PREFIX (default build/text-deps/install):

    lib/libcellcache_text_deps.a      one static archive: pytorch-tokenizers'
                                      HFTokenizer (+ re2, abseil, pcre2),
                                      xgrammar, llama.cpp's Jinja engine
    include/                          their headers
    lib/cmake/cellcache_text_deps/    find_package(cellcache_text_deps CONFIG)
                                      -> IMPORTED target cellcache::text_deps

A stamp file in PREFIX holds a key over the pins, cmake/text_deps (but its
smoke/ test), the compilers, the toolchain file and the CMake arguments; when it
matches, nothing is done. The first build takes about 3-6 minutes on 2 cores.
--smoke then builds and runs cmake/text_deps/smoke against the prefix.

setup.py can import this file and call ensure(). Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CMAKE_PROJECT = ROOT / "cmake" / "text_deps"
DEFAULT_PREFIX = ROOT / "build" / "text-deps" / "install"
DEFAULT_DOWNLOADS = ROOT / "build" / "text-deps" / "downloads"
DEFAULT_BUILD = ROOT / "build" / "text-deps" / "build"
STAMP = "cellcache_text_deps.stamp"
ARCHIVE = Path("lib") / "libcellcache_text_deps.a"
CONFIG = Path("lib") / "cmake" / "cellcache_text_deps" / "cellcache_text_deps-config.cmake"
# What an install puts into the prefix (removed before a reinstall over our own older one).
OWNED = ["include/pytorch", "include/re2", "include/absl", "include/pcre2.h", "include/xgrammar",
         "include/dlpack", "include/nlohmann", "include/llama_common", str(ARCHIVE),
         "lib/cmake/cellcache_text_deps"]
COMPONENT = "cellcache_text_deps"


class Pin(NamedTuple):
    package: str
    version: str
    filename: str
    sha256: str


PINS = [
    Pin("pytorch-tokenizers", "1.0.1", "pytorch_tokenizers-1.0.1.tar.gz",
        "19938c0efd5348fb0589610094c1c6bf6e055b20889f6250068d2b552a0b137b"),
    Pin("xgrammar", "0.2.8", "xgrammar-0.2.8.tar.gz",
        "8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80"),
    # 77 MB; only vendor/llama.cpp/common/{jinja/*,json.*,unicode.*} are compiled.
    Pin("llama-cpp-python", "0.3.36", "llama_cpp_python-0.3.36.tar.gz",
        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"),
]


class TextDepsError(Exception):
    """One line for the user; main() prints it and exits with status 1."""


def say(msg: str) -> None:
    print(f"text deps: {msg}", flush=True)


# --------------------------------------------------------------------------- downloads

def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_message(output: str) -> str:
    """pip's own words: its first ERROR line, and the network complaint before it, if any."""
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("ERROR:")]
    net = [l for l in lines if re.search(r"Could not fetch URL|NewConnectionError|Max retries|"
                                         r"SSLError|ProxyError|timed out|Name or service", l)]
    msg = errors[0] if errors else lines[-1] if lines else "no output"
    if net and net[0] not in msg:
        msg += f" ({net[0][:200]})"
    return msg


def _pip_env() -> dict:
    """The environment for `python -m pip`: inside pip's isolated build
    environment (`pip install .` runs setup.py there) the interpreter's own
    site-packages, pip's among them, are hidden by the PYTHONPATH pip sets;
    without it they are back. pip's configuration (index, find-links) stays."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}


def download(pin: Pin, downloads: Path, log_dir: Path) -> Path:
    """The verified sdist in `downloads`, fetched with pip unless already there."""
    target = downloads / pin.filename
    if target.is_file():
        if sha256_of(target) == pin.sha256:
            return target
        say(f"{target} does not match its sha256; downloading it again")
    say(f"downloading {pin.package} {pin.version}")
    downloads.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "download.log"
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=downloads) as tmp:
        # --no-binary <pkg>, never :all: (pip would then build every build dependency from source).
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-binary", pin.package, f"{pin.package}=={pin.version}", "-d", tmp]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_pip_env())
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n{proc.stdout}\n")
        if proc.returncode != 0:
            raise TextDepsError(f"downloading {pin.package} {pin.version} failed: "
                                f"{_pip_message(proc.stdout)} (pip's output: {log})")
        got = sorted(Path(tmp).glob("*.tar.gz")) + sorted(Path(tmp).glob("*.zip"))
        if len(got) != 1:
            raise TextDepsError(f"pip download of {pin.package} {pin.version} gave "
                                f"{[p.name for p in Path(tmp).iterdir()]}, not one sdist (log: {log})")
        digest = sha256_of(got[0])
        if digest != pin.sha256:
            raise TextDepsError(f"sha256 mismatch for {got[0].name} ({pin.package} {pin.version}): "
                                f"got {digest}, expected {pin.sha256}")
        os.replace(got[0], target)
    return target


# --------------------------------------------------------------------------- tools and key

def _which(name: str | None) -> str | None:
    if not name:
        return None
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name)


def _tool(name: str, given: str | None) -> str | None:
    """`given`, else the one beside this interpreter (pip's cmake/ninja in a venv), else PATH's."""
    if given:
        return _which(given)
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"<{e}>"
    return out.strip().splitlines()[0] if out.strip() else ""


def find_compilers() -> tuple[str, str]:
    """(C compiler, C++ compiler): $CC/$CXX when set, else cc/c++ (gcc/g++, clang/clang++).
    pcre2 is C, the rest C++."""
    found = []
    for env, names, lang, apt in (("CC", ("cc", "gcc", "clang"), "C", "gcc"),
                                  ("CXX", ("c++", "g++", "clang++"), "C++", "g++")):
        if os.environ.get(env):
            path = _which(shlex.split(os.environ[env])[0])
            if not path:
                raise TextDepsError(f"the {lang} compiler {env}={os.environ[env]} was not found")
        else:
            path = next((p for p in map(_which, names) if p), None)
            if not path:
                raise TextDepsError(f"no {lang} compiler found (set {env}, or install one: "
                                    f"apt-get install {apt})")
        found.append(path)
    return found[0], found[1]


def cmake_version(cmake: str) -> tuple[int, ...]:
    line = _first_line([cmake, "--version"])
    m = re.search(r"(\d+)\.(\d+)", line)
    if not m:
        raise TextDepsError(f"{cmake} does not run as CMake ({line or 'no output'}); "
                            "pip install cmake (>= 3.28)")
    return int(m.group(1)), int(m.group(2))


def nlohmann_include_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("nlohmann_json")
    if spec is None or spec.origin is None:
        raise TextDepsError("nlohmann-json is not installed (pip install nlohmann-json==3.12.0)")
    return str(Path(spec.origin).parent / "include")


def _project_files() -> dict[str, str]:
    """sha256 of every file of cmake/text_deps but its smoke test (not part of the prefix)."""
    files = {}
    for p in sorted(CMAKE_PROJECT.rglob("*")):
        rel = p.relative_to(CMAKE_PROJECT).as_posix()
        if p.is_file() and not rel.startswith("smoke/") and "__pycache__" not in rel:
            files[rel] = sha256_of(p)
    return files


def build_key(compilers: tuple[str, str] | None, toolchain: Path | None, nlohmann: str,
              cmake_args: list[str]) -> str:
    """The stamp's content. Paths that change between otherwise identical builds (pip's
    temporary build environments: cmake, ninja, nlohmann) are left out; contents are in."""
    desc = {
        "pins": [(p.package, p.version, p.sha256) for p in PINS],
        "project": _project_files(),
        "compilers": [(c, _first_line([c, "--version"])) for c in compilers] if compilers else None,
        "toolchain": (str(toolchain), sha256_of(toolchain)) if toolchain else None,
        "nlohmann": sha256_of(Path(nlohmann) / "nlohmann" / "json.hpp"),
        "cmake_args": cmake_args,
        "env": {k: os.environ.get(k, "") for k in ("CFLAGS", "CXXFLAGS", "LDFLAGS")},
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- running

def _run_logged(cmd: list[str], log: Path, what: str, progress: bool = False,
                env: dict | None = None) -> None:
    """Runs cmd with its output in `log`; with progress, ninja's [n/N] on one terminal line.
    On failure: one line naming the log, then its last 30 lines, then TextDepsError."""
    tty = progress and sys.stdout.isatty()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if tty:
                m = re.match(r"\[(\d+)/(\d+)\]", line)
                if m:
                    sys.stdout.write(f"\r  [{m.group(1)}/{m.group(2)}]")
                    sys.stdout.flush()
        rc = proc.wait()
    if tty:
        sys.stdout.write("\r" + " " * 20 + "\r")
        sys.stdout.flush()
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        print(f"--- the last {len(tail)} lines of {log}:", *tail, "---", sep="\n", file=sys.stderr)
        raise TextDepsError(f"{what} failed (exit status {rc}); full log: {log}")


def _cache_entry(cache: Path, name: str) -> str | None:
    for line in cache.read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.split(":", 1)[0] == name:
            return value
    return None


def _fresh_build_dir_if_needed(build_dir: Path, setup_key: str) -> None:
    """Starts the build folder afresh when its compilers/toolchain/generator changed, when the
    cmake or ninja its cache names is gone (pip's temporary build environments) or when it
    was made in another folder: CMake refuses such a cache."""
    cache = build_dir / "CMakeCache.txt"
    marker = build_dir / "cellcache_setup_key"
    if not cache.is_file():
        return
    stale = not marker.is_file() or marker.read_text().strip() != setup_key
    if not stale:
        tools = [_cache_entry(cache, n) for n in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM")]
        made_in = _cache_entry(cache, "CMAKE_CACHEFILE_DIR")
        stale = (made_in is not None and Path(made_in).resolve() != build_dir.resolve()) or \
            any(t and not Path(t).exists() for t in tools)
    if stale:
        shutil.rmtree(build_dir)


def ensure(prefix: Path = DEFAULT_PREFIX, downloads: Path = DEFAULT_DOWNLOADS,
           jobs: int | None = None, cmake: str | None = None, ninja: str | None = None,
           nlohmann_include: str | None = None, *, build_dir: Path | None = None,
           toolchain_file: Path | None = None, extra_cmake_args: list[str] | tuple = ()) -> Path:
    """Makes `prefix` hold the built text stack (see the module's docstring) and returns it.
    Does nothing (one line) when the prefix's stamp matches. Raises TextDepsError."""
    t0 = time.monotonic()
    prefix = Path(prefix).resolve()
    downloads = Path(downloads).resolve()
    build_dir = Path(build_dir).resolve() if build_dir else \
        (DEFAULT_BUILD if prefix == DEFAULT_PREFIX else prefix.parent / (prefix.name + "-build"))
    log_dir = build_dir.parent
    jobs = jobs or os.cpu_count() or 2
    cmake = _tool("cmake", cmake)
    if not cmake:
        raise TextDepsError("cmake not found (pip install cmake, >= 3.28)")
    if cmake_version(cmake) < (3, 28):
        raise TextDepsError(f"{cmake} is CMake {'.'.join(map(str, cmake_version(cmake)))}; "
                            "3.28 or newer is needed (pip install cmake)")
    ninja = _tool("ninja", ninja)
    nlohmann = nlohmann_include or nlohmann_include_dir()
    if not (Path(nlohmann) / "nlohmann" / "json.hpp").is_file():
        raise TextDepsError(f"{nlohmann} has no nlohmann/json.hpp")
    toolchain = Path(toolchain_file).resolve() if toolchain_file else None
    if toolchain and not toolchain.is_file():
        raise TextDepsError(f"toolchain file {toolchain} does not exist")
    compilers = None if toolchain else find_compilers()
    missing = [p.filename for p in PINS if p.sha256 not in (CMAKE_PROJECT / "CMakeLists.txt").read_text()]
    if missing:
        raise TextDepsError(f"the sha256 pins of {missing} differ between scripts/text_deps.py and "
                            "cmake/text_deps/CMakeLists.txt")

    args = ["-DCMAKE_BUILD_TYPE=Release", *extra_cmake_args]
    if toolchain:
        args.append(f"-DCMAKE_TOOLCHAIN_FILE={toolchain}")
    else:
        args += [f"-DCMAKE_C_COMPILER={compilers[0]}", f"-DCMAKE_CXX_COMPILER={compilers[1]}"]
    generator = "Ninja" if ninja else "Unix Makefiles"
    key = build_key(compilers, toolchain, nlohmann, args + [f"generator={generator}"])

    stamp = prefix / STAMP
    if stamp.is_file() and stamp.read_text().strip() == key and \
            (prefix / ARCHIVE).is_file() and (prefix / CONFIG).is_file():
        say(f"up to date in {prefix}")
        return prefix

    fetched = [download(pin, downloads, log_dir) for pin in PINS]
    say(f"{len(fetched)} sdists verified in {downloads}")

    setup_key = hashlib.sha256(json.dumps([compilers, str(toolchain), generator]).encode()).hexdigest()
    _fresh_build_dir_if_needed(build_dir, setup_key)
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "cellcache_setup_key").write_text(setup_key + "\n")
    configure = [cmake, "-S", str(CMAKE_PROJECT), "-B", str(build_dir), "-G", generator,
                 f"-DCELLCACHE_TEXT_DOWNLOADS={downloads}", f"-DNLOHMANN_JSON_INCLUDE_DIR={nlohmann}",
                 f"-DCMAKE_INSTALL_PREFIX={prefix}", *args]
    if ninja:
        configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    say("configuring")
    _run_logged(configure, log_dir / "configure.log", "configuring (cmake)")
    say(f"building (about 3-6 min on 2 cores the first time; log: {log_dir / 'build.log'})")
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    _run_logged([cmake, "--build", str(build_dir), "-j", str(jobs)], log_dir / "build.log",
                "building", progress=True, env=env)

    say(f"installing into {prefix}")
    if stamp.is_file() or (prefix / ARCHIVE).is_file():   # an older install of ours: no leftovers
        stamp.unlink(missing_ok=True)
        for rel in OWNED:
            p = prefix / rel
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    _run_logged([cmake, "--install", str(build_dir), "--component", COMPONENT, "--prefix", str(prefix)],
                log_dir / "install.log", "installing")
    stamp.write_text(key + "\n")
    size = (prefix / ARCHIVE).stat().st_size / 1e6
    say(f"done in {time.monotonic() - t0:.0f} s: {prefix / ARCHIVE} ({size:.1f} MB)")
    return prefix


# --------------------------------------------------------------------------- smoke test

def smoke(prefix: Path, cmake: str | None, ninja: str | None, build_dir: Path,
          checkpoint: Path) -> None:
    """Builds cmake/text_deps/smoke against the prefix (find_package) and runs it on the
    default model's tokenizer.json and tokenizer_config.json."""
    cmake = _tool("cmake", cmake)
    ninja = _tool("ninja", ninja)
    tok = checkpoint / "tokenizer.json"
    cfg = checkpoint / "tokenizer_config.json"
    if not tok.is_file():
        raise TextDepsError(f"smoke test: {tok} not found")
    build_dir.mkdir(parents=True, exist_ok=True)
    log_dir = build_dir.parent
    say("smoke test: building cmake/text_deps/smoke against the prefix")
    configure = [cmake, "-S", str(CMAKE_PROJECT / "smoke"), "-B", str(build_dir),
                 "-G", "Ninja" if ninja else "Unix Makefiles", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCELLCACHE_TEXT_DEPS_PREFIX={prefix}"]
    if ninja:
        configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    _run_logged(configure, log_dir / "smoke-configure.log", "smoke test: configuring")
    _run_logged([cmake, "--build", str(build_dir)], log_dir / "smoke-build.log", "smoke test: building")
    exe = build_dir / "text_deps_smoke"
    log = log_dir / "smoke-run.log"
    _run_logged([str(exe), str(tok), str(cfg)], log, "smoke test: running")
    for line in log.read_text(errors="replace").splitlines()[1:]:
        print(f"  {line}")
    say("smoke test passed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX,
                    help="install prefix (default build/text-deps/install)")
    ap.add_argument("--downloads", type=Path, default=DEFAULT_DOWNLOADS,
                    help="where the sdists are kept (default build/text-deps/downloads)")
    ap.add_argument("--build-dir", type=Path, default=None,
                    help="CMake build folder (default build/text-deps/build)")
    ap.add_argument("--jobs", "-j", type=int, default=None, help="parallel jobs (default: CPUs)")
    ap.add_argument("--cmake", default=None, help="cmake to use (default: the one beside this python, else PATH's)")
    ap.add_argument("--ninja", default=None, help="ninja to use (default: beside this python, else PATH's; Makefiles without)")
    ap.add_argument("--nlohmann-include", default=None,
                    help="nlohmann/json 3.12 include folder (default: pip's nlohmann-json)")
    ap.add_argument("--toolchain-file", type=Path, default=None,
                    help="CMAKE_TOOLCHAIN_FILE for a cross build")
    ap.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3", "Os"), default=None,
                    help="compile with -OPT instead of CMake's Release -O3 (scripts/aarch64.sh: "
                         "a quicker test build of the cross-compiled libraries)")
    ap.add_argument("--smoke", action="store_true",
                    help="then build and run cmake/text_deps/smoke against the prefix")
    ap.add_argument("--checkpoint", type=Path,
                    default=ROOT / "executorch_cellcache" / "exporting" / "default_checkpoint",
                    help="folder with tokenizer.json/tokenizer_config.json for --smoke")
    a = ap.parse_args(argv)
    try:
        opt = [f"-DCMAKE_{lang}_FLAGS_RELEASE=-{a.opt_level} -DNDEBUG" for lang in ("C", "CXX")] \
            if a.opt_level else []
        prefix = ensure(a.prefix, a.downloads, a.jobs, a.cmake, a.ninja, a.nlohmann_include,
                        build_dir=a.build_dir, toolchain_file=a.toolchain_file,
                        extra_cmake_args=opt)
        if a.smoke:
            if a.toolchain_file:
                raise TextDepsError("--smoke runs the test program here: not with --toolchain-file")
            smoke(prefix, a.cmake, a.ninja, ROOT / "build" / "text-deps" / "smoke", a.checkpoint)
    except TextDepsError as e:
        print(f"text deps: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("text deps: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
