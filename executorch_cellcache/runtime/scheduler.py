"""Continuous batching over the cell cache.

Each step packs, up to ``max_tokens_per_step`` tokens: first one decode token
of every running sample, then chunks of admitted prompts in arrival order, so
a new prompt's prefill shares forwards with other sequences' decoding. A
prompt is prefilled once into one sequence; its ``n`` samples are
``seq_clone``s of it (shared cells, no copy).

Every request carries its own ``SamplingParams`` (sampling, seed, n,
max_new_tokens, stop tokens, logprobs). Between steps, at any time, a caller
may ``submit`` a request, ``cancel`` one, or ``finish_sample`` (end one
sample early, e.g. on a stop string): their sequences are freed at once, so
the next ``plan`` admits into those cells. The scheduler is not thread-safe:
one thread drives it (the server's engine thread).

The scheduler never sees logits. A step is: ``plan()`` (which tokens run and
which rows of logits they need, ``StepPlan.consumers``), the caller's forward,
the caller's token choice (runtime/sampling.py ``choose_tokens`` over
``StepPlan.sampling_rows()``), then ``commit(plan, picks)`` with the chosen
tokens, which records them, stops samples and streams ``TokenEvent``s.

Admission: a waiting request is admitted only when the cells it can still need
in the worst case (prompt + n * (max_new_tokens - 1); the last token of a
sample is never fed back) fit in the free cells left after the worst-case
needs of the running requests, and its sequence ids fit. So a running request
never runs out of cells; a request that could not fit even in an empty cache
raises CapacityError at submission.

Prefix cache (optional, runtime/prefix_cache.py): a request starts from a clone
of the longest cached prefix of its prompt and prefills only the rest; a
sample that ends (stop, length, finish_sample or cancel) leaves its sequence
to the cache as an entry instead of freeing it, and a request cancelled while
prefilling leaves its placed prompt tokens. Admission counts the cells and
ids only the cache holds as available and evicts least-recently-used entries
when it needs them. The prefix is cloned before eviction, so evicting the entry
it came from frees only that entry's tail; eviction never frees a cell a
running sequence owns. ``abandon`` (an error) frees, never caches.

Each sample ends with a ``finish_reason``: "stop" (a stop token: any of the
request's ``stop_token_ids``, or of the program's EOS ids when
``stop_on_eos``, kept as the sample's last token; or ``finish_sample``),
"length" (max_new_tokens reached) or "cancelled".
"""

import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from executorch_cellcache.cache._core import (
    MAX_SEQUENCES,
    check_request_fits,
    request_worst_case_cells,
)
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.prefix_cache import PrefixCache
from executorch_cellcache.runtime.sampling import SamplingParams, TokenLogprobs

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"


