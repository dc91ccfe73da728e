"""Per-request generation parameters and the next-token choice: greedy, or
seeded temperature / top-k / top-p sampling, with optional log-probabilities.

Seeds: sample ``j`` of a request draws from its own generator seeded with
``(seed, j)`` and nothing else, so a request's tokens depend only on its
prompt, its parameters and its seed: never on which other requests share the
batch, where it sits in it, or when it arrived (vLLM #51226 is that bug).
The same prompt with the same seed gives the same tokens wherever it runs.
``seed=None`` draws fresh entropy for every sample.
"""

import numbers
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from executorch_cellcache.cache.errors import InvalidConfigError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``n`` samples share its prefilled prompt;
    each stops after ``max_new_tokens`` tokens, or at a stop token (the
    program's EOS ids) when ``stop_on_eos``. ``logprobs``: None = none, k >= 0
    = the chosen token's log-probability plus the k most likely tokens'."""
    temperature: float = 0.0   # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    n: int = 1
    max_new_tokens: int = 16
    stop_on_eos: bool = True
    logprobs: Optional[int] = None

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


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: float32 [vocab] -> the next token id."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    # Shift before dividing: a tiny temperature then gives -inf, never inf - inf.
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        z = (z - z.max()) / params.temperature
    order = np.argsort(-z, kind="stable")
    if params.top_k is not None:
        order = order[:params.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if params.top_p is not None:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
