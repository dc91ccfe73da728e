#!/usr/bin/env python
"""Trains the embedded default model and writes it as a Hugging Face
checkpoint folder (default: executorch_cellcache/exporting/default_checkpoint).

    python scripts/train_default_model.py            # the shipped checkpoint
    python scripts/train_default_model.py --steps 50 --out /tmp/ckpt   # a quick try

Corpus: the training split of Python's ``pydoc_data.topics`` (the split rule is
``exporting/default_model.split_documents``). Tokenizer: a byte-level BPE
trained with ``tokenizers`` on that split. Model: transformers'
``LlamaForCausalLM`` (GQA, RoPE), trained from a fixed seed with AdamW, a
plain loop, a fixed number of steps and ``--threads`` intra-op threads
(default 1), so two runs on the same versions give the same weights. Batches
are blocks of the training token stream at offsets drawn from a seeded
generator. Then a quantization-aware fine-tune (torchao QAT: fake-quantized
8da4w linears and int8 embedding, the rules of ``exporting/quantize.plan``) of
``--qat-steps`` more steps, so the shipped weights lose little when exported
with ``--quantize 8da4w``. Ends by scoring the held-out split (windows and
stride as ``cellcache eval``) in fp32 and eagerly quantized as export
quantizes, and writing README.md with the figures.
"""

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from executorch_cellcache.exporting import default_model, quantize
from executorch_cellcache.runtime.evaluate import scored_windows

BOS, EOS = "<s>", "</s>"
# The quantization the fine-tune trains against: what `cellcache export --quantize 8da4w
# --embedding-quantize 8` does (the README's recommended quantized export), with the min/max
# scales torchao's fake quantizers use. Saved in config.json (quantize.QAT_CONFIG_KEY), so
# export picks those scales for this checkpoint.
RECOMMENDED = dict(quantize="8da4w", group_size=32, embedding_quantize="8")
QAT_QUANTIZE = {**RECOMMENDED, "weight_scales": "minmax"}
QAT_STEPS = 600
QAT_LR = 1e-3
# The figures the README reports, each quantized eagerly as export quantizes (scales
# unset: export's choice for this checkpoint, the fine-tune's min/max after QAT).
EVAL_QUANTIZE = {
    "8da4w": RECOMMENDED,
    "8da4w, HQQ scales": {**RECOMMENDED, "weight_scales": "hqq"},
    "8da8w": dict(quantize="8da8w", embedding_quantize="8"),
}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _count(minimum):
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value
    return parse


