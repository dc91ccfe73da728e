"""Runner end to end (SPEC sections 4 and 6): batched greedy generation against
transformers, n samples sharing one prefill, admission that waits, rollback,
seeded sampling, and bad input.

Two programs are exported once per module from a seeded tiny Llama
(tests/model_configs.py): a roomy one (256 cells) and a tight one (48 cells)
that holds only two of the waiting test's requests at a time. Both use
max_tokens_per_step=16, so longer prompts are prefilled in chunks.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from model_configs import make_model

import executorch_cellcache as ecc
from executorch_cellcache.runtime.runner import GenerateStats
from executorch_cellcache import (
    CapacityError,
    InvalidConfigError,
    PositionConflictError,
    UnknownSequenceError,
)

pytestmark = pytest.mark.slow

STEP = 16          # max_tokens_per_step of both programs
CELLS = 256        # the roomy program
TIGHT_CELLS = 48   # the tight program: two waiting-test requests fit, never three
TIE = 1e-3         # top-2 logits closer than this are a tie for the greedy check

# Lengths 5, 13, 23, 40: two are longer than STEP, one spans three chunks.
PROMPTS = [
    [(7 * i + 3) % 300 + 10 for i in range(5)],
    [(11 * i + 5) % 300 + 10 for i in range(13)],
    [(13 * i + 1) % 300 + 10 for i in range(23)],
    [(17 * i + 9) % 300 + 10 for i in range(40)],
]
# The EOS test's prompt; the program's EOS id is a token greedy decoding of it
# reaches after a few tokens (chosen by the oracle before export).
EOS_PROMPT = [40, 41, 42, 43, 44, 45]


def _oracle_greedy(model, prompt, k):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(k):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def oracle_and_paths(tmp_path_factory):
    """(eager transformers oracle, roomy .pte, tight .pte, eos id)."""
    model = make_model("llama")
    model.set_attn_implementation("eager")
    greedy = _oracle_greedy(model, EOS_PROMPT, 8)
    # EOS := the first token, from the 3rd on, that greedy decoding has not produced before.
    idx = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    eos = greedy[idx]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    out = tmp_path_factory.mktemp("runner")
    roomy, tight = out / "roomy.pte", out / "tight.pte"
    ecc.export(model, roomy, n_cells=CELLS, max_tokens_per_step=STEP)
    ecc.export(model, tight, n_cells=TIGHT_CELLS, max_tokens_per_step=STEP)
    return model, roomy, tight, eos


@pytest.fixture(scope="module")
def oracle(oracle_and_paths):
    return oracle_and_paths[0]


@pytest.fixture(scope="module")
def roomy_pte(oracle_and_paths):
    return oracle_and_paths[1]


@pytest.fixture(scope="module")
def tight_pte(oracle_and_paths):
    return oracle_and_paths[2]


@pytest.fixture(scope="module")
def runner(roomy_pte):
    # These tests count prefill tokens, steps and free cells after each call;
    # the prefix cache (on by default) has its own tests below.
    return ecc.Runner(roomy_pte, prefix_cache=False)


def _teacher_forced_check(oracle, prompt, generated):
    """Each generated token is transformers' argmax given the tokens before it
    (or one of the tokens tied with the maximum within TIE)."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = oracle(ids).logits[0].float()
    for j, tok in enumerate(generated):
        row = logits[len(prompt) + j - 1]
        best = float(row.max())
        tied = set(torch.nonzero(row >= best - TIE).flatten().tolist())
        assert tok in tied, (
            f"generated token {j} is {tok} (logit {float(row[tok]):.5f}) but transformers' "
            f"argmax is {int(row.argmax())} (logit {best:.5f}); prompt len {len(prompt)}, "
            f"generated {generated}")


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
        _teacher_forced_check(oracle, prompt, samples[0])
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
    _teacher_forced_check(oracle, PROMPTS[3], a)
    assert runner.last_stats.steps == 3 + 4  # ceil(40 / 16) prefill + 4 decode forwards


