"""Programs with a cell pool per window policy (issue #25): export, metadata,
and parity with transformers while windowed pools reclaim and reuse cells.

The oracle is transformers eager in fp32 on each sequence's whole token list
(as tests/test_export_models.py). Mistral (every layer slides) and Gemma3
(sliding, full, sliding, full) run 8 sequences in one batch, several windows
past W: forks that share windowed cells and diverge, a rollback within the
retained margin, sequences freed and their cells reused by others. Each
decode row is within 1e-4 of the oracle, greedy choices agree, and the
pooled program's logits equal, to the bit, those of the same weights
exported with one pool (the attention kernel counts its pieces and tiles
from position 0, not from the first cell a pool still holds).
"""

import time

import pytest
import torch
from conftest import ARCH_CELLS, POOL_FULL_CELLS, POOL_MARGIN, POOL_STEP, POOL_WINDOW_CELLS
from model_configs import WINDOW, make_model

from executorch_cellcache import InvalidConfigError, export
from executorch_cellcache.cache.admission import window_pool_bound
from executorch_cellcache.exporting.options import ExportOptions
from executorch_cellcache.runtime.runner import Runner

ATOL = 1e-4
TIE = 1e-3
MARGIN = POOL_MARGIN  # retained_margin R of the pooled programs
STEP = POOL_STEP      # max_tokens_per_step T
DECODE = 30      # decode steps: 5 windows past W
FAST = 1.0       # seconds: bad options are refused before any tracing


