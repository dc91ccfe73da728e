"""The Python face of the C++ engine (cpp/engine/engine.h, ``_core.Engine``):
the one scheduler, prefix cache, speculative decoding and token choice, which
``Runner.generate`` and the server step over the Runner's forward.

Python keeps what is Python by nature, through the engine's two hooks
(engine.h StepHooks), routed here per request id:

- ``masks(rows)``: structured output. Once per step, for every pick of a
  constrained request, the tokens its sample's grammar allows next
  (runtime/constraints.py: the C++ grammar layer, XGrammar).
- ``ends_sample(request, sample, token, stop_token)``: each token a watched
  request's sample takes, before any later token of the same accepted run:
  the grammar consumes it, the server's text side matches stop strings, and
  True ends the sample there (finish reason "stop").

A hook that raises ends the step as a failed forward does (every running
request ends, its sequences freed) and the exception leaves ``Engine.step``.
"""

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from executorch_cellcache.cache import _core
from executorch_cellcache.runtime import constraints
from executorch_cellcache.runtime.sampling import SamplingParams

# ends_sample's text side: (sample, token, stop_token) -> whether the sample ends.
TextWatch = Callable[[int, int, bool], bool]


class Watch:
    """One request's per-token side: its structured-output constraint (a
    runtime/constraints.Constraint, or None; each sample gets a matcher at its
    first mask) and its text watch (the server's stop strings, or None)."""

    def __init__(self, constraint=None, text: Optional[TextWatch] = None):
        self.constraint = constraint
        self.text = text
        self.matchers: Dict[int, object] = {}
        self.started: set = set()   # samples whose matcher consumed a token
        # Why the grammar failed, or None: a matcher that refuses the token its own
        # mask allowed ends that sample ("stop") and no other request.
        self.error: Optional[str] = None

    def ends_sample(self, sample: int, token: int, stop_token: bool) -> bool:
        ended = False
        if self.constraint is not None:
            matcher = self.matchers[sample]   # made by the mask that chose the token
            try:
                matcher.advance(token)
            except RuntimeError as e:
                self.error = str(e)
                return True
            self.started.add(sample)
            ended = matcher.complete
        if self.text is not None:
            ended = self.text(sample, token, stop_token) or ended
        return ended


class Hooks:
    """The StepHooks object handed to ``_core.Engine``: routes each request's
    calls to its Watch (``watches[request id]``). A caller on another thread
    than the stepping one submits and registers the watch under ``lock``."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.watches: Dict[int, Watch] = {}
        self.lock = threading.Lock()

    def watch(self, request: int) -> Watch:
        with self.lock:
            return self.watches[request]

    def drop(self, request: int) -> None:
        with self.lock:
            self.watches.pop(request, None)

    def masks(self, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), self.vocab_size), dtype=bool)
        filled, matchers = [], []
        for i, (request, sample) in enumerate(rows.tolist()):
            watch = self.watch(request)
            matcher = watch.matchers.get(sample)
            if matcher is None:
                matcher = watch.matchers[sample] = watch.constraint.matcher()
            if sample in watch.started:
                filled.append(i)
                matchers.append(matcher)
            else:
                out[i] = watch.constraint.initial_mask()
        constraints.fill_masks(matchers, out, filled)
        return out

    def ends_sample(self, request: int, sample: int, token: int, stop_token: bool) -> bool:
        return self.watch(request).ends_sample(sample, token, stop_token)


def core_params(params: SamplingParams) -> "_core.SamplingParams":
    """The engine's SamplingParams for a validated Python one."""
    return _core.SamplingParams(
        temperature=float(params.temperature), top_k=params.top_k,
        top_p=None if params.top_p is None else float(params.top_p), seed=params.seed,
        n=params.n, max_new_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids), stop_on_eos=params.stop_on_eos,
        logprobs=params.logprobs)


def new_engine(runner, forward, prefix_cache: bool,
               prefix_cache_cells: Optional[int]) -> "tuple[_core.Engine, Hooks]":
    """An engine over ``runner``'s cache and ``forward`` (Runner.step's
    signature, returning float32 numpy logits), with Python hooks."""
    info = runner.info
    hooks = Hooks(info.vocab_size)
    engine = _core.Engine(runner.cache, forward, info.vocab_size, info.max_tokens_per_step,
                          list(info.eos_ids), tokenizer_json=info.tokenizer_json or "",
                          prefix_cache=prefix_cache, prefix_cache_cells=prefix_cache_cells,
                          hooks=hooks)
    return engine, hooks


@dataclass
class PrefixCacheStats:
    """Cumulative counts over every request admitted with the prefix cache
    (cpp/engine/prefix_cache.h PrefixCacheStats)."""
    requests: int = 0
    hits: int = 0              # requests that reused at least one cached token
    prompt_tokens: int = 0
    cached_tokens: int = 0     # prompt tokens served from cached cells
    evictions: int = 0         # entries evicted for room or for the bound

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class PrefixCacheView:
    """What a Runner's caller sees of the engine's prefix cache
    (``runner.prefix_cache``): finished requests' sequences kept as cached
    prefixes that later requests starting with the same tokens clone."""

    def __init__(self, runner):
        self._runner = runner

    def _stats(self) -> dict:
        return self._runner.engine.prefix_cache_stats()

    @property
    def stats(self) -> PrefixCacheStats:
        d = self._stats()
        return PrefixCacheStats(d["requests"], d["hits"], d["prompt_tokens"],
                                d["cached_tokens"], d["evictions"])

    def reclaimable_cells(self) -> int:
        """Cells only the cache holds (a request may take them by eviction)."""
        return self._runner.engine.prefix_cache_reclaimable_cells()

    def seqs(self) -> List[int]:
        """The sequence ids the cache holds, one per entry."""
        return list(self._runner.engine.prefix_cache_seqs())

    def tokens(self, seq: int) -> Optional[List[int]]:
        """The tokens whose K/V the cache's entry ``seq`` holds, or None."""
        return self._runner.engine.prefix_cache_tokens(seq)

    def __len__(self) -> int:
        return self._stats()["entries"]

    def clear(self) -> None:
        """Drops every cached prefix (their cells are freed)."""
        self._runner.engine.clear_prefix_cache()
