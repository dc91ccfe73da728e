#!/usr/bin/env bash
# The aarch64 (64-bit ARM Linux) build of the C++ side: the core, the kernels,
# the engine and cellcache_runner, cross-compiled with Debian's GCC against the
# executorch wheel for manylinux_2_28_aarch64 (its C++ SDK: libraries, headers,
# CMake package) and run under qemu-user.
#
#   scripts/aarch64.sh install   the cross compiler and qemu (apt, when missing
#                                and we are root) and the aarch64 executorch wheel
#   scripts/aarch64.sh build     install, then build into build/aarch64
#   scripts/aarch64.sh test      build, then the C++ tests under qemu (ctest)
#   scripts/aarch64.sh sanitize  the core and engine tests under ASan + UBSan
#                                (build/aarch64-asan), under qemu: ~11 minutes on
#                                2 cores, so not part of scripts/test.sh; leak
#                                checking is off (LeakSanitizer cannot run under
#                                qemu-user; the x86-64 ASan run checks leaks)
#   scripts/aarch64.sh run ARGS  run an aarch64 program of the build under qemu,
#                                e.g. `run build/aarch64/cpp/apps/cellcache_runner --help`
#
# The emulated CPU is $CELLCACHE_QEMU_CPU (default neoverse-n1: ARMv8.2-A with
# NEON, fp16 and dot product, no SVE2 or SME; see cmake/aarch64-linux-gnu.cmake).
# What is missing (compiler, qemu, the wheel) ends the command with exit status
# 3 and one line naming it and how to get it; tests/test_aarch64.py skips on
# that off CI and fails with CI=1.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

TRIPLE=aarch64-linux-gnu
EXECUTORCH_VERSION=1.5.1
SDK=$ROOT/build/aarch64-sdk
BUILD=$ROOT/build/aarch64
# The tokenizer, chat-template and grammar libraries (scripts/text_deps.py), cross-built
# with CMake's Release -O3, or with -$CELLCACHE_AARCH64_TEXT_OPT when set (O1: scripts/test.sh,
# a build whose programs only run under qemu, about a third less compile time), each
# level in a prefix of its own.
TEXT_OPT=${CELLCACHE_AARCH64_TEXT_OPT:-}
TEXT_DEPS=$ROOT/build/aarch64-text-deps${TEXT_OPT:+-$TEXT_OPT}
QEMU_CPU=${CELLCACHE_QEMU_CPU:-neoverse-n1}

missing() {
  echo "aarch64: $1" >&2
  exit 3
}

python_bin() {
  if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi
}

install_tools() {
  local need=()
  command -v ${TRIPLE}-g++ >/dev/null || need+=(g++-${TRIPLE})
  command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== aarch64: installing ${need[*]} (apt)"
    mkdir -p "$ROOT/build"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${need[@]}"; } >"$ROOT/build/aarch64-apt.log" 2>&1 ||
      missing "apt-get could not install ${need[*]} (see build/aarch64-apt.log)"
  else
    missing "${need[*]} not installed: on Debian or Ubuntu, sudo apt-get install ${need[*]}"
  fi
}

fetch_sdk() {
  local unpacked=$SDK/executorch-$EXECUTORCH_VERSION
  [ -f "$unpacked/executorch/share/cmake/executorch-config.cmake" ] && return 0
  echo "== aarch64: fetching the executorch $EXECUTORCH_VERSION wheel for manylinux_2_28_aarch64"
  mkdir -p "$SDK"
  "$(python_bin)" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --platform manylinux_2_28_aarch64 --python-version 3.11 \
      "executorch==$EXECUTORCH_VERSION" -d "$SDK" 2>"$SDK/pip.log" ||
    missing "pip could not download executorch==$EXECUTORCH_VERSION for manylinux_2_28_aarch64 (see $SDK/pip.log)"
  rm -rf "$unpacked.partial"
  "$(python_bin)" -m zipfile -e "$SDK"/executorch-$EXECUTORCH_VERSION-*manylinux_2_28_aarch64*.whl \
      "$unpacked.partial"
  mv "$unpacked.partial" "$unpacked"
}

