"""Builds executorch-cellcache: the C++ core, the ExecuTorch kernels and the
Python extension, with CMake (>= 3.28) against the installed executorch wheel.

Develop with `pip install --no-build-isolation -e .` after the pinned
requirements (scripts/install.sh does both): the build then uses the venv's
executorch wheel. `pip install .` or `pip wheel --no-deps .` builds in an
isolated environment with pyproject.toml's build requirements (executorch
included) instead. The package's run-time requirements are
RUNTIME_REQUIREMENTS below (tests/test_wheel.py builds a wheel, installs it into
a fresh venv and runs the CLI there).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
RUNNER = "cellcache_runner"  # the C++ runner executable (cpp/apps/)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds the top-level CMakeLists.txt, then installs its
    artifacts next to the package's Python files."""

    def build_extension(self, ext):
        import pybind11

        # The extension's folder (executorch_cellcache/cache); the package is its parent.
        package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent.parent
        build_dir = ROOT / "build" / "python"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = [_cmake()]
        ninja = _ninja()
        start_afresh_if_tools_are_gone(build_dir)
        text_deps = _text_deps(cmake[0], ninja)
        configure = cmake + [
            "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DCMAKE_BUILD_TYPE=Release",
            # The C++ test programs are built and run by scripts/test.sh (sanitizer builds).
            "-DCELLCACHE_TESTS=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-Dexecutorch_DIR={_executorch_cmake_dir()}",
            f"-DNLOHMANN_JSON_INCLUDE_DIR={_nlohmann_json_include_dir()}",
            f"-DCELLCACHE_TEXT_DEPS_DIR={text_deps}",
            f"-DCMAKE_INSTALL_PREFIX={package_dir.parent}",
        ]
        subprocess.run(configure, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(cmake + ["--build", str(build_dir), "-j", jobs], check=True)
        subprocess.run(cmake + ["--install", str(build_dir)], check=True)
        # The op schemas travel with the package (graph/ops.py reads them).
        (package_dir / "graph").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "ops" / "cellcache_ops.yaml", package_dir / "graph" / "cellcache_ops.yaml")
        # So do the program metadata's methods (cache/metadata.py reads them).
        (package_dir / "cache").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "ops" / "program_metadata.yaml",
                    package_dir / "cache" / "program_metadata.yaml")
        # An editable install copies back only the extension module; the C++
        # runner (installed to bin/ by CMake) is copied into the source tree too,
        # where `cellcache runner-path` finds it, and so is the engine's CMake
        # package (lib/: static libraries and lib/cmake/executorch_cellcache/,
        # include/; cpp/package/), where `cellcache cmake-dir` finds it. Its
        # targets file locates the libraries relative to itself, so the copy works.
        source_package = ROOT / "executorch_cellcache"
        if getattr(self, "editable_mode", False) and source_package != package_dir:
            (source_package / "bin").mkdir(exist_ok=True)
            shutil.copy2(package_dir / "bin" / RUNNER, source_package / "bin" / RUNNER)
            for folder in ("lib", "include"):
                shutil.rmtree(source_package / folder, ignore_errors=True)
                shutil.copytree(package_dir / folder, source_package / folder)


def _text_deps(cmake: str, ninja: str) -> Path:
    """The tokenizer, chat-template and grammar libraries (scripts/text_deps.py:
    built from their PyPI sdists into build/text-deps/install once, minutes;
    then reused). $CELLCACHE_TEXT_DEPS_DIR names an install of them to use
    instead (tests/test_wheel.py passes the development build's)."""
    given = os.environ.get("CELLCACHE_TEXT_DEPS_DIR")
    if given:
        if not (Path(given) / "lib" / "libcellcache_text_deps.a").exists():
            sys.exit(f"CELLCACHE_TEXT_DEPS_DIR={given} holds no lib/libcellcache_text_deps.a "
                     f"(python scripts/text_deps.py --prefix {given} builds it there)")
        return Path(given)
    import importlib.util
    spec = importlib.util.spec_from_file_location("text_deps", ROOT / "scripts" / "text_deps.py")
    text_deps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(text_deps)
    try:
        return text_deps.ensure(jobs=os.cpu_count() or 2, cmake=cmake, ninja=ninja,
                                nlohmann_include=_nlohmann_json_include_dir())
    except text_deps.TextDepsError as e:
        sys.exit(f"text deps: {e}")


