"""Continuous batching over the cell cache: the executable specification of
cpp/engine/scheduler.h (the engine the product runs). The differential
(tests/test_engine_differential.py) runs both on the same request streams and
must find them equal; the JSON cases in tests/cases/scheduler/ are the spec
of record.

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
raises CapacityError at submission (naming the pool that is too small).

Pools (issue #25; runtime/pools.py): a pooled program's cache holds one pool
per window policy and every step places each token in each, so admission
counts each pool: the full count above in a full-attention pool; in a
windowed pool, which reclaims what no owner can see again, at most
n * (W + max(R, T - 1) + T) cells for a request's n sequences (the core's
rule, cpp/cellcache/admission.h), less the cells they alone own already. A
prompt far longer than a windowed pool prefills in chunks of at most
max_tokens_per_step tokens; the pool reclaims as each step completes, so it
never needs the whole prompt.

Prefix cache (optional, runtime/prefix_cache.py): a request starts from a clone
of the longest cached prefix of its prompt and prefills only the rest; a
sample that ends (stop, length, finish_sample or cancel) leaves its sequence
to the cache as an entry instead of freeing it, and a request cancelled while
prefilling leaves its placed prompt tokens. Admission counts the cells and
ids only the cache holds as available and evicts least-recently-used entries
when it needs them. The prefix is cloned before eviction, so evicting the entry
it came from frees only that entry's tail; eviction never frees a cell a
running sequence owns. ``abandon`` (an error) frees, never caches.

Speculative decoding (optional, runtime/speculative.py): a ``proposer``
guesses the tokens that follow a decode sample's last token (prompt lookup, or
a draft model); the step carries them after that sample's decode token, each
with its logits row, and the token choice (sampling.verify) keeps the
proposals the target agrees with plus one token of its own. Commit removes the
rejected proposals' positions (``seq_rm``) and emits the accepted run token by
token, so stop tokens, max_new_tokens, stop strings (``finish_sample`` from a
callback) and the prefix cache see exactly the tokens plain decoding would
have produced. Budget: decode tokens first, then prompt chunks; proposals get
what is left (in decode order, each sample up to its own limit), so they never
delay another sequence's work. A sample proposes at most
max_new_tokens - len(tokens) - 1 tokens, so admission's worst case holds. The
limit adapts per sample: +2 after a fully accepted proposal, -1 after a
rejection, within [1, proposer.max_draft] (the schedule of transformers'
assisted generation). Backoff: after m proposals in a row with no token
accepted, a sample sits out min(2^(m-1), MAX_DRAFT_WAIT) of its proposal turns
(turns where it would have been asked): where a batch's samples do not follow
their context, proposals would cost the step more than they win, most at
larger batches, where a step is compute-bound.

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

from executorch_cellcache.cache._core import MAX_SEQUENCES, request_worst_case_cells
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.constraints import batch_masks
from executorch_cellcache.runtime.pools import Pools
from spec.prefix_cache import PrefixCache
from executorch_cellcache.runtime.sampling import SamplingParams, TokenLogprobs  # noqa: F401

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
# Speculation's backoff: after m proposals in a row with nothing accepted, a
# sample sits out min(2^(m-1), MAX_DRAFT_WAIT) of its proposal turns.
MAX_DRAFT_WAIT = 16


@dataclass(eq=False)
class Sample:
    index: int                     # within its request
    seq: int
    request: "Request" = field(repr=False)
    tokens: List[int] = field(default_factory=list)  # generated so far
    finish_reason: Optional[str] = None
    draft_limit: int = 0           # proposal length it may ask for next (speculation)
    draft_misses: int = 0          # its proposals in a row with no token accepted
    draft_wait: int = 0            # proposal turns it sits out (after misses)
    matcher: Any = None            # structured output: its constraints.Matcher, or None

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
    speculate: bool = True         # whether its samples take proposals (when a proposer is set)
    constraint: Any = None         # structured output: a constraints.Constraint, or None
    proposed_tokens: int = 0       # speculative decoding: its samples' proposals verified
    accepted_tokens: int = 0       # and accepted
    # The sampling code's state: one generator per sample, params.generator(j),
    # made at submit; the scheduler never draws from them.
    rngs: List[np.random.Generator] = field(default_factory=list, repr=False)

    def worst_case_cells(self, cached: int = 0) -> int:
        """Positions this request may still place: the cells it may still
        claim in a pool that reclaims nothing (``cached``: prompt tokens a
        waiting request would clone instead of prefilling)."""
        if not self.samples:
            return request_worst_case_cells(len(self.prompt), max(self.prefilled, cached),
                                            self.params.n, self.params.max_new_tokens)
        return sum(self.params.max_new_tokens - len(s.tokens)
                   for s in self.samples if not s.done)

    def reserve(self, pools: Pools) -> List[int]:
        """[n_pools] the free cells this running request may still take from
        each pool (Pools.reserve: its live sequences and worst case)."""
        if not self.samples:
            return pools.reserve(self.worst_case_cells(), [self.seq], self.params.n)
        live = [s.seq for s in self.samples if not s.done]
        return pools.reserve(self.worst_case_cells(), live, len(live))

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
    token indices whose logits the step needs (``logits_for``) in groups, one
    per consumer: the decode Sample fed that group's first token, or the
    Request whose prompt ends there (its n samples start from that row).
    ``drafts[i]``: the tokens proposed for consumer i (a decode Sample; empty
    for none), placed right after its decode token, each with a logits row,
    so group i has 1 + len(drafts[i]) rows; ``draft_probs[i]``: None, or
    float [len(drafts[i]), vocab], the distributions a draft model sampled
    them from."""
    seq_ids: List[int]
    tokens: List[int]
    positions: List[int]
    logits_for: List[int]
    consumers: list   # per logits group: Sample or Request
    drafts: List[List[int]] = field(default_factory=list)
    draft_probs: list = field(default_factory=list)
    n_prefill: int = 0
    n_decode: int = 0
    n_proposed: int = 0

    def widths(self) -> List[int]:
        """Per logits group, the most tokens ``commit`` takes for it: params.n
        for a request whose prompt ends there, 1 + len(draft) for a decode
        sample (exactly 1 without a draft)."""
        return [c.params.n if isinstance(c, Request) else 1 + len(d)
                for c, d in zip(self.consumers, self.drafts)]

    def masks(self) -> list:
        """Per logits group, None or bool [vocab]: the tokens a constrained
        request or sample may choose (runtime/constraints.py; the decode
        samples' masks in one batched call)."""
        out, decoding = [], []
        for g, c in enumerate(self.consumers):
            if isinstance(c, Request):
                out.append(None if c.constraint is None else c.constraint.initial_mask())
            else:
                out.append(None)
                if c.matcher is not None:
                    decoding.append(g)
        if decoding:
            rows = batch_masks([self.consumers[g].matcher for g in decoding])
            for g, row in zip(decoding, rows):
                out[g] = row
        return out

    def sampling_rows(self) -> list:
        """Per logits group, what ``sampling.choose_tokens`` chooses its tokens
        with: (params, generators) (one generator per token commit takes: a
        decode sample's own; a request's n, in sample order), or (params,
        [generator], draft, draft_probs) for a sample with proposals."""
        rows = []
        for c, d, q in zip(self.consumers, self.drafts, self.draft_probs):
            if isinstance(c, Request):
                rows.append((c.params, c.rngs))
            elif d:
                rows.append((c.request.params, [c.request.rngs[c.index]], d, q))
            else:
                rows.append((c.request.params, [c.request.rngs[c.index]]))
        return rows