def test_stop_on_eos(runner, oracle_and_paths):
    oracle, eos = oracle_and_paths[0], oracle_and_paths[3]
    full = _oracle_greedy(oracle, EOS_PROMPT, 8)
    cut = full.index(eos)
    [[stopped]] = runner.generate([EOS_PROMPT], max_new_tokens=8)
    assert stopped == full[:cut + 1], "generation must stop at EOS, EOS included"
    [[kept_going]] = runner.generate([EOS_PROMPT], max_new_tokens=8, stop_on_eos=False)
    assert kept_going == full


# --------------------------------------------------------------------------- waiting

# Six requests; worst-case cells each = prompt + max_new - 1 = 21, 18, 23, 19, 22, 20.
# Any two fit in TIGHT_CELLS (23 + 22 = 45 <= 48), no three do (18 + 19 + 20 = 57).
WAIT_LENS = [12, 9, 14, 10, 13, 11]
WAIT_PROMPTS = [[(5 * i + 31 * r) % 300 + 10 for i in range(n)] for r, n in enumerate(WAIT_LENS)]
WAIT_NEW = 10


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


# --------------------------------------------------------------------------- prefix cache


def test_prefix_cache_bound_out_of_range_is_refused(roomy_pte):
    for bad in (CELLS + 1, -1, 2.5):
        with pytest.raises(InvalidConfigError, match=rf"prefix_cache_cells must be an integer "
                                                     rf"in \[0, {CELLS}\].*got {bad}"):
            ecc.Runner(roomy_pte, prefix_cache_cells=bad)
    with pytest.raises(InvalidConfigError, match="prefix_cache=False turns off"):
        ecc.Runner(roomy_pte, prefix_cache=False, prefix_cache_cells=8)
    with pytest.raises(InvalidConfigError, match="prefix_cache must be True or False"):
        ecc.Runner(roomy_pte, prefix_cache="no")


def test_prefix_cache_bound_smaller_than_a_request_keeps_its_first_cells(roomy_pte, runner):
    bounded = ecc.Runner(roomy_pte, prefix_cache_cells=10)
    prompt = PROMPTS[3]  # 40 tokens
    kw = {"max_new_tokens": 5, "n": 2, "stop_on_eos": False}
    assert bounded.generate([prompt], **kw) == runner.generate([prompt], **kw)
    assert bounded.last_stats.prefix_cache_cells == 10
    assert bounded.cache.free_cells == CELLS - 10
    longer = prompt + [11, 12]
    assert bounded.generate([longer], **kw) == runner.generate([longer], **kw)
    assert bounded.last_stats.cached_tokens == [10]
    assert bounded.cache.free_cells == CELLS - 10


def test_cached_prefix_of_a_request_that_cannot_fit_is_refused_and_kept(tight_pte):
    r = ecc.Runner(tight_pte)
    prompt = WAIT_PROMPTS[0]
    first = r.generate([prompt], max_new_tokens=4, stop_on_eos=False)
    held, entries = r.cache.free_cells, r.prefix_cache.seqs()
    # The prompt's cells are cached, but prompt + fed-back tokens exceed the whole cache.
    with pytest.raises(CapacityError, match=rf"needs up to {len(prompt) + 2 + 39} cells"):
        r.generate([prompt + [5, 6]], max_new_tokens=40)
    assert r.cache.free_cells == held and r.prefix_cache.seqs() == entries
    r.cache.check_invariants()
    again = r.generate([prompt], max_new_tokens=4, stop_on_eos=False)
    assert again == first and r.last_stats.cached_tokens == [len(prompt) - 1]


def test_eviction_waits_for_cells_a_running_request_shares(tight_pte):
    """B needs cells held by the cached prefix that running A cloned: B waits
    for A (eviction never frees A's cells), then evicts and runs; both give
    the tokens of runs without a prefix cache."""
    r = ecc.Runner(tight_pte)
    x = [(3 * i + 7) % 300 + 10 for i in range(30)]
    r.generate([x], max_new_tokens=1)
    a, b = x + [5, 6], WAIT_PROMPTS[2]  # worst cases 2 + 3 and 14 + 3 cells
    events = []
    out = r.generate([a, b], max_new_tokens=4, stop_on_eos=False,
                     on_token=lambda p, s, t: events.append(p))
    assert r.last_stats.cached_tokens == [30, 0]
    assert events == [0, 0, 0, 0, 1, 1, 1, 1]  # B started after A ended
    cold = ecc.Runner(tight_pte, prefix_cache=False)
    assert out == [cold.generate([a], 4, stop_on_eos=False)[0],
                   cold.generate([b], 4, stop_on_eos=False)[0]]
    assert r.prefix_cache.stats.evictions >= 1
    r.cache.check_invariants()