@dataclass(eq=False)
class Sample:
    index: int                     # within its request
    seq: int
    request: "Request" = field(repr=False)
    tokens: List[int] = field(default_factory=list)  # generated so far
    finish_reason: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One prompt and its parameters. ``tag`` is the caller's handle (the
    prompt index for Runner.generate); ``label`` names it in errors."""
    prompt: List[int]
    params: SamplingParams
    tag: Any = None
    label: str = "the request"
    seq: Optional[int] = None      # the prompt's sequence while prefilling
    prefilled: int = 0             # prompt tokens placed (or cloned from the prefix cache)
    cached_tokens: int = 0         # prompt tokens served from the prefix cache
    samples: List[Sample] = field(default_factory=list)
    cancelled: bool = False
    # The sampling code's state: one generator per sample, params.generator(j),
    # made at submit; the scheduler never draws from them.
    rngs: List[np.random.Generator] = field(default_factory=list, repr=False)

    def worst_case_cells(self, cached: int = 0) -> int:
        """Cells this request may still claim (``cached``: prompt tokens a
        waiting request would clone instead of prefilling)."""
        if not self.samples:
            return request_worst_case_cells(len(self.prompt), max(self.prefilled, cached),
                                            self.params.n, self.params.max_new_tokens)
        return sum(self.params.max_new_tokens - len(s.tokens)
                   for s in self.samples if not s.done)

    @property
    def finished(self) -> bool:
        return self.cancelled or (bool(self.samples) and all(s.done for s in self.samples))


@dataclass
class TokenEvent:
    """One generated token, as ``on_token`` receives it. ``finish_reason`` is
    set when this token ended its sample; ``stop_token`` says the token is a
    stop token (one of the request's stop_token_ids, or an EOS id) that
    stopped it (text output leaves it out)."""
    request: Request
    sample_index: int
    token: int
    logprobs: Optional[TokenLogprobs]
    finish_reason: Optional[str]
    stop_token: bool


@dataclass
class StepPlan:
    """One step: per token (graph order) its sequence, id and position; the
    token indices whose logits the step needs (``logits_for``) and, per such
    row, its consumer: the decode Sample fed that token, or the Request whose
    prompt ends there (its n samples start from that row)."""
    seq_ids: List[int]
    tokens: List[int]
    positions: List[int]
    logits_for: List[int]
    consumers: list   # [len(logits_for)]: Sample or Request
    n_prefill: int = 0
    n_decode: int = 0

    def widths(self) -> List[int]:
        """Per logits row, the tokens ``commit`` takes for it: 1 for a decode
        sample, params.n for a request whose prompt ends there."""
        return [c.params.n if isinstance(c, Request) else 1 for c in self.consumers]

    def sampling_rows(self) -> List[Tuple[SamplingParams, List[np.random.Generator]]]:
        """Per logits row, what ``sampling.choose_tokens`` chooses its tokens
        with: (params, generators), one generator per token commit takes for
        the row (a decode sample's own; a request's n, in sample order)."""
        return [(c.params, c.rngs) if isinstance(c, Request) else
                (c.request.params, [c.request.rngs[c.index]]) for c in self.consumers]


def cells_needed(prompt_len: int, params: SamplingParams) -> int:
    """Cells a request can claim in the worst case (see the module docstring;
    the rule's one home is cpp/cellcache/admission.h)."""
    return request_worst_case_cells(prompt_len, 0, params.n, params.max_new_tokens)


class Scheduler:
    """Plans steps for a cache; the Runner executes them, chooses the tokens
    and commits them (see the module docstring).

    eos_ids: the program's stop tokens (a request stops on any of them when
    its params say stop_on_eos; on its own stop_token_ids always).
    on_token(TokenEvent) streams every token.
    prefix_cache: the cached prefixes to serve from and to leave finished
    sequences to (None = free them).
    """

    def __init__(self, cache, max_tokens_per_step: int, eos_ids: List[int],
                 on_token: Optional[Callable[[TokenEvent], None]] = None,
                 prefix_cache: Optional[PrefixCache] = None):
        self.cache = cache
        self.prefix = prefix_cache
        self.budget = max_tokens_per_step
        self.eos = frozenset(eos_ids)
        self.on_token = on_token
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.finished: List[Request] = []  # in finishing order; callers may clear it
        self._next_decode = 0  # round-robin start when decode tokens exceed the budget

    # ------------------------------------------------------------------ requests

    def check_fits(self, request: Request) -> None:
        """Raises CapacityError when ``request`` could not run even in an empty
        cache (too many cells or sequence ids)."""
        p = request.params
        check_request_fits(request.label, len(request.prompt), p.n, p.max_new_tokens,
                           self.cache.capacity)

    def submit(self, request: Request) -> None:
        """Queues a request (FIFO). Raises CapacityError (see check_fits) and
        InvalidConfigError for an empty prompt or bad parameters."""
        if not request.prompt:
            raise InvalidConfigError(f"{request.label} is empty")
        request.params.validate()
        self.check_fits(request)
        request.rngs = [request.params.generator(j) for j in range(request.params.n)]
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Ends every unfinished sample of ``request`` ("cancelled") and frees
        its sequences now; a waiting request leaves the queue. A finished or
        unknown request is left alone."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            if not request.samples:
                self._leave(request.prompt, request.seq)
            for s in request.samples:
                self._end(s, FINISH_CANCELLED)
            self.running.remove(request)
        else:
            return
        request.cancelled = True
        self.finished.append(request)

    def finish_sample(self, request: Request, sample_index: int,
                      reason: str = FINISH_STOP) -> None:
        """Ends one sample early (a stop string the caller matched) and frees
        its sequence now. A sample that already finished is left alone."""
        if not 0 <= sample_index < len(request.samples):
            raise InvalidConfigError(f"{request.label} has no sample {sample_index} (it has "
                                     f"{len(request.samples)})")
        self._end(request.samples[sample_index], reason)
        self._retire()

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
                self._end(s, FINISH_CANCELLED, keep=False)
        self.running.clear()
        self.waiting.clear()
        if self.prefix is not None:
            self.prefix.enforce_bound()  # cells the freed ones shared are the cache's now

    def _end(self, sample: Sample, reason: str, keep: bool = True) -> None:
        if not sample.done:
            sample.finish_reason = reason
            if keep:
                self._leave(sample.request.prompt + sample.tokens, sample.seq)
            else:
                self.cache.seq_free(sample.seq)

    def _leave(self, tokens: List[int], seq: int) -> None:
        """A finished sequence: cached, or freed. It holds the K/V of the first
        next_pos(seq) of ``tokens`` (the prompt and generated tokens fed back:
        usually all but the last, all of them when it ends during the commit
        of the step that fed its last token)."""
        if self.prefix is None:
            self.cache.seq_free(seq)
        else:
            self.prefix.insert(tokens[:self.cache.next_pos(seq)], seq)

    def _retire(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.finished.append(req)

    # ------------------------------------------------------------------ steps

    def _admit(self) -> None:
        cells = sum(r.worst_case_cells() for r in self.running)
        # Ids: those live in the cache (ours and anyone else's) plus the sample
        # clones that running prompts will still take.
        ids = sum(r.params.n - 1 for r in self.running if not r.samples)
        while self.waiting:
            head = self.waiting[0]
            seq, cached = self._clone_cached_prefix(head, ids)
            # With the prefix cloned, its cells are the head's: eviction may now
            # take the entry it came from (freeing only that entry's tail).
            taken = 1 if seq is not None else 0
            if not self._room(cells + head.worst_case_cells(cached),
                              ids + head.params.n - taken, keep=None):
                if seq is not None:
                    self.cache.seq_free(seq)  # drops owner bits only: the entry holds them
                return  # FIFO: later prompts wait behind it
            self.waiting.popleft()
            head.seq = seq if seq is not None else self.cache.seq_new()
            head.prefilled = head.cached_tokens = cached
            if self.prefix is not None:
                self.prefix.record(len(head.prompt), cached)
            cells += head.worst_case_cells()
            ids += head.params.n - 1
            self.running.append(head)

    def _clone_cached_prefix(self, head: Request, ids: int):
        """(a clone of the longest cached prefix of head's prompt, its length),
        or (None, 0) on a miss, without the prefix cache, or when no id is free
        for the clone even after evicting other entries."""
        if self.prefix is None:
            return None, 0
        src, cached = self.prefix.match(head.prompt)
        if not cached or not self._room(0, ids + 1, keep=src):
            return None, 0
        return self.cache.seq_clone(src, upto=cached), cached

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

    def commit(self, plan: StepPlan, picks: Sequence[int],
               logprobs: Optional[Sequence[Optional[TokenLogprobs]]] = None) -> None:
        """Applies a step's chosen tokens.

        picks: token ids, flat: for each logits row i of ``plan`` in row
          order, ``plan.widths()[i]`` tokens: one for a decode sample, the
          request's ``params.n`` (sample 0 first) for a request whose prompt
          ends at row i. A row whose consumer was cancelled or finished still
          has its tokens in picks; they are skipped.
        logprobs: None, or parallel to picks (a TokenLogprobs or None each),
          passed to the TokenEvents.
        Each token goes to its sample, which stops at a stop token (kept as
        its last token) or at max_new_tokens; on_token gets a TokenEvent per
        token. A request cancelled (or a sample finished) by an ``on_token``
        callback during the commit takes no further tokens.
        Raises InvalidConfigError, changing nothing, when picks (or logprobs)
        has the wrong length or picks holds a non-integer or a negative id.

        Example: consumers [sample a, request r with n=2] -> picks
        [token for a, token for r's sample 0, token for r's sample 1].
        """
        need = sum(plan.widths())
        if len(picks) != need:
            raise InvalidConfigError(f"commit needs {need} picks for the step's "
                                     f"{len(plan.consumers)} logits rows, got {len(picks)}")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
               for t in picks):
            raise InvalidConfigError(f"picks must be token ids (integers >= 0), got "
                                     f"{list(picks)!r}")
        if logprobs is not None and len(logprobs) != need:
            raise InvalidConfigError(f"logprobs must be parallel to picks ({need}), got "
                                     f"{len(logprobs)}")
        picks = [int(t) for t in picks]
        lps = list(logprobs) if logprobs is not None else [None] * need
        for req in self.running:
            if not req.samples:
                req.prefilled += sum(1 for s in plan.seq_ids if s == req.seq)
        at = 0
        for consumer in plan.consumers:
            if isinstance(consumer, Request):
                n = consumer.params.n
                if not consumer.cancelled:
                    self._start_samples(consumer, picks[at:at + n], lps[at:at + n])
                at += n
            else:
                if not consumer.done:
                    self._emit(consumer, picks[at], lps[at])
                at += 1
        self._retire()

    def _start_samples(self, req: Request, picks: List[int],
                       logprobs: List[Optional[TokenLogprobs]]) -> None:
        seqs = [req.seq] + [self.cache.seq_clone(req.seq) for _ in range(req.params.n - 1)]
        req.samples = [Sample(j, seq, req) for j, seq in enumerate(seqs)]
        for s in req.samples:
            if not s.done:  # a callback may have cancelled the request meanwhile
                self._emit(s, picks[s.index], logprobs[s.index])

    def _emit(self, sample: Sample, token: int, logprobs: Optional[TokenLogprobs]) -> None:
        req, params = sample.request, sample.request.params
        sample.tokens.append(token)
        stop_token = token in params.stop_token_ids or (params.stop_on_eos and token in self.eos)
        if stop_token:
            self._end(sample, FINISH_STOP)
        elif len(sample.tokens) >= params.max_new_tokens:
            self._end(sample, FINISH_LENGTH)
        if self.on_token is not None:
            self.on_token(TokenEvent(req, sample.index, token, logprobs, sample.finish_reason,
                                     stop_token))
