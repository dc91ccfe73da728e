#!/usr/bin/env python
"""Trains the embedded default model and writes it as a Hugging Face
checkpoint folder (default: out/default_checkpoint; the shipped checkpoint,
executorch_cellcache/exporting/default_checkpoint, only when named).

    python scripts/train_default_model.py            # out/default_checkpoint
    python scripts/train_default_model.py --out executorch_cellcache/exporting/default_checkpoint
                                                     # replaces the shipped checkpoint
    python scripts/train_default_model.py --steps 50 --out /tmp/ckpt   # a quick try

Corpus: the training split of Python's ``pydoc_data.topics`` (the split rule is
``exporting/default_model.split_documents``). Tokenizer: a byte-level BPE
trained with ``tokenizers`` on that split. Model: transformers'
``LlamaForCausalLM`` (GQA, RoPE), trained from a fixed seed with AdamW, a
plain loop, a fixed number of steps and ``--threads`` intra-op threads
(default 1), so two runs on the same versions give the same weights. Batches
are blocks of the training token stream at offsets drawn from a seeded
generator; ``--copy-fraction`` of the rows are instead copy examples
(``exporting/copy_task.py``: a passage, a separator, the passage again; the
passage is random tokens, a passage of the training split, or one with words
edited), so the model repeats what its context holds, what prompt lookup
drafts from. The model starts from a hand-written induction circuit in its
first two layers (``plant_induction_circuit``; ``--no-induction-init``: plain
random initialization), whose attention weights stay as written. Then a
quantization-aware fine-tune (torchao QAT: fake-quantized
8da4w linears and int8 embedding, the rules of ``exporting/quantize.plan``) of
``--qat-steps`` more steps, so the shipped weights lose little when exported
with ``--quantize 8da4w`` (its batches carry copy examples too). Ends by
scoring the held-out split (windows and stride as ``cellcache eval``) in fp32
and eagerly quantized as export quantizes, and the held-out copy task
(``copy_task.heldout_copy_prompts``: eager greedy decoding, prompt lookup
simulated), and writing README.md with the figures.
"""

import argparse
import hashlib
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

from executorch_cellcache.exporting import copy_task, default_model, quantize, tool_task
from executorch_cellcache.runtime.evaluate import scored_windows
from executorch_cellcache.cache._core import prompt_lookup as lookup

BOS, EOS = "<s>", "</s>"
DEFAULT_OUT = Path("out/default_checkpoint")
SHIPPED = "executorch_cellcache/exporting/default_checkpoint"   # default_model.CHECKPOINT
# The quantization the fine-tune trains against: what `cellcache export --quantize 8da4w
# --embedding-quantize 8` does (the README's recommended quantized export), with the min/max
# scales torchao's fake quantizers use. Saved in config.json (quantize.QAT_CONFIG_KEY), so
# export picks those scales for this checkpoint.
RECOMMENDED = dict(quantize="8da4w", group_size=32, embedding_quantize="8")
QAT_QUANTIZE = {**RECOMMENDED, "weight_scales": "minmax"}
STEPS = 2000
QAT_STEPS = 600
QAT_LR = 1e-3
# The figures the README reports, each quantized eagerly as export quantizes (scales
# unset: export's choice for this checkpoint, the fine-tune's min/max after QAT).
EVAL_QUANTIZE = {
    "8da4w": RECOMMENDED,
    "8da4w, HQQ scales": {**RECOMMENDED, "weight_scales": "hqq"},
    "8da8w": dict(quantize="8da8w", embedding_quantize="8"),
}
# Copy examples (exporting/copy_task.py): a passage of the training split, the separator, the
# passage again (half of them with 1 to 3 words replaced, removed or inserted), EOS. A
# fraction COPY_FRACTION of the batch rows (training and fine-tune) start at a copy example
# instead of a random offset of the training stream, so the whole example is in the row.
COPY_FRACTION = 0.2
INDUCTION_EMBED = 40
EMBED_SCALE = 10.0
ROPE_THETA = 1e6
COPY_EXAMPLES = 4096
COPY_PASSAGE_CHARS = (150, 360)
COPY_EDITED = 0.75
COPY_EDIT_SHARE = (0.1, 0.3)
COPY_RANDOM = 0.5
COPY_RANDOM_TOKENS = (40, 110)
# The chat template (Hermes-style tool calls, which serving/tool_calls.py reads from the
# "<tool_call>" in it): offered tools as "name(params): description" lines, each call as
# <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call> right after "Assistant:", a tool
# result as a "Tool:" line. Tool-use chats (TOOL_FRACTION of the fine-tune's rows) teach the
# demo: a short fine-tune, so that training before it is the recipe without tools.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}Tools:\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{% set params = f.parameters.properties if f.parameters is defined and "
    "f.parameters.properties is defined else {} %}"
    "{{ f.name }}({{ params.keys() | join(', ') }}){% if f.description %}: {{ f.description }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
    "To call a tool, answer <tool_call>{{ '\\n' }}{\"name\": NAME, \"arguments\": {...}}"
    "{{ '\\n' }}</tool_call>{{ '\\n\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'tool' %}Tool: {{ message['content'] }}\n"
    "{% else %}Assistant:{% if message['content'] %} {{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>{{ '\\n' }}{\"name\": {{ f.name | tojson }}, \"arguments\": "
    "{{ f.arguments | tojson }}}{{ '\\n' }}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TOOL_FRACTION = 0.2
