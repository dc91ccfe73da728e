"""Per-request generation parameters, as the Python API takes them: greedy,
or seeded temperature / top-k / top-p sampling, with optional
log-probabilities. The token choice itself is the C++ engine's
(cpp/engine/sampling.h); ``runtime/engine.py core_params`` hands these over.

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
_INT32_MAX, _UINT64_MAX = 2**31 - 1, 2**64 - 1  # the engine's fields (cpp/engine/sampling.h)


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
        if self.top_k is not None and (not _integer(self.top_k) or
                                       not 1 <= self.top_k <= _INT32_MAX):
            raise InvalidConfigError(f"top_k must be an integer in [1, {_INT32_MAX}], got "
                                     f"{self.top_k!r}")
        if self.top_p is not None and (not _number(self.top_p) or not 0 < self.top_p <= 1):
            raise InvalidConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or
                                      not 0 <= self.seed <= _UINT64_MAX):
            raise InvalidConfigError(f"seed must be an integer in [0, 2**64 - 1], got "
                                     f"{self.seed!r}")
        if not _integer(self.n) or not 1 <= self.n <= _INT32_MAX:
            raise InvalidConfigError(f"n must be an integer >= 1, got {self.n!r}")
        if not _integer(self.max_new_tokens) or not 1 <= self.max_new_tokens <= _INT32_MAX:
            raise InvalidConfigError(f"max_new_tokens must be an integer in [1, {_INT32_MAX}], "
                                     f"got {self.max_new_tokens!r}")
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
