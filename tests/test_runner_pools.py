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

Each program is exported once per run (conftest.made_once); a test that needs
an empty cache loads a new Runner.
"""

import asyncio

import pytest
import torch
from conftest import made_once
from model_configs import WINDOW, make_model

from executorch_cellcache import InvalidConfigError, export
from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.errors import CapacityError
from executorch_cellcache.runtime.runner import Runner
from executorch_cellcache.runtime.sampling import SamplingParams
from executorch_cellcache.runtime.speculative import Speculative

pytestmark = pytest.mark.slow

ATOL = 1e-4
MARGIN = 4           # retained_margin R
STEP = 8             # max_tokens_per_step T
# One sequence's most cells in a windowed pool: W + max(R, T - 1) + T (admission.h).
PER_SEQ = WINDOW + max(MARGIN, STEP - 1) + STEP
N_SEQ = 8
WINDOW_CELLS = N_SEQ * PER_SEQ   # 8 sequences at once, reusing what they reclaim
FULL_CELLS = 384                 # the full-attention pool (Gemma3's full layers)
DECODE = 5 * WINDOW              # decode steps: 5 windows past W
ARCHS = ("mistral", "gemma3")


def _tokens(n, seed, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """arch -> (eager oracle, pooled .pte path), exported once per run."""
    cache = {}

    def get(arch):
        if arch not in cache:
            oracle = make_model(arch)
            oracle.set_attn_implementation("eager")
            path = made_once(tmp_path_factory, f"pools-{arch}.pte", lambda p: export(
                oracle, p, n_cells=FULL_CELLS, max_tokens_per_step=STEP,
                window_cells={WINDOW: WINDOW_CELLS}, retained_margin=MARGIN))
            cache[arch] = (oracle, path)
        return cache[arch]
    return get


def reference(oracle, tokens):
    """transformers eager logits [len(tokens), vocab] of the whole sequence."""
    with torch.no_grad():
        return oracle(torch.tensor([list(tokens)])).logits[0].float()


def oracle_greedy(oracle, prompt, k):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(oracle(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class Recorder:
    """Wraps runner.step: keeps every logits row as rows[seq][position], and
    per windowed pool the sequences each cell was placed for, and the most
    positions each pool reclaimed of any sequence."""

    def __init__(self, runner):
        self.r, self.step = runner, runner.step
        self.rows = {}
        self.cell_users = {}   # pool -> cell -> {seq}
        self.max_reclaimed = {p.index: 0 for p in runner.pools.pools}
        self.fed = []
        runner.step = self

    def __call__(self, seq_ids, tokens, positions, logits_for):
        out = self.step(seq_ids, tokens, positions, logits_for)
        cache = self.r.cache
        for row, i in enumerate(logits_for):
            self.rows.setdefault(seq_ids[i], {})[positions[i]] = out[row].clone()
        self.fed += positions
        for p in self.r.pools.pools:
            users = self.cell_users.setdefault(p.index, {})
            for cell, seq in zip(cache.pool(p.index).step_cells.tolist(), seq_ids):
                users.setdefault(cell, set()).add(seq)
            for seq in set(seq_ids):
                self.max_reclaimed[p.index] = max(self.max_reclaimed[p.index],
                                                  cache.reclaimed(seq, p.index)[1])
        return out

    def check(self, oracle, seq, prompt, generated, what):
        """Every row of seq against transformers on prompt + generated."""
        rows = self.rows[seq]
        want = reference(oracle, prompt + generated[:-1])
        positions = sorted(q for q in rows if q >= len(prompt) - 1)
        got = torch.stack([rows[q] for q in positions])
        err = (got - want[positions]).abs().max().item()
        assert err <= ATOL, f"{what}: max abs error {err:.3g} > {ATOL}"
        assert positions == list(range(len(prompt) - 1, len(prompt) + len(generated) - 1))


def windowed(runner):
    return [p.index for p in runner.pools.pools if p.window is not None]


# ---------------------------------------------------------------------- generation


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_sequences_decode_past_the_window_as_transformers(programs, arch):
    """8 prompts decode 5 windows past W together: every sequence is admitted
    at once (the windowed pool holds 8 worst cases, not 8 full histories),
    the windowed pools reclaim and place cells given up by one sequence for
    another, and tokens and logits are transformers'."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    assert r.pools.pooled and [r.pools.pools[p].capacity for p in windowed(r)] == [WINDOW_CELLS]
    rec = Recorder(r)
    prompts = [_tokens(4 + i, seed=100 + i) for i in range(N_SEQ)]
    out = r.generate(prompts, DECODE, stop_on_eos=False)
    assert sorted(rec.rows) == list(range(N_SEQ))  # 8 live sequences at once: ids 0..7
    for i, (prompt, [got]) in enumerate(zip(prompts, out)):
        assert got == oracle_greedy(oracle, prompt, DECODE), f"prompt {i}"
        rec.check(oracle, i, prompt, got, f"{arch} sequence {i}")
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
    assert got == oracle_greedy(oracle, prompt, 10)
    rec.check(oracle, 0, prompt, got, f"{arch} long prompt")
    assert all(rec.max_reclaimed[p] >= len(prompt) - PER_SEQ for p in windowed(r))
    assert r.last_stats.prefill_tokens == len(prompt)
    assert r.last_stats.steps >= len(prompt) // STEP