TOOL_EXAMPLES = 2048


def _count(minimum):
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value
    return parse


def _fraction(text):
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def _rate(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"checkpoint folder to write (default: {DEFAULT_OUT}; the shipped one "
                        f"is {SHIPPED}, written only when named)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--steps", type=_count(1), default=STEPS)
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
    p.add_argument("--copy-fraction", type=_fraction, default=COPY_FRACTION,
                   help=f"fraction of batch rows that are copy examples (default "
                        f"{COPY_FRACTION}; 0: none, the recipe before copy examples)")
    p.add_argument("--rope-theta", type=_rate, default=ROPE_THETA)
    p.add_argument("--no-induction-init", dest="induction_init", action="store_false",
                   help="random initialization only (no planted induction circuit)")
    p.add_argument("--copy-examples", type=_count(1), default=COPY_EXAMPLES,
                   help=f"copy examples drawn from the training split (default {COPY_EXAMPLES})")
    p.add_argument("--tool-fraction", type=_fraction, default=TOOL_FRACTION,
                   help=f"fraction of the fine-tune's batch rows that are tool-use chats "
                        f"(default {TOOL_FRACTION}; 0: none, the recipe before the tool-use "
                        f"demo)")
    p.add_argument("--tool-examples", type=_count(1), default=TOOL_EXAMPLES,
                   help=f"tool-use chats drawn (default {TOOL_EXAMPLES})")
    args = p.parse_args(argv)
    if args.copy_fraction + args.tool_fraction > 1:
        p.error(f"--copy-fraction {args.copy_fraction} and --tool-fraction "
                f"{args.tool_fraction} add up to more than all the rows")
    return args


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


_WORD = re.compile(r"\S+")


def _edit(rng, passage, vocabulary, count):
    """``passage`` with ``count`` of its words (at most all) each replaced by,
    or preceded by, a word of ``vocabulary``, or removed (with the spaces
    after it)."""
    words = list(_WORD.finditer(passage))
    picked = rng.sample(range(len(words)), min(count, len(words)))
    text = passage
    for i in sorted(picked, reverse=True):   # from the end: earlier offsets stay valid
        start, end = words[i].span()
        kind = rng.randrange(3)
        if kind == 0:
            text = text[:start] + rng.choice(vocabulary) + text[end:]
        elif kind == 1:
            while end < len(text) and text[end] == " ":
                end += 1
            text = text[:start] + text[end:]
        else:
            text = text[:start] + rng.choice(vocabulary) + " " + text[start:]
    return text