def test_a_cached_prefix_whose_entry_holds_a_long_tail_is_still_served(tight_pte):
    """The entry holding the prompt also holds 29 generated tokens the new
    request does not share; only evicting that entry makes room. The prefix is
    cloned first, so eviction frees just the tail and the request still
    reuses the prompt."""
    r = ecc.Runner(tight_pte)
    prompt = WAIT_PROMPTS[0]                       # 12 tokens
    r.generate([prompt], max_new_tokens=30, stop_on_eos=False)
    assert r.cache.free_cells == TIGHT_CELLS - 41  # 12 + 29 fed back
    longer = prompt + [5]                          # needs 1 + 29 more cells
    out = r.generate([longer], max_new_tokens=30, stop_on_eos=False)
    assert r.last_stats.cached_tokens == [12]
    assert out == ecc.Runner(tight_pte, prefix_cache=False).generate(
        [longer], max_new_tokens=30, stop_on_eos=False)
    r.cache.check_invariants()


def test_seeded_samples_are_the_same_from_a_cached_prefix(roomy_pte, runner):
    cached = ecc.Runner(roomy_pte)
    kw = {"max_new_tokens": 8, "n": 3, "stop_on_eos": False, "seed": 5, **SAMPLING}
    cached.generate([PROMPTS[3]], **kw)
    longer = PROMPTS[3] + [17, 18, 19]
    assert cached.generate([longer], **kw) == runner.generate([longer], **kw)
    assert cached.last_stats.cached_tokens == [40]


def test_cache_clear_also_empties_the_prefix_cache(roomy_pte, runner):
    r = ecc.Runner(roomy_pte)
    kw = {"max_new_tokens": 4, "stop_on_eos": False}
    expected = runner.generate(PROMPTS[:2], **kw)
    assert r.generate(PROMPTS[:2], **kw) == expected
    assert len(r.prefix_cache) == 2
    r.cache.clear()  # behind the runner's back: cached ids are gone
    assert len(r.prefix_cache) == 0 and r.prefix_cache.reclaimable_cells() == 0
    assert r.generate(PROMPTS[:2], **kw) == expected
    assert r.last_stats.cached_tokens == [0, 0]
    r.clear()
    assert r.cache.n_sequences == 0 and r.cache.free_cells == CELLS


# --------------------------------------------------------------------------- rollback


def _prefill(runner, seq, tokens, start=0):
    """Feeds tokens at positions start.. in chunks; returns the last token's logits."""
    logits = None
    for i in range(0, len(tokens), STEP):
        chunk = tokens[i:i + STEP]
        pos = list(range(start + i, start + i + len(chunk)))
        logits = runner.step([seq] * len(chunk), chunk, pos, [len(chunk) - 1])
    return logits[0]


def _greedy_steps(runner, seq, token, k):
    """Feeds ``token`` at next_pos, then k-1 greedy tokens; returns the k greedy tokens."""
    out = []
    for _ in range(k):
        logits = runner.step([seq], [token], [runner.cache.next_pos(seq)], [0])
        token = int(torch.argmax(logits[0]))
        out.append(token)
    return out


