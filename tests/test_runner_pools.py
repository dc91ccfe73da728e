"""The Python runtime on POOLED programs (issue #25 phase 2): Runner.generate,
the scheduler's per-pool admission, chunked prefill through a windowed pool,
forks, prompt-lookup speculation, the prefix cache and the server's engine,
on tiny Mistral (every layer slides) and Gemma3 (sliding, full, sliding,
full) programs with a cell pool per window policy.

Oracles: transformers eager in fp32 on each sample's whole token list (every
logits row a forward returned, teacher-forced, within 1e-4; greedy tokens
equal to transformers' greedy continuation), plain decoding for speculation,
the prefix-cache-off runner for cached runs, cell_pool.h's reclaim rule
(restated from ``cache.reclaimed``) for which prefixes the cache may serve,
and the cache's own per-step placements for reclaim and reuse.

The programs are conftest.py's ``pooled_pte`` (exported once per run, shared
with tests/test_export_pools.py): a windowed pool of POOL_WINDOW_CELLS cells,
fewer than 8 sequences' worst cases, so admission runs at most
POOL_WINDOW_CELLS // PER_SEQ requests at once and later ones take the cells
earlier ones gave up. A test that needs an empty cache loads a new Runner.
"""

import asyncio

import pytest
import torch
from conftest import POOL_FULL_CELLS, POOL_MARGIN, POOL_STEP, POOL_WINDOW_CELLS
from model_configs import WINDOW, make_model

from executorch_cellcache import InvalidConfigError
from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.errors import CapacityError
from executorch_cellcache.runtime.runner import Runner
from spec.sampling import SamplingParams
from spec.speculative import Speculative

pytestmark = pytest.mark.slow

ATOL = 1e-4
MARGIN, STEP = POOL_MARGIN, POOL_STEP   # retained_margin R, max_tokens_per_step T
WINDOW_CELLS, FULL_CELLS = POOL_WINDOW_CELLS, POOL_FULL_CELLS
# One sequence's most cells in a windowed pool: W + max(R, T - 1) + T (admission.h).
PER_SEQ = WINDOW + max(MARGIN, STEP - 1) + STEP
N_FIT = WINDOW_CELLS // PER_SEQ  # one-sample requests the windowed pool admits at once
N_SEQ = 8
DECODE = 5 * WINDOW              # decode steps: 5 windows past W
ARCHS = ("mistral", "gemma3")