@pytest.mark.parametrize("arch", ARCHS)
def test_forks_share_windowed_cells_and_diverge(programs, arch):
    """n=3 seeded samples of one prompt longer than W: they diverge, each
    row is transformers' on that sample's own tokens, and the prompt is
    placed once (sample j is sequence j: the prompt's, then its clones)."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    rec = Recorder(r)
    prompt = _tokens(3 * WINDOW, seed=11)
    [samples] = r.generate([prompt], 3 * WINDOW, n=3, temperature=1.0, seed=5,
                           stop_on_eos=False)
    assert len({tuple(s) for s in samples}) == 3
    for j, s in enumerate(samples):
        rec.check(oracle, j, prompt, s, f"{arch} sample {j}")
    assert r.last_stats.prefill_tokens == len(prompt)
    for p in windowed(r):
        assert r.last_stats.pool_peak_cells[p] <= 3 * PER_SEQ


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_speculation_gives_plain_decoding(programs, arch):
    """Prompt lookup on a pooled program: rejected proposals are rolled back
    within the step that placed them (always allowed), and the tokens are
    plain greedy decoding's."""
    oracle, path = programs(arch)
    r = Runner(path, prefix_cache=False)
    segment = _tokens(2 * WINDOW, seed=21)
    prompts = [segment + segment[:WINDOW], _tokens(5, seed=22) + segment * 2]
    plain = r.generate(prompts, 3 * WINDOW, stop_on_eos=False)
    spec = r.generate(prompts, 3 * WINDOW, stop_on_eos=False,
                      speculative=Speculative("lookup", max_draft=STEP - 1))
    assert spec == plain
    assert r.last_stats.proposed_tokens > 0
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
    seq_c = next(iter(rec.rows))
    rec.check(oracle, seq_c, c, out_c, f"{arch} cached prefix")
    on.clear()
    assert on.pools.free() == on.pools.capacities()


# ---------------------------------------------------------------------- bad input


def test_a_request_beyond_the_window_pool_is_refused_naming_it(programs):
    """n=9 samples need 9 x PER_SEQ cells of the windowed pool (8 x fits):
    CapacityError naming it, before anything runs."""
    _, path = programs("mistral")
    r = Runner(path)
    with pytest.raises(CapacityError, match=rf"window-{WINDOW} pool"):
        r.generate([_tokens(5, seed=1)], 4, n=N_SEQ + 1)
    assert r.cache.n_sequences == 0 and r.pools.free() == r.pools.capacities()
    assert len(r.generate([_tokens(5, seed=1)], 4, n=N_SEQ)[0]) == N_SEQ


def test_a_pooled_draft_beyond_its_margin_is_refused_at_setup(programs):
    """The draft model's mirrors roll back over one-token proposal steps, at
    most R + 1 of them (cell_pool.h): max_draft > R + 2 is refused before any
    request runs; "auto" stays within it."""
    _, path = programs("mistral")
    r = Runner(path)
    too_many = Speculative("draft", max_draft=MARGIN + 3, draft_model=str(path))
    with pytest.raises(InvalidConfigError, match="retained margin"):
        r.generate([_tokens(5, seed=2)], 4, speculative=too_many)
    assert r.cache.n_sequences == 0
    auto = r.proposer(Speculative("draft", draft_model=str(path)))
    assert 1 <= auto.max_draft <= MARGIN + 2
    auto.close()


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


def test_the_engine_serves_a_pooled_program(programs):
    """The server's engine thread on a pooled program: two concurrent
    requests complete with the runner's greedy tokens."""
    from executorch_cellcache.serving.engine import Engine, Output

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