def test_rollback_then_continue_equals_fresh_run(roomy_pte):
    runner = ecc.Runner(roomy_pte)
    cache = runner.cache
    prompt = PROMPTS[2]  # 23 tokens: two chunks
    s = cache.seq_new()
    first = int(torch.argmax(_prefill(runner, s, prompt)))
    gen = [first] + _greedy_steps(runner, s, first, 9)  # g0..g9; g0..g8 are in the cache
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
    cont = _greedy_steps(runner, s, correction, 6)

    fresh = ecc.Runner(roomy_pte)
    [[expected]] = fresh.generate([prompt + kept + [correction]], max_new_tokens=6,
                                  stop_on_eos=False)
    assert cont == expected

    # Rolling back and re-feeding the same token reproduces the original greedy path.
    runner2 = ecc.Runner(roomy_pte)
    s2 = runner2.cache.seq_new()
    _prefill(runner2, s2, prompt)
    _greedy_steps(runner2, s2, first, 9)
    runner2.rollback(s2, k)
    assert _greedy_steps(runner2, s2, gen[9 - k], k) == gen[10 - k:10]

    runner.rollback(s, 0)  # a no-op
    assert cache.seq_len(s) == len(prompt) + len(kept) + 6
    with pytest.raises(InvalidConfigError, match="roll back"):
        runner.rollback(s, cache.seq_len(s) + 1)
    cache.seq_free(s)
    assert cache.free_cells == CELLS


# --------------------------------------------------------------------------- sampling

SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


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


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def baseline(runner):
    kw = {"max_new_tokens": 6, "n": 2, "stop_on_eos": False}
    return kw, runner.generate(PROMPTS[:2], **kw)


def _still_works(runner, baseline):
    kw, expected = baseline
    runner.cache.check_invariants()
    free = runner.cache.free_cells
    assert runner.generate(PROMPTS[:2], **kw) == expected
    assert runner.cache.free_cells == free


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        ecc.Runner(tmp_path / "missing.pte")
    text = tmp_path / "notes.pte"
    text.write_text("not an ExecuTorch program\n" * 10)
    with pytest.raises(InvalidConfigError, match="not a loadable ExecuTorch program"):
        ecc.Runner(text)
    with pytest.raises(InvalidConfigError, match="folder"):
        ecc.Runner(tmp_path)
    # Non-UTF-8 bytes where the program identifier goes once aborted the process
    # (the runtime logs the identifier raw).
    garbage = tmp_path / "garbage.pte"
    garbage.write_bytes(b"\0" * 4 + b"\xff" * 4 + b"\0" * 56)
    with pytest.raises(InvalidConfigError, match="not a loadable ExecuTorch program"):
        ecc.Runner(garbage)

    from executorch.exir import to_edge

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    program = to_edge(torch.export.export(Plain(), (torch.ones(3),))).to_executorch()
    plain = tmp_path / "plain.pte"
    plain.write_bytes(program.buffer)
    with pytest.raises(InvalidConfigError, match="no cell-cache metadata"):
        ecc.Runner(plain)


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([[]], {}, "prompt 0 is empty"),
    ([[5, 6], []], {}, "prompt 1 is empty"),
    ([[5, 6]], {"n": 0}, "n must be"),
    ([[5, 6]], {"n": -1}, "n must be"),
    ([[5, 6]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[5, 320]], {}, r"outside the vocabulary \[0, 320\)"),
    ([[-1, 6]], {}, "outside the vocabulary"),
    ([[5, 6]], {"temperature": -0.5}, "temperature"),
    ([[5, 6]], {"temperature": 0.8, "top_p": 0.0}, "top_p"),
    ([[5, 6]], {"temperature": 0.8, "top_k": 0}, "top_k"),
], ids=["empty", "empty-second", "n0", "n-neg", "max-new-0", "vocab-high", "vocab-neg",
        "temperature", "top-p", "top-k"])
def test_generate_bad_arguments(runner, baseline, prompts, kwargs, match):
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidConfigError, match=match):
        runner.generate(prompts, **args)
    _still_works(runner, baseline)