def copy_examples(tok, texts, count, seed, max_tokens):
    """(stream [n] int64, starts [k] int64, scored [n] bool): ``count`` copy
    examples, each BOS + passage + ``copy_task.COPY_SEPARATOR`` + the same
    passage + EOS, concatenated; ``starts`` holds the offsets of those with
    ``max_tokens`` of stream from them; ``scored`` marks the tokens the loss
    counts. COPY_RANDOM of the examples are random tokens instead of text:
    COPY_RANDOM_TOKENS ordinary tokens drawn uniformly; nothing but copying
    predicts them, and they and the separator after them are not scored (the
    model does not learn them as text). The others are text: a passage starts
    at a line start of a training text (texts drawn in proportion to their
    length) and has COPY_PASSAGE_CHARS characters or a few fewer (it ends on a
    word); COPY_EDITED of them have COPY_EDIT_SHARE of their words edited
    (``_edit``, words from the training split), so that the copy, not memory
    of the corpus, predicts them; an edited passage is not scored, its copy
    is; an unedited example is scored throughout. Examples over
    ``max_tokens`` are drawn again. All from ``random.Random(seed)``."""
    rng = random.Random(seed)
    lo, hi = COPY_PASSAGE_CHARS
    line_starts = [[0] + [m.end() for m in re.finditer("\n", t) if m.end() < len(t)]
                   for t in texts]
    cumulative, total = [], 0
    for t in texts:
        total += len(t)
        cumulative.append(total)
    vocabulary = sorted(set(re.findall(r"[A-Za-z]{2,}", "\n".join(texts))))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    separator = tok.encode(copy_task.COPY_SEPARATOR, add_special_tokens=False).ids
    ordinary = [i for i in range(tok.get_vocab_size()) if i not in (bos, eos)]
    ids, starts, scored = [], [], []
    while len(starts) < count:
        if rng.random() < COPY_RANDOM:
            passage = rng.choices(ordinary, k=rng.randint(*COPY_RANDOM_TOKENS))
            example = [bos] + passage + separator + passage + [eos]
            if len(example) > max_tokens:
                continue
            starts.append(len(ids))
            ids += example
            scored += [False] * (1 + len(passage) + len(separator)) + [True] * (len(passage) + 1)
            continue
        d = rng.choices(range(len(texts)), cum_weights=cumulative)[0]
        text, begin = texts[d], rng.choice(line_starts[d])
        piece = text[begin:begin + rng.randint(lo, hi)]
        if begin + len(piece) < len(text):   # cut inside the text: end on a word
            piece = piece[:max(piece.rfind(" "), piece.rfind("\n"), 0)]
        passage = piece.rstrip()
        if len(passage.strip()) < lo // 2:
            continue
        edited = rng.random() < COPY_EDITED
        if edited:
            words = len(_WORD.findall(passage))
            passage = _edit(rng, passage, vocabulary,
                            max(1, round(words * rng.uniform(*COPY_EDIT_SHARE))))
        encoding = tok.encode(copy_task.copy_document(passage))
        if len(encoding.ids) + 1 > max_tokens:
            continue
        starts.append(len(ids))
        ids += encoding.ids + [eos]
        # an edited passage is not text to learn: only its copy is scored
        scored += [not edited or end > len(passage) for _, end in encoding.offsets] + [True]
    starts = [s for s in starts if s + max_tokens <= len(ids)]
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
            torch.tensor(scored, dtype=torch.bool))


