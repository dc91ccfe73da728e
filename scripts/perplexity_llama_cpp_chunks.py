#!/usr/bin/env python
"""Perplexity the way llama.cpp's ``llama-perplexity -c N`` computes it, for our
programs and for transformers eager, so the three figures score the same tokens.

llama-perplexity (tools/perplexity/perplexity.cpp, perplexity()): the text's
tokens are cut into floor(n_tokens / N) chunks of N that do not overlap; each
chunk is one sequence at positions 0..N-1 (its first token replaced by BOS when
the vocabulary adds one); tokens N/2+1 .. N-1 of each chunk are scored from the
logits before them. ``cellcache eval`` scores every token after sliding windows
instead; its figure is close but not the same token set.

    python scripts/perplexity_llama_cpp_chunks.py --text scripts/data/heldout.txt \
        --ctx 256 [--eager smollm2] [P.pte ...]
"""

import argparse
import math
import sys
from pathlib import Path

import torch


def _chunks(ids, ctx):
    return [ids[i * ctx:(i + 1) * ctx] for i in range(len(ids) // ctx)]


def _score(logits, chunk, ctx):
    first = ctx // 2
    logp = torch.log_softmax(logits[first:ctx - 1].double(), -1)
    target = torch.tensor(chunk[first + 1:ctx])
    return float(-logp.gather(1, target[:, None]).sum()), ctx - 1 - first


def program_nll(path, ids, ctx):
    from executorch_cellcache import Runner

    runner = Runner(path)
    step = runner.info.max_tokens_per_step
    total = count = 0.0
    for chunk in _chunks(ids, ctx):
        seq = runner.cache.seq_new()
        rows = []
        for i in range(0, ctx, step):
            part = chunk[i:i + step]
            rows.append(runner.step([seq] * len(part), part, list(range(i, i + len(part))),
                                    list(range(len(part)))))
        runner.cache.seq_free(seq)
        nll, n = _score(torch.cat(rows), chunk, ctx)
        total, count = total + nll, count + n
    return total / count, int(count)


def eager_nll(gguf_path, ids, ctx):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    total = count = 0.0
    with torch.no_grad():
        for chunk in _chunks(ids, ctx):
            logits = model(torch.tensor([chunk])).logits[0]
            nll, n = _score(logits, chunk, ctx)
            total, count = total + nll, count + n
    return total / count, int(count)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("programs", nargs="*", metavar="P.pte")
    parser.add_argument("--text", required=True)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--model", default="smollm2",
                        help="the GGUF (or packaged name) whose tokenizer and eager weights")
    parser.add_argument("--eager", action="store_true", help="transformers fp32 too")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from executorch_cellcache.exporting import packaged_models

    path = packaged_models.resolve(args.model) or Path(args.model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=True)
    print(f"{len(ids)} tokens, {len(ids) // args.ctx} chunks of {args.ctx}")
    rows = [("transformers fp32 (eager)", lambda: eager_nll(path, ids, args.ctx))] \
        if args.eager else []
    rows += [(p, lambda p=p: program_nll(p, ids, args.ctx)) for p in args.programs]
    for name, run in rows:
        nll, n = run()
        print(f"{name}: {n} tokens scored, mean NLL {nll:.4f}, perplexity {math.exp(nll):.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