def test_request_that_can_never_fit(runner, baseline):
    # 5 prompt tokens + 1 x 252 generated = 257 > 256 cells.
    with pytest.raises(CapacityError, match=r"257 cells.*256"):
        runner.generate([PROMPTS[0]], max_new_tokens=253)
    # n multiplies the generated part; prompt 0 fits (5 + 3 x 82 = 251), prompt 1
    # (13 + 3 x 82 = 259) never can: nothing runs.
    with pytest.raises(CapacityError, match=r"prompt 1 needs up to 259 cells.*256"):
        runner.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=83, n=3)
    _still_works(runner, baseline)
    # The largest request that fits runs.
    [[out]] = runner.generate([PROMPTS[0]], max_new_tokens=252, stop_on_eos=False)
    assert len(out) == 252
    assert runner.last_stats.peak_cells == 256
    _still_works(runner, baseline)


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
    _still_works(runner, baseline)

    # numpy inputs are fine.
    logits = runner.step(np.array([s, s, s]), np.array([5, 6, 7]), np.arange(3), np.array([1, 2]))
    assert tuple(logits.shape) == (2, 320) and logits.dtype == torch.float32
    assert cache.seq_len(s) == 3

    free = cache.free_cells
    for positions in ([1], [2], [0]):  # rewrite a held position
        with pytest.raises(PositionConflictError):
            runner.step([s], [8], positions, [0])
    with pytest.raises(PositionConflictError):  # repeat within a step
        runner.step([s, s], [8, 9], [3, 3], [1])
    with pytest.raises(PositionConflictError):  # backwards within a step
        runner.step([s, s], [8, 9], [4, 3], [1])
    assert cache.seq_len(s) == 3 and cache.free_cells == free
    # A step whose other sequence is fine changes nothing either.
    t = cache.seq_new()
    with pytest.raises(PositionConflictError):
        runner.step([t, t, s], [8, 9, 10], [0, 1, 1], [2])
    assert cache.seq_len(t) == 0 and cache.seq_len(s) == 3 and cache.free_cells == free
    cache.seq_free(t)
    _still_works(runner, baseline)

    with pytest.raises(UnknownSequenceError):
        runner.step([s + 100], [8], [0], [0])
    # The sequence itself continues where it was.
    runner.step([s], [8], [cache.next_pos(s)], [0])
    assert cache.seq_len(s) == 4
    cache.seq_free(s)
    _still_works(runner, baseline)


# --------------------------------------------------------------------------- failures leave the cache usable


def test_generate_that_raises_frees_its_sequences(runner):
    free, live = runner.cache.free_cells, runner.cache.n_sequences
    expected = runner.generate(PROMPTS[:2], max_new_tokens=4, stop_on_eos=False)

    def stop_after_prefill(prompt_index, sample_index, token):
        raise KeyboardInterrupt

    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            runner.generate(PROMPTS[:2], max_new_tokens=4, n=3, on_token=stop_after_prefill)
        assert runner.cache.free_cells == free
        assert runner.cache.n_sequences == live
    assert runner.generate(PROMPTS[:2], max_new_tokens=4, stop_on_eos=False) == expected


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=1.0, seed=-1), "seed"), (dict(temperature=1.0, seed=1.5), "seed"),
    (dict(temperature=1.0, seed="a"), "seed"), (dict(temperature=1.0, top_k=2.5), "top_k"),
    (dict(temperature="1"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(temperature=1.0, top_p="0.5"), "top_p"),
])
def test_bad_sampling_parameters_are_refused_before_any_forward(runner, kwargs, name):
    free = runner.cache.free_cells
    with pytest.raises(InvalidConfigError, match=name):
        runner.generate(PROMPTS[:1], max_new_tokens=4, **kwargs)
    assert runner.cache.free_cells == free and runner.cache.n_sequences == 0


def test_tiny_temperature_samples_the_argmax(runner):
    greedy = runner.generate(PROMPTS[:1], max_new_tokens=6, stop_on_eos=False)
    tiny = runner.generate(PROMPTS[:1], max_new_tokens=6, temperature=1e-320, seed=3,
                           stop_on_eos=False)
    assert tiny == greedy


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


def test_admission_counts_ids_held_outside_the_scheduler(runner):
    held = [runner.cache.seq_new() for _ in range(250)]
    try:
        out = runner.generate(PROMPTS[:2], max_new_tokens=3, n=4, stop_on_eos=False)
        assert [len(samples) for samples in out] == [4, 4]
        assert runner.cache.n_sequences == 250
    finally:
        for s in held:
            runner.cache.seq_free(s)


