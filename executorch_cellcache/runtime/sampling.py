"""Per-request generation parameters and the next-token choice: greedy, or
seeded temperature / top-k / top-p sampling, with optional log-probabilities.

The scheduler never sees logits: the runner plans a step, runs the forward,
chooses each row's tokens here (``choose_tokens``) and hands them to
``Scheduler.commit``.

Seeds: sample ``j`` of a request draws from its own generator seeded with
``(seed, j)`` and nothing else, so a request's tokens depend only on its
prompt, its parameters and its seed: never on which other requests share the
batch, where it sits in it, or when it arrived (vLLM #51226 is that bug).
The same prompt with the same seed gives the same tokens wherever it runs.
``seed=None`` draws fresh entropy for every sample.
"""

import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from executorch_cellcache.cache.errors import InvalidConfigError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_STOP_TOKEN_IDS = 1024  # a bound on what one request may ask for (sampling.h: the same)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``n`` samples share its prefilled prompt;
    each stops after ``max_new_tokens`` tokens, or at a stop token: any of
    ``stop_token_ids`` (token ids >= 0; a list or tuple, stored as a tuple of
    ints), or any of the program's EOS ids when ``stop_on_eos``. The stop
    token is kept as the sample's last token. ``logprobs``: None = none, k >= 0
    = the chosen token's log-probability plus the k most likely tokens'."""
    temperature: float = 0.0   # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    n: int = 1
    max_new_tokens: int = 16
    stop_on_eos: bool = True
    logprobs: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        ids = self.stop_token_ids
        if isinstance(ids, (list, tuple, np.ndarray)) and all(_integer(t) for t in ids):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        # anything else stays as given, for validate() to name

    def validate(self) -> None:
        """Raises InvalidConfigError (a ValueError) naming a parameter of the
        wrong type or out of range."""
        if not _number(self.temperature) or not np.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidConfigError(f"temperature must be a number >= 0, got "
                                     f"{self.temperature!r}")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 1):
            raise InvalidConfigError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and (not _number(self.top_p) or not 0 < self.top_p <= 1):
            raise InvalidConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or self.seed < 0):
            raise InvalidConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not _integer(self.n) or self.n < 1:
            raise InvalidConfigError(f"n must be an integer >= 1, got {self.n!r}")
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidConfigError(f"max_new_tokens must be an integer >= 1, got "
                                     f"{self.max_new_tokens!r}")
        if not isinstance(self.stop_on_eos, bool):
            raise InvalidConfigError(f"stop_on_eos must be a bool, got {self.stop_on_eos!r}")
        if self.logprobs is not None and (not _integer(self.logprobs) or
                                          not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidConfigError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                     f"got {self.logprobs!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or any(not _integer(t) or t < 0 for t in ids):
            raise InvalidConfigError(f"stop_token_ids must be a sequence of token ids "
                                     f"(integers >= 0), got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidConfigError(f"stop_token_ids holds {len(ids)} ids; at most "
                                     f"{MAX_STOP_TOKEN_IDS} are taken")

    def generator(self, sample_index: int) -> np.random.Generator:
        """Sample ``sample_index``'s generator: a function of (seed,
        sample_index) only (see the module docstring)."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng([int(self.seed), int(sample_index)])


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log, of the model's softmax before
    temperature) of a chosen token and of the most likely tokens."""
    logprob: float
    top: List[Tuple[int, float]]   # (token id, logprob), most likely first


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
