"""Runner.generate end to end (SPEC sections 4 and 6): batched greedy generation
against transformers (teacher-forced), n samples sharing one prefill, chunked
prompts, stop on EOS, admission that waits in a tight cache (equal to solo
runs), seeded sampling independent of the batch, and a generate that raises
leaving the cache as it was.

Programs, prompts and helpers: conftest.py and tests/runner_support.py.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import (
    CELLS, EOS_PROMPT, PROMPTS, SAMPLING, TIGHT_CELLS, WAIT_NEW, WAIT_PROMPTS, oracle_greedy,
    teacher_forced_check,
)

import executorch_cellcache as ecc

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- greedy


def test_batched_greedy_n3_matches_transformers(runner, oracle):
    max_new = 8
    out = runner.generate(PROMPTS, max_new_tokens=max_new, n=3, stop_on_eos=False)
    stats = runner.last_stats
    assert len(out) == len(PROMPTS)
    for prompt, samples in zip(PROMPTS, out):
        assert len(samples) == 3
        assert all(len(s) == max_new for s in samples)
        assert samples[0] == samples[1] == samples[2], "greedy samples of one prompt differ"
        teacher_forced_check(oracle, prompt, samples[0])
    # Each prompt is prefilled once and its 3 samples share its cells: the cells held
    # never exceed the prompts once plus every sample's fed-back tokens, far below
    # three copies of the prompts.
    total_prompt = sum(len(p) for p in PROMPTS)
    shared_bound = total_prompt + len(PROMPTS) * 3 * (max_new - 1)
    assert stats.prefill_tokens == total_prompt
    assert stats.decode_tokens == len(PROMPTS) * 3 * (max_new - 1)
    assert total_prompt <= stats.peak_cells <= shared_bound
    assert stats.peak_cells < 3 * total_prompt
    assert stats.capacity == CELLS
    # Everything was freed at the end.
    assert runner.cache.free_cells == CELLS


def test_lone_prompt_longer_than_a_step(runner, oracle):
    # 40 tokens alone: the first two forwards are prompt chunks that end no prompt.
    [[a, b]] = runner.generate([PROMPTS[3]], max_new_tokens=5, n=2, stop_on_eos=False)
    assert a == b
    teacher_forced_check(oracle, PROMPTS[3], a)
    assert runner.last_stats.steps == 3 + 4  # ceil(40 / 16) prefill + 4 decode forwards


def test_stop_on_eos(runner, oracle_and_paths):
    oracle, eos = oracle_and_paths[0], oracle_and_paths[3]
    full = oracle_greedy(oracle, EOS_PROMPT, 8)
    cut = full.index(eos)
    [[stopped]] = runner.generate([EOS_PROMPT], max_new_tokens=8)
    assert stopped == full[:cut + 1], "generation must stop at EOS, EOS included"
    [[kept_going]] = runner.generate([EOS_PROMPT], max_new_tokens=8, stop_on_eos=False)
    assert kept_going == full


# --------------------------------------------------------------------------- waiting


def test_tight_cache_waits_and_matches_solo_runs(tight_pte):
    runner = ecc.Runner(tight_pte)
    assert runner.cache.capacity == TIGHT_CELLS
    events = []   # (prompt index, token) in emission order
    used = []     # cells held after each step

    real_step = runner.step

    def step(*args):  # observes the cells held right after each forward
        logits = real_step(*args)
        used.append(TIGHT_CELLS - runner.cache.free_cells)
        return logits

    runner.step = step
    out = runner.generate(WAIT_PROMPTS, max_new_tokens=WAIT_NEW, stop_on_eos=False,
                          on_token=lambda p, s, t: events.append(p))
    assert [len(s) for s in out] == [1] * 6
    assert all(len(s[0]) == WAIT_NEW for s in out)

    for prompt, samples in zip(WAIT_PROMPTS, out):
        solo = ecc.Runner(tight_pte).generate([prompt], max_new_tokens=WAIT_NEW,
                                              stop_on_eos=False)
        assert samples == solo[0]

    assert max(used) <= TIGHT_CELLS
    assert runner.last_stats.peak_cells == max(used) <= TIGHT_CELLS
    # Concurrency from the token stream: a request is live from its first to its last token.
    first = {p: events.index(p) for p in range(6)}
    last = {p: len(events) - 1 - events[::-1].index(p) for p in range(6)}
    peak_live = max(sum(first[p] <= i <= last[p] for p in range(6)) for i in range(len(events)))
    assert peak_live == 2, f"expected two requests at a time, saw {peak_live}"
    # Requests actually waited: the third starts only after one of the first two ended.
    assert first[2] > min(last[0], last[1])
    # Only the prefix cache holds cells afterwards (finished requests), and clear() drops it.
    assert runner.cache.free_cells == TIGHT_CELLS - runner.prefix_cache.reclaimable_cells()
    assert runner.cache.n_sequences == len(runner.prefix_cache) > 0
    runner.clear()
    assert runner.cache.free_cells == TIGHT_CELLS and runner.cache.n_sequences == 0


def test_admission_counts_ids_held_outside_the_scheduler(runner):
    held = [runner.cache.seq_new() for _ in range(250)]
    try:
        out = runner.generate(PROMPTS[:2], max_new_tokens=3, n=4, stop_on_eos=False)
        assert [len(samples) for samples in out] == [4, 4]
        assert runner.cache.n_sequences == 250
    finally:
        for s in held:
            runner.cache.seq_free(s)


# --------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_across_batches(runner):
    p, q, r = PROMPTS[1], PROMPTS[3], PROMPTS[0]
    kw = {"max_new_tokens": 12, "n": 3, "stop_on_eos": False, **SAMPLING}
    alone = runner.generate([p], seed=7, **kw)
    again = runner.generate([p], seed=7, **kw)
    assert alone == again
    # Other prompts batched with it, before or after it: same samples.
    batched = runner.generate([p, q, r], seed=7, **kw)
    assert batched[0] == alone[0]
    assert runner.generate([q, p], seed=7, **kw)[1] == alone[0]
    assert runner.generate([r, q, p], seed=7, **kw)[2] == alone[0]
    # A sample's generator is (seed, sample index): the same prompt twice in one
    # batch samples the same tokens twice.
    assert runner.generate([p, p], seed=7, **kw) == [alone[0], alone[0]]
    # The samples are not all equal, and another seed gives other samples.
    assert len({tuple(s) for s in alone[0]}) > 1
    other = runner.generate([p], seed=8, **kw)
    assert other != alone
    # Sampling did not disturb greedy decoding.
    greedy = runner.generate([p], max_new_tokens=12, stop_on_eos=False)
    assert runner.generate([p], max_new_tokens=12, stop_on_eos=False, seed=99) == greedy


def test_tiny_temperature_samples_the_argmax(runner):
    greedy = runner.generate(PROMPTS[:1], max_new_tokens=6, stop_on_eos=False)
    tiny = runner.generate(PROMPTS[:1], max_new_tokens=6, temperature=1e-320, seed=3,
                           stop_on_eos=False)
    assert tiny == greedy


# --------------------------------------------------------------------------- failures leave the cache usable


def test_generate_that_raises_frees_its_sequences(runner):
    free, live = runner.cache.free_cells, runner.cache.n_sequences
    expected = runner.generate(PROMPTS[:2], max_new_tokens=4, stop_on_eos=False)

    def stop_after_prefill(prompt_index, sample_index, token):
        raise KeyboardInterrupt("stopped after the prefill")

    for _ in range(3):
        with pytest.raises(KeyboardInterrupt, match="stopped after the prefill"):
            runner.generate(PROMPTS[:2], max_new_tokens=4, n=3, on_token=stop_after_prefill)
        assert runner.cache.free_cells == free
        assert runner.cache.n_sequences == live
    assert runner.generate(PROMPTS[:2], max_new_tokens=4, stop_on_eos=False) == expected