# --------------------------------------------------------------------------- the scheduler the server drives


def _drive(runner, sched, arrivals):
    """Steps ``sched`` on ``runner`` until idle; arrivals: {step number:
    [requests]} submitted just before that step. Returns the token events."""
    events = []
    sched.on_token = events.append
    stats = GenerateStats()
    step = 0
    while not sched.idle or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            sched.submit(req)
        if not sched.idle:
            assert runner.advance(sched, stats) is not None
        step += 1
    return events


def _scheduler(runner):
    from executorch_cellcache.runtime.scheduler import Scheduler

    return Scheduler(runner.cache, runner.info.max_tokens_per_step, runner.info.eos_ids)


def _request(prompt, **params):
    from executorch_cellcache.runtime.sampling import SamplingParams
    from executorch_cellcache.runtime.scheduler import Request

    return Request(list(prompt), SamplingParams(**params))


def test_requests_with_their_own_parameters_joining_late_equal_each_alone(runner):
    specs = [
        (PROMPTS[0], dict(max_new_tokens=5, stop_on_eos=False)),
        (PROMPTS[3], dict(max_new_tokens=7, n=2, temperature=0.9, top_p=0.95, seed=3,
                          stop_on_eos=False)),
        (PROMPTS[1], dict(max_new_tokens=9, n=3, temperature=0.7, top_k=20, seed=11,
                          stop_on_eos=False)),
        (PROMPTS[2], dict(max_new_tokens=4, stop_on_eos=False)),
    ]
    reqs = [_request(p, **kw) for p, kw in specs]
    # Two arrive at once, one while they decode, one after the others' prefills.
    _drive(runner, _scheduler(runner), {0: reqs[:2], 3: [reqs[2]], 6: [reqs[3]]})
    for req, (prompt, kw) in zip(reqs, specs):
        kw = dict(kw)
        alone = runner.generate([prompt], **kw)[0]
        assert [s.tokens for s in req.samples] == alone
        assert all(s.finish_reason == "length" for s in req.samples)
    assert runner.cache.free_cells == CELLS and runner.cache.n_sequences == 0


def test_cancel_frees_a_request_in_every_state(tight_pte):
    runner = ecc.Runner(tight_pte)
    sched = _scheduler(runner)
    stats = GenerateStats()
    kw = dict(max_new_tokens=WAIT_NEW, stop_on_eos=False)
    decoding, prefilling, waiting = (_request(p, **kw) for p in WAIT_PROMPTS[:3])
    long_prompt = _request(PROMPTS[3][:30], max_new_tokens=3, stop_on_eos=False)
    sched.submit(decoding)
    runner.advance(sched, stats)               # its prompt (12 tokens) in one step
    runner.advance(sched, stats)
    assert len(decoding.samples[0].tokens) == 2
    sched.submit(long_prompt)                  # 30 + 2 cells: waits (21 + 32 > 48)
    sched.submit(waiting)
    sched.cancel(waiting)                      # never admitted
    assert waiting.cancelled and waiting not in sched.waiting
    sched.cancel(decoding)                     # mid-decode: frees its cells now
    assert decoding.samples[0].finish_reason == "cancelled"
    assert runner.cache.free_cells == TIGHT_CELLS
    runner.advance(sched, stats)               # the long prompt's first chunk
    assert long_prompt.prefilled == STEP and not long_prompt.samples
    sched.cancel(long_prompt)                  # mid-prefill
    assert runner.cache.free_cells == TIGHT_CELLS and runner.cache.n_sequences == 0
    assert sched.idle
    assert sched.finished == [waiting, decoding, long_prompt]
    sched.cancel(decoding)                     # twice: nothing happens
    assert sched.finished == [waiting, decoding, long_prompt]
    # The cache serves the next request as if nothing happened.
    fresh = _request(WAIT_PROMPTS[0], **kw)
    _drive(runner, sched, {0: [fresh]})
    solo = ecc.Runner(tight_pte).generate([WAIT_PROMPTS[0]], **kw)[0]
    assert [s.tokens for s in fresh.samples] == solo


