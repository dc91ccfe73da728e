"""Speculative decoding's options, as the Python API, ``cellcache generate``
and ``cellcache serve`` take them. The proposers (prompt lookup, a draft
model) and the acceptance rule are the C++ engine's (cpp/engine/speculative.h,
sampling.h verify): the output is plain decoding's (the same tokens when
greedy, and for prompt lookup when sampling with the same seed; the same
distribution when a draft model samples its proposals). A draft that fails
stops proposing for the rest of the run; decoding goes on without it.

Pooled drafts (issue #25): a draft mirror is cut back over its one-token
proposal steps, and a windowed pool lets a sequence roll back at least
retained_margin + 1 positions (cpp/cellcache/cell_pool.h), so a pooled
draft takes max_draft <= retained_margin + 2 (refused beyond, at setup).
"""

from dataclasses import dataclass
from typing import Optional

from executorch_cellcache.cache.errors import InvalidConfigError

METHODS = ("lookup", "draft")
# max_draft None ("auto", the default): k chosen once per Runner from measured step costs
# (Runner.step_seconds and _core.choose_max_draft: cpp/engine/draft_length.h, the rule both
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