def _rate(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=default_model.CHECKPOINT,
                   help="checkpoint folder to write (default: the package's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--steps", type=_count(1), default=1200)
    p.add_argument("--batch-size", type=_count(1), default=8)
    p.add_argument("--seq-len", type=int, default=default_model.TRAINING_CONTEXT,
                   help="training context in tokens")
    p.add_argument("--lr", type=_rate, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eval-window", type=int, default=default_model.TRAINING_CONTEXT)
    p.add_argument("--eval-stride", type=int, default=default_model.TRAINING_CONTEXT // 2)
    p.add_argument("--eval-every", type=int, default=300, help="held-out NLL every N steps")
    p.add_argument("--qat-steps", type=_count(0), default=QAT_STEPS,
                   help=f"quantization-aware fine-tune steps after training (default "
                        f"{QAT_STEPS}; 0: none)")
    p.add_argument("--qat-lr", type=_rate, default=QAT_LR,
                   help=f"peak learning rate of the fine-tune (default {QAT_LR})")
    return p.parse_args(argv)


def train_tokenizer(texts, vocab_size):
    """A byte-level BPE (``tokenizers``) with BOS/EOS; encode adds BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def token_stream(tok, texts):
    """[n] int64: every training document as BOS + text + EOS, in order."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def build_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 32 * 32 + 32,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=10000.0,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
        tie_word_embeddings=True, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def learning_rate(step, steps, peak):
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream, args, generator, heldout_ids, steps, peak_lr, phase="train"):
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    n_starts = len(stream) - args.seq_len + 1
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, n_starts, (args.batch_size,), generator=generator)
        batch = torch.stack([stream[s:s + args.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr)
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(f"{phase} step {step:5d}  loss {loss.item():.4f}  (mean of last 50: "
                  f"{recent:.4f})  {time.perf_counter() - t0:6.0f} s", file=sys.stderr,
                  flush=True)
        if (step + 1) % args.eval_every == 0 and step + 1 < steps:
            model.eval()
            nll, _ = heldout_nll(model, heldout_ids, args.eval_window, args.eval_stride)
            print(f"           held-out NLL {nll:.4f}", file=sys.stderr, flush=True)
            model.train()
    model.eval()
    return losses


@torch.no_grad()
def heldout_nll(model, ids, window, stride):
    """(mean NLL, tokens scored) of ``ids`` [n] with the eval windows."""
    total, count = 0.0, 0
    for begin, end, first in scored_windows(len(ids), window, stride):
        logits = model(input_ids=ids[None, begin:end]).logits[0].double()
        logp = torch.log_softmax(logits[first - begin - 1:end - begin - 1], dim=-1)
        target = ids[first:end]
        total -= logp.gather(1, target[:, None]).sum().item()
        count += end - first
    return total / count, count


def quantization_aware_finetune(model, stream, args, heldout_ids):
    """torchao QAT on ``model`` in place: every module export would quantize
    for QAT_QUANTIZE gets that config's fake quantizer (int8 per-token
    activations and int4 group weights on linears, int8 rows on the embedding;
    torchao's QAT chooses min/max scales), ``args.qat_steps`` steps of the
    training loop at ``args.qat_lr``, then the fake quantizers are removed:
    the weights stay fp32. Batches come from their own generator (seed + 1),
    so the fine-tune does not depend on how many batches training drew.
    Returns the losses."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear, QATConfig

    steps = quantize.plan(model, quantize.check_options(**QAT_QUANTIZE))
    quantize.apply(model, steps, wrap=lambda config: QATConfig(config, step="prepare"))
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses = train(model, stream, args, generator, heldout_ids, args.qat_steps, args.qat_lr,
                   phase="qat")
    quantize_(model, QATConfig(step="convert"), filter_fn=lambda m, fqn: isinstance(
        m, (FakeQuantizedLinear, FakeQuantizedEmbedding)))
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        raise RuntimeError("the QAT module swap broke the lm_head / embedding tie")
    setattr(model.config, quantize.QAT_CONFIG_KEY, dict(QAT_QUANTIZE))
    return losses


def quantized_heldout_nll(model, ids, args):
    """{mode: mean held-out NLL} of ``model`` quantized eagerly (a copy) as
    export quantizes for each EVAL_QUANTIZE entry."""
    import copy

    out = {}
    for name, opts in EVAL_QUANTIZE.items():
        if not args.qat_steps and opts.get("weight_scales") == "hqq":
            continue  # export's own choice is hqq then: the first row
        quantized = copy.deepcopy(model)
        quantize.quantize_model(quantized, quantize.check_options(**opts))
        out[name] = heldout_nll(quantized, ids, args.eval_window, args.eval_stride)[0]
    return out


def write_tokenizer(tok, out, model_max_length):
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")


def write_readme(out, args, figures):
    command = "python scripts/train_default_model.py " + " ".join(sys.argv[1:])
    ppl = math.exp(figures["heldout_nll"])
    qat = ""
    if args.qat_steps:
        opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QAT_QUANTIZE.items())
        before = math.exp(figures['pretrained_nll'])
        group, emb = QAT_QUANTIZE["group_size"], QAT_QUANTIZE["embedding_quantize"]
        qat = f"""- Then quantization-aware fine-tuning with torchao's QAT: every module that
  `cellcache export {opts}` quantizes carries
  a fake quantizer (int8 per-token activations and int4 weights in groups of
  {group} on every linear, int{emb} rows on the embedding, min/max scales), removed
  afterwards (the weights stay fp32); {args.qat_steps} more steps, AdamW lr {args.qat_lr} (same
  schedule), batches from seed {args.seed + 1}; {figures['qat_seconds']:.0f} s. Final loss (mean of
  the last 50 steps) {figures['qat_final_loss']:.4f}. Held-out perplexity before it {before:.3f}.
  `config.json` records it under `{quantize.QAT_CONFIG_KEY}`, so `cellcache export` picks
  min/max scales for this checkpoint.
"""
    quantized = "\n".join(
        f"  - {name}: mean NLL {q:.4f}, perplexity {math.exp(q):.3f} "
        f"({math.exp(q - figures['heldout_nll']) - 1:+.1%} vs fp32)"
        for name, q in figures["quantized_nll"].items())
    text = f"""# cellcache-default-llama

The embedded default model of executorch-cellcache: a {figures['params'] / 1e6:.2f}M-parameter
Llama (transformers `LlamaForCausalLM`: {args.layers} layers, hidden {args.hidden_size}, 4
attention heads over 2 K/V heads (GQA), RoPE, tied embeddings) with a byte-level BPE
tokenizer of {figures['vocab']} tokens (`<s>` = BOS, added by encoding; `</s>` = EOS, ends
every training document). It writes Python-documentation-like English and knows nothing else.
`tokenizer_config.json` carries a plain "User: / Assistant:" chat template (it was not trained
on chats).

## Training

- Command (repository root, project .venv): `{command.strip()}`
- Corpus: Python {platform.python_version()}'s `pydoc_data.topics` (the text `help()` shows),
  topics sorted by name. Held out: every {default_model.HELDOUT_EVERY}th topic from index
  {default_model.HELDOUT_FIRST} ({figures['heldout_docs']} topics, {figures['heldout_chars']}
  characters, sha256 `{figures['heldout_sha256'][:16]}`); the rule is
  `executorch_cellcache.exporting.default_model.split_documents`. Training: the other
  {figures['train_docs']} topics, {figures['train_tokens']} tokens.
- Seed {args.seed}, {args.threads} torch thread(s), {args.steps} steps of {args.batch_size} x
  {args.seq_len} tokens at seeded offsets, AdamW lr {args.lr} (linear warmup, cosine to 10%),
  weight decay 0.1, torch {torch.__version__}; {figures['train_seconds']:.0f} s of training.
- Final training loss (mean of the last 50 steps): {figures['final_loss']:.4f} (last step
  {figures['last_loss']:.4f}).
{qat}- Held-out, eager transformers, windows of {args.eval_window} tokens with stride
  {args.eval_stride} (the `cellcache eval` rule): {figures['heldout_tokens']} tokens scored,
  mean NLL {figures['heldout_nll']:.4f}, perplexity {ppl:.3f}. Quantized eagerly as
  `cellcache export` quantizes (`exporting/quantize.py`):
{quantized}

## License

The corpus is the Python documentation, Copyright (c) 2001-2023 Python Software Foundation,
distributed with Python under the PSF License Version 2
(https://docs.python.org/3/license.html); these weights are derived from it.
"""
    (out / "README.md").write_text(text)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(args.seed)
    train_texts, heldout_texts = default_model.split_documents()
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab_size)
    stream = token_stream(tok, train_texts)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; training stream {len(stream)} tokens "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    model = build_model(args, tok)
    params = sum(p.numel() for p in model.parameters())
    heldout = default_model.heldout_text()
    ids = torch.tensor(tok.encode(heldout).ids, dtype=torch.int64)
    t1 = time.perf_counter()
    losses = train(model, stream, args, generator, ids, args.steps, args.lr)
    train_seconds = time.perf_counter() - t1
    pretrained_nll, _ = heldout_nll(model, ids, args.eval_window, args.eval_stride)
    qat_losses, qat_seconds = [], 0.0
    if args.qat_steps:
        print(f"held-out NLL {pretrained_nll:.4f} (perplexity {math.exp(pretrained_nll):.3f}); "
              f"quantization-aware fine-tune, {args.qat_steps} steps", file=sys.stderr)
        t2 = time.perf_counter()
        qat_losses = quantization_aware_finetune(model, stream, args, ids)
        qat_seconds = time.perf_counter() - t2

    nll, count = heldout_nll(model, ids, args.eval_window, args.eval_stride)
    quantized = quantized_heldout_nll(model, ids, args)
    figures = dict(
        pretrained_nll=pretrained_nll, qat_seconds=qat_seconds, quantized_nll=quantized,
        qat_final_loss=sum(qat_losses[-50:]) / len(qat_losses[-50:]) if qat_losses else None,
        params=params, vocab=tok.get_vocab_size(), train_docs=len(train_texts),
        train_tokens=len(stream), heldout_docs=len(heldout_texts), heldout_chars=len(heldout),
        heldout_sha256=hashlib.sha256(heldout.encode()).hexdigest(),
        final_loss=sum(losses[-50:]) / len(losses[-50:]), last_loss=losses[-1],
        train_seconds=train_seconds, heldout_tokens=count, heldout_nll=nll)

    args.out.mkdir(parents=True, exist_ok=True)
    model.name_or_path = default_model.NAME
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(args.out)
    write_tokenizer(tok, args.out, model.config.max_position_embeddings)
    write_readme(args.out, args, figures)
    weights = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    quantized_text = ", ".join(f"{name} {math.exp(q):.3f} ({math.exp(q - nll) - 1:+.1%})"
                               for name, q in quantized.items())
    print(f"final loss {figures['final_loss']:.4f} (last step {losses[-1]:.4f}); held-out "
          f"{count} tokens, NLL {nll:.4f}, perplexity {math.exp(nll):.3f}; quantized as "
          f"export does: {quantized_text}; {train_seconds + qat_seconds:.0f} s training; "
          f"model.safetensors sha256 {weights[:16]}; wrote {args.out}")


if __name__ == "__main__":
    main()
