"""The copy task of the default model: repeat a passage given above.

The default model (``default_model``) is trained on copy examples built from
its TRAINING split (``scripts/train_default_model.py``): a passage, then
``COPY_SEPARATOR``, then the passage again, sometimes with a few words
replaced, removed or inserted, then end of text. At inference the prompt is
the passage, the separator and the passage's first ``PREFIX_CHARS`` or so
characters; the greedy continuation should repeat the rest. That is what
prompt lookup (speculative decoding with drafts copied from the context)
accelerates, so the task measures it.

This module holds the format, the held-out prompts (``heldout_copy_prompts``:
built from the HELD-OUT split, deterministic, tokenizer-free, for the
training script, the benchmarks and the tests alike) and the speculative
decoding simulation (``prompt_lookup_forwards``: how many forwards a greedy
output costs when each forward verifies a draft; the task's draft is prompt
lookup's: the tokens that follow the earliest earlier occurrence of the
context's last two tokens).
"""

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from . import default_model

COPY_SEPARATOR = "\n\nRepeat:\n"   # between a passage and its copy
PREFIX_CHARS = 80                   # how much of the copy a prompt gives (then a word boundary)
# Held-out passages: paragraphs (``default_model.DOCUMENT_SEPARATOR``-separated) of the
# held-out split that share no run of text with the training split, cut to whole lines, of this
# many characters: about 50 to 115 tokens of the default tokenizer, so a passage and its copy
# fit the 256-token training context.
PASSAGE_CHARS = (150, 330)
SHARED_RUN_CHARS = 40     # a run this long found in the training split: the paragraph is not new
GRAMMAR = "::="            # in a paragraph: a grammar production, not a passage
SHARED_RUN_STRIDE = 8     # runs checked at every 8th character (so any shared 47 are found)
HELDOUT_PROMPTS = 16
LOOKUP_NGRAM = 2        # prompt lookup matches the context's last 2 tokens ...
LOOKUP_TOKENS = 8       # ... and proposes up to 8 tokens that followed them


@dataclass(frozen=True)
class CopyPrompt:
    passage: str     # the text to repeat
    prompt: str      # passage + COPY_SEPARATOR + the passage's first PREFIX_CHARS or so
    reference: str   # the rest of the passage: what a perfect copy continues with


def copy_document(passage: str, copy: Optional[str] = None) -> str:
    """A copy example's text (a training document, BOS and EOS not included):
    ``passage``, the separator, then ``copy`` (default: the passage itself)."""
    return passage + COPY_SEPARATOR + (passage if copy is None else copy)


def prefix_length(passage: str, chars: int = PREFIX_CHARS) -> int:
    """Where a copy prompt cuts ``passage``: at the last whitespace at or
    before ``chars`` that follows a non-whitespace character (so the prompt
    ends on a word and the continuation starts with whitespace, as the
    byte-level tokenizer splits running text); ``chars`` when there is none."""
    for k in range(min(chars, len(passage) - 1), 0, -1):
        if passage[k].isspace() and not passage[k - 1].isspace():
            return k
    return min(chars, len(passage))


def copy_prompt(passage: str, chars: int = PREFIX_CHARS) -> CopyPrompt:
    """The copy-task prompt for ``passage`` and its reference continuation."""
    k = prefix_length(passage, chars)
    return CopyPrompt(passage, copy_document(passage, passage[:k]), passage[k:])


def heldout_passages(n: int = HELDOUT_PROMPTS,
                     chars: Tuple[int, int] = PASSAGE_CHARS) -> List[str]:
    """The first ``n`` held-out passages, deterministically. Candidates: the
    paragraphs (text between blank lines, trailing whitespace dropped) of the
    held-out documents none of whose ``SHARED_RUN_CHARS``-character runs
    starting at a multiple of ``SHARED_RUN_STRIDE`` occurs in a training
    document (pydoc topics repeat each other: most of the held-out
    ``attribute-access``, ``customization`` and ``for`` is in training topics
    word for word, and copying it would test memory) and is no grammar
    production (``GRAMMAR``: notation, some 2 characters a token, so its copy
    would not fit the training context), each cut to its longest
    run of whole lines from its start of at most ``chars[1]`` characters, kept
    if at least ``chars[0]``. Taken round robin over the held-out documents
    (each one's first candidate, then each one's second, ...), so every topic
    with new text contributes."""
    return list(_heldout_passages(n, tuple(chars)))


