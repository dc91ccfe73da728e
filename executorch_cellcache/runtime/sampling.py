"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling.

Each sample draws from its own generator seeded with (seed, prompt index,
sample index), so its tokens do not depend on how requests were batched.
"""

import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

from executorch_cellcache.cache.errors import InvalidConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None

    def validate(self) -> None:
        """Raises InvalidConfigError (a ValueError) naming a parameter of the
        wrong type or out of range."""
        def number(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        def integer(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        if not number(self.temperature) or not np.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidConfigError(f"temperature must be a number >= 0, got "
                                     f"{self.temperature!r}")
        if self.top_k is not None and (not integer(self.top_k) or self.top_k < 1):
            raise InvalidConfigError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and (not number(self.top_p) or not 0 < self.top_p <= 1):
            raise InvalidConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not integer(self.seed) or self.seed < 0):
            raise InvalidConfigError(f"seed must be an integer >= 0, got {self.seed!r}")

    def generator(self, prompt_index: int, sample_index: int) -> np.random.Generator:
        entropy = [prompt_index, sample_index] if self.seed is None else \
            [self.seed, prompt_index, sample_index]
        return np.random.default_rng(entropy if self.seed is not None else None)


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
