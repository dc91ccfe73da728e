"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling.

Each sample draws from its own generator seeded with (seed, prompt index,
sample index), so its tokens do not depend on how requests were batched.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from executorch_cellcache.errors import InvalidConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None

    def validate(self) -> None:
        """Raises InvalidConfigError (a ValueError) for out-of-range parameters."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidConfigError(f"top_p must lie in (0, 1], got {self.top_p}")

    def generator(self, prompt_index: int, sample_index: int) -> np.random.Generator:
        entropy = [prompt_index, sample_index] if self.seed is None else \
            [self.seed, prompt_index, sample_index]
        return np.random.default_rng(entropy if self.seed is not None else None)


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: float32 [vocab] -> the next token id."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    order = np.argsort(-z, kind="stable")
    if params.top_k is not None:
        order = order[:params.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if params.top_p is not None:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
