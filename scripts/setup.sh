#!/usr/bin/env bash
# A fresh machine, one command: install everything, export the embedded default
# model with the cell cache, generate for three prompts with two samples each, and
# score the model's held-out text (perplexity).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
mkdir -p out
cellcache export --cells 1024 --max-tokens-per-step 64 --out out/default.pte
cellcache generate out/default.pte --n 2 --max-new-tokens 32 --temperature 0.8 --seed 1 \
  --prompt "The for statement" --prompt "A class definition" --prompt "Exceptions are"
cellcache eval out/default.pte
