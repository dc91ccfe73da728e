"""The server's engine thread: one thread steps the Runner's C++ engine
(``runner.engine``, cpp/engine/engine.h: scheduler, prefix cache,
speculative decoding, token choice); the HTTP side submits and cancels
requests from the event loop, thread-safe.

Continuous batching: a submission is queued in the engine, which applies it
before its next step, so a request that arrives while others decode joins
the next step (its prefill shares that forward with their decode tokens). A
cancellation (a client that went away) is applied the same way: its
sequences are freed before the next step is planned. Admission is the
engine's worst-case rule; requests that do not fit wait, and past
``max_queue`` waiting requests a submission is refused (``QueueFullError``,
HTTP 429).

Outputs: for every token the engine thread posts an ``Output`` (the sample,
the text it releases, the token, its logprobs, the finish reason when it
ended the sample) to the request's ``Handle`` on the event loop. Text is
decoded and stop strings are matched in the engine's ``ends_sample`` hook
(runtime/engine.py), on the engine thread, as each token is taken: a stop
string ends its sample (and frees its sequence) within the same step, and no
token of a speculative run after it is emitted.
"""

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.cache.errors import CapacityError
from executorch_cellcache.runtime.engine import PrefixCacheStats
from executorch_cellcache.runtime.runner import Runner
from executorch_cellcache.runtime.sampling import SamplingParams, TokenLogprobs
from executorch_cellcache.serving.metrics import Metrics
from executorch_cellcache.serving.text import SampleText

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"
# The engine's error when nothing fits while requests wait (engine.cpp step()).
_NOTHING_ADMITTED = "no request can be admitted"

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
    Outputs, or an EngineError that ends the request. The counts are the
    engine's (cpp/engine/engine.h Usage), complete once every sample's last
    Output arrived."""
    n: int
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    texts: List[SampleText]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0
    cached_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    id: Optional[int] = None        # the engine's request id
    # Engine thread only: per sample, the (text, offset) of tokens taken but
    # not yet delivered; the last Output, held until the sample's usage came.
    pending: List[Deque[Tuple[str, int]]] = field(default_factory=list)
    last: Dict[int, "Output"] = field(default_factory=dict)
    finished: int = 0
    reasons: set = field(default_factory=set)
    grammar_error: Optional[str] = None   # the constraint failed (its samples end; 500)

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
        # Speculative decoding (checked here, before any request).
        self.max_draft = runner.use_speculative(speculative)
        self.metrics.spec_max_draft.set(self.max_draft)
        self._core = runner.engine
        self._core.reset_stats()
        self._draft_failure_reported = False
        self._seen = self._core.stats()  # what the metrics counted so far
        self._prefix_seen = PrefixCacheStats()
        self._cached_cells = 0  # cells held only by the prefix cache, as of the last change
        self._lock = threading.Lock()  # guards _live, _stopping; held across submit + register
        self._live: Dict[int, Handle] = {}
        self._failed: List[Handle] = []  # engine thread: requests a failed step ended
        self._failed_grammar: set = set()  # engine thread: requests told their grammar failed
        self._finished_any = False
        self._wake = threading.Event()
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
        handle.pending = [deque() for _ in range(params.n)]
        on_token, on_finish = self._sink(handle)
        with self._lock:
            if self._stopping:
                raise EngineError("the server is shutting down")
            waiting = self._core.waiting_requests
            if waiting >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFullError(f"{waiting} requests already wait for the cache "
                                     f"(--max-queue {self.max_queue}); retry later")
            # Every token is watched: its text is decoded as it is taken, and a stop
            # string ends the sample there.
            try:
                handle.id = self.runner.submit(
                    prompt, params, on_token, on_finish, label=prompt_field,
                    constraint=constraint, text=self._text_watch(handle),
                    on_grammar_error=lambda message: setattr(handle, "grammar_error", message))
            except (ValueError, CapacityError) as e:  # what _check did not foresee
                raise RequestError(str(e), prompt_field) from e
            self._live[handle.id] = handle
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Frees the request's sequences before the next step (a client that
        went away). Thread-safe; a finished request is left alone."""
        with self._lock:
            live = handle.id in self._live
        if live:
            try:
                self._core.cancel(handle.id)
            except ValueError:
                pass  # it finished meanwhile, or its cancel is already queued
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
            if self._stopping:
                self._shut_down()
                return
            try:
                worked = self._core.step()
            except Exception as e:  # a forward failed: the program, not a client
                if str(e).startswith(_NOTHING_ADMITTED):  # another user holds the cells
                    self._wake.wait(0.01)
                    self._wake.clear()
                    continue
                failed, self._failed = self._failed, []
                for handle in failed:
                    handle._post(EngineError(f"generation failed: {e}"))
                self._after_step()
                continue
            self._after_step()
            if not worked:
                self._wake.wait()
                self._wake.clear()

    def _shut_down(self) -> None:
        self._core.abort()
        with self._lock:
            live, self._live = list(self._live.values()), {}
        error = EngineError("the server is shutting down")
        for handle in live:
            handle._post(error)
        self._after_step()

    def _text_watch(self, handle: Handle):
        """ends_sample's text side: decodes the token, matches stop strings."""
        texts, pending = handle.texts, handle.pending

        def watch(sample: int, token: int, stop_token: bool) -> bool:
            text = texts[sample]
            offset = text.offset
            pending[sample].append(("" if stop_token else text.push(token), offset))
            return text.stopped
        return watch

    def _sink(self, handle: Handle):
        """(on_token, on_finish) posting ``handle``'s Outputs."""
        metrics = self.metrics

        def on_token(_id, sample, token, logprob, top, _stop_token, finish):
            handle.completion_tokens += 1
            metrics.generated_tokens.inc()
            piece, offset = handle.pending[sample].popleft()
            lp = None if logprob is None else TokenLogprobs(logprob, top)
            if finish is not None:
                piece += handle.texts[sample].finish()
                # Posted with the sample's usage, in on_finish, which follows at once.
                handle.last[sample] = Output(sample, piece, token, lp, finish, offset)
            else:
                handle._post(Output(sample, piece, token, lp, None, offset))

        def on_finish(_id, sample, reason, usage):
            handle.cached_tokens = usage.cached_tokens
            handle.proposed_tokens += usage.proposed_tokens
            handle.accepted_tokens += usage.accepted_tokens
            handle.reasons.add(reason)
            handle.finished += 1
            last = handle.last.pop(sample, None)
            if handle.grammar_error is not None:
                if handle not in self._failed_grammar:
                    self._failed_grammar.add(handle)
                    handle._post(EngineError(f"structured output failed: "
                                             f"{handle.grammar_error}"))
            elif last is not None:
                handle._post(last)
            if reason == "error" and handle not in self._failed:
                self._failed.append(handle)
            if handle.finished == handle.n:
                self._finished(handle)
        return on_token, on_finish

    def _finished(self, handle: Handle) -> None:
        reasons = handle.reasons
        reason = "error" if "error" in reasons or handle.grammar_error is not None else \
            FINISH_CANCELLED if FINISH_CANCELLED in reasons else \
            FINISH_LENGTH if FINISH_LENGTH in reasons else FINISH_STOP
        self.metrics.requests.labels(finish_reason=reason).inc()
        with self._lock:
            self._live.pop(handle.id, None)
        self._failed_grammar.discard(handle)
        self._finished_any = True

    def _after_step(self) -> None:
        core, m = self._core, self.metrics
        waiting = core.waiting_requests
        m.waiting.set(waiting)
        m.running.set(max(0, core.live_requests - waiting))
        now, seen = core.stats(), self._seen
        m.steps.inc(now.steps - seen.steps)
        m.prompt_tokens.inc(now.prefill_tokens - seen.prefill_tokens)
        pc = self.runner.prefix_cache
        # The cells only the prefix cache holds change when an entry is inserted (a request
        # finished), cloned (an admission) or evicted: the scan of the used cells runs only
        # then, not on every decode step.
        prefix = None if pc is None else pc.stats
        if pc is not None and (self._finished_any or prefix != self._prefix_seen):
            self._cached_cells = pc.reclaimable_cells()
        self._finished_any = False
        cached_cells = 0 if pc is None else self._cached_cells
        m.cells_in_use.set(self.capacity - sum(self.pools.free()) - cached_cells)
        if core.speculative:
            m.spec_proposed.inc(now.proposed_tokens - seen.proposed_tokens)
            m.spec_accepted.inc(now.accepted_tokens - seen.accepted_tokens)
            if now.decode_groups:
                m.spec_tokens_per_forward.set(now.decode_tokens / now.decode_groups)
            if now.speculation_failure and not self._draft_failure_reported:
                self._draft_failure_reported = True
                m.spec_draft_failed.set(1)
                log.error("the draft model failed; decoding goes on without speculation: %s",
                          now.speculation_failure)
        self._seen = now
        if prefix is not None:
            self._update_prefix_metrics(prefix, cached_cells)

    def _update_prefix_metrics(self, now: PrefixCacheStats, cached_cells: int) -> None:
        seen, m = self._prefix_seen, self.metrics
        m.prefix_requests.inc(now.requests - seen.requests)
        m.prefix_hits.inc(now.hits - seen.hits)
        m.prefix_cached_tokens.inc(now.cached_tokens - seen.cached_tokens)
        m.prefix_evictions.inc(now.evictions - seen.evictions)
        m.prefix_hit_rate.set(now.hit_rate)
        m.prefix_cells.set(cached_cells)
        self._prefix_seen = now