@dataclass
class SpeculationStats:
    """Counters of speculative decoding over a scheduler's life: proposed and
    accepted tokens, decode groups verified with a proposal, and the tokens
    those groups gave their samples (accepted + the target's own; none past
    a stop)."""
    proposed: int = 0
    accepted: int = 0
    verified_groups: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


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
    proposer: speculative decoding's proposals (runtime/speculative.py), or
    None. Needs max_tokens_per_step >= 2 (a decode token and a proposal).
    """

    def __init__(self, cache, max_tokens_per_step: int, eos_ids: List[int],
                 on_token: Optional[Callable[[TokenEvent], None]] = None,
                 prefix_cache: Optional[PrefixCache] = None, proposer=None):
        self.cache = cache
        self.pools = Pools(cache, max_tokens_per_step)
        self.proposer = proposer  # speculative.Proposer or None
        self.prefix = prefix_cache
        self.budget = max_tokens_per_step
        self.eos = frozenset(eos_ids)
        self.on_token = on_token
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.finished: List[Request] = []  # in finishing order; callers may clear it
        self._next_decode = 0  # round-robin start when decode tokens exceed the budget
        self.speculation = SpeculationStats()
        self.decode_emitted = 0  # tokens decode groups gave their samples (accepted runs too)

    # ------------------------------------------------------------------ requests

    def check_fits(self, request: Request) -> None:
        """Raises CapacityError when ``request`` could not run even in an empty
        cache (too many cells in some pool, the message naming it, or too
        many sequence ids)."""
        p = request.params
        self.pools.check_fits(request.label, len(request.prompt), p.n, p.max_new_tokens)

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
            if self.proposer is not None:
                self.proposer.release(sample)
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
            return
        if self.cache.next_pos(seq) > len(tokens):
            # A stop inside an accepted run: the proposals after it were placed too.
            self.cache.seq_rm(seq, len(tokens))
        self.prefix.insert(tokens[:self.cache.next_pos(seq)], seq)

    def _retire(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.finished.append(req)

    # ------------------------------------------------------------------ steps

    def _admit(self) -> None:
        if not self.waiting:
            return
        cells = [0] * len(self.pools)  # per pool: what the running requests may still take
        for r in self.running:
            cells = [c + x for c, x in zip(cells, r.reserve(self.pools))]
        # Ids: those live in the cache (ours and anyone else's) plus the sample
        # clones that running prompts will still take.
        ids = sum(r.params.n - 1 for r in self.running if not r.samples)
        while self.waiting:
            head = self.waiting[0]
            seq, cached = self._clone_cached_prefix(head, ids)
            # With the prefix cloned, its cells are the head's: eviction may now
            # take the entry it came from (freeing only that entry's tail).
            taken = 1 if seq is not None else 0
            p = head.params
            need = self.pools.worst_case(len(head.prompt), cached, p.n, p.max_new_tokens)
            if not self._room([c + x for c, x in zip(cells, need)],
                              ids + head.params.n - taken, keep=None):
                if seq is not None:
                    self.cache.seq_free(seq)  # drops owner bits only: the entry holds them
                if seq is None or self.running:
                    return  # FIFO: later prompts wait behind it, for running ones to end
                # With nothing running, cold instead: in a reclaiming pool a clone can
                # cost more than it saves (the worst case there is the sequences' bound
                # whatever is cached, and the clone's cells stay the entry's until it is
                # evicted), so the head would wait forever. With one pool this fails
                # exactly when the clone did. (cpp/engine/scheduler.cpp does the same.)
                seq, cached, taken = None, 0, 0
                need = self.pools.worst_case(len(head.prompt), 0, p.n, p.max_new_tokens)
                if not self._room([c + x for c, x in zip(cells, need)], ids + p.n,
                                  keep=None):
                    return
            self.waiting.popleft()
            head.seq = seq if seq is not None else self.cache.seq_new()
            head.prefilled = head.cached_tokens = cached
            if self.prefix is not None:
                self.prefix.record(len(head.prompt), cached)
            cells = [c + x for c, x in zip(cells, need)]
            ids += head.params.n - 1
            self.running.append(head)

    def _clone_cached_prefix(self, head: Request, ids: int):
        """(a clone of the longest cached prefix of head's prompt, its length),
        or (None, 0) on a miss, without the prefix cache, or when no id is free
        for the clone even after evicting other entries."""
        if self.prefix is None:
            return None, 0
        src, cached = self.prefix.match(head.prompt)
        if not cached or not self._room([0] * len(self.pools), ids + 1, keep=src):
            return None, 0
        return self.cache.seq_clone(src, upto=cached), cached

    def _room(self, cells: List[int], ids: int, keep: Optional[int]) -> bool:
        """Whether ``cells`` free cells (one count per pool) and ``ids`` free
        ids exist, evicting cached entries other than ``keep`` to make them
        when that suffices."""
        if self.prefix is not None:
            return self.prefix.evict(cells, ids, keep=keep)
        return all(f >= c for f, c in zip(self.pools.free(), cells)) and \
            MAX_SEQUENCES - self.cache.n_sequences >= ids

    def plan(self) -> StepPlan:
        """Admits what fits, then packs the next step: one decode token per
        running sample (round-robin past the budget), then prompt chunks in
        admission order, up to max_tokens_per_step tokens; with a proposer,
        proposals fill what the budget has left (module docstring)."""
        self._admit()
        plan = StepPlan([], [], [], [], [])
        active = [s for req in self.running for s in req.samples if not s.done]
        decode: List[Sample] = []
        if active:
            start = self._next_decode % len(active)
            decode = (active[start:] + active[:start])[:self.budget]
            plan.n_decode = len(decode)
            self._next_decode = start + plan.n_decode
        left = self.budget - len(decode)
        chunks = []
        for req in self.running:
            if req.samples:
                continue
            take = min(left, len(req.prompt) - req.prefilled)
            chunks.append((req, take))
            left -= take
        drafts = self._proposals(decode, left)
        for s, (draft, probs) in zip(decode, drafts):
            pos = len(s.request.prompt) + len(s.tokens) - 1
            self._add(plan, s.seq, s.tokens[-1], pos, s, draft, probs)
            for i, t in enumerate(draft):
                self._add(plan, s.seq, t, pos + 1 + i, None, logits=True)
            plan.n_proposed += len(draft)
        for req, take in chunks:
            for i in range(req.prefilled, req.prefilled + take):
                last = i == len(req.prompt) - 1
                self._add(plan, req.seq, req.prompt[i], i, req if last else None)
            plan.n_prefill += take
        return plan

    def _proposals(self, decode: List[Sample], left: int) -> list:
        """Per decode sample, (draft tokens, draft_probs or None) within ``left``
        tokens of budget, in decode order."""
        none = [([], None)] * len(decode)
        if self.proposer is None or left <= 0:
            return none
        asks = []
        for i, s in enumerate(decode):
            if not s.request.speculate or s.matcher is not None:
                continue
            if not s.draft_limit:
                s.draft_limit = self.proposer.max_draft
            limit = min(s.draft_limit, s.request.params.max_new_tokens - len(s.tokens) - 1, left)
            if limit > 0 and s.draft_wait:
                s.draft_wait -= 1
            elif limit > 0:
                asks.append((i, s, limit))
                left -= limit
        if not asks:
            return none
        out = list(none)
        for (i, _, limit), (draft, probs) in zip(
                asks, self.proposer.propose([(s, limit) for _, s, limit in asks])):
            out[i] = (list(draft)[:limit], probs)
        return out

    @staticmethod
    def _add(plan: StepPlan, seq: int, token: int, pos: int, consumer,
             draft: Sequence[int] = (), probs=None, logits: bool = False) -> None:
        if consumer is not None:
            plan.logits_for.append(len(plan.tokens))
            plan.consumers.append(consumer)
            plan.drafts.append(list(draft))
            plan.draft_probs.append(probs if draft else None)
        elif logits:  # a proposal's row: part of the group opened before it
            plan.logits_for.append(len(plan.tokens))
        plan.seq_ids.append(seq)
        plan.tokens.append(token)
        plan.positions.append(pos)

    def commit(self, plan: StepPlan, picks: Sequence[int],
               logprobs: Optional[Sequence[Optional[TokenLogprobs]]] = None) -> None:
        """Applies a step's chosen tokens.

        picks: token ids, flat, group after group of ``plan``: the request's
          ``params.n`` (sample 0 first) for a request whose prompt ends there;
          one for a decode sample without a draft; for a decode sample with a
          draft d of k tokens, what ``sampling.verify`` returned: d[:a] and one
          more token (never d[a]), 1..k+1 tokens. A group whose consumer was
          cancelled or finished still has its tokens in picks; they are skipped.
        logprobs: None, or parallel to picks (a TokenLogprobs or None each),
          passed to the TokenEvents.
        Each token goes to its sample, which stops at a stop token (kept as
        its last token) or at max_new_tokens; on_token gets a TokenEvent per
        token. A sample's rejected proposals are removed from its sequence
        (seq_rm) before its tokens are emitted; a sample that stops inside
        its accepted run takes none of the tokens after the stop. A request
        cancelled (or a sample finished) by an ``on_token`` callback during
        the commit takes no further tokens.
        Raises InvalidConfigError, changing nothing, when picks (or logprobs)
        has the wrong length or picks holds a non-integer or a negative id.

        Example: consumers [sample a, request r with n=2] -> picks
        [token for a, token for r's sample 0, token for r's sample 1].
        """
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
               for t in picks):
            raise InvalidConfigError(f"picks must be token ids (integers >= 0), got "
                                     f"{list(picks)!r}")
        picks = [int(t) for t in picks]
        counts = []
        at = 0
        for consumer, draft in zip(plan.consumers, plan.drafts):
            if isinstance(consumer, Request):
                take = consumer.params.n
            else:
                take = 1
                while take <= len(draft) and at + take <= len(picks) and \
                        picks[at + take - 1] == draft[take - 1]:
                    take += 1
            counts.append(take)
            at += take
        if at != len(picks):
            raise InvalidConfigError(f"commit needs {at} picks for the step's "
                                     f"{len(plan.consumers)} logits groups, got {len(picks)}")
        if logprobs is not None and len(logprobs) != at:
            raise InvalidConfigError(f"logprobs must be parallel to picks ({at}), got "
                                     f"{len(logprobs)}")
        lps = list(logprobs) if logprobs is not None else [None] * at
        for req in self.running:
            if not req.samples:
                req.prefilled += sum(1 for s in plan.seq_ids if s == req.seq)
        at = 0
        for consumer, draft, take in zip(plan.consumers, plan.drafts, counts):
            if isinstance(consumer, Request):
                if not consumer.cancelled:
                    self._start_samples(consumer, picks[at:at + take], lps[at:at + take])
            elif draft:
                self._emit_run(consumer, draft, picks[at:at + take], lps[at:at + take])
            elif not consumer.done:
                self.decode_emitted += 1
                self._emit(consumer, picks[at], lps[at])
            at += take
        self._retire()

    def _emit_run(self, sample: Sample, draft: List[int], tokens: List[int],
                  logprobs: List[Optional[TokenLogprobs]]) -> None:
        """A verified group: drop the rejected proposals' positions, adapt the
        sample's proposal limit, emit the tokens until the sample stops."""
        accepted = len(tokens) - 1
        st = self.speculation
        st.proposed += len(draft)
        st.accepted += accepted
        st.verified_groups += 1
        sample.request.proposed_tokens += len(draft)
        if sample.done:
            return  # ended meanwhile: _end already rolled back or freed its sequence
        if accepted < len(draft):
            self.cache.seq_rm(sample.seq, len(sample.request.prompt) + len(sample.tokens) +
                              accepted)
            sample.draft_limit = max(1, sample.draft_limit - 1)
        else:
            sample.draft_limit = min(self.proposer.max_draft, sample.draft_limit + 2)
        sample.draft_misses = 0 if accepted else sample.draft_misses + 1
        if sample.draft_misses:
            sample.draft_wait = min(MAX_DRAFT_WAIT, 1 << (sample.draft_misses - 1))
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if sample.done:
                return
            st.emitted += 1
            self.decode_emitted += 1
            if i < accepted:  # an accepted proposal that is emitted (OpenAI's count)
                sample.request.accepted_tokens += 1
            self._emit(sample, token, lp)

    def _start_samples(self, req: Request, picks: List[int],
                       logprobs: List[Optional[TokenLogprobs]]) -> None:
        seqs = [req.seq] + [self.cache.seq_clone(req.seq) for _ in range(req.params.n - 1)]
        req.samples = [Sample(j, seq, req) for j, seq in enumerate(seqs)]
        if req.constraint is not None:
            for s in req.samples:
                s.matcher = req.constraint.matcher()
        for s in req.samples:
            if not s.done:  # a callback may have cancelled the request meanwhile
                self._emit(s, picks[s.index], logprobs[s.index])

    def _emit(self, sample: Sample, token: int, logprobs: Optional[TokenLogprobs]) -> None:
        req, params = sample.request, sample.request.params
        sample.tokens.append(token)
        if sample.matcher is not None:
            sample.matcher.advance(token)
        stop_token = token in params.stop_token_ids or (params.stop_on_eos and token in self.eos)
        if stop_token or (sample.matcher is not None and sample.matcher.complete):
            self._end(sample, FINISH_STOP)
        elif len(sample.tokens) >= params.max_new_tokens:
            self._end(sample, FINISH_LENGTH)
        if self.on_token is not None:
            self.on_token(TokenEvent(req, sample.index, token, logprobs, sample.finish_reason,
                                     stop_token))