def _tokens(n, seed, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class Batch:
    """Drives one runner through a script of steps and records, per sequence,
    its tokens and the logits of each decode row (keyed by position)."""

    def __init__(self, runner):
        self.r = runner
        self.tokens = {}   # seq -> token list
        self.rows = {}     # seq -> {position: logits of the row predicting position + 1}
        self.cell_users = {}  # windowed pool: cell -> set of sequences that wrote it

    def new(self, prompt):
        s = self.r.cache.seq_new()
        self.tokens[s], self.rows[s] = [], {}
        for c in range(0, len(prompt), STEP):
            self.step({s: prompt[c:c + STEP]})
        return s

    def fork(self, src):
        s = self.r.cache.seq_clone(src)
        self.tokens[s] = list(self.tokens[src])
        self.rows[s] = dict(self.rows[src])
        return s

    def step(self, feed):
        """feed: seq -> tokens appended at its next positions, one forward."""
        seqs, toks, pos, last = [], [], [], []
        for s, ts in feed.items():
            start = len(self.tokens[s])
            seqs += [s] * len(ts)
            toks += ts
            pos += range(start, start + len(ts))
            last.append(len(toks) - 1)
        logits = self.r.step(seqs, toks, pos, last)
        cache = self.r.cache
        for p in range(cache.n_pools):
            if cache.pool(p).window is not None:
                for cell, s in zip(cache.pool(p).step_cells.tolist(), seqs):
                    self.cell_users.setdefault((p, cell), set()).add(s)
        for row, (s, ts) in zip(logits, feed.items()):
            self.tokens[s] += ts
            self.rows[s][len(self.tokens[s]) - 1] = row
        return {s: int(row.argmax()) for row, s in zip(logits, feed)}

    def rollback(self, s, n):
        end = len(self.tokens[s]) - n
        self.r.cache.seq_rm(s, end)
        del self.tokens[s][end:]
        self.rows[s] = {p: r for p, r in self.rows[s].items() if p < end}

    def free(self, s):
        self.r.cache.seq_free(s)


def _script(runner, n_roots=4, decode=DECODE):
    """The batch of the module docstring on ``runner`` (n_roots prompts, each
    forked once, ``decode`` steps); returns the Batch and the sequences freed
    along the way (with their final tokens)."""
    b = Batch(runner)
    roots = [b.new(_tokens(13, seed)) for seed in range(n_roots)]
    nxt = {s: int(b.rows[s][12].argmax()) for s in roots}
    # Forks share the prompt's windowed cells, then diverge on another token.
    for i, src in enumerate(roots):
        f = b.fork(src)
        nxt[f] = (nxt[src] + 1 + i) % 300 + 3
    finished = {}
    for t in range(decode):
        nxt = b.step({s: [tok] for s, tok in nxt.items()})
        if t == 10:  # a rollback within the margin: take back 3 tokens, then go on differently
            s = roots[1]
            b.rollback(s, 3)
            nxt[s] = (b.tokens[s][-1] + 7) % 300 + 3
        if t == 15 and n_roots > 2:  # freed: its cells go to the others
            s = roots[2]
            finished[s] = list(b.tokens[s])
            b.free(s)
            del nxt[s]
    return b, finished


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_pooled_program_matches_transformers_while_cells_are_reclaimed(pooled_pte, arch):
    oracle = make_model(arch)
    oracle.set_attn_implementation("eager")
    runner = Runner(pooled_pte(arch))
    assert runner.info.window_cells == {WINDOW: POOL_WINDOW_CELLS}
    assert runner.info.retained_margin == MARGIN
    want_pools = 1 if arch == "mistral" else 2
    assert runner.cache.n_pools == want_pools
    assert sorted(runner.cache.pool(p).capacity for p in range(want_pools)) == \
        sorted({POOL_WINDOW_CELLS, *([POOL_FULL_CELLS] if arch == "gemma3" else [])})
    b, finished = _script(runner)
    windowed = [p for p in range(runner.cache.n_pools) if runner.cache.pool(p).window]
    # Reclaim ran for every live sequence, and a cell served several sequences.
    for s in b.tokens:
        if s not in finished:
            assert runner.cache.reclaimed(s, windowed[0])[1] > 2 * WINDOW
    assert max(len(users) for users in b.cell_users.values()) >= 3
    sequences = {s: b.tokens[s] for s in b.tokens}
    for s, toks in sequences.items():
        with torch.no_grad():
            want = oracle(torch.tensor([toks])).logits[0].float()
        rows = b.rows[s]
        got = torch.stack([rows[p] for p in sorted(rows)])
        ref = want[sorted(rows)]
        err = (got - ref).abs().max().item()
        assert err <= ATOL, f"{arch} seq {s}: max abs error {err:.3g}"
        top2 = torch.topk(ref, 2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > TIE
        assert bool(((got.argmax(-1) == ref.argmax(-1)) | ~clear).all())


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_pooled_program_equals_the_one_pool_program_to_the_bit(pooled_pte, arch_exports,
                                                               arch):
    """The same weights exported with one pool (conftest's arch_exports, whose
    pool holds every position of a shorter script) give the same logits to
    the bit while the pooled program reclaims: the kernel's pieces and tiles
    are counted from position 0, not from the first cell a pool still holds."""
    pooled, single = Runner(pooled_pte(arch)), Runner(arch_exports(arch)[1].path)
    assert single.info.n_cells == ARCH_CELLS and single.info.window_cells is None
    b, _ = _script(pooled, n_roots=2, decode=20)
    b1, _ = _script(single, n_roots=2, decode=20)
    windowed = [p for p in range(pooled.cache.n_pools) if pooled.cache.pool(p).window]
    assert all(pooled.cache.reclaimed(s, windowed[0])[1] > 0 for s in b.tokens)
    assert b1.tokens == b.tokens
    for s in b.rows:
        for p, row in b.rows[s].items():
            assert torch.equal(row, b1.rows[s][p]), f"{arch} seq {s} position {p}"


def test_auto_sizes_windowed_pools_only_where_they_save_cells(tmp_path):
    opts = ExportOptions(n_cells=4096, max_tokens_per_step=STEP, window_cells="auto",
                         pool_sequences=3).checked()
    per_seq = WINDOW + max(32, STEP - 1) + STEP
    assert window_pool_bound(WINDOW, 32, STEP, 3) == 3 * per_seq
    assert opts.window_pools([WINDOW, None]) == {WINDOW: 3 * per_seq}
    assert opts.window_pools([None, None]) is None
    small = ExportOptions(n_cells=64, max_tokens_per_step=STEP, window_cells="auto").checked()
    assert small.window_pools([WINDOW, None]) is None  # 8 sequences need more than 64
    # auto: pools where 8 sequences' worst cases are fewer than n_cells.
    assert ExportOptions(n_cells=4096, max_tokens_per_step=STEP,
                         window_cells="auto").checked().window_pools([WINDOW, None]) == \
        {WINDOW: 8 * per_seq}
    assert ExportOptions(n_cells=256, max_tokens_per_step=STEP,
                         window_cells="auto").checked().window_pools([WINDOW, None]) is None
    # The default is one pool; "none" says so as the CLI does.
    assert ExportOptions(window_cells="none").checked().window_cells is None
    assert ExportOptions(n_cells=4096).checked().window_pools([WINDOW, None]) is None
    assert ExportOptions(n_cells=4096, max_tokens_per_step=STEP, window_cells="auto",
                         attention="reference").checked().window_pools([WINDOW]) is None


def _refused(match, arch="gemma3", **options):
    model = make_model(arch)
    t0 = time.perf_counter()
    with pytest.raises(InvalidConfigError, match=match):
        export(model, "/tmp/never-written.pte", **options)
    assert time.perf_counter() - t0 < FAST * 5  # before tracing (a model copy is all)


@pytest.mark.parametrize("options, match", [
    (dict(window_cells={WINDOW + 1: 200}), f"names window {WINDOW + 1}, which no layer has"),
    (dict(window_cells={WINDOW: 200, 99: 300}), "names window 99"),
    (dict(window_cells={WINDOW: 20}, retained_margin=4, max_tokens_per_step=8),
     rf"window_cells\[{WINDOW}\] = 20 is too small for one sequence stepping 8 tokens: .* "
     rf"= {WINDOW + 7 + 8} cells"),
    (dict(window_cells={WINDOW: 200}, attention="reference"), "needs the 'cells' attention"),
    (dict(window_cells={}), "window_cells is empty"),
    (dict(window_cells="some"), "window_cells must be None, 'auto'"),
    (dict(window_cells={WINDOW: 0}), r"window_cells\[6\] must be a positive integer"),
    (dict(window_cells={WINDOW: 200}, retained_margin=-1), "retained_margin must be an integer"),
    (dict(window_cells={WINDOW: 200}, retained_margin=True), "retained_margin must be"),
    (dict(window_cells={WINDOW: 200}, retained_margin=2 ** 31), "retained_margin must be <= "),
    (dict(window_cells="auto", pool_sequences=0), "pool_sequences must be a positive"),
    # Options that would do nothing are refused, not ignored.
    (dict(pool_sequences=4), "pool_sequences sizes the pools of window_cells='auto'; with "
                             "window_cells=None it would do nothing"),
    (dict(window_cells={WINDOW: 200}, pool_sequences=4), "pool_sequences sizes the pools"),
    (dict(retained_margin=4), "with one pool nothing is reclaimed"),
    (dict(window_cells="none", retained_margin=0), "with one pool nothing is reclaimed"),
])
def test_bad_pool_options_are_refused_before_tracing(options, match):
    _refused(match, **options)


def test_window_cells_on_a_full_attention_model_is_refused():
    _refused("every layer of this model has full attention", arch="llama",
             window_cells={WINDOW: 200})


def test_options_and_keywords_are_not_mixed():
    with pytest.raises(TypeError, match="not both"):
        export(make_model("llama"), "/tmp/x.pte", ExportOptions(), n_cells=64)


def test_checked_options_pass_again_and_a_replaced_copy_is_checked_anew():
    """export() checks the options the CLI already checked: their filled-in
    retained_margin and pool_sequences must not read as options given for
    nothing; a dataclasses.replace() of them is checked again."""
    import dataclasses

    done = ExportOptions(n_cells=256, max_tokens_per_step=8).checked()
    assert done.retained_margin == 32 and done.pool_sequences == 8
    assert done.checked() is done
    with pytest.raises(InvalidConfigError, match="n_cells must be a positive integer"):
        dataclasses.replace(done, n_cells=0).checked()
