"""The engine: one thread owns the Runner and steps its Scheduler (each step
is ``Runner.advance``: plan, forward, token choice, commit); the HTTP side
submits and cancels requests from the event loop, thread-safe.

Continuous batching: a submission lands in an inbox the engine thread drains
before every step, so a request that arrives while others decode joins the
next step (its prefill shares that forward with their decode tokens). A
cancellation (a client that went away) is drained the same way: its sequences
are freed before the next step is planned. Admission is the scheduler's
worst-case rule; requests that do not fit wait, and past ``max_queue``
waiting requests a submission is refused (``QueueFullError``, HTTP 429).

Outputs: for every token the engine thread posts an ``Output`` (the sample,
the text it releases, the token, its logprobs, the finish reason when it
ended the sample) to the request's ``Handle`` on the event loop. Text is
decoded and stop strings are matched here, in the engine thread, so a stop
string ends its sample (and frees its sequence) within the same step.
"""

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Deque, List, Optional, Tuple

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.runtime.prefix_cache import PrefixCacheStats
from executorch_cellcache.runtime.runner import Runner
from executorch_cellcache.runtime.sampling import SamplingParams, TokenLogprobs
from executorch_cellcache.runtime.scheduler import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    Scheduler,
    TokenEvent,
)
from executorch_cellcache.serving.metrics import Metrics
from executorch_cellcache.serving.text import SampleText

log = logging.getLogger("uvicorn.error")  # as app.py: beside uvicorn's own lines

DEFAULT_MAX_TOKENS = 256  # when a request names none (and the cache has room for it)