check_compiler() {
  command -v ${TRIPLE}-g++ >/dev/null ||
    missing "g++-$TRIPLE not installed (scripts/install.sh installs it as root; or sudo apt-get install g++-$TRIPLE)"
}

check_qemu() {
  command -v qemu-aarch64 >/dev/null ||
    missing "qemu-user not installed (scripts/install.sh installs it as root; or sudo apt-get install qemu-user)"
  [ -d /usr/$TRIPLE/lib ] ||
    missing "no aarch64 C and C++ libraries in /usr/$TRIPLE/lib (sudo apt-get install g++-$TRIPLE brings them)"
}

check_installed() {
  check_compiler
  check_qemu
}

build() {
  check_installed
  fetch_sdk
  local py json_include
  py=$(python_bin)
  json_include=$("$py" -c "import nlohmann_json, os; print(os.path.join(os.path.dirname(nlohmann_json.__file__), 'include'))") ||
    missing "the nlohmann-json package is not installed (pip install -r requirements.txt)"
  # The tokenizer, chat-template and grammar libraries, cross-built once (minutes).
  "$py" "$ROOT/scripts/text_deps.py" --prefix "$TEXT_DEPS/install" --build-dir "$TEXT_DEPS/build" \
    --toolchain-file "$ROOT/cmake/aarch64-linux-gnu.cmake" --nlohmann-include "$json_include" \
    ${TEXT_OPT:+--opt-level "$TEXT_OPT"} |
    sed 's/^/== aarch64: /'
  echo "== aarch64: building into $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$ROOT/cmake/aarch64-linux-gnu.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DCELLCACHE_PYTHON=OFF -DCELLCACHE_QEMU_CPU="$QEMU_CPU" \
    -Dexecutorch_DIR="$SDK/executorch-$EXECUTORCH_VERSION/executorch/share/cmake" \
    -DNLOHMANN_JSON_INCLUDE_DIR="$json_include" -DCELLCACHE_TEXT_DEPS_DIR="$TEXT_DEPS/install" >/dev/null
  cmake --build "$BUILD" --target cellcache_core_test cellcache_engine_test \
    cellcache_engine_threads_test cellcache_runner
}

sanitize() {
  check_installed
  echo "== aarch64: core and engine tests under ASan + UBSan (build/aarch64-asan)"
  cmake -S "$ROOT" -B "$ROOT/build/aarch64-asan" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$ROOT/cmake/aarch64-linux-gnu.cmake" \
    -DCELLCACHE_CORE_ONLY=ON -DCELLCACHE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
    -DCELLCACHE_QEMU_CPU="$QEMU_CPU" >/dev/null
  cmake --build "$ROOT/build/aarch64-asan"
  ASAN_OPTIONS=detect_leaks=0 ctest --test-dir "$ROOT/build/aarch64-asan" --output-on-failure
}

case "${1:-}" in
  install) install_tools; fetch_sdk ;;
  build) install_tools; build ;;
  test)
    install_tools
    build
    echo "== aarch64: C++ tests under qemu-aarch64 -cpu $QEMU_CPU"
    ctest --test-dir "$BUILD" --output-on-failure --parallel "$(nproc)"
    ;;
  sanitize) install_tools; sanitize ;;
  run)
    shift
    check_qemu
    [ $# -ge 1 ] || { echo "usage: scripts/aarch64.sh run PROGRAM [ARGS]" >&2; exit 2; }
    [ -f "$1" ] || { echo "aarch64: no program '$1'" >&2; exit 2; }
    exec qemu-aarch64 -cpu "$QEMU_CPU" -L /usr/$TRIPLE "$@"
    ;;
  *)
    echo "usage: scripts/aarch64.sh install|build|test|sanitize|run PROGRAM [ARGS]" >&2
    exit 2
    ;;
esac