def _tokens(n, seed, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def programs(pooled_pte):
    """arch -> (eager oracle with the program's weights, pooled .pte path)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            oracle = make_model(arch)
            oracle.set_attn_implementation("eager")
            cache[arch] = (oracle, pooled_pte(arch))
        return cache[arch]
    return get


def reference(oracle, tokens):
    """transformers eager logits [len(tokens), vocab] of the whole sequence."""
    with torch.no_grad():
        return oracle(torch.tensor([list(tokens)])).logits[0].float()


class Recorder:
    """Wraps runner.step: keeps every logits row as rows[life][position], a
    life being a sequence id's lifetime (its seq_serial: ids are handed out
    again once freed, serials never); per pool the lives each cell was placed
    for, the most positions each pool reclaimed of any sequence, and the most
    sequences live at once."""

    def __init__(self, runner):
        self.r, self.step = runner, runner.step
        self.rows = {}
        self.cell_users = {}   # pool -> cell -> {life}
        self.max_reclaimed = {p.index: 0 for p in runner.pools.pools}
        self.max_live = 0
        self.fed = []
        runner.step = self

    def __call__(self, seq_ids, tokens, positions, logits_for):
        cache = self.r.cache
        life = {s: cache.seq_serial(s) for s in set(seq_ids)}
        out = self.step(seq_ids, tokens, positions, logits_for)
        for row, i in enumerate(logits_for):
            self.rows.setdefault(life[seq_ids[i]], {})[positions[i]] = out[row].clone()
        self.fed += positions
        self.max_live = max(self.max_live, len(life))
        for p in self.r.pools.pools:
            users = self.cell_users.setdefault(p.index, {})
            for cell, seq in zip(cache.pool(p.index).step_cells.tolist(), seq_ids):
                users.setdefault(cell, set()).add(life[seq])
            for seq in life:
                self.max_reclaimed[p.index] = max(self.max_reclaimed[p.index],
                                                  cache.reclaimed(seq, p.index)[1])
        return out

    def lives(self):
        """The recorded lifetimes in the order their sequences were made."""
        return sorted(self.rows)

    def check(self, oracle, life, prompt, generated, what, greedy=True):
        """Every row of a lifetime against transformers on prompt + generated;
        greedy: each generated token is transformers' argmax given the tokens
        before it, i.e. the sequence is transformers' greedy continuation
        (one forward instead of one per token)."""
        rows = self.rows[life]
        want = reference(oracle, prompt + generated[:-1])
        if greedy:
            argmax = want[len(prompt) - 1:].argmax(-1).tolist()
            assert generated == argmax, f"{what}: not transformers' greedy tokens"
        positions = sorted(q for q in rows if q >= len(prompt) - 1)
        got = torch.stack([rows[q] for q in positions])
        err = (got - want[positions]).abs().max().item()
        assert err <= ATOL, f"{what}: max abs error {err:.3g} > {ATOL}"
        # Every generated token fed back was computed (a fork's first row, at the
        # prompt's last position, is its source's).
        assert set(range(len(prompt), len(prompt) + len(generated) - 1)) <= set(positions)


def windowed(runner):
    return [p.index for p in runner.pools.pools if p.window is not None]


# ---------------------------------------------------------------------- generation


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_sequences_decode_past_the_window_as_transformers(programs, arch):
    """8 prompts decode 5 windows past W in a windowed pool that holds fewer
    than 8 worst cases: admission runs what fits (at least N_FIT: its cells
    // (W + max(R, T - 1) + T)), the windowed pools reclaim and place cells
    one sequence gave up for others, and tokens and logits are
    transformers'."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    assert r.pools.pooled and [r.pools.pools[p].capacity for p in windowed(r)] == [WINDOW_CELLS]
    rec = Recorder(r)
    prompts = [_tokens(4 + i, seed=100 + i) for i in range(N_SEQ)]
    out = r.generate(prompts, DECODE, stop_on_eos=False)
    # At least N_FIT ran at once; more when running ones were near their end (a
    # request reserves no more than the positions it may still place).
    assert N_FIT <= rec.max_live
    # FIFO admission, one sequence a request: lifetimes in prompt order.
    for i, (prompt, [got], life) in enumerate(zip(prompts, out, rec.lives())):
        rec.check(oracle, life, prompt, got, f"{arch} sequence {i}")
    for p in windowed(r):
        assert rec.max_reclaimed[p] > 0
        assert any(len(seqs) > 1 for seqs in rec.cell_users[p].values()), \
            "no reclaimed cell went to another sequence"
        assert r.last_stats.pool_peak_cells[p] <= WINDOW_CELLS
    total = sum(len(p) + DECODE - 1 for p in prompts)
    assert total > WINDOW_CELLS  # the windowed pool could not have held every position
    for p in r.pools.pools:
        if p.window is None:  # Gemma3's full pool keeps every position it is given
            assert max(r.last_stats.pool_peak_cells[q] for q in windowed(r)) < \
                r.last_stats.pool_peak_cells[p.index] <= total
    assert r.pools.free() == r.pools.capacities()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_thirty_windows_long_prefills_in_chunks(programs, arch):
    """A prompt longer than the windowed pool (30 x W > 8 sequences' worst
    case) prefills in chunks of T and decodes as transformers."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    rec = Recorder(r)
    prompt = _tokens(30 * WINDOW, seed=7)
    assert len(prompt) > WINDOW_CELLS
    [[got]] = r.generate([prompt], 10, stop_on_eos=False)
    [life] = rec.lives()
    rec.check(oracle, life, prompt, got, f"{arch} long prompt")
    assert all(rec.max_reclaimed[p] >= len(prompt) - PER_SEQ for p in windowed(r))
    # Bounded: the windowed pool never held more than one sequence's worst case.
    assert all(r.last_stats.pool_peak_cells[p] <= PER_SEQ for p in windowed(r))
    assert r.last_stats.prefill_tokens == len(prompt)
    assert r.last_stats.steps >= len(prompt) // STEP


@pytest.mark.parametrize("arch", ARCHS)
def test_forks_share_windowed_cells_and_diverge(programs, arch):
    """n=3 seeded samples of one prompt longer than W: they diverge, each
    row is transformers' on that sample's own tokens, and the prompt is
    placed once (sample j is the j-th sequence made: the prompt's, then its
    clones)."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    rec = Recorder(r)
    prompt = _tokens(3 * WINDOW, seed=11)
    [samples] = r.generate([prompt], 3 * WINDOW, n=3, temperature=1.0, seed=5,
                           stop_on_eos=False)
    assert len({tuple(s) for s in samples}) == 3
    for j, (s, life) in enumerate(zip(samples, rec.lives())):
        rec.check(oracle, life, prompt, s, f"{arch} sample {j}", greedy=False)
    assert r.last_stats.prefill_tokens == len(prompt)
    for p in windowed(r):
        assert r.last_stats.pool_peak_cells[p] <= 3 * PER_SEQ


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_speculation_gives_plain_decoding(programs, arch):
    """Prompt lookup on a pooled program: rejected proposals are rolled back
    within the step that placed them (always allowed), and the tokens are
    plain greedy decoding's. The prompt quotes a segment and its greedy
    continuation, then the segment again, so lookup proposes that
    continuation (which Mistral, every layer sliding, repeats exactly)."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    segment = _tokens(2 * WINDOW, seed=21)
    [[follow]] = r.generate([segment], 2 * WINDOW, stop_on_eos=False)
    prompts = [segment + follow + segment, _tokens(5, seed=22) + segment + follow + segment]
    plain = r.generate(prompts, 3 * WINDOW, stop_on_eos=False)
    spec = r.generate(prompts, 3 * WINDOW, stop_on_eos=False,
                      speculative=Speculative("lookup", max_draft=STEP - 1))
    assert spec == plain
    if arch == "mistral":  # (Gemma3's full layers see the whole prompt: it need not repeat)
        assert 0 < r.last_stats.accepted_tokens <= r.last_stats.proposed_tokens
    assert r.pools.free() == r.pools.capacities()


# ---------------------------------------------------------------------- prefix cache


def holds_by_rule(cache, seq, upto):
    """cell_pool.h: a windowed pool that gave up seq's positions below
    ``below`` serves a clone of ``upto`` iff upto > below and
    upto - W + 1 >= below."""
    for p in range(cache.n_pools):
        below = cache.reclaimed(seq, p)[0]
        if below and not (upto > below and upto - cache.pool(p).window + 1 >= below):
            return False
    return True


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_serves_only_what_the_pools_hold(programs, arch):
    """A's entry (4 windows long, mostly reclaimed) cannot serve B's short
    shared prefix (a miss, as the rule says) but serves C, which continues
    A's whole conversation; outputs equal the uncached runner's and C's rows
    are transformers'."""
    oracle, path = programs(arch)
    on, off = Runner(path), Runner(path, prefix_cache=False)
    a = _tokens(4 * WINDOW, seed=31)
    [[out_a]] = on.generate([a], 6, stop_on_eos=False)
    [entry] = on.prefix_cache.seqs()
    held = a + out_a[:-1]
    assert on.prefix_cache.tokens(entry) == held
    b = a[:WINDOW + 2] + _tokens(4, seed=32)
    c = held + _tokens(3, seed=33)
    assert not holds_by_rule(on.cache, entry, WINDOW + 2)
    assert holds_by_rule(on.cache, entry, len(held))
    [[out_b]] = on.generate([b], 6, stop_on_eos=False)
    assert on.last_stats.cached_tokens == [0]
    rec = Recorder(on)
    [[out_c]] = on.generate([c], 6, stop_on_eos=False)
    assert on.last_stats.cached_tokens == [len(held)]
    assert min(rec.fed) == len(held)  # nothing of the cached prefix computed again
    assert [out_b, out_c] == [o[0] for o in off.generate([b, c], 6, stop_on_eos=False)]
    [life] = rec.lives()
    rec.check(oracle, life, c, out_c, f"{arch} cached prefix")
    on.clear()
    assert on.pools.free() == on.pools.capacities()


# ---------------------------------------------------------------------- bad input


def test_a_request_beyond_the_window_pool_is_refused_naming_it(programs):
    """n = N_FIT + 1 samples of a long request need more than the windowed
    pool's cells (N_FIT fit): CapacityError naming it, before anything
    runs."""
    _, path = programs("mistral")
    r = Runner(path)
    with pytest.raises(CapacityError, match=rf"window-{WINDOW} pool"):
        r.generate([_tokens(5, seed=1)], 4 * WINDOW, n=N_FIT + 1)
    assert r.cache.n_sequences == 0 and r.pools.free() == r.pools.capacities()
    assert len(r.generate([_tokens(5, seed=1)], 4 * WINDOW, n=N_FIT)[0]) == N_FIT


def test_a_pooled_draft_beyond_its_margin_is_refused_at_setup(programs):
    """The draft model's mirrors roll back over one-token proposal steps, at
    most R + 1 of them (cell_pool.h): max_draft > R + 2 is refused before any
    request runs; "auto" stays within it."""
    _, path = programs("mistral")
    r = Runner(path)
    too_many = Speculative("draft", max_draft=MARGIN + 3, draft_model=str(path))
    with pytest.raises(InvalidConfigError, match="windowed pools keep for a rollback: at most "
                                                 rf"{MARGIN + 2} \(retained_margin"):
        r.generate([_tokens(5, seed=2)], 4, speculative=too_many)
    assert r.cache.n_sequences == 0
    auto = r.use_speculative(Speculative("draft", draft_model=str(path)))
    assert 1 <= auto <= MARGIN + 2
    r.use_speculative(None)


def test_a_program_whose_pools_cannot_be_built_is_refused(programs, monkeypatch):
    """Metadata naming a pool for a window no layer has, or pools with the
    dense-mask attention path: InvalidConfigError naming the program, no
    Runner."""
    _, path = programs("mistral")
    real = metadata.read

    def bad(program):
        info = real(program)
        info.window_cells = {WINDOW + 1: WINDOW_CELLS}
        return info
    monkeypatch.setattr(metadata, "read", bad)
    with pytest.raises(InvalidConfigError, match=str(path.name)):
        Runner(path)

    def dense(program):
        info = real(program)
        info.attention = "reference"
        return info
    monkeypatch.setattr(metadata, "read", dense)
    with pytest.raises(InvalidConfigError, match="'cells' attention path"):
        Runner(path)


# ---------------------------------------------------------------------- server


class _Ids:
    """A tokenizer stand-in for the engine: token t reads as '<t>'."""

    def token_bytes(self, t):
        return f"<{t}>".encode()

    def token_name(self, t):
        return None

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def test_the_engine_serves_a_pooled_program(programs):
    """The server's engine thread on a pooled program: two concurrent
    requests complete with the runner's greedy tokens; a request beyond the
    windowed pool is refused at submission naming it."""
    from executorch_cellcache.serving.engine import Engine, Output, RequestError

    _, path = programs("gemma3")
    prompts = [_tokens(3 * WINDOW, seed=41), _tokens(5, seed=42)]
    want = [o[0] for o in Runner(path, prefix_cache=False).generate(prompts, 12,
                                                                    stop_on_eos=False)]
    engine = Engine(Runner(path), tokenizer=_Ids())
    engine.start()

    async def run():
        params = SamplingParams(max_new_tokens=12, stop_on_eos=False)
        handles = [engine.submit(p, params, []) for p in prompts]
        got = []
        for h in handles:
            tokens = []
            while True:
                item = await asyncio.wait_for(h.queue.get(), 60)
                assert isinstance(item, Output), item
                tokens.append(item.token)
                if item.finish_reason is not None:
                    break
            got.append(tokens)
        return got

    try:
        assert asyncio.run(run()) == want
    finally:
        engine.stop()
    # A request the windowed pool can never hold: a 400 naming the pool and what to lower
    # (in HTTP's terms: max_tokens, not the CLI's --max-new-tokens).
    too_many = SamplingParams(max_new_tokens=4 * WINDOW, n=N_FIT + 1)
    with pytest.raises(RequestError, match=rf"window-{WINDOW} pool .*; lower max_tokens "
                                           rf"or n$") as e:
        engine.submit(prompts[1], too_many, [])
    assert e.value.param == "max_tokens"   # fewer tokens would fit: 5 + 6 x 19 <= 120
    long_prompt = _tokens(WINDOW_CELLS + 1, seed=43)   # no max_tokens fits n=6 beside it
    with pytest.raises(RequestError, match=r"; lower n$") as e:
        engine.submit(long_prompt, SamplingParams(max_new_tokens=1, n=N_FIT + 1), [])
    assert e.value.param == "n"


@pytest.mark.parametrize("prompt_len,n", [(5, N_FIT + 1), (5, 1), (40, N_FIT + 2), (200, 2)])
def test_the_server_default_max_tokens_fits_every_pool(programs, prompt_len, n):
    """Without max_tokens the server takes the most that fit in every pool:
    brute force over the core's worst case as the SPEC writes it (a full
    pool: prompt + n x (m - 1) cells; a windowed pool: the smaller of that and
    n x (W + max(R, T - 1) + T))."""
    from executorch_cellcache.serving.engine import DEFAULT_MAX_TOKENS, Engine

    _, path = programs("gemma3")
    engine = Engine(Runner(path), tokenizer=_Ids())

    def fits(m):
        tokens = prompt_len + n * (m - 1)
        return tokens <= FULL_CELLS and min(tokens, n * PER_SEQ) <= WINDOW_CELLS

    want = max([m for m in range(1, DEFAULT_MAX_TOKENS + 1) if fits(m)], default=1)
    assert engine.default_max_tokens(prompt_len, n) == want


def test_cli_generate_reports_each_pools_peak(programs, capsys):
    """`cellcache generate` on a pooled program: the summary gives each pool's
    peak cells, the windowed pool's within its capacity."""
    import re

    from executorch_cellcache.cli import main

    _, path = programs("gemma3")
    prompt = " ".join(map(str, _tokens(3 * WINDOW, seed=51)))
    assert main(["generate", str(path), "--token-ids", "--prompt", prompt,
                 "--max-new-tokens", "12", "--no-stop-on-eos"]) == 0
    err = capsys.readouterr().err
    got = re.search(rf"window-{WINDOW} pool: (\d+) of (\d+), full-attention pool: (\d+) of "
                    rf"(\d+)", err)
    assert got, err
    window_peak, window_cells, full_peak, full_cells = map(int, got.groups())
    assert (window_cells, full_cells) == (WINDOW_CELLS, FULL_CELLS)
    assert window_peak <= PER_SEQ and full_peak == 3 * WINDOW + 12 - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_perplexity_through_a_window_pool_is_transformers(programs, arch):
    """evaluate() scores a 200-token text as one window (longer than the
    windowed pool: it reclaims as the window prefills) with the mean NLL
    transformers eager gives the same tokens."""
    from executorch_cellcache.runtime.evaluate import evaluate

    oracle, path = programs(arch)
    ids = _tokens(200, seed=61)
    assert len(ids) > WINDOW_CELLS
    got = evaluate(Runner(path, prefix_cache=False), ids)
    logp = torch.log_softmax(reference(oracle, ids).double(), dim=-1)
    want = -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert (got.window, got.tokens) == (len(ids), len(ids) - 1)
    assert abs(got.mean_nll - want) <= 1e-4
