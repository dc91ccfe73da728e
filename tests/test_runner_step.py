"""Runner.step and Runner.rollback (the raw forward): rollback then continue
equals a fresh run, bad step inputs refused with the cache unchanged, ids
that are not integers refused, and the runtime log kept to one forward.

Programs, prompts and helpers: conftest.py and tests/runner_support.py.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import CELLS, PROMPTS, STEP, greedy_steps, prefill, still_works

import executorch_cellcache as ecc
from executorch_cellcache import InvalidConfigError, PositionConflictError, UnknownSequenceError

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- rollback


def test_rollback_then_continue_equals_fresh_run(roomy_pte):
    runner = ecc.Runner(roomy_pte)
    cache = runner.cache
    prompt = PROMPTS[2]  # 23 tokens: two chunks
    s = cache.seq_new()
    first = int(torch.argmax(prefill(runner, s, prompt)))
    gen = [first] + greedy_steps(runner, s, first, 9)  # g0..g9; g0..g8 are in the cache
    assert cache.seq_len(s) == len(prompt) + 9
    free_before = cache.free_cells

    k = 4
    runner.rollback(s, k)
    kept = gen[:9 - k]  # g0..g4 stay in the cache
    assert cache.seq_len(s) == len(prompt) + len(kept)
    assert cache.next_pos(s) == len(prompt) + len(kept)
    assert cache.free_cells == free_before + k

    # Speculative-decoding style: the draft g5.. was rejected, feed a correction instead.
    correction = next(t for t in range(10, 300) if t != gen[9 - k])
    cont = greedy_steps(runner, s, correction, 6)

    fresh = ecc.Runner(roomy_pte)
    [[expected]] = fresh.generate([prompt + kept + [correction]], max_new_tokens=6,
                                  stop_on_eos=False)
    assert cont == expected

    # Rolling back and re-feeding the same token reproduces the original greedy path.
    runner2 = ecc.Runner(roomy_pte)
    s2 = runner2.cache.seq_new()
    prefill(runner2, s2, prompt)
    greedy_steps(runner2, s2, first, 9)
    runner2.rollback(s2, k)
    assert greedy_steps(runner2, s2, gen[9 - k], k) == gen[10 - k:10]

    runner.rollback(s, 0)  # a no-op
    assert cache.seq_len(s) == len(prompt) + len(kept) + 6
    with pytest.raises(InvalidConfigError, match="roll back"):
        runner.rollback(s, cache.seq_len(s) + 1)
    cache.seq_free(s)
    assert cache.free_cells == CELLS


def _fresh_inputs(runner, tokens, positions, logits_for):
    """forward's inputs made anew for every step (what Runner.step did before it
    kept its input tensors between steps)."""
    return [torch.tensor(tokens, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
            torch.tensor(logits_for, dtype=torch.int64), runner._handle,
            torch.empty(runner.cache.planned_used_end, dtype=torch.uint8)]


def test_steps_of_changing_sizes_equal_steps_with_fresh_inputs(roomy_pte, monkeypatch):
    """Runner.step refills the last step's input tensors when the sizes repeat:
    no value of an earlier step may survive into a later one, whatever the
    order of sizes (prefill chunks, decode steps of 1 and 3 sequences, a step
    reading logits of more rows than the one before)."""
    def run(runner):
        cache = runner.cache
        seqs = [cache.seq_new() for _ in range(3)]
        rows = []
        for i, s in enumerate(seqs):
            rows.append(runner.step([s] * 5, PROMPTS[i][:5], list(range(5)), [4]))
        rows.append(runner.step(seqs, [7, 8, 9], [5, 5, 5], [0, 1, 2]))
        rows.append(runner.step([seqs[1]], [11], [6], [0]))
        rows.append(runner.step(seqs[::-1], [12, 13, 14], [6, 7, 6], [2, 0]))
        rows.append(runner.step([seqs[0]] * 2 + [seqs[1]], [15, 16, 17], [7, 8, 8], [0, 1, 2]))
        rows.append(runner.step([seqs[2]] * 5, PROMPTS[3][:5], list(range(7, 12)), [0, 4]))
        return torch.cat([torch.as_tensor(r) for r in rows])

    kept = run(ecc.Runner(roomy_pte))
    monkeypatch.setattr(ecc.Runner, "_forward_inputs", _fresh_inputs)
    assert torch.equal(kept, run(ecc.Runner(roomy_pte)))


# --------------------------------------------------------------------------- bad input


def test_step_bad_inputs(runner, baseline):
    cache = runner.cache
    s = cache.seq_new()
    bad_calls = [
        (([s, s], [5, 6, 7], [0, 1, 2], [2]), "one entry per token"),
        (([s, s, s], [5, 6, 7], [0, 1], [2]), "one entry per token"),
        (([s] * (STEP + 1), [5] * (STEP + 1), list(range(STEP + 1)), [0]), "1 to 16"),
        (([], [], [], [0]), "1 to 16"),
        (([s, s], [5, 6], [0, 1], [2]), "logits_for"),
        (([s, s], [5, 6], [0, 1], []), "logits_for"),
        (([s, s], [5, 6], [0, 1], [-1]), "logits_for"),
        (([s, s], [5, 6], [0, 1], [0, 1, 1]), "logits_for"),
        (([s, s], [5, 999], [0, 1], [1]), "outside the vocabulary"),
    ]
    for args, match in bad_calls:
        with pytest.raises(InvalidConfigError, match=match):
            runner.step(*args)
        assert cache.seq_len(s) == 0
    still_works(runner, baseline)

    # numpy inputs are fine.
    logits = runner.step(np.array([s, s, s]), np.array([5, 6, 7]), np.arange(3), np.array([1, 2]))
    assert tuple(logits.shape) == (2, 320) and logits.dtype == torch.float32
    assert cache.seq_len(s) == 3

    free = cache.free_cells
    for positions in ([1], [2], [0]):  # rewrite a held position
        with pytest.raises(PositionConflictError,
                           match=rf"token 0 \(sequence {s}\) at position {positions[0]}: not "
                                 rf"after position 2 that the sequence already holds"):
            runner.step([s], [8], positions, [0])
    increase = "positions of a sequence must strictly increase within a step"
    with pytest.raises(PositionConflictError,  # repeat within a step
                       match=rf"token 1 \(sequence {s}\) at position 3: {increase} \(previous 3\)"):
        runner.step([s, s], [8, 9], [3, 3], [1])
    with pytest.raises(PositionConflictError,  # backwards within a step
                       match=rf"token 1 \(sequence {s}\) at position 3: {increase} \(previous 4\)"):
        runner.step([s, s], [8, 9], [4, 3], [1])
    assert cache.seq_len(s) == 3 and cache.free_cells == free
    # A step whose other sequence is fine changes nothing either.
    t = cache.seq_new()
    with pytest.raises(PositionConflictError,
                       match=rf"token 2 \(sequence {s}\) at position 1: not after position 2"):
        runner.step([t, t, s], [8, 9, 10], [0, 1, 1], [2])
    assert cache.seq_len(t) == 0 and cache.seq_len(s) == 3 and cache.free_cells == free
    cache.seq_free(t)
    still_works(runner, baseline)

    with pytest.raises(UnknownSequenceError, match=rf"unknown sequence id {s + 100} \("):
        runner.step([s + 100], [8], [0], [0])
    # The sequence itself continues where it was.
    runner.step([s], [8], [cache.next_pos(s)], [0])
    assert cache.seq_len(s) == 4
    cache.seq_free(s)
    still_works(runner, baseline)


def test_non_integer_tokens_are_refused_not_truncated(runner):
    s = runner.cache.seq_new()
    try:
        with pytest.raises(InvalidConfigError, match="tokens"):
            runner.step([s], [72.9], [0], [0])
        with pytest.raises(InvalidConfigError, match="prompt 0"):
            runner.generate([[1.7, 2.2]], max_new_tokens=2)
        with pytest.raises(InvalidConfigError, match="prompt 0"):
            runner.generate([["3", "4"]], max_new_tokens=2)
        assert runner.cache.seq_len(s) == 0
    finally:
        runner.cache.seq_free(s)


def test_step_messages_are_the_cores(runner):
    """Runner.step's batch checks are the core's (cpp/cellcache/step_batch.h,
    the C++ runner's too): the same message for the same batch."""
    from executorch_cellcache.cache import _core

    s = runner.cache.seq_new()
    try:
        bad = ([s, s], [5, 999], [0, 1], [1])
        outside = r"^tokens: token ids \[999\] are outside the vocabulary \[0, 320\)$"
        with pytest.raises(InvalidConfigError, match=outside) as core:
            _core.check_step_batch(2, bad[1], 2, bad[3], STEP, runner.info.vocab_size)
        with pytest.raises(InvalidConfigError, match=outside) as step:
            runner.step(*bad)
        assert str(step.value) == str(core.value) == \
            "tokens: token ids [999] are outside the vocabulary [0, 320)"
        # Python ints beyond 64 bits are refused by name before they reach the core.
        with pytest.raises(InvalidConfigError, match=r"positions must hold 64-bit integers, "
                                                     r"got 36893488147419103232"):
            runner.step([s], [5], [2**65], [0])
        assert runner.cache.seq_len(s) == 0
    finally:
        runner.cache.seq_free(s)


# --------------------------------------------------------------------------- the runtime's log


def test_the_runtime_log_holds_at_most_one_forward(roomy_pte):
    """The runtime's stderr lines are captured per forward for error messages;
    forwards that succeed must not make that file grow without bound (a server
    runs millions of them)."""
    runner = ecc.Runner(roomy_pte)
    s = runner.cache.seq_new()
    first = int(torch.argmax(prefill(runner, s, PROMPTS[0])))
    sizes = []
    for token in [first] + greedy_steps(runner, s, first, 3):
        runner._log.write(b"x" * 1000 + b"\n")  # what an earlier forward logged
        runner._log.flush()
        runner.step([s], [token], [runner.cache.next_pos(s)], [0])
        sizes.append(os.fstat(runner._log.fileno()).st_size)
    assert max(sizes) < 2000, sizes
