"""Perplexity of a text through an exported cell-cache program (``cellcache
eval``), in sliding windows like llama.cpp's ``llama-perplexity`` and the
Hugging Face recipe "Perplexity of fixed-length models".
"""

import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

from executorch_cellcache.cache.errors import CapacityError, InvalidConfigError

if TYPE_CHECKING:
    from executorch_cellcache.runtime.runner import Runner


@dataclass
class Perplexity:
    tokens: int          # tokens scored
    mean_nll: float      # mean negative log-likelihood per scored token, nats
    window: int          # tokens per window (the context of the first scored token)
    stride: int          # tokens between window starts

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def scored_windows(n_tokens: int, window: int, stride: int) -> List[Tuple[int, int, int]]:
    """The windows over ``n_tokens`` tokens as (begin, end, first_scored).

    Rule (the Hugging Face fixed-length recipe): windows start at 0, stride,
    2*stride, ...; a window holds tokens [begin, end) with end = min(begin +
    window, n_tokens), at positions 0 .. end-begin-1 (no BOS inserted); it
    scores the tokens from the previous window's end on (only the tokens
    after the overlap), never its own first token (which has no context in
    the window); the last window is the first that reaches n_tokens. With
    stride < window every token but the text's first is scored exactly once;
    with stride == window (no overlap) each window's first token is not.

    Example: n_tokens=10, window=6, stride=3 -> (0, 6, 1), (3, 9, 6),
    (6, 10, 9): tokens 1-5, 6-8 and 9 are scored.
    """
    out = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        first = max(prev_end, begin + 1)
        if end > first:
            out.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _token_ids(runner, text) -> List[int]:
    if isinstance(text, str):
        if not text:
            raise InvalidConfigError("the text is empty")
        if runner.tokenizer is None:
            raise InvalidConfigError(f"{runner.path} carries no tokenizer: it cannot score text "
                                     f"(pass token ids, or export from a checkpoint folder "
                                     f"with a tokenizer.json)")
        ids = runner.tokenizer.encode(text)
    else:
        ids = list(text)
    if len(ids) < 2:
        raise InvalidConfigError(f"the text is {len(ids)} token(s) long; perplexity needs at "
                                 f"least 2 tokens (one to predict from, one to score)")
    return ids


def evaluate(model: Union[str, Path, "Runner"], text: Union[str, Sequence[int]],
             window: Optional[int] = None, stride: Optional[int] = None,
             progress: bool = False) -> Perplexity:
    """Perplexity of ``text`` through a cell-cache program.

    model: a .pte path or a ``Runner``. text: a string (encoded with the
    program's tokenizer, which adds BOS when it is configured to) or token
    ids. window: tokens per window, at most the program's ``n_cells``
    (default: ``n_cells``, clipped to the text; a pooled program without a
    full-attention pool reclaims what its windows no longer see, so any
    window fits: default the text). stride: tokens between
    window starts, 1 .. window (default: window // 2). Windows and scored
    tokens follow ``scored_windows``. Each window is one fresh sequence,
    prefilled in teacher-forced steps of up to ``max_tokens_per_step``
    tokens that return the logits of every position that predicts a scored
    token; log-probabilities in float64. progress: a tqdm bar (stderr) over
    the window tokens run.

    Returns Perplexity (tokens scored, mean NLL in nats, ``.perplexity``).
    Raises InvalidConfigError for an empty text, a text shorter than 2
    tokens, a program without a tokenizer given a string, a window beyond
    the cache or a stride outside 1 .. window; CapacityError when the cache
    lacks ``window`` free cells (another user holds them).
    """
    from executorch_cellcache.runtime.runner import Runner

    runner = model if isinstance(model, Runner) else Runner(model)
    ids = _token_ids(runner, text)
    runner._check_vocabulary(ids, "text")
    pools = runner.pools
    # The cells a window of w tokens (one sequence) needs at most, per pool (admission.h).
    full = [p.capacity for p in pools.pools if p.window is None]
    n_cells = min(full) if full else None
    window = min(n_cells or len(ids), len(ids)) if window is None else \
        _positive(window, "window")
    if n_cells is not None and window > n_cells:
        raise InvalidConfigError(f"window {window} exceeds the program's cache of {n_cells} "
                                 f"cells (a window is one sequence in the cache)")
    if window < 2:
        raise InvalidConfigError(f"window must hold at least 2 tokens, got {window}")
    stride = max(1, window // 2) if stride is None else _positive(stride, "stride")
    if stride > window:
        raise InvalidConfigError(f"stride {stride} is larger than the window {window}: tokens "
                                 f"between windows would never be scored")
    # A text shorter than the window is one window.
    window = min(window, len(ids))
    stride = min(stride, window)
    need = pools.worst_case(window, 0, 1, 1)
    if any(f < c for f, c in zip(pools.free(), need)):
        raise CapacityError(f"a window of {window} tokens needs {max(need)} free cells; the "
                            f"cache has {pools.summary()}")

    windows = scored_windows(len(ids), window, stride)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(end - begin for begin, end, _ in windows), unit="tok",
                   desc="evaluating", file=sys.stderr)
    total, count = 0.0, 0
    try:
        for begin, end, first in windows:
            total += _window_nll(runner, ids, begin, end, first, bar)
            count += end - first
    finally:
        if bar is not None:
            bar.close()
    return Perplexity(tokens=count, mean_nll=total / count, window=window, stride=stride)


def _window_nll(runner, ids: List[int], begin: int, end: int, first: int, bar) -> float:
    """Summed NLL of ids[first:end] given ids[begin:t] each, as one sequence."""
    step = runner.info.max_tokens_per_step
    seq = runner.cache.seq_new()
    total = 0.0
    try:
        for c in range(begin, end, step):
            chunk = ids[c:min(c + step, end)]
            # the token at absolute index t predicts t + 1; rows for t + 1 in [first, end)
            predicting = [j for j in range(len(chunk)) if first <= c + j + 1 < end]
            logits = runner.step([seq] * len(chunk), chunk,
                                 list(range(c - begin, c - begin + len(chunk))),
                                 predicting or [len(chunk) - 1])
            if predicting:
                # logits: [len(predicting), vocab] float32
                logp = torch.log_softmax(logits.double(), dim=-1)
                targets = torch.tensor([ids[c + j + 1] for j in predicting])
                total -= logp.gather(1, targets[:, None]).sum().item()
            if bar is not None:
                bar.update(len(chunk))
    finally:
        runner.cache.seq_free(seq)
    return total
