"""The Python runtime's token choice, kept as an executable specification
of cpp/engine/sampling.h (the engine's, the only one the product runs):
greedy, seeded temperature / top-k / top-p sampling, speculative decoding's
verify, masked choice and log-probabilities. The tests compare the engine
with it (tests/test_engine_differential.py) and test its rules directly.
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.sampling import (  # noqa: F401 - the spec's API
    MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs,
)


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """logits: float32 [vocab] -> the log-softmax at ``token`` and the ``k``
    largest entries (ties by lower id)."""
    z = logits.astype(np.float64)
    z = z - z.max()
    log_probs = z - np.log(np.exp(z).sum())
    top = []
    if k:
        k = min(k, len(log_probs))
        head = np.argpartition(-log_probs, k - 1)[:k]
        top = head[np.lexsort((head, -log_probs[head]))]
    return TokenLogprobs(float(log_probs[token]), [(int(t), float(log_probs[t])) for t in top])


def _kept(logits: np.ndarray, params: SamplingParams) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities): the distribution a sampled token is
    drawn from (temperature, then top-k, then top-p); most likely first under
    top-k or top-p, in vocabulary order otherwise (a full sort of a 49k-token
    row costs ~5 ms, ten times what drawing from it does)."""
    # Shift before dividing: a tiny temperature then gives -inf, never inf - inf.
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        z = (z - z.max()) / params.temperature
    if params.top_k is None and params.top_p is None:
        probs = np.exp(z)
        return np.arange(len(z)), probs / probs.sum()
    order = np.argsort(-z, kind="stable")
    if params.top_k is not None:
        order = order[:params.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if params.top_p is not None:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order, probs


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits: float32 [vocab] -> float64 [vocab]: the probability ``choose``
    draws each token with (params.temperature > 0), zero outside top-k/top-p."""
    order, probs = _kept(logits, params)
    out = np.zeros(logits.shape[-1])
    out[order] = probs
    return out


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: float32 [vocab] -> the next token id. Greedy draws nothing;
    sampling draws one number from ``rng``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    order, probs = _kept(logits, params)
    return int(order[rng.choice(len(order), p=probs)])


def verify(logits: np.ndarray, draft: Sequence[int], draft_probs: Optional[np.ndarray],
           params: SamplingParams, rng: np.random.Generator) -> List[int]:
    """Speculative decoding's acceptance rule: the tokens a decode row with
    proposed tokens emits (the accepted proposals, then one of the target's).

    logits: float32 [k + 1, vocab]; row i scores the token after draft[:i].
    draft: the k proposed tokens (k >= 0).
    draft_probs: None for a deterministic proposal (prompt lookup, or a draft
      model's greedy choice), else float [k, vocab]: the distribution each
      draft token was drawn from (``distribution`` of the draft's logits).
    Returns 1..k+1 tokens: draft[:a] and one more, never equal to draft[a].

    Greedy, or a deterministic proposal: row i's token is chosen as plain
    decoding chooses it (``choose``), the proposal kept while they agree. A
    deterministic draft has q = 1 on its token, so this is the rejection rule
    below (accept with probability p(d), else draw from p without d), drawing
    one number per emitted token, as plain decoding does: the same seed gives
    the same tokens with or without the proposals.
    Sampled proposals (Leviathan et al. 2023, Chen et al. 2023): accept d_i
    with probability min(1, p(d_i) / q(d_i)); on rejection draw from
    max(0, p - q) normalized, and stop; after k acceptances draw the last
    token from row k. The output follows exactly the distribution of plain
    sampling.
    """
    k = len(draft)
    out: List[int] = []
    if params.temperature == 0:   # greedy: every row's argmax at once, kept while they agree
        for token in np.argmax(logits[:k + 1], axis=1).tolist():
            out.append(token)
            if len(out) > k or token != draft[len(out) - 1]:
                return out
        return out
    for i in range(k + 1):
        if i == k or draft_probs is None or params.temperature == 0:
            token = choose(logits[i], params, rng)
            out.append(token)
            if i == k or token != draft[i]:
                return out
            continue
        p = distribution(logits[i], params)
        d = int(draft[i])
        if rng.random() * draft_probs[i][d] < p[d]:
            out.append(d)
            continue
        residual = np.maximum(p - draft_probs[i], 0.0)
        total = residual.sum()
        if total <= 0:  # p <= q everywhere yet p(d) < q(d): only through rounding
            residual = p.copy()
            residual[d] = 0.0
            total = residual.sum()
        out.append(int(rng.choice(len(residual), p=residual / total)))
        return out
    return out


_NEG_INF = np.float32(-np.inf)


def _masked(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``np.where(allowed, row, -inf)``, cheaper where few tokens are
    allowed (inside a JSON object's structure, often one or two)."""
    count = int(np.count_nonzero(allowed))
    if count * 16 > len(allowed):
        return np.where(allowed, row, _NEG_INF)
    out = np.full(row.shape, _NEG_INF, dtype=np.result_type(row.dtype, np.float32))
    idx = np.flatnonzero(allowed)
    out[idx] = row[idx]
    return out


def masked_greedy(row: np.ndarray, allowed: np.ndarray) -> int:
    """``int(np.argmax(np.where(allowed, row, -inf)))`` (greedy decoding over
    the tokens a grammar allows: the first of the largest). The row's own
    argmax when that token is allowed (no earlier allowed token can equal it),
    so most greedy rows build no masked copy."""
    best = int(np.argmax(row))
    return best if allowed[best] else int(np.argmax(_masked(row, allowed)))


def choose_tokens(logits: np.ndarray, rows: Sequence[tuple],
                  masks: Optional[Sequence[Optional[np.ndarray]]] = None
                  ) -> Tuple[List[int], List[Optional[TokenLogprobs]]]:
    """Chooses one step's tokens in ``Scheduler.commit``'s flat layout.

    logits: float32 [sum of the groups' rows, vocab], group after group.
    rows: per logits group (``StepPlan.sampling_rows()``), a tuple
      (params, generators) or (params, generators, draft, draft_probs).
      Without a draft (or an empty one) the group is one logits row and one
      token is chosen from it per generator, in order (a decode sample's own
      generator, or the n generators of a request whose prompt ends there).
      With a draft of k proposed tokens the group is k + 1 rows and has one
      generator; ``verify`` picks its 1..k+1 tokens.
    masks: None, or parallel to rows: None or bool [vocab], the tokens a
      constrained group (runtime/constraints.py; never one with a draft) may
      choose; the others are chosen as if their logits were -inf.
    Returns (picks, logprobs): picks, the token ids (Python ints) group after
    group; logprobs, parallel to picks, a TokenLogprobs (from the row the
    token was chosen from, unmasked) where params.logprobs asks for one, else
    None.
    Raises InvalidConfigError when logits is not 2-D with the groups' rows.

    Example: rows [(greedy, [g]), (params n=2, [g0, g1]), (greedy, [g], [7, 9], None)]
    and logits [5, V] -> picks [argmax(logits[0]), t0, t1, then 1 to 3 tokens
    from rows 2..4: 7 if argmax(logits[2]) == 7, ...].
    """
    need = sum(1 + len(r[2]) if len(r) > 2 else 1 for r in rows)
    if logits.ndim != 2 or logits.shape[0] != need:
        raise InvalidConfigError(f"choose_tokens needs logits [{need}, vocab] (one row per "
                                 f"plan row), got shape {tuple(logits.shape)}")
    picks: List[int] = []
    logprobs: List[Optional[TokenLogprobs]] = []
    at = 0
    for g, row in enumerate(rows):
        params, generators = row[0], row[1]
        draft = row[2] if len(row) > 2 else ()
        allowed = masks[g] if masks is not None else None
        if allowed is not None:
            if draft:
                raise InvalidConfigError("a constrained logits group cannot carry a draft")
            if params.temperature == 0:
                chosen = [masked_greedy(logits[at], allowed)] * len(generators)
            else:
                row_logits = _masked(logits[at], allowed)
                chosen = [choose(row_logits, params, rng) for rng in generators]
            sources = [at] * len(chosen)
        elif draft:
            chosen = verify(logits[at:at + len(draft) + 1], draft, row[3], params,
                            generators[0])
            sources = range(at, at + len(chosen))
        else:
            chosen = [choose(logits[at], params, rng) for rng in generators]
            sources = [at] * len(chosen)
        for token, src in zip(chosen, sources):
            picks.append(token)
            logprobs.append(None if params.logprobs is None else
                            token_logprobs(logits[src], token, params.logprobs))
        at += 1 + len(draft)
    return picks, logprobs
