"""The Python runtime's proposers (prompt lookup, a draft model), kept as an
executable specification of cpp/engine/speculative.h, which the engine runs.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.pools import Pools
from executorch_cellcache.runtime.speculative import (  # noqa: F401 - the spec's API
    DEFAULT_MAX_DRAFT, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, METHODS, Speculative, _DRAFT_STREAM,
)
from spec.sampling import distribution


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