def test_cancel_from_a_token_callback_stops_at_once(runner):
    other = _request(PROMPTS[1], max_new_tokens=6, stop_on_eos=False)
    victim = _request(PROMPTS[0], max_new_tokens=6, n=3, stop_on_eos=False)
    sched = _scheduler(runner)
    seen = []

    def on_token(ev):
        seen.append((ev.request, ev.sample_index))
        if ev.request is victim and len(victim.samples[0].tokens) == 2:
            sched.cancel(victim)

    sched.submit(victim)
    sched.submit(other)
    stats = GenerateStats()
    sched.on_token = on_token
    while not sched.idle:
        runner.advance(sched, stats)
    # Sample 0's second token cancelled the request: samples 1 and 2 got one token.
    assert [len(s.tokens) for s in victim.samples] == [2, 1, 1]
    assert all(s.finish_reason == "cancelled" for s in victim.samples)
    assert [s.tokens for s in other.samples] == runner.generate(
        [PROMPTS[1]], max_new_tokens=6, stop_on_eos=False)[0]
    assert runner.cache.free_cells == CELLS and runner.cache.n_sequences == 0


def test_finish_sample_frees_only_that_sample(runner):
    req = _request(PROMPTS[2], max_new_tokens=8, n=3, stop_on_eos=False)
    sched = _scheduler(runner)

    def on_token(ev):
        if ev.sample_index == 1 and len(req.samples[1].tokens) == 3:
            sched.finish_sample(req, 1)

    sched.submit(req)
    sched.on_token = on_token
    stats = GenerateStats()
    while not sched.idle:
        runner.advance(sched, stats)
    full = runner.generate([PROMPTS[2]], max_new_tokens=8, stop_on_eos=False)[0][0]
    assert [s.tokens for s in req.samples] == [full, full[:3], full]
    assert [s.finish_reason for s in req.samples] == ["length", "stop", "length"]
    assert runner.cache.free_cells == CELLS
    with pytest.raises(InvalidConfigError, match="no sample 3"):
        sched.finish_sample(req, 3)


def test_stop_token_finish_reason(runner, oracle_and_paths):
    eos = oracle_and_paths[3]
    req = _request(EOS_PROMPT, max_new_tokens=8)
    events = _drive(runner, _scheduler(runner), {0: [req]})
    [sample] = req.samples
    assert sample.tokens[-1] == eos and sample.finish_reason == "stop"
    assert [e.stop_token for e in events] == [False] * (len(sample.tokens) - 1) + [True]
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])


def test_cancelled_and_stopped_requests_leave_prefixes_that_serve_later_ones(roomy_pte, runner):
    """With the prefix cache, a request cancelled mid-prefill leaves the prompt
    tokens it placed, and a sample ended by finish_sample leaves its prompt and
    fed-back tokens; later requests reuse exactly those and match runs without
    a prefix cache."""
    from executorch_cellcache.runtime.scheduler import Scheduler

    cached = ecc.Runner(roomy_pte)
    sched = Scheduler(cached.cache, cached.info.max_tokens_per_step, cached.info.eos_ids,
                      prefix_cache=cached.prefix_cache)
    prefilling = _request(PROMPTS[3], max_new_tokens=4, stop_on_eos=False)  # 40 tokens
    stopped = _request(PROMPTS[2], max_new_tokens=8, stop_on_eos=False)
    stats = GenerateStats()
    sched.submit(prefilling)
    cached.advance(sched, stats)                  # one 16-token chunk placed
    sched.cancel(prefilling)
    sched.submit(stopped)

    def stop_at_three(ev):
        if len(ev.request.samples[0].tokens) == 3:
            sched.finish_sample(ev.request, 0)
    sched.on_token = stop_at_three
    while not sched.idle:
        cached.advance(sched, stats)
    assert len(stopped.samples[0].tokens) == 3
    kw = {"max_new_tokens": 5, "stop_on_eos": False}
    later = [PROMPTS[3] + [21], PROMPTS[2] + stopped.samples[0].tokens + [22]]
    assert cached.generate(later, **kw) == runner.generate(later, **kw)
    assert cached.last_stats.cached_tokens == [STEP, len(PROMPTS[2]) + 2]


