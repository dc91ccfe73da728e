#!/usr/bin/env bash
# Every test: installs (idempotent), runs the C++ core tests under
# AddressSanitizer + UndefinedBehaviorSanitizer (ctest), the engine's threads test
# under ThreadSanitizer, the C++ tests of the aarch64 cross build under qemu,
# then the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
echo "== C++ core tests (ASan + UBSan)"
cmake -S . -B build/asan -G Ninja -DCELLCACHE_CORE_ONLY=ON -DCELLCACHE_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build/asan
ctest --test-dir build/asan --output-on-failure --parallel "$(nproc)"
echo "== C++ engine threads test (ThreadSanitizer)"
cmake -S . -B build/tsan -G Ninja -DCELLCACHE_CORE_ONLY=ON -DCELLCACHE_SANITIZE_THREAD=ON \
  -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build/tsan --target cellcache_engine_threads_test
ctest --test-dir build/tsan --output-on-failure -R cellcache_engine_threads_test
echo "== C++ tests of the aarch64 build, under qemu (scripts/aarch64.sh)"
# Its text libraries at -O1 (they only run under qemu here): a third less compile time.
# Exported: tests/test_aarch64.py builds (finds) the same with `scripts/aarch64.sh build`.
export CELLCACHE_AARCH64_TEXT_OPT=${CELLCACHE_AARCH64_TEXT_OPT-O1}
status=0
scripts/aarch64.sh test || status=$?
if [ "$status" = 3 ] && [ -z "${CI:-}" ]; then
  echo "   skipped: the line above says what is missing"
elif [ "$status" != 0 ]; then
  exit "$status"
fi
echo "== Python tests"
python -m pytest "$@"
