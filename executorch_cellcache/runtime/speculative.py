"""Speculative decoding's proposers: guesses of the tokens that follow a
sample, which the scheduler verifies in one forward of the target program
(runtime/scheduler.py) with the acceptance rule of runtime/sampling.py
``verify``. Output is plain decoding's: the same tokens when greedy (and, for
prompt lookup, when sampling with the same seed), the same distribution when
a draft model samples its proposals.

Two proposers:

- ``PromptLookup`` (prompt lookup decoding; transformers' ``prompt_lookup_num_tokens``,
  vLLM's n-gram proposer): the sample's last m tokens, for m from
  ``max_ngram`` down to ``min_ngram``, are searched in its prompt + output;
  at the earliest earlier occurrence, the up to k tokens that followed it are
  proposed. No model, no memory: it wins where the output quotes its input
  (code edits, summaries, answers from a passage).
- ``DraftModel``: a second cell-cache program with the same vocabulary and
  tokenizer, with its own cache, driven in the same process. Each sample has a
  mirror sequence there holding the tokens the draft has seen; before it
  proposes, the mirror is cut back to what the target accepted (``seq_rm``)
  and fed the rest, then k tokens are proposed one forward at a time, all
  proposing samples batched in each forward. Greedy requests get the draft's
  argmax; sampled ones a draw from the draft's distribution under the same
  parameters, with the distributions kept for the rejection rule. A draft
  that fails stops proposing for the rest of the run (``failure`` says why);
  the run goes on with plain decoding.

Pooled programs (issue #25): the target rolls a sample back only within the
step that placed its proposals, which a windowed pool always allows. A draft
mirror is cut back over its one-token proposal steps, up to max_draft - 1
positions, and a windowed pool lets a sequence roll back at least
retained_margin + 1 positions (cpp/cellcache/cell_pool.h): a pooled draft
takes max_draft <= retained_margin + 2 (``draft_rollback_limit``; the Runner
refuses more at setup). A mirror is cloned from a sibling's only where the
draft's pools still hold the shared prefix (``holds_prefix``), and counts its
free cells per pool.

A proposer answers ``propose([(sample, limit), ...])`` with, per sample, up to
``limit`` tokens and None or their draft distributions [k, vocab], and is told
``release(sample)`` when a sample ends.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.pools import Pools
from executorch_cellcache.runtime.sampling import distribution

METHODS = ("lookup", "draft")
# max_draft None ("auto", the default): k chosen once per Runner from measured step costs
# (Runner.step_seconds and _core.choose_max_draft: cpp/runner/draft_length.h, the rule both
# runtimes use). DEFAULT_MAX_DRAFT where the cache has no room to measure: on the 135M 8da4w
# bench program a step of 9 tokens cost 2.9x a 1-token step, one of 8 only 2.0x.
DEFAULT_MAX_DRAFT = 7
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 2
_DRAFT_STREAM = 0x5eed  # sample j's draft draws: a generator of (seed, j, this)


@dataclass(frozen=True)
class Speculative:
    """What ``Runner.generate(speculative=...)``, ``cellcache generate`` and
    ``cellcache serve`` take.

    method: "lookup" (prompt lookup) or "draft" (a draft model).
    max_draft: k, the most tokens proposed per sample and step (>= 1, and at
      most the program's max_tokens_per_step - 1: a proposal rides beside its
      sample's decode token); None (default): chosen by the Runner from what
      its steps cost (``Runner.max_draft_for``).
    min_ngram / max_ngram: prompt lookup's match lengths (1 <= min <= max).
    draft_model: the draft .pte (method "draft" only)."""
    method: str = "lookup"
    max_draft: Optional[int] = None
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM
    draft_model: Optional[str] = None

    def validate(self, max_tokens_per_step: int) -> None:
        """Raises InvalidConfigError naming the value at fault."""
        if self.method not in METHODS:
            raise InvalidConfigError(f"speculative method must be one of {', '.join(METHODS)}, "
                                     f"got {self.method!r}")
        if max_tokens_per_step < 2:
            raise InvalidConfigError(
                f"speculative decoding needs a program whose max_tokens_per_step holds a "
                f"decode token and a proposal (>= 2); this one's is {max_tokens_per_step}")
        k = self.max_draft
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or
                              not 1 <= k <= max_tokens_per_step - 1):
            raise InvalidConfigError(
                f"max_draft (--draft-max, tokens proposed per step) must be an integer in [1, "
                f"{max_tokens_per_step - 1}] (the program's max_tokens_per_step "
                f"{max_tokens_per_step} minus the decode token), got {k!r}")
        for name in ("min_ngram", "max_ngram"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise InvalidConfigError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram "
                                     f"({self.max_ngram})")
        if self.method == "draft" and not self.draft_model:
            raise InvalidConfigError("speculative method 'draft' needs a draft model "
                                     "(--draft-model D.pte)")
        if self.method == "lookup" and self.draft_model:
            raise InvalidConfigError("a draft model is used by speculative method 'draft', "
                                     "not 'lookup'")


def lookup(context: Sequence[int], limit: int, min_ngram: int, max_ngram: int) -> List[int]:
    """Prompt lookup: for m = max_ngram down to min_ngram, the earliest i with
    context[i:i+m] == context[-m:] and i + m < len(context) gives
    context[i+m : i+m+limit]; [] when no length matches."""
    n = len(context)
    if n < 2 or limit <= 0:
        return []
    ctx = np.asarray(context, dtype=np.int64)
    for m in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        tail = ctx[n - m:]
        # Candidate starts i in [0, n - m - 1]: the match must end before the tail does.
        hits = ctx[:n - m] == tail[0]
        for j in range(1, m):
            hits &= ctx[j:n - m + j] == tail[j]
        found = np.flatnonzero(hits)
        if len(found):
            i = int(found[0]) + m
            return ctx[i:i + limit].tolist()
    return []


class NgramIndex:
    """``lookup``'s answers for a context that only grows, without searching
    it: the earliest start of every m-gram (min_ngram <= m <= max_ngram) seen,
    updated as tokens are appended (O(max_ngram) per token)."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.context: List[int] = []
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._first: Dict[int, Dict[tuple, int]] = {m: {} for m in range(min_ngram,
                                                                          max_ngram + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        ctx = self.context
        for t in tokens:
            ctx.append(int(t))
            n = len(ctx)
            for m, first in self._first.items():
                if n >= m:
                    first.setdefault(tuple(ctx[n - m:]), n - m)

    def lookup(self, limit: int) -> List[int]:
        """``lookup(self.context, limit, min_ngram, max_ngram)``."""
        ctx, n = self.context, len(self.context)
        if limit <= 0:
            return []
        for m in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            i = self._first[m].get(tuple(ctx[n - m:]))
            if i is not None and i + m < n:   # earliest is the tail itself: no earlier one
                return ctx[i + m:i + m + limit]
        return []


class PromptLookup:
    """Proposals from the sample's own prompt + output (module docstring),
    from an NgramIndex per sample that follows its tokens."""

    def __init__(self, config: Speculative):
        self.max_draft = config.max_draft or DEFAULT_MAX_DRAFT
        self.min_ngram, self.max_ngram = config.min_ngram, config.max_ngram
        self.failure: Optional[str] = None
        self._index: Dict[object, NgramIndex] = {}

    def propose(self, asks) -> List[Tuple[List[int], None]]:
        out = []
        for s, limit in asks:
            index = self._index.get(s)
            if index is None:
                index = self._index[s] = NgramIndex(self.min_ngram, self.max_ngram)
            prompt, held = s.request.prompt, len(index.context)
            if held < len(prompt):
                index.extend(prompt[held:])
                held = len(prompt)
            index.extend(s.tokens[held - len(prompt):])
            out.append((index.lookup(limit), None))
        return out

    def release(self, sample) -> None:
        self._index.pop(sample, None)

    def close(self) -> None:
        self._index.clear()


@dataclass(eq=False)
class _Mirror:
    seq: int
    fed: List[int]          # the tokens whose K/V the draft holds, positions 0..len-1
    rng: Optional[np.random.Generator] = None


class DraftModel:
    """Proposals from a draft program (module docstring). ``draft`` is a
    runtime.runner.Runner of the draft .pte (its prefix cache off); the
    caller checked that its vocabulary matches the target's."""

    def __init__(self, config: Speculative, draft):
        self.max_draft = config.max_draft or DEFAULT_MAX_DRAFT
        self.draft = draft
        self.cache = draft.cache
        self.budget = draft.info.max_tokens_per_step
        self.mirrors: Dict[object, _Mirror] = {}
        self.failure: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle

    def release(self, sample) -> None:
        m = self.mirrors.pop(sample, None)
        if m is not None and self.failure is None:
            self.cache.seq_free(m.seq)

    def close(self) -> None:
        """Frees every mirror (the draft's cache is empty afterwards)."""
        self.mirrors.clear()
        self.cache.clear()

    def _stop(self, error: Exception) -> None:
        self.failure = f"{type(error).__name__}: {error}"
        self.mirrors.clear()
        try:
            self.cache.clear()
        except Exception:  # the draft is already unusable; the target run goes on
            pass

    # ------------------------------------------------------------------ proposing

    def propose(self, asks):
        if self.failure is not None:
            return [([], None)] * len(asks)
        try:
            return self._propose(asks)
        except Exception as e:  # noqa: BLE001 - any draft failure ends speculation, not the run
            self._stop(e)
            return [([], None)] * len(asks)

    def _mirror(self, sample, context: List[int]) -> Optional[_Mirror]:
        m = self.mirrors.get(sample)
        if m is not None:
            return m
        req = sample.request
        sibling = max((self.mirrors[o] for o in req.samples if o in self.mirrors),
                      key=lambda o: _common(o.fed, context), default=None)
        if self.cache.n_sequences >= MAX_SEQUENCES:
            return None
        upto = 0 if sibling is None else min(_common(sibling.fed, context), len(context) - 1)
        # A windowed pool of a pooled draft may have reclaimed what that prefix needs.
        if upto > 0 and self.cache.holds_prefix(sibling.seq, upto):
            m = _Mirror(self.cache.seq_clone(sibling.seq, upto=upto), context[:upto])
        else:
            m = _Mirror(self.cache.seq_new(), [])
        p = req.params
        if p.temperature > 0:
            m.rng = np.random.default_rng() if p.seed is None else \
                np.random.default_rng([int(p.seed), sample.index, _DRAFT_STREAM])
        self.mirrors[sample] = m
        return m

    def _propose(self, asks):
        out: List[Tuple[List[int], Optional[np.ndarray]]] = [([], None)] * len(asks)
        work = []  # (ask index, sample, mirror, limit, tokens still to feed)
        pools = self.draft.pools
        free = pools.free()  # per pool, less what earlier samples of this call will take
        for i, (s, limit) in enumerate(asks):
            context = s.request.prompt + s.tokens
            m = self._mirror(s, context)
            if m is None:
                continue
            keep = min(_common(m.fed, context), len(context) - 1)
            if keep < len(m.fed):
                before = pools.free()
                self.cache.seq_rm(m.seq, keep)
                free = [f + a - b for f, a, b in zip(free, pools.free(), before)]
                del m.fed[keep:]
            pending = context[keep:]
            # Positions it places; a windowed pool's worst case bounds them (admission.h).
            need = pools.worst_case(len(pending) + limit - 1, 0, 1, 1)
            if any(n > f for n, f in zip(need, free)):
                continue  # the draft's cache is full: no proposal for this sample now
            free = [f - n for f, n in zip(free, need)]
            work.append([i, s, m, limit, pending])
        drafts = {w[0]: [] for w in work}
        probs = {w[0]: [] for w in work}
        while True:
            feeding = [w for w in work if w[4]]
            if not feeding:
                break
            seq_ids, tokens, positions, rows, owners = [], [], [], [], []
            for w in feeding:
                take = w[4][:self.budget - len(tokens)]
                if not take:
                    break
                m = w[2]
                for t in take:
                    seq_ids.append(m.seq)
                    positions.append(len(m.fed))
                    tokens.append(t)
                    m.fed.append(t)
                del w[4][:len(take)]
                if not w[4]:  # fed everything: this row scores its next proposal
                    rows.append(len(tokens) - 1)
                    owners.append(w)
            if not rows:  # a forward of catch-up chunks only still returns one row
                self.draft.step(seq_ids, tokens, positions, [len(tokens) - 1])
                continue
            logits = self.draft.step(seq_ids, tokens, positions, rows).numpy()
            for w, row in zip(owners, logits):
                i, s, m, limit = w[0], w[1], w[2], w[3]
                params = s.request.params
                if params.temperature == 0:
                    token = int(np.argmax(row))
                else:
                    q = distribution(row, params)
                    token = int(m.rng.choice(len(q), p=q))
                    probs[i].append(q)
                drafts[i].append(token)
                if len(drafts[i]) < limit:
                    w[4] = [token]  # fed next round; the last proposal is never fed
        for w in work:
            i = w[0]
            out[i] = (drafts[i], np.stack(probs[i]) if probs[i] else None)
        return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def draft_rollback_limit(pools: Pools) -> Optional[int]:
    """The largest max_draft a draft program with these pools can take back
    (module docstring): None (any) when no pool reclaims, else
    retained_margin + 2."""
    return pools.margin + 2 if pools.pooled else None


def check_draft(target_info, draft_info, draft_path) -> None:
    """Raises InvalidConfigError when the draft program cannot propose for the
    target: another vocabulary size or tokenizer."""
    if draft_info.vocab_size != target_info.vocab_size:
        raise InvalidConfigError(
            f"the draft model {draft_path} has a vocabulary of {draft_info.vocab_size} tokens, "
            f"the target {target_info.vocab_size}: speculative decoding needs the same "
            f"vocabulary")
    if (draft_info.tokenizer_json or target_info.tokenizer_json) and \
            draft_info.tokenizer_json != target_info.tokenizer_json:
        raise InvalidConfigError(
            f"the draft model {draft_path} embeds another tokenizer than the target: "
            f"speculative decoding needs the same tokenizer")

