"""Runner: loads a cell-cache .pte and serves many sequences with it.

The runner owns a ``CellCache`` configured from the program's metadata
(``runner.cache``, the BatchControl face) and declares every step before it
runs the program's forward with ``executorch.runtime``.
"""

import contextlib
import numbers
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from executorch_cellcache.cache import _core, metadata
from executorch_cellcache.cache._core import CellCache
from executorch_cellcache.cache.errors import CapacityError, InvalidConfigError
from executorch_cellcache.runtime.execute import execute
from executorch_cellcache.runtime.kernels import require_kernels
from executorch_cellcache.runtime.prefix_cache import PrefixCache
from executorch_cellcache.runtime.sampling import SamplingParams, choose_tokens
from executorch_cellcache.runtime.scheduler import Request, Scheduler, StepPlan
from executorch_cellcache.runtime.tokenizer import from_metadata


@dataclass
class GenerateStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0         # in every step
    decode_step_tokens: int = 0    # in steps without prompt tokens (what decode_seconds timed)
    steps: int = 0
    prefill_seconds: float = 0.0   # forwards that carried prompt tokens
    decode_seconds: float = 0.0    # forwards that carried only decode tokens
    peak_cells: int = 0
    capacity: int = 0
    # Prefix cache (zeros when it is off): per prompt, the prompt tokens served
    # from cached cells; the cells only the cache holds when the call ended.
    cached_tokens: List[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prefix_cache_cells: int = 0

    @property
    def cached_prompt_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the call's prompts that reused at least one cached token."""
        return sum(c > 0 for c in self.cached_tokens) / len(self.cached_tokens) \
            if self.cached_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_step_tokens / self.decode_seconds if self.decode_seconds else 0.0


@contextlib.contextmanager
def _runtime_log_captured(log):
    """Sends what the ExecuTorch runtime logs to stderr (file descriptor 2) into
    the file ``log`` while a program loads or runs: its info lines (CPU probing)
    and per-kernel error lines are noise to a user, who gets one exception.
    Yields a function returning (and clearing) the captured text, which errors
    quote. The file is emptied on entry, so a long-running server's log holds at
    most one forward's lines."""
    def take() -> str:
        log.seek(0)
        text = log.read().decode("utf-8", "replace").strip()
        log.seek(0)
        log.truncate()
        return text

    sys.stderr.flush()
    if log.tell():  # lines of an earlier forward that succeeded: nobody will quote them
        log.seek(0)
        log.truncate()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield take
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _with_log(message: str, log: str) -> str:
    lines = [line for line in log.splitlines() if "cpuinfo" not in line][-5:]
    return message + ("; the runtime said:\n  " + "\n  ".join(lines) if lines else "")


def _load_program(path: Path, logged):
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        raise InvalidConfigError(f"{path} is a folder, expected a .pte file")
    # An ExecuTorch program carries the identifier "ET" + 2 digits at bytes 4-8. Check it
    # here: the runtime logs a bad identifier raw, and non-UTF-8 bytes in that log line
    # abort the Python log sink.
    with open(path, "rb") as f:
        header = f.read(8)
    if len(header) < 8 or header[4:6] != b"ET" or not header[6:8].isdigit():
        raise InvalidConfigError(f"{path} is not a loadable ExecuTorch program (no 'ET' "
                                 f"program identifier); export one with `cellcache export`")
    from executorch.runtime import Runtime  # slow to import: after the cheap checks

    try:
        return Runtime.get().load_program(str(path))
    except (RuntimeError, ValueError) as e:
        raise InvalidConfigError(_with_log(
            f"{path} is not a loadable ExecuTorch program ({e})", logged())) from e


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _token_ids(values, what: str) -> List[int]:
    """Integers (Python or numpy) as Python ints; floats, bools and strings are
    refused rather than truncated."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidConfigError(f"{what} must hold integers, got {v!r}")
        if not _INT64_MIN <= v <= _INT64_MAX:  # Python ints are unbounded, the program's are not
            raise InvalidConfigError(f"{what} must hold 64-bit integers, got {v!r}")
        out.append(int(v))
    return out


class Runner:
    """Batched generation from a cell-cache .pte.

    Runner(pte_path) reads the program's metadata and creates ``runner.cache``,
    the CellCache (BatchControl) every step is declared on; ``runner.info``
    holds the metadata and ``runner.tokenizer`` the program's tokenizer (or
    None). Raises FileNotFoundError / InvalidConfigError for a missing file, a
    non-ExecuTorch file or a program without cell-cache metadata.

    prefix_cache (default on): finished requests' cells stay as cached
    prefixes (``runner.prefix_cache``, runtime/prefix_cache.py) that later
    requests starting with the same tokens reuse instead of prefilling, in
    ``generate`` and in a server's scheduler; prefix_cache_cells bounds the
    cells only the cache holds (None = no bound; InvalidConfigError outside
    [0, n_cells]). ``clear()`` (or ``runner.cache.clear()``) drops them.
    """

    def __init__(self, pte_path, prefix_cache: bool = True,
                 prefix_cache_cells: Optional[int] = None):
        self.path = Path(pte_path)
        self._log = tempfile.TemporaryFile()  # the runtime's stderr lines, see step()
        with _runtime_log_captured(self._log) as logged:
            self.program = _load_program(self.path, logged)
            try:
                self.info = metadata.read(self.program)
                require_kernels(self.info)
                self._forward = self.program.load_method("forward")
            except (RuntimeError, ValueError) as e:
                raise InvalidConfigError(_with_log(f"{self.path}: {e}", logged())) from e
        if self.info.kv_dtype not in metadata.KV_DTYPES:
            raise InvalidConfigError(
                f"{self.path}: K/V dtype {self.info.kv_dtype!r} is not supported by this runner "
                f"(supported: {', '.join(metadata.KV_DTYPES)}); re-export the model")
        self.cache = CellCache(self.info.n_cells, self.info.n_layers, self.info.windows)
        if not isinstance(prefix_cache, bool):
            raise InvalidConfigError(f"prefix_cache must be True or False, got {prefix_cache!r}")
        if not prefix_cache and prefix_cache_cells is not None:
            raise InvalidConfigError("prefix_cache_cells bounds the prefix cache, which "
                                     "prefix_cache=False turns off; pass one or the other")
        self.prefix_cache = PrefixCache(self.cache, prefix_cache_cells) if prefix_cache \
            else None
        self._handle = torch.tensor([self.cache.handle], dtype=torch.int64)
        self.tokenizer = from_metadata(self.info.tokenizer_kind, self.info.tokenizer_json)
        self.last_stats = GenerateStats(capacity=self.info.n_cells)

    def clear(self) -> None:
        """Empties the cache: every sequence (cached prefixes included) and id."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.cache.clear()

    # ------------------------------------------------------------------ raw forward

    def step(self, seq_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
             logits_for: Sequence[int]) -> torch.Tensor:
        """One forward: declares the step, runs it, returns float32 logits
        [len(logits_for), vocab] for the token indices in ``logits_for``.

        seq_ids, tokens, positions: one entry per token, graph order.
        Raises CapacityError when the tokens do not fit in the free cells,
        InvalidConfigError for inconsistent inputs, and the cache's errors
        (UnknownSequenceError, PositionConflictError, ...) from the forward.
        """
        seq_ids = _token_ids(seq_ids, "seq_ids")
        tokens = _token_ids(tokens, "tokens")
        positions = _token_ids(positions, "positions")
        logits_for = _token_ids(logits_for, "logits_for")
        n_tok = len(tokens)
        # The step rules live once, in the core (cpp/cellcache/step_batch.h).
        _core.check_step_batch(len(seq_ids), tokens, len(positions), logits_for,
                               self.info.max_tokens_per_step, self.info.vocab_size)
        if not self.cache.declare_step(seq_ids):
            raise CapacityError(f"a step of {n_tok} tokens does not fit in the "
                                f"{self.cache.free_cells} free cells of {self.cache.capacity}")
        inputs = [
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(logits_for, dtype=torch.int64),
            self._handle,
            torch.empty(self.cache.planned_used_end, dtype=torch.uint8),
        ]
        held_end = {seq: self.cache.next_pos(seq) for seq in set(seq_ids)}
        _core.clear_last_op_error()
        with _runtime_log_captured(self._log) as logged:
            try:
                out = execute(self._forward, inputs)
            except RuntimeError as e:
                self._undo_partial_step(held_end)
                _core.raise_last_op_error()  # the cache's own error, when it is one
                raise RuntimeError(_with_log(f"the forward failed ({e})", logged())) from e
        return out[0]

    def _check_vocabulary(self, ids: List[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise InvalidConfigError(f"{what}: token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.info.vocab_size})")

    def _undo_partial_step(self, held_end) -> None:
        """A forward that failed after placing left cells whose K/V some layers
        never wrote: remove the positions this step placed (those at or after
        each sequence's next_pos before the step) so no later step reads them.
        The core abandons a step that stopped between layers by itself (rule 5
        in cell_cache.h); this also covers a forward that failed after its
        last place op, when the step already counts as complete."""
        for seq, end in held_end.items():
            if self.cache.next_pos(seq) > end:
                self.cache.seq_rm(seq, end)

    def rollback(self, seq: int, k: int) -> None:
        """Removes the last ``k`` positions of ``seq`` (speculative-decoding
        rollback); the next token goes at ``cache.next_pos(seq)``."""
        held = self.cache.seq_len(seq)
        if not 0 <= k <= held:
            raise InvalidConfigError(f"cannot roll back {k} tokens of sequence {seq}, which "
                                     f"holds {held}")
        if k:
            self.cache.seq_rm(seq, self.cache.next_pos(seq) - k)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, n: int = 1,
                 temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, seed: Optional[int] = None,
                 stop_on_eos: bool = True,
                 on_token: Optional[Callable[[int, int, int], None]] = None,
                 on_step: Optional[Callable[[GenerateStats], None]] = None,
                 stop_token_ids: Sequence[int] = ()
                 ) -> List[List[List[int]]]:
        """Continuous-batching generation: a loop over the same Scheduler the
        server drives (``advance``).

        prompts: token-id lists (non-empty). Returns, per prompt, ``n`` lists
        of new token ids. A sample stops at any of ``stop_token_ids`` (ids in
        the vocabulary), or of the program's EOS ids when ``stop_on_eos``; the
        stop token is included. on_token(prompt_index, sample_index,
        token) streams tokens. Every prompt gets the same parameters and seed:
        sample j of a prompt draws from a generator of (seed, j) only, so a
        prompt's tokens do not depend on its index or its companions (the same
        prompt and seed give the same tokens wherever it sits in the batch).
        With the prefix cache, a prompt reuses the longest cached prefix and
        finished samples stay cached; ``last_stats.cached_tokens`` lists the
        prompt tokens each prompt reused.
        Raises InvalidConfigError for bad arguments and CapacityError for a
        request that can never fit in the cache.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                n=n, max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos,
                                stop_token_ids=stop_token_ids)
        self.check_params(params)
        params = replace(params, n=int(n), max_new_tokens=int(max_new_tokens))
        forward = None if on_token is None else \
            (lambda ev: on_token(ev.request.tag, ev.sample_index, ev.token))
        sched = Scheduler(self.cache, self.info.max_tokens_per_step, self.info.eos_ids, forward,
                          self.prefix_cache)
        requests = [Request(self.check_prompt(list(p), f"prompt {i}"), params, tag=i,
                            label=f"prompt {i}") for i, p in enumerate(prompts)]
        for req in requests:
            sched.submit(req)
        stats = GenerateStats(capacity=self.cache.capacity)
        self.last_stats = stats
        try:
            while not sched.idle:
                if self.advance(sched, stats) is None:
                    raise CapacityError("no request can be admitted into the free cells "
                                        f"({self.cache.free_cells} of {self.cache.capacity}); "
                                        "another user of this cache holds them")
                if on_step is not None:
                    on_step(stats)
        except BaseException:
            sched.abandon()  # free this call's sequences: the cache stays usable
            raise
        stats.cached_tokens = [req.cached_tokens for req in requests]
        stats.prompt_tokens = sum(len(req.prompt) for req in requests)
        if self.prefix_cache is not None:
            stats.prefix_cache_cells = self.prefix_cache.reclaimable_cells()
        return [[s.tokens for s in req.samples] for req in requests]

    def check_prompt(self, prompt: Sequence[int], what: str = "prompt") -> List[int]:
        """A prompt as Python ints; raises InvalidConfigError for an empty
        prompt, non-integers or ids outside the vocabulary."""
        ids = _token_ids(prompt, what)
        if not ids:
            raise InvalidConfigError(f"{what} is empty")
        self._check_vocabulary(ids, what)
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """Raises InvalidConfigError for parameters of the wrong type or out of
        range (SamplingParams.validate) and for stop_token_ids outside the
        vocabulary."""
        params.validate()
        self._check_vocabulary(list(params.stop_token_ids), "stop_token_ids")

    def advance(self, sched: Scheduler, stats: GenerateStats) -> Optional[StepPlan]:
        """One step of ``sched``: plans it, runs the forward, chooses the
        tokens (runtime/sampling.py), commits them (on_token callbacks run
        here) and adds to ``stats``. Returns the plan, or None when nothing
        could be planned (no request running and the waiting one does not
        fit)."""
        plan = sched.plan()
        if not plan.tokens:
            return None
        # A step of prompt chunks that end no prompt needs no logits, but a forward
        # returns at least one row: take the last token's and ignore it.
        logits_for = plan.logits_for or [len(plan.tokens) - 1]
        t0 = time.perf_counter()
        logits = self.step(plan.seq_ids, plan.tokens, plan.positions, logits_for)
        elapsed = time.perf_counter() - t0
        stats.steps += 1
        stats.peak_cells = max(stats.peak_cells, self.cache.capacity - self.cache.free_cells)
        stats.prefill_tokens += plan.n_prefill
        stats.decode_tokens += plan.n_decode
        if plan.n_prefill:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
            stats.decode_step_tokens += plan.n_decode
        picks, logprobs = choose_tokens(logits.numpy()[:len(plan.logits_for)],
                                        plan.sampling_rows())
        sched.commit(plan, picks, logprobs)
        return plan
