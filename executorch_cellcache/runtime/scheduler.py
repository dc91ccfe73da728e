"""Continuous batching over the cell cache.

Each step packs, up to ``max_tokens_per_step`` tokens: first one decode token
of every running sample, then chunks of admitted prompts in arrival order, so
a new prompt's prefill shares forwards with other sequences' decoding. A
prompt is prefilled once into one sequence; its ``n`` samples are
``seq_clone``s of it (shared cells, no copy).

Admission: a waiting request is admitted only when the cells it can still need
in the worst case (prompt + n * (max_new_tokens - 1); the last token of a
sample is never fed back) fit in the free cells left after the worst-case
needs of the running requests, and its sequence ids fit. So a running request
never runs out of cells; a request that could not fit even in an empty cache
raises CapacityError at submission.

Prefix cache (optional, runtime/prefix_cache.py): a request starts from a clone
of the longest cached prefix of its prompt and prefills only the rest; a
finished sample's sequence becomes a cached entry instead of being freed.
Admission counts the cells and ids only the cache holds as available and
evicts least-recently-used entries when it needs them (never the entry the
request clones; eviction never frees a cell a running sequence owns).
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional

import numpy as np

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.cache.errors import CapacityError
from executorch_cellcache.runtime.prefix_cache import PrefixCache
from executorch_cellcache.runtime.sampling import SamplingParams, choose


@dataclass
class Sample:
    index: int
    seq: int
    rng: np.random.Generator
    request: "Request" = field(repr=False)
    tokens: List[int] = field(default_factory=list)  # generated so far
    done: bool = False


@dataclass
class Request:
    index: int
    prompt: List[int]
    n: int
    max_new_tokens: int
    seq: Optional[int] = None      # the prompt's sequence while prefilling
    prefilled: int = 0             # prompt tokens placed (or cloned from the prefix cache)
    cached_tokens: int = 0         # prompt tokens served from the prefix cache
    samples: List[Sample] = field(default_factory=list)

    def worst_case_cells(self, cached: int = 0) -> int:
        """Cells this request may still claim (``cached``: prompt tokens a
        waiting request would clone instead of prefilling)."""
        if not self.samples:
            return len(self.prompt) - max(self.prefilled, cached) + \
                self.n * (self.max_new_tokens - 1)
        return sum(self.max_new_tokens - len(s.tokens) for s in self.samples if not s.done)

    @property
    def finished(self) -> bool:
        return bool(self.samples) and all(s.done for s in self.samples)


@dataclass
class StepPlan:
    seq_ids: List[int]
    tokens: List[int]
    positions: List[int]
    logits_for: List[int]
    # For each row of logits: the decode Sample, or the Request whose prompt ends there.
    consumers: list
    n_prefill: int = 0
    n_decode: int = 0


class Scheduler:
    """Plans steps for a cache; the Runner executes them and feeds logits back."""

    def __init__(self, cache, max_tokens_per_step: int, params: SamplingParams,
                 eos_ids: List[int], stop_on_eos: bool,
                 on_token: Optional[Callable[[int, int, int], None]] = None,
                 prefix_cache: Optional[PrefixCache] = None):
        self.cache = cache
        self.prefix = prefix_cache
        self.budget = max_tokens_per_step
        self.params = params
        self.eos = set(eos_ids) if stop_on_eos else set()
        self.on_token = on_token
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self._next_decode = 0  # round-robin start when decode tokens exceed the budget

    def submit(self, request: Request) -> None:
        need = len(request.prompt) + request.n * (request.max_new_tokens - 1)
        if need > self.cache.capacity:
            raise CapacityError(
                f"prompt {request.index} needs up to {need} cells ({len(request.prompt)} prompt "
                f"tokens + n={request.n} samples x {request.max_new_tokens - 1} generated tokens "
                f"fed back) but the cache has {self.cache.capacity}; lower max_new_tokens "
                f"(--max-new-tokens) or n (--n), or export with more cells (--cells)")
        if request.n > MAX_SEQUENCES:
            raise CapacityError(f"n={request.n} samples exceed the {MAX_SEQUENCES} sequence ids")
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def abandon(self) -> None:
        """Frees every sequence this scheduler created (when generation stops on
        an error), so the cache keeps no half-finished requests."""
        for req in self.running:
            if not req.samples:
                self.cache.seq_free(req.seq)
            for s in req.samples:
                if not s.done:
                    s.done = True
                    self.cache.seq_free(s.seq)
        self.running.clear()
        self.waiting.clear()
        if self.prefix is not None:
            self.prefix.enforce_bound()  # cells the freed ones shared are the cache's now

    def _admit(self) -> None:
        cells = sum(r.worst_case_cells() for r in self.running)
        # Ids: those live in the cache (ours and anyone else's) plus the sample
        # clones that running prompts will still take.
        ids = sum(r.n - 1 for r in self.running if not r.samples)
        while self.waiting:
            head = self.waiting[0]
            src, cached = self.prefix.match(head.prompt) if self.prefix else (None, 0)
            if not self._room(cells + head.worst_case_cells(cached), ids + head.n, keep=src):
                return  # FIFO: later prompts wait behind it
            self.waiting.popleft()
            head.seq = self.cache.seq_clone(src, upto=cached) if cached else self.cache.seq_new()
            head.prefilled = head.cached_tokens = cached
            if self.prefix is not None:
                self.prefix.record(len(head.prompt), cached)
            cells += head.worst_case_cells()
            ids += head.n - 1
            self.running.append(head)

    def _room(self, cells: int, ids: int, keep: Optional[int]) -> bool:
        """Whether ``cells`` free cells and ``ids`` free ids exist, evicting
        cached entries other than ``keep`` to make them when that suffices."""
        if self.prefix is not None:
            return self.prefix.evict(cells, ids, keep=keep)
        return self.cache.free_cells >= cells and \
            MAX_SEQUENCES - self.cache.n_sequences >= ids

    def plan(self) -> StepPlan:
        """Admits what fits, then packs the next step: one decode token per
        running sample (round-robin past the budget), then prompt chunks in
        admission order, up to max_tokens_per_step tokens."""
        self._admit()
        plan = StepPlan([], [], [], [], [])
        active = [s for req in self.running for s in req.samples if not s.done]
        if active:
            start = self._next_decode % len(active)
            for s in (active[start:] + active[:start])[:self.budget]:
                pos = len(s.request.prompt) + len(s.tokens) - 1
                self._add(plan, s.seq, s.tokens[-1], pos, s)
            plan.n_decode = min(len(active), self.budget)
            self._next_decode = start + plan.n_decode
        for req in self.running:
            if req.samples:
                continue
            take = min(self.budget - len(plan.tokens), len(req.prompt) - req.prefilled)
            for i in range(req.prefilled, req.prefilled + take):
                last = i == len(req.prompt) - 1
                self._add(plan, req.seq, req.prompt[i], i, req if last else None)
            plan.n_prefill += take
        return plan

    @staticmethod
    def _add(plan: StepPlan, seq: int, token: int, pos: int, consumer) -> None:
        if consumer is not None:
            plan.logits_for.append(len(plan.tokens))
            plan.consumers.append(consumer)
        plan.seq_ids.append(seq)
        plan.tokens.append(token)
        plan.positions.append(pos)

    def commit(self, plan: StepPlan, logits: np.ndarray) -> None:
        """Applies a step's results. logits: float32 [len(plan.logits_for), vocab]."""
        for req in self.running:
            if not req.samples:
                req.prefilled += sum(1 for s in plan.seq_ids if s == req.seq)
        for row, consumer in zip(logits, plan.consumers, strict=True):
            if isinstance(consumer, Request):
                self._start_samples(consumer, row)
            else:
                self._emit(consumer, row)
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.finished.append(req)

    def _start_samples(self, req: Request, row: np.ndarray) -> None:
        seqs = [req.seq] + [self.cache.seq_clone(req.seq) for _ in range(req.n - 1)]
        req.samples = [Sample(j, seq, self.params.generator(req.index, j), req)
                       for j, seq in enumerate(seqs)]
        for s in req.samples:
            self._emit(s, row)

    def _emit(self, sample: Sample, row: np.ndarray) -> None:
        req = sample.request
        token = choose(row, self.params, sample.rng)
        sample.tokens.append(token)
        if self.on_token is not None:
            self.on_token(req.index, sample.index, token)
        if token in self.eos or len(sample.tokens) >= req.max_new_tokens:
            sample.done = True
            if self.prefix is None:
                self.cache.seq_free(sample.seq)
            else:  # it holds the prompt and every token fed back: all but the last
                self.prefix.insert(req.prompt + sample.tokens[:-1], sample.seq)