def _executorch_cmake_dir():
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("executorch==1.5.1 must be installed first (scripts/setup.sh does it)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "share" / "cmake")


def _nlohmann_json_include_dir():
    """The include folder of the pinned nlohmann-json package (nlohmann/json.hpp),
    for the C++ runner's --stdio mode; found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("nlohmann_json")
    if spec is None or spec.origin is None:
        sys.exit("nlohmann-json==3.12.0 must be installed first (pip install -r requirements.txt; "
                 "scripts/setup.sh does it)")
    return str(Path(spec.origin).parent / "include")


def _cmake():
    """pip's cmake (>= 3.28, a requirement) next to this interpreter, else PATH's."""
    beside = Path(sys.executable).parent / "cmake"
    return str(beside) if beside.exists() else shutil.which("cmake") or "cmake"


def _ninja():
    """pip's ninja (a build requirement) next to this interpreter, else PATH's."""
    beside = Path(sys.executable).parent / "ninja"
    return str(beside) if beside.exists() else shutil.which("ninja") or "ninja"


def _cache_entry(cache: Path, name: str):
    """A CMakeCache.txt entry's value (NAME:TYPE=VALUE), or None."""
    for line in cache.read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.split(":", 1)[0] == name:
            return value
    return None


def start_afresh_if_tools_are_gone(build_dir: Path) -> bool:
    """Removes build_dir's CMake cache when the cmake or ninja it names no
    longer exists, or when it was made in another folder. Each `pip install .`
    builds in its own temporary build environment (pip's isolation), whose
    cmake and ninja are gone by the next install from the same checkout; a
    checkout moved or copied carries its build folder along. CMake refuses
    either cache. (The objects are rebuilt then anyway: their include paths name
    that environment's executorch, or the old folder.) True when it removed
    the cache."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return False
    tools = [_cache_entry(cache, name) for name in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM")]
    made_in = _cache_entry(cache, "CMAKE_CACHEFILE_DIR")
    moved = made_in is not None and Path(made_in).resolve() != build_dir.resolve()
    if not moved and all(not tool or Path(tool).exists() for tool in tools):
        return False
    cache.unlink()
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    return True


RUNTIME_REQUIREMENTS = [
    "torch==2.13.0",
    "executorch==1.5.1",
    "torchao==0.18.0",        # quantized export (--quantize, --embedding-quantize)
    "transformers==5.24.0",   # model loading and the graph's attention interface
    "tokenizers==0.23.3",     # the program's embedded tokenizer
    "numpy",
    "pyyaml",                 # the op schemas and metadata fields (ops/*.yaml)
    "tqdm",
    # cellcache serve
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "jinja2==3.1.6",
    "prometheus_client==0.26.0",
    "pydantic",               # (fastapi's) the request schemas
    "starlette",              # (fastapi's) its HTTP errors
    "gguf==0.19.0",           # GGUF checkpoints (export --model FILE.gguf; bench --llama-cpp)
    "accelerate==1.16.0",     # transformers' GGUF loader
]
EXTRAS = {
    "bench": ["matplotlib"],  # cellcache bench --plot
    "test": ["pytest", "pytest-xdist==3.8.0", "filelock", "openai==3.57.0", "httpx==0.28.1",
             "hypothesis", "matplotlib", "scipy==1.17.1", "jsonschema==4.26.0",
             "selenium==4.51.0"],
}

setup(
    name="executorch-cellcache",
    version="0.1.0",
    description="Multi-sequence cell KV cache for LLMs exported to ExecuTorch",
    packages=find_packages(include=["executorch_cellcache", "executorch_cellcache.*"]),
    # The embedded default model: a checkpoint folder (weights, config, tokenizer, README);
    # the chat page `cellcache serve` serves at / (HTML, JS, CSS).
    package_data={"executorch_cellcache": ["*/*.pyi", "*/*.yaml", "exporting/default_checkpoint/*",
                                           "serving/static/*"]},
    python_requires=">=3.11",
    # The project's own code is MIT; the embedded default model's weights derive from
    # Python's documentation (PSF License, default_checkpoint/README.md).
    license="MIT AND PSF-2.0",
    license_files=["LICENSE"],
    # What the package imports at run time (export, generate, eval, serve, the C++
    # runner), pinned as requirements.txt pins them: the C++ parts are built against
    # this executorch wheel, and quantized export is tested with this torchao.
    install_requires=RUNTIME_REQUIREMENTS,
    # What one command alone needs (each names its extra when it is missing).
    extras_require=EXTRAS,
    ext_modules=[CMakeExtension("executorch_cellcache.cache._core")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["cellcache=executorch_cellcache.cli:main"]},
)