def test_cancel_from_a_token_callback_leaves_what_each_sample_placed(roomy_pte, runner):
    """Sample 0's second token cancels its request while samples 1 and 2 have
    their first token placed by the same step but not yet answered: each
    sequence is cached with exactly the tokens it holds."""
    from executorch_cellcache.runtime.scheduler import Scheduler

    cached = ecc.Runner(roomy_pte)
    sched = Scheduler(cached.cache, cached.info.max_tokens_per_step, cached.info.eos_ids,
                      prefix_cache=cached.prefix_cache)
    victim = _request(PROMPTS[0], max_new_tokens=6, n=3, stop_on_eos=False)

    def on_token(ev):
        if len(victim.samples[0].tokens) == 2:
            sched.cancel(victim)
    sched.on_token = on_token
    sched.submit(victim)
    stats = GenerateStats()
    while not sched.idle:
        cached.advance(sched, stats)
    assert [len(s.tokens) for s in victim.samples] == [2, 1, 1]
    assert len(cached.prefix_cache) == 1
    later = [PROMPTS[0] + victim.samples[0].tokens + [23]]
    kw = {"max_new_tokens": 4, "stop_on_eos": False}
    assert cached.generate(later, **kw) == runner.generate(later, **kw)
    assert cached.last_stats.cached_tokens == [len(PROMPTS[0]) + 1]


def test_logprobs_match_transformers_log_softmax(runner, oracle):
    k = 4
    prompt = PROMPTS[1]
    req = _request(prompt, max_new_tokens=5, logprobs=k, stop_on_eos=False)
    plain = _request(prompt, max_new_tokens=5, stop_on_eos=False)
    events = _drive(runner, _scheduler(runner), {0: [req, plain]})
    mine = [e for e in events if e.request is req]
    assert all(e.logprobs is None for e in events if e.request is plain)
    tokens = req.samples[0].tokens
    with torch.no_grad():
        logits = oracle(torch.tensor([prompt + tokens])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)
    for j, e in enumerate(mine):
        row = expected[len(prompt) + j - 1]
        assert e.logprobs.logprob == pytest.approx(float(row[e.token]), abs=1e-4)
        assert len(e.logprobs.top) == k
        values = [lp for _, lp in e.logprobs.top]
        assert values == sorted(values, reverse=True)
        for tok, lp in e.logprobs.top:
            assert lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert values[-1] >= float(torch.topk(row, k).values[-1]) - 1e-4
        assert e.logprobs.top[0][0] == e.token  # greedy picks the most likely


def test_requests_with_bad_parameters_are_refused_at_submit(runner):
    sched = _scheduler(runner)
    for params, match in [(dict(n=0), "n must be"), (dict(logprobs=21), "logprobs"),
                          (dict(max_new_tokens=0), "max_new_tokens"),
                          (dict(stop_on_eos=1), "stop_on_eos")]:
        with pytest.raises(InvalidConfigError, match=match):
            sched.submit(_request(PROMPTS[0], **params))
    with pytest.raises(InvalidConfigError, match="empty"):
        sched.submit(_request([], max_new_tokens=2))
    with pytest.raises(CapacityError, match="257 cells"):
        sched.submit(_request(PROMPTS[0], max_new_tokens=253))
    assert sched.idle and runner.cache.free_cells == CELLS


def test_the_runtime_log_holds_at_most_one_forward(roomy_pte):
    """The runtime's stderr lines are captured per forward for error messages;
    forwards that succeed must not make that file grow without bound (a server
    runs millions of them)."""
    runner = ecc.Runner(roomy_pte)
    s = runner.cache.seq_new()
    first = int(torch.argmax(_prefill(runner, s, PROMPTS[0])))
    sizes = []
    for token in [first] + _greedy_steps(runner, s, first, 3):
        runner._log.write(b"x" * 1000 + b"\n")  # what an earlier forward logged
        runner._log.flush()
        runner.step([s], [token], [runner.cache.next_pos(s)], [0])
        sizes.append(os.fstat(runner._log.fileno()).st_size)
    assert max(sizes) < 2000, sizes
