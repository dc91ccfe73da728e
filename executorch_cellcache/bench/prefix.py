"""The prefix cache (SPEC section 9): time to first token of a request that
shares a long system prompt with an earlier one, cached vs cold, and the cells
chat sessions sharing that system prompt hold vs private copies."""

import statistics
import time
from typing import Dict, List

import numpy as np

from executorch_cellcache.bench.common import BenchSetup

SESSIONS = 8
USER_TOKENS = 8    # each turn's new user message
REPLY_TOKENS = 16


def _tokens(rng, vocab: int, n: int) -> List[int]:
    return rng.integers(0, vocab, n).tolist()


def _first_token_seconds(runner, prompt: List[int]) -> float:
    t0 = time.perf_counter()
    runner.generate([prompt], max_new_tokens=1, stop_on_eos=False)
    return time.perf_counter() - t0


def prefix_ttft(runner, setup: BenchSetup) -> Dict[str, float]:
    """Median seconds to the first token of ``system + question``: cold (empty
    cache) and cached (an earlier request with the same system prompt and
    another question has finished). Cold and cached runs alternate (the
    machine's speed drifts); each uses a question never seen before."""
    vocab = setup.model["vocab_size"]
    rng = np.random.default_rng(7)
    system = _tokens(rng, vocab, setup.prefix_len)
    cold, cached = [], []
    for _ in range(max(2, setup.repeats) + 1):  # the first round warms up
        runner.clear()
        cold.append(_first_token_seconds(runner, system + _tokens(rng, vocab, USER_TOKENS)))
        cached.append(_first_token_seconds(runner, system + _tokens(rng, vocab, USER_TOKENS)))
        if runner.last_stats.cached_tokens != [setup.prefix_len]:
            raise RuntimeError(f"the cached request reused {runner.last_stats.cached_tokens} "
                               f"prompt tokens, expected {setup.prefix_len}")
    runner.clear()
    return {"prefix_ttft_cold_seconds": statistics.median(cold[1:]),
            "prefix_ttft_cached_seconds": statistics.median(cached[1:])}


def chat_session_cells(runner, setup: BenchSetup) -> Dict[str, float]:
    """Cells held by SESSIONS chat sessions of two turns each that share one
    system prompt (the first session's first turn warms the cache), against
    private copies of every session's history (what a cache without sharing
    holds for them: the sum of their lengths)."""
    vocab = setup.model["vocab_size"]
    rng = np.random.default_rng(8)
    system = _tokens(rng, vocab, setup.prefix_len)
    runner.clear()

    def turn(batch):  # one generate call; each history gets its reply appended
        for history, [reply] in zip(batch, runner.generate(batch, REPLY_TOKENS,
                                                           stop_on_eos=False)):
            history.extend(reply)

    histories = [system + _tokens(rng, vocab, USER_TOKENS) for _ in range(SESSIONS)]
    turn(histories[:1])   # the first session's first turn caches the system prompt
    turn(histories[1:])   # the others' first turns reuse it
    for history in histories:
        history.extend(_tokens(rng, vocab, USER_TOKENS))
    turn(histories)       # second turns: each resends its whole history
    held = sum(runner.pools.capacities()) - sum(runner.pools.free())  # every pool's
    # Each session's cached sequence holds its history but the last reply token.
    private = sum(len(h) - 1 for h in histories)
    runner.clear()
    return {"chat_sessions_cells": held, "chat_sessions_private_cells": private}