class RequestError(ValueError):
    """A request the engine can never serve (HTTP 400); ``param`` names the
    request field at fault."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """``max_queue`` requests already wait for admission (HTTP 429)."""


class EngineError(RuntimeError):
    """The engine stopped serving a request: a forward failed, or the server
    is shutting down."""


@dataclass
class Output:
    sample: int
    text: str                       # text released by this token ("" while held back)
    token: int
    logprobs: Optional[TokenLogprobs]
    finish_reason: Optional[str]    # set on the sample's last output
    offset: int = 0                 # where this token's text starts in the sample's text


@dataclass(eq=False)
class Handle:
    """One submitted request as the HTTP side sees it. ``queue`` receives
    Outputs, or an EngineError that ends the request."""
    n: int
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    texts: List[SampleText]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0
    request: Optional[Request] = None

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop closed: nobody is listening any more


class Engine:
    """Serves ``runner``'s program; ``tokenizer`` turns its tokens into text
    (the program's own unless given). ``start()`` launches the engine thread,
    ``stop()`` ends it (every live request gets an EngineError)."""

    def __init__(self, runner: Runner, max_queue: int = 64, metrics: Optional[Metrics] = None,
                 tokenizer=None, speculative=None):
        self.runner = runner
        self.tokenizer = tokenizer or runner.tokenizer
        # Cells of every pool (one for a single-pool program); the full count of a
        # request (prompt + samples' tokens) is bounded by the full-attention pool
        # only: a windowed pool of a pooled program reclaims (runtime/pools.py).
        self.pools = runner.pools
        self.capacity = sum(self.pools.capacities())
        full = [p.capacity for p in self.pools.pools if p.window is None]
        self._full_capacity: Optional[int] = min(full) if full else None
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.metrics.cells_total.set(self.capacity)
        self.stats = runner.new_stats()
        # Speculative decoding (Runner.proposer: checked here, before any request).
        self._proposer = runner.proposer(speculative)
        self.metrics.spec_max_draft.set(0 if self._proposer is None else
                                        self._proposer.max_draft)
        self._draft_failure_reported = False
        self._sched = Scheduler(runner.cache, runner.info.max_tokens_per_step,
                                runner.info.eos_ids, self._on_token, runner.prefix_cache,
                                self._proposer)
        self._spec_seen = (0, 0)  # (proposed, accepted) the metrics counted so far
        self._prefix_seen = PrefixCacheStats()  # what the metrics counted so far
        self._cached_cells = 0  # cells held only by the prefix cache, as of the last change
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: Deque[Tuple[str, Request]] = deque()
        self._waiting = 0          # requests not yet admitted: inbox submissions + scheduler's
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ HTTP side

    def default_max_tokens(self, prompt_len: int, n: int) -> int:
        """DEFAULT_MAX_TOKENS, or the most that fit beside the prompt in
        every pool when n samples of that many would not (at least 1; a
        windowed pool too small for n sequences whatever the tokens is left
        to submit's 400)."""
        if self.pools.first_short(prompt_len, n, DEFAULT_MAX_TOKENS) is None:
            return DEFAULT_MAX_TOKENS
        lo, hi = 1, DEFAULT_MAX_TOKENS - 1   # the worst case grows with max_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.pools.first_short(prompt_len, n, mid) is None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def submit(self, prompt: List[int], params: SamplingParams, stops: List[str],
               prompt_field: str = "prompt", constraint=None) -> Handle:
        """Queues a request; call it on the event loop that will read the
        handle. Raises RequestError for a request that can never be served,
        QueueFullError when the wait queue is full. ``constraint``: structured
        output (Runner.constraint), or None."""
        self._check(prompt, params, prompt_field)
        handle = Handle(params.n, len(prompt), asyncio.get_running_loop(),
                        [SampleText(self.tokenizer, stops) for _ in range(params.n)])
        handle.request = Request(prompt, params, tag=handle, constraint=constraint)
        with self._lock:
            if self._stopping:
                raise EngineError("the server is shutting down")
            if self._waiting >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFullError(f"{self._waiting} requests already wait for the cache "
                                     f"(--max-queue {self.max_queue}); retry later")
            self._waiting += 1
            self._inbox.append(("submit", handle.request))
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Frees the request's sequences before the next step (a client that
        went away). Thread-safe; a finished request is left alone."""
        with self._lock:
            self._inbox.append(("cancel", handle.request))
        self._wake.set()

    def _check(self, prompt: List[int], params: SamplingParams, prompt_field: str) -> None:
        try:
            self.runner.check_prompt(prompt, prompt_field)
            params.validate()
        except ValueError as e:
            raise RequestError(str(e), prompt_field) from e
        try:
            self.runner.check_params(params)  # what remains: stop ids in the vocabulary
        except ValueError as e:
            raise RequestError(str(e), "stop_token_ids") from e
        if params.n > MAX_SEQUENCES:
            raise RequestError(f"n={params.n} samples exceed the {MAX_SEQUENCES} sequences "
                               f"the cache can hold at once", "n")
        capacity = self._full_capacity
        if capacity is not None and len(prompt) > capacity:
            raise RequestError(f"the prompt has {len(prompt)} tokens but the model's KV cache "
                               f"holds {capacity}; shorten it", prompt_field)
        # Admission's worst case in every pool (cpp/cellcache/admission.h): in the full
        # pool the prompt plus n x (max_tokens - 1) cells; in a windowed one the smaller of
        # that and n sequences' window bound.
        short = self.pools.first_short(len(prompt), params.n, params.max_new_tokens)
        if short is not None and short[0].window is None:
            raise RequestError(
                f"max_tokens={params.max_new_tokens} with n={params.n} needs up to {short[1]} "
                f"cache cells beside this {len(prompt)}-token prompt, but the KV cache holds "
                f"{short[0].capacity}; lower max_tokens or n", "max_tokens")
        if short is not None:
            pool, need = short
            # Blame n when no max_tokens would fit.
            blame = "n" if self.pools.first_short(len(prompt), params.n, 1) else "max_tokens"
            raise RequestError(
                f"max_tokens={params.max_new_tokens} with n={params.n} needs up to {need} "
                f"cells of {self.pools.describe(pool.index)} beside this {len(prompt)}-token "
                f"prompt; lower {'n' if blame == 'n' else 'max_tokens or n'}", blame)

    # ------------------------------------------------------------------ engine thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="cellcache-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            self._drain()
            if self._stopping:
                self._fail_all(EngineError("the server is shutting down"))
                return
            if self._sched.idle:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                plan = self.runner.advance(self._sched, self.stats)
            except Exception as e:  # a forward failed: the program, not a client
                self._fail_all(EngineError(f"generation failed: {e}"))
                continue
            if plan is None:  # nothing admitted yet: wait for cells to free
                self._wake.wait(0.01)
                self._wake.clear()
            else:
                self.metrics.steps.inc()
                self.metrics.prompt_tokens.inc(plan.n_prefill)
            self._after_step()

    def _drain(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for verb, request in items:
            if verb == "submit":
                try:
                    self._sched.submit(request)
                except Exception as e:  # checked at submission: not expected
                    request.tag._post(EngineError(str(e)))
                    with self._lock:
                        self._waiting -= 1
            else:
                self._sched.cancel(request)
        if items:
            self._after_step()

    def _after_step(self) -> None:
        any_finished = bool(self._sched.finished)
        for req in self._sched.finished:
            reasons = {s.finish_reason for s in req.samples}
            reason = FINISH_CANCELLED if req.cancelled else \
                FINISH_LENGTH if FINISH_LENGTH in reasons else FINISH_STOP
            self.metrics.requests.labels(finish_reason=reason).inc()
        self._sched.finished.clear()
        with self._lock:
            self._waiting = len(self._sched.waiting) + \
                sum(1 for verb, _ in self._inbox if verb == "submit")
        self.metrics.waiting.set(self._waiting)
        self.metrics.running.set(len(self._sched.running))
        pc = self.runner.prefix_cache  # driven by this thread only, like the scheduler
        # The cells only the prefix cache holds change when an entry is inserted (a request
        # finished), cloned (an admission, counted in stats) or evicted (counted): the scan
        # of the used cells runs only then, not on every decode step.
        if pc is not None and (any_finished or pc.stats != self._prefix_seen):
            self._cached_cells = pc.reclaimable_cells()
        cached_cells = 0 if pc is None else self._cached_cells
        self.metrics.cells_in_use.set(self.capacity - sum(self.pools.free()) - cached_cells)
        if self._proposer is not None:
            spec, m = self._sched.speculation, self.metrics
            m.spec_proposed.inc(spec.proposed - self._spec_seen[0])
            m.spec_accepted.inc(spec.accepted - self._spec_seen[1])
            self._spec_seen = (spec.proposed, spec.accepted)
            if self.stats.decode_groups:
                m.spec_tokens_per_forward.set(self.stats.tokens_per_forward)
            if self._proposer.failure is not None and not self._draft_failure_reported:
                self._draft_failure_reported = True
                m.spec_draft_failed.set(1)
                log.error("the draft model failed; decoding goes on without speculation: %s",
                          self._proposer.failure)
        if pc is not None:
            self._update_prefix_metrics(pc, cached_cells)

    def _update_prefix_metrics(self, pc, cached_cells: int) -> None:
        now, seen, m = pc.stats, self._prefix_seen, self.metrics
        m.prefix_requests.inc(now.requests - seen.requests)
        m.prefix_hits.inc(now.hits - seen.hits)
        m.prefix_cached_tokens.inc(now.cached_tokens - seen.cached_tokens)
        m.prefix_evictions.inc(now.evictions - seen.evictions)
        m.prefix_hit_rate.set(now.hit_rate)
        m.prefix_cells.set(cached_cells)
        self._prefix_seen = replace(now)

    def _fail_all(self, error: EngineError) -> None:
        live = list(self._sched.running) + list(self._sched.waiting)
        with self._lock:
            live += [r for verb, r in self._inbox if verb == "submit"]
            self._inbox.clear()
        self._sched.abandon()
        for req in live:
            req.tag._post(error)
        self._after_step()

    def _on_token(self, ev: TokenEvent) -> None:
        handle: Handle = ev.request.tag
        text = handle.texts[ev.sample_index]
        handle.completion_tokens += 1
        self.metrics.generated_tokens.inc()
        offset = text.offset
        piece = "" if ev.stop_token else text.push(ev.token)
        reason = ev.finish_reason
        if text.stopped:
            reason = FINISH_STOP
            self._sched.finish_sample(ev.request, ev.sample_index)
        if reason is not None:
            piece += text.finish()
        handle._post(Output(ev.sample_index, piece, ev.token, ev.logprobs, reason, offset))
