"""``cellcache runner-path`` and ``cellcache cmake-dir``: where the C++ runner
and the C++ engine's CMake package were installed with the package."""

import os
from pathlib import Path

RUNNER = "cellcache_runner"  # the C++ runner executable (cpp/apps/)
# The installed CMake package of the engine (cpp/package/), under the package.
CMAKE_CONFIG = Path("lib") / "cmake" / "executorch_cellcache" / "executorch_cellcache-config.cmake"


def add_parser(sub) -> None:
    sub.add_parser(
        "runner-path", help="print the path of the C++ runner executable",
        description=f"Print the absolute path of {RUNNER}, the C++ runner built with the "
                    "package: batched generation from a .pte and token ids, without Python "
                    "(run it with --help).").set_defaults(run=_print_runner_path)
    sub.add_parser(
        "cmake-dir", help="print the folder of the C++ engine's CMake package",
        description="Print the folder holding executorch_cellcache-config.cmake, the CMake "
                    "package of the C++ engine built with the package (its static libraries "
                    "and headers), for an app's build: cmake "
                    "-Dexecutorch_cellcache_DIR=$(cellcache cmake-dir), then "
                    "find_package(executorch_cellcache CONFIG REQUIRED) and link "
                    "executorch_cellcache::runner.").set_defaults(run=_print_cmake_dir)


def _package_dir() -> Path:
    """executorch_cellcache/, the folder above this one."""
    return Path(__file__).resolve().parents[1]


def runner_executable() -> Path:
    """The installed runner (bin/ of the package), else the one of an
    in-tree build (build/python/cpp/apps/)."""
    package = _package_dir()
    candidates = [package / "bin" / RUNNER,
                  package.parent / "build" / "python" / "cpp" / "apps" / RUNNER]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"the C++ runner {RUNNER} was not built (looked for "
                            f"{', '.join(map(str, candidates))}); rebuild the package with "
                            f"`pip install --no-build-isolation -e .`")


def cmake_package_dir() -> Path:
    """The CMake package installed in the package (lib/cmake/executorch_cellcache/;
    an editable install has it copied into the source tree by setup.py)."""
    config = _package_dir() / CMAKE_CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"the C++ engine's CMake package was not installed (no "
                                f"{config}); rebuild the package with "
                                f"`pip install --no-build-isolation -e .`")
    return config.parent


def _print_runner_path(args) -> int:
    print(runner_executable())
    return 0


def _print_cmake_dir(args) -> int:
    print(cmake_package_dir())
    return 0