def tool_examples(tok, texts, count, seed, max_tokens):
    """(stream, starts, scored) as ``copy_examples`` gives them: ``count``
    tool-use conversations (``exporting/tool_task.py``), each rendered with
    CHAT_TEMPLATE as the server renders a chat, assistant replies (and their
    EOS) scored, nothing else. Free-text argument values are words of the
    training split; text replies (to requests no offered tool fits) are its
    line-start passages of 40 to 160 characters ending on a word. All from
    ``random.Random(seed)``; conversations over ``max_tokens`` are drawn
    again."""
    from executorch_cellcache.serving.chat_template import ChatTemplate

    rng = random.Random(seed)
    template = ChatTemplate(CHAT_TEMPLATE, None, BOS, EOS)
    words = sorted(w for w in set(re.findall(r"[a-z]{4,12}", "\n".join(texts))))
    replies = []
    for text in texts:
        for m in re.finditer(r"(?m)^[A-Z][^\n]{40,160}", text):
            piece = m.group(0)
            replies.append(piece[:max(piece.rfind(" "), 40)].rstrip())
    ids, starts, scored = [], [], []
    while len(starts) < count:
        messages, tools = tool_task.conversation(rng, words, replies)
        text = template.render(messages, add_generation_prompt=False, tools=tools)
        spans = []    # [start, end) of each assistant reply, its EOS included
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                begin = len(template.render(messages[:k], add_generation_prompt=True,
                                            tools=tools))
                end = len(template.render(messages[:k + 1], add_generation_prompt=False,
                                          tools=tools)) - 1     # the "\n" after EOS
                spans.append((begin, end))
        encoding = tok.encode(text, add_special_tokens=False)
        if len(encoding.ids) > max_tokens:
            continue
        starts.append(len(ids))
        ids += encoding.ids
        scored += [any(b < end <= e for b, e in spans) for _, end in encoding.offsets]
    starts = [s for s in starts if s + max_tokens <= len(ids)]
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
            torch.tensor(scored, dtype=torch.bool))


def draw_batch(stream, pools, args, generator):
    """(inputs, labels), [batch, seq_len] each: rows at random offsets of
    ``stream``; each row is instead, with probability ``fraction``, the stream
    of one of ``pools`` (``[(fraction, examples)]``, examples as
    ``copy_examples`` gives them) from a random example's start, its unscored
    tokens labelled -100. With no pools the generator draws only the offsets
    (the recipe before copy examples)."""
    n_starts = len(stream) - args.seq_len + 1
    starts = torch.randint(0, n_starts, (args.batch_size,), generator=generator)
    rows = [stream[s:s + args.seq_len] for s in starts.tolist()]
    labels = list(rows)
    if pools:
        draw = torch.rand(args.batch_size, generator=generator)
        low = 0.0
        for fraction, (pool_stream, pool_starts, scored) in pools:
            picks = torch.randint(0, len(pool_starts), (args.batch_size,), generator=generator)
            chosen = (draw >= low) & (draw < low + fraction)
            low += fraction
            for i in torch.nonzero(chosen).flatten().tolist():
                s = int(pool_starts[picks[i]])
                rows[i] = pool_stream[s:s + args.seq_len]
                labels[i] = rows[i].masked_fill(~scored[s:s + args.seq_len], -100)
    return torch.stack(rows), torch.stack(labels)


