#!/usr/bin/env bash
# A fresh machine, one command: install everything, export the embedded default
# model with the cell cache, and generate for three prompts with two samples each.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
mkdir -p out
cellcache export --cells 1024 --max-tokens-per-step 64 --out out/default.pte
cellcache generate out/default.pte --n 2 --max-new-tokens 16 \
  --prompt "The cell cache" --prompt "Many sequences at once" --prompt "Hello"