@functools.lru_cache(maxsize=8)
def _heldout_passages(n: int, chars: Tuple[int, int]) -> Tuple[str, ...]:
    """``heldout_passages``, computed once per arguments."""
    lo, hi = chars
    train, heldout = default_model.split_documents()
    k = SHARED_RUN_CHARS
    training = {text[i:i + k] for text in train for i in range(len(text) - k + 1)}
    per_document = []
    for text in heldout:
        passages = []
        for paragraph in text.split(default_model.DOCUMENT_SEPARATOR):
            paragraph = paragraph.rstrip()
            if GRAMMAR in paragraph:
                continue
            if any(paragraph[i:i + k] in training
                   for i in range(0, len(paragraph) - k + 1, SHARED_RUN_STRIDE)):
                continue
            lines = paragraph.split("\n")
            while len(lines) > 1 and len("\n".join(lines)) > hi:
                lines.pop()
            passage = "\n".join(lines)
            if lo <= len(passage) <= hi and passage.strip():
                passages.append(passage)
        per_document.append(passages)
    out = []
    for rank in range(max(map(len, per_document), default=0)):
        for passages in per_document:
            if rank < len(passages) and len(out) < n:
                out.append(passages[rank])
    if len(out) < n:
        raise ValueError(f"the held-out split has {len(out)} new passages of {lo} to {hi} "
                         f"characters, fewer than {n}")
    return tuple(out)


def heldout_copy_prompts(n: int = HELDOUT_PROMPTS, chars: int = PREFIX_CHARS
                         ) -> List[CopyPrompt]:
    """The held-out copy task: ``copy_prompt`` of each ``heldout_passages(n)``."""
    return [copy_prompt(p, chars) for p in heldout_passages(n)]


def prompt_lookup_forwards(prompt: Sequence[int], output: Sequence[int],
                           propose: Callable[[List[int]], Sequence[int]]
                           ) -> Tuple[int, List[int]]:
    """Simulates greedy speculative decoding producing ``output`` (the greedy
    continuation of ``prompt``, token ids): each forward verifies
    ``propose(prompt + emitted so far)`` (the draft) and emits the draft's
    tokens that agree with ``output`` plus the model's own next token.
    Returns (forwards, accepted draft tokens per forward); tokens per forward
    is ``len(output) / forwards``. The task's ``propose`` is the runtime's
    prompt lookup (``runtime/speculative.lookup``) at LOOKUP_NGRAM tokens and
    LOOKUP_TOKENS proposed; the caller passes it (this layer imports no
    runtime)."""
    context, emitted, accepted = list(prompt), 0, []
    while emitted < len(output):
        draft = list(propose(context))
        a = 0
        while a < len(draft) and emitted + a < len(output) - 1 and draft[a] == output[emitted + a]:
            a += 1
        accepted.append(a)
        context += output[emitted:emitted + a + 1]
        emitted += a + 1
    return len(accepted), accepted


def common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class CopyFigures:
    tokens_per_forward: float   # mean over the prompts of emitted tokens / forwards
    copied_chars: int           # reference characters the outputs reproduce exactly (a prefix each)
    reference_chars: int        # the references' characters, all prompts
    exact: int                  # prompts whose output starts with their whole reference
    prompts: int
    per_prompt: List[dict]      # tokens, forwards, copied, reference chars, output text

    def summary(self) -> str:
        return (f"{self.tokens_per_forward:.2f} tokens per forward (prompt lookup, "
                f"{LOOKUP_NGRAM}-gram, up to {LOOKUP_TOKENS} proposed); "
                f"{self.copied_chars} of {self.reference_chars} reference characters copied "
                f"exactly ({self.copied_chars / max(1, self.reference_chars):.0%}), "
                f"{self.exact} of {self.prompts} passages in full")


def copy_task_figures(greedy: Callable[[List[int]], List[int]],
                      encode: Callable[[str], List[int]],
                      decode: Callable[[List[int]], str],
                      propose: Callable[[List[int]], Sequence[int]],
                      eos: Optional[int] = None,
                      prompts: Optional[Sequence[CopyPrompt]] = None) -> CopyFigures:
    """Scores a model on the copy task. ``greedy(prompt_ids)`` returns the
    model's greedy continuation (token ids, ending at its EOS or a length
    limit; any runtime: eager transformers, a ``.pte``); ``encode`` maps text
    to the ids a prompt is fed as (BOS included if the model wants one);
    ``decode`` maps ids back to text; ``propose`` drafts from a context
    (``prompt_lookup_forwards``). ``prompts`` default:
    ``heldout_copy_prompts()``. Tokens per forward: ``prompt_lookup_forwards``
    over the whole output (EOS included); copied characters: the common prefix
    of the decoded output (up to ``eos``) and the reference."""
    prompts = heldout_copy_prompts() if prompts is None else prompts
    rows = []
    for p in prompts:
        ids = list(encode(p.prompt))
        out = list(greedy(ids))
        forwards, _ = prompt_lookup_forwards(ids, out, propose) if out else (0, [])
        text_ids = out[:out.index(eos)] if eos is not None and eos in out else out
        text = decode(text_ids)
        rows.append(dict(tokens=len(out), forwards=forwards,
                         copied=common_prefix(text, p.reference),
                         reference=len(p.reference), output=text))
    tpf = [r["tokens"] / r["forwards"] for r in rows if r["forwards"]]
    return CopyFigures(
        tokens_per_forward=sum(tpf) / len(tpf) if tpf else 0.0,
        copied_chars=sum(r["copied"] for r in rows),
        reference_chars=sum(r["reference"] for r in rows),
        exact=sum(r["copied"] == r["reference"] for r in rows),
        prompts=len(rows), per_prompt=rows)