def build_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 32 * 32 + 32,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=args.rope_theta,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
        tie_word_embeddings=True, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def plant_induction_circuit(model, generator, embed=INDUCTION_EMBED, sharpness=10.0,
                            match=1.0, copy_gain=6.0, first_slow_pair=7, embed_scale=None):
    """Sets the weights of a fresh model so that, before any training, it
    copies: an induction circuit (the mechanism transformers learn for
    in-context copying; Olsson et al., 2022) written in by hand, because this
    model, in these few steps, does not find it (trained on copy examples
    alone, random tokens or text, it had not after 1,300 steps).

    Residual stream (hidden 128): embeddings are random rows of equal norm in
    the first ``embed`` dimensions (E), a constant in the last (C), zeros
    elsewhere; with tied embeddings C adds the same to every logit.
    - Layer 0: query and key read only C, with RoPE phases that put the first
      query head of each K/V head on the previous token and the second on the
      one before it; they copy (their K/V head's share of) that token's E into
      the next ``embed`` dimensions (P1: the previous token) and the ones after
      (P2: the one before).
    - Layer 1: the query heads match the last two tokens (E and P1) against
      each position's two before it (P1 and P2), in the RoPE pairs from
      ``first_slow_pair`` on (rope_theta 1e6: they turn under 0.5 rad over the
      256-token context, so the match barely depends on distance); the first
      query head of each K/V head adds ``copy_gain`` times the attended
      token's E to the stream: the token after the earlier occurrence of the
      last two, the next token of a copy (prompt lookup's rule, learned).
    The other blocks start writing nothing (output projections zero; training
    grows them), so their random outputs do not drown the circuit; the
    embeddings are ``EMBED_SCALE`` times as long as transformers' random
    initialization makes them, so they change slowly enough for the circuit to
    keep reading them. Returns (restore, frozen): a function that sets C back
    to the constant, which training calls after every step (C is what the
    previous-token attention reads, and as a free per-token logit bias it
    would drift), and the names of the parameters training leaves as written
    (the two layers' attention and the norms before it: trained, the
    language-model loss unlearned the copying; kept, they also quantize
    exactly: each int4 group holds one value or copies of one)."""
    config = model.config
    d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim, const = d // heads, d - 1
    half, group = head_dim // 2, heads // kv_heads
    per = embed // kv_heads
    shares = [range(g * per, (g + 1) * per) for g in range(kv_heads)]
    if 3 * embed >= d or group != 2 or per * kv_heads != embed or per > head_dim:
        raise ValueError(f"an induction circuit of {embed} embedding dimensions does not fit "
                         f"hidden size {d} with {kv_heads} K/V heads of {head_dim} for "
                         f"{heads} query heads")
    inv_freq = config.rope_parameters["rope_theta"] ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    emb = model.get_input_embeddings().weight
    # rows EMBED_SCALE times as long as the random initialization's, 1/8 of their square in C
    norm = config.initializer_range * math.sqrt(d) * (
        EMBED_SCALE if embed_scale is None else embed_scale)
    value = norm * math.sqrt(8.0 / embed)
    rms = math.sqrt((norm * norm + value * value) / d)  # of every embedding row
    p1, p2 = embed, 2 * embed
    with torch.no_grad():
        rows = torch.randn(emb.shape[0], embed, generator=generator)
        emb.zero_()
        emb[:, :embed] = rows / rows.norm(dim=1, keepdim=True) * norm
        emb[:, const] = value
        layer0, layer1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        for attn in (layer0, layer1):
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                linear.weight.zero_()
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
        amp = sharpness * rms / value
        for h in range(heads):
            back = 1 + h % group          # 1: the previous token, 2: the one before
            for j in range(half):
                layer0.q_proj.weight[h * head_dim + j, const] = amp * math.cos(back * inv_freq[j])
                layer0.q_proj.weight[h * head_dim + half + j, const] = -amp * math.sin(
                    back * inv_freq[j])
        for g in range(kv_heads):
            for j in range(half):
                layer0.k_proj.weight[g * head_dim + j, const] = amp
        # layer 1 reads E + P1 + P2 + C normalized: an E entry is then about `unit`
        unit = (norm / math.sqrt(embed)) / math.sqrt((3 * norm * norm + value * value) / d)
        slots = [j for j in range(first_slow_pair, half)] + [
            half + j for j in range(first_slow_pair, half)]
        scale = math.sqrt(match * math.sqrt(head_dim)) / unit
        for g, share in enumerate(shares):
            for i, dim in enumerate(share):
                # layer 0 values: E of the attended token; outputs: to P1, P2
                layer0.v_proj.weight[g * head_dim + i, dim] = rms
                layer0.o_proj.weight[p1 + dim, (g * group) * head_dim + i] = 1.0
                layer0.o_proj.weight[p2 + dim, (g * group + 1) * head_dim + i] = 1.0
                # layer 1 values: E of the attended token, written back to E
                layer1.v_proj.weight[g * head_dim + i, dim] = rms
                layer1.o_proj.weight[dim, g * group * head_dim + i] = copy_gain
            # match: slot k pairs (current token, key's previous) on the first half of
            # the slots and (previous token, key's one before) on the second, over the
            # dims of this K/V head's share (cycled)
            dims = list(share)
            for k, slot in enumerate(slots):
                dim = dims[(k // 2) % len(dims)]
                query_src, key_src = (dim, p1 + dim) if k % 2 == 0 else (p1 + dim, p2 + dim)
                layer1.k_proj.weight[g * head_dim + slot, key_src] = scale
                for h in range(g * group, (g + 1) * group):
                    layer1.q_proj.weight[h * head_dim + slot, query_src] = scale

    def restore():
        with torch.no_grad():
            model.get_input_embeddings().weight[:, const] = value
    frozen = [f"model.layers.{i}.{name}.weight" for i in (0, 1) for name in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj")]
    return restore, frozen


def freeze(model, names):
    """Parameters named in ``names`` are not trained (requires_grad False)."""
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)


def learning_rate(step, steps, peak):
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream, pools, args, generator, heldout_ids, steps, peak_lr, phase="train",
          after_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch, labels = draw_batch(stream, pools, args, generator)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr)
        loss = model(input_ids=batch, labels=labels).loss  # the model shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if after_step is not None:
            after_step()
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


@torch.no_grad()
def greedy_continuation(model, ids, eos, max_new_tokens=128):
    """Eager greedy decoding (a DynamicCache): the new token ids after
    ``ids``, at most ``max_new_tokens``, ending at the first ``eos``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out, x = [], torch.tensor([ids], dtype=torch.int64)
    for _ in range(max_new_tokens):
        token = int(model(input_ids=x, cache=cache, use_cache=True).logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
        x = torch.tensor([[token]], dtype=torch.int64)
    return out


def copy_figures(model, tok):
    """``copy_task.copy_task_figures`` of the eager ``model`` on the held-out
    copy prompts: greedy 128 tokens (or to EOS), prompt lookup simulated."""
    eos = tok.token_to_id(EOS)
    return copy_task.copy_task_figures(
        lambda ids: greedy_continuation(model, ids, eos), lambda text: tok.encode(text).ids,
        tok.decode, task_lookup, eos)


def tool_figures(model, tok):
    """How the eager ``model`` answers ``tool_task.heldout_tool_requests()``
    greedily (no grammar; up to 64 tokens): {"requests", "calls" (replies
    that are a parseable call), "right_tool", "right_arguments"}."""
    from executorch_cellcache.serving.chat_template import ChatTemplate
    from executorch_cellcache.serving.tool_calls import HERMES

    template, eos = ChatTemplate(CHAT_TEMPLATE, None, BOS, EOS), tok.token_to_id(EOS)
    out = dict(requests=0, calls=0, right_tool=0, right_arguments=0)
    for request in tool_task.heldout_tool_requests():
        text = template.render(request.messages, tools=request.tools)
        reply = greedy_continuation(model, tok.encode(text, add_special_tokens=False).ids, eos,
                                    64)
        calls = HERMES.parse(tok.decode([t for t in reply if t != eos])).calls
        out["requests"] += 1
        if calls:
            out["calls"] += 1
            out["right_tool"] += calls[0].name == request.name
            out["right_arguments"] += (calls[0].name == request.name and
                                       json.loads(calls[0].arguments) == request.arguments)
    return out


def task_lookup(context):
    """The copy task's draft: the runtime's prompt lookup at the task's n-gram
    and proposal length (copy_task.LOOKUP_NGRAM, LOOKUP_TOKENS)."""
    return lookup(context, copy_task.LOOKUP_TOKENS, copy_task.LOOKUP_NGRAM,
                  copy_task.LOOKUP_NGRAM)


def quantization_aware_finetune(model, stream, pools, args, heldout_ids, after_step=None,
                                frozen=()):
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
    freeze(model, frozen)
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses = train(model, stream, pools, args, generator, heldout_ids, args.qat_steps,
                   args.qat_lr, phase="qat", after_step=after_step)
    quantize_(model, QATConfig(step="convert"), filter_fn=lambda m, fqn: isinstance(
        m, (FakeQuantizedLinear, FakeQuantizedEmbedding)))
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        raise RuntimeError("the QAT module swap broke the lm_head / embedding tie")
    setattr(model.config, quantize.QAT_CONFIG_KEY, dict(QAT_QUANTIZE))
    return losses


def quantized_heldout_nll(model, ids, args, tok):
    """({mode: mean held-out NLL}, copy-task figures of the first mode) of
    ``model`` quantized eagerly (a copy) as export quantizes for each
    EVAL_QUANTIZE entry (the first: the recommended 8da4w)."""
    import copy

    out, copying = {}, None
    for name, opts in EVAL_QUANTIZE.items():
        if not args.qat_steps and opts.get("weight_scales") == "hqq":
            continue  # export's own choice is hqq then: the first row
        quantized = copy.deepcopy(model)
        quantize.quantize_model(quantized, quantize.check_options(**opts))
        out[name] = heldout_nll(quantized, ids, args.eval_window, args.eval_stride)[0]
        if copying is None:
            copying = copy_figures(quantized, tok)
    return out, copying


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
    copying = ""
    if args.induction_init:
        copying += f"""- Initialization: an induction circuit written into the first two layers
  (`plant_induction_circuit` in the script: layer 0 attends to the previous two tokens and
  copies them into their own dimensions; layer 1 matches the last two tokens against every
  earlier pair and adds the token that followed the match; embeddings in {INDUCTION_EMBED}
  dimensions plus a constant one, {EMBED_SCALE:g}x the usual length; rope_theta
  {args.rope_theta:g}); those two layers' attention weights and input norms are not trained, the
  constant embedding dimension is reset after every step; everything else trains.
"""
    if args.copy_fraction:
        lo, hi = COPY_PASSAGE_CHARS
        a, b = COPY_RANDOM_TOKENS
        n, tokens, seed = args.copy_examples, figures["copy_tokens"], args.seed + 2
        copying += f"""- Copy examples: {n} documents ({tokens} tokens) of the form
  passage + `{copy_task.COPY_SEPARATOR!r}` + the same passage + EOS
  (`exporting/copy_task.py`), drawn from seed {seed}: {COPY_RANDOM:.0%} random tokens
  ({a} to {b}, only the copy scored); the rest {lo} to {hi} characters of the training split from a
  line start, ending on a word, {COPY_EDITED:.0%} of them with {COPY_EDIT_SHARE[0]:.0%} to
  {COPY_EDIT_SHARE[1]:.0%} of their words replaced, removed or preceded by another
  (only the copy scored: memory of the corpus does not predict it). A row of a batch is,
  with probability {args.copy_fraction}, such an example from its start (then the next
  ones) instead of a random block of the training stream (training and fine-tune alike).
"""
    tools, tool_intro = "", " (it was not trained on chats)"
    if figures["tool_use"]:
        u = figures["tool_use"]
        tool_intro = (": a demo of tool calls, taught in the fine-tune by a mix of tool-use chats, "
                      "so that `cellcache serve` can show them end to end; it knows no more than "
                      "before")
        tools += f"""- Tool-use chats (a demo), in the fine-tune: {args.tool_examples} conversations ({figures['tool_tokens']}
  tokens; `exporting/tool_task.py`), drawn from seed {args.seed + 4}, rendered with the chat
  template: 1 to 3 of {len(tool_task.TOOLS)} tools offered, a request for what one does answered
  by its call (sometimes followed by the tool's result and a sentence quoting it), or
  ({tool_task.NEGATIVE:.0%}) a request no offered tool fits answered with a passage of the
  training split; only the assistant's replies scored. A row of a batch is, with
  probability {args.tool_fraction}, such conversations instead, in the fine-tune only (training
  before it is the recipe without tools).
  On {u['requests']} held-out requests (values no training chat uses), eager greedy fp32 with
  no grammar: {u['calls']} replies are a parseable call, {u['right_tool']} call the right tool,
  {u['right_arguments']} with the right arguments.
"""
    (lo, hi), prompts = copy_task.PASSAGE_CHARS, figures["copy"].prompts
    copy_task_figures = f"""- Copy task (`copy_task.heldout_copy_prompts()`: {prompts} held-out
  paragraphs of new text, {lo} to {hi} characters; prompt = passage + separator + its first
  {copy_task.PREFIX_CHARS} or so characters), eager greedy decoding of up to 128 tokens, prompt
  lookup simulated (the context's last {copy_task.LOOKUP_NGRAM} tokens matched at their earliest
  earlier occurrence, up to {copy_task.LOOKUP_TOKENS} tokens proposed, as many accepted as
  the greedy output agrees with):
""" + "".join(f"  - {name}: {f.summary()}\n" for name, f in (
        ("fp32" + (", before the fine-tune" if args.qat_steps else ""),
         figures["pretrained_copy"]),
        *((("fp32", figures["copy"]),) if args.qat_steps else ()),
        ("8da4w", figures["quantized_copy"])))
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
`tokenizer_config.json` carries a "User: / Assistant:" chat template with a tools section
and Hermes-style `<tool_call>` calls{tool_intro}.

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
{copying}{qat}{tools}- Held-out, eager transformers, windows of {args.eval_window} tokens with stride
  {args.eval_stride} (the `cellcache eval` rule): {figures['heldout_tokens']} tokens scored,
  mean NLL {figures['heldout_nll']:.4f}, perplexity {ppl:.3f}. Quantized eagerly as
  `cellcache export` quantizes (`exporting/quantize.py`):
{quantized}
{copy_task_figures}
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
    copies = tools = None
    pools = []
    if args.copy_fraction:
        copies = copy_examples(tok, train_texts, args.copy_examples, args.seed + 2, args.seq_len)
        pools.append((args.copy_fraction, copies))
    if args.tool_fraction and args.qat_steps:
        tools = tool_examples(tok, train_texts, args.tool_examples, args.seed + 4, args.seq_len)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; training stream {len(stream)} tokens"
          + (f"; {args.copy_examples} copy examples, {len(copies[0])} tokens, "
             f"{args.copy_fraction:.0%} of the rows" if copies is not None else "")
          + (f"; {args.tool_examples} tool-use chats, {len(tools[0])} tokens, "
             f"{args.tool_fraction:.0%} of the fine-tune's rows" if tools is not None else "")
          + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    model = build_model(args, tok)
    restore, frozen = None, []
    if args.induction_init:
        restore, frozen = plant_induction_circuit(
            model, torch.Generator().manual_seed(args.seed + 3))
        freeze(model, frozen)
    params = sum(p.numel() for p in model.parameters())
    heldout = default_model.heldout_text()
    ids = torch.tensor(tok.encode(heldout).ids, dtype=torch.int64)
    t1 = time.perf_counter()
    losses = train(model, stream, pools, args, generator, ids, args.steps, args.lr,
                   after_step=restore)
    train_seconds = time.perf_counter() - t1
    pretrained_nll, _ = heldout_nll(model, ids, args.eval_window, args.eval_stride)
    pretrained_copy = copy_figures(model, tok)
    print(f"held-out NLL {pretrained_nll:.4f} (perplexity {math.exp(pretrained_nll):.3f}); "
          f"copy task: {pretrained_copy.summary()}", file=sys.stderr)
    qat_losses, qat_seconds = [], 0.0
    if args.qat_steps:
        print(f"quantization-aware fine-tune, {args.qat_steps} steps", file=sys.stderr)
        t2 = time.perf_counter()
        tuning = pools + ([(args.tool_fraction, tools)] if tools is not None else [])
        qat_losses = quantization_aware_finetune(model, stream, tuning, args, ids, restore,
                                                 frozen)
        qat_seconds = time.perf_counter() - t2

    nll, count = heldout_nll(model, ids, args.eval_window, args.eval_stride)
    copying = copy_figures(model, tok) if args.qat_steps else pretrained_copy
    quantized, quantized_copying = quantized_heldout_nll(model, ids, args, tok)
    tool_use = tool_figures(model, tok) if tools is not None else None
    if tool_use:
        print(f"tool use: {tool_use}", file=sys.stderr)
    figures = dict(
        tool_use=tool_use, tool_tokens=len(tools[0]) if tools is not None else 0,
        pretrained_nll=pretrained_nll, qat_seconds=qat_seconds, quantized_nll=quantized,
        pretrained_copy=pretrained_copy, copy=copying, quantized_copy=quantized_copying,
        copy_tokens=len(copies[0]) if copies is not None else 0,
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
          f"export does: {quantized_text}; copy task: {copying.summary()}; 8da4w: "
          f"{quantized_copying.summary()}; {train_seconds + qat_seconds:.0f} s training; "
          f"model.safetensors sha256 {weights[:16]}; wrote {args.out}")


if __name__ == "__main__":
    main()
