"""Random differential streams of the core against its brute-force model
(tests/core_model.py), with pools and reclaim (issue #25).

Each stream draws a cache (1-4 layers, windows 1-5 or full; most of them one
pool per window policy with a rollback margin of 0-3 and windowed pools a few
cells above their least size, the rest one pool) and about 25 verbs: steps
that decode one to three sequences by a few tokens (so windowed pools reclaim
and reuse reclaimed cells for other sequences), steps with a sequence verb
between two layers (a partly served step abandoned), forks (full and
prefix), rollbacks aimed at the edge of what a pool still holds (refused with
BelowReclaimedError there), middle ranges, frees and holds_prefix. After
every verb each pool's cells, every live sequence's next position, length and
reclaim record, and check_invariants() must agree with the model; every
served layer's mask must equal the model's and let each token attend exactly
what it would had nothing been reclaimed; a verb that raises must raise the
model's class and change nothing. On a divergence the stream's seed and its
verbs so far are shown.

The last tests give the differential teeth: a model with a different margin
or a looser rollback rule is caught.
"""

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import core_model
from core_model import Model, check_agrees, check_served, snapshot

from executorch_cellcache import CellCache, CellCacheError

STREAMS = 10_000
VERBS = 25
SEED = 2026_12_03


class Stream:
    """One random stream: a cache, its model, and the verbs run so far."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.seed = seed
        self.log = []
        r = self.rng
        n_layers = r.randint(1, 4)
        windows = [r.choice([None, None, 1, 2, 3, 4, 5]) for _ in range(n_layers)]
        sliding = sorted({w for w in windows if w is not None})
        n_cells = r.randint(4, 40)
        window_cells, margin = None, None
        if sliding and r.random() < 0.8:
            margin = r.choice([0, 0, 1, 2, 3])
            window_cells = {w: r.randint(w + margin + 1, w + margin + 8) for w in sliding}
        self.config = dict(n_cells=n_cells, windows=windows, window_cells=window_cells,
                           retained_margin=margin)
        self.cache = CellCache(n_cells, windows=windows, window_cells=window_cells,
                               retained_margin=margin)
        self.model = Model(n_cells, windows, window_cells, margin)
        self.stats = {"reclaimed": 0, "refused": 0, "reused": 0}

    # -- helpers
    def both(self, what, real, model):
        """Runs the model, then the cache: equal results or one error class, and
        a call that raises changes nothing."""
        self.log.append(what)
        seqs = sorted(self.model.live)
        before = snapshot(self.cache, seqs)
        try:
            want, want_exc = model(), None
        except CellCacheError as e:
            want, want_exc = None, type(e)
        try:
            got = real()
        except CellCacheError as e:
            assert type(e) is want_exc, f"{what}: cache raised {e!r}, model {want_exc or want!r}"
            assert snapshot(self.cache, seqs) == before, f"{what}: {e!r} changed the cache"
            if type(e).__name__ == "BelowReclaimedError":
                self.stats["refused"] += 1
            return None
        assert want_exc is None, f"{what}: cache returned {got!r}, model raised {want_exc}"
        assert got == want, f"{what}: cache returned {got!r}, model {want!r}"
        return got

    def live_seq(self):
        live = sorted(self.model.live)
        return self.rng.choice(live) if live else None

    def edge(self, seq):
        """A position near what seq holds or near a pool's floor for it."""
        m, r = self.model, self.rng
        candidates = [0, m.next_pos(seq), m.next_pos(seq) - 1]
        for pool in m.pools:
            below, count = pool.reclaimed(seq)
            if count:
                candidates += [below + d for d in range(-1, pool.window + 1)]
        held = m.positions(seq)
        if held:
            candidates += [r.choice(held), r.choice(held) + 1]
        return max(0, r.choice(candidates))

    # -- the step protocol
    def declare(self, seqs):
        return self.both(f"declare_step({seqs})", lambda: self.cache.declare_step(seqs),
                         lambda: self.model.declare_step(seqs))

    def positions(self):
        nxt, out = {}, []
        for s in self.model.step_seqs:
            base = nxt.get(s, self.model.next_pos(s))
            p = base + self.rng.choice([0, 0, 0, 0, 1, 2])
            out.append(p)
            nxt[s] = p + 1
        return out

    def serve(self, positions, layer):
        m = self.model
        self.log.append(f"place_step({positions}, layer={layer})")
        placing = m.step_pos is None
        placed = self.cache.place_step(positions, layer=layer)
        if placing:
            reused = m.reused
            m.place(positions, [self.cache.pool(i).step_cells.tolist()
                                for i in range(len(m.pools))])
            self.stats["reused"] += m.reused > reused
        assert placed.cells.tolist() == m.pools[m.layer_pool[layer]].step_cells
        before = sum(p.reclaimed(s)[1] for p in m.pools for s in m.live)
        m.serve(layer)
        if sum(p.reclaimed(s)[1] for p in m.pools for s in m.live) > before:
            self.stats["reclaimed"] += 1
        check_served(self.cache, m, layer, placed)

    def decode(self):
        """A whole step: 1-3 live sequences, 1-4 tokens each."""
        live = sorted(self.model.live)
        if not live:
            return
        seqs = self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))
        ids = [s for s in seqs for _ in range(self.rng.randint(1, 4))]
        if self.declare(ids):
            positions = self.positions()
            for layer in range(self.model.n_layers):
                self.serve(positions, layer)

    def interrupted_step(self):
        """A step whose forward stops part-way: a verb abandons its placement."""
        live = sorted(self.model.live)
        if not live or self.model.n_layers < 2:
            return
        ids = [self.rng.choice(live) for _ in range(self.rng.randint(1, 3))]
        ids.sort()
        if not self.declare(ids):
            return
        positions = self.positions()
        for layer in range(self.rng.randint(1, self.model.n_layers - 1)):
            self.serve(positions, layer)
        self.rng.choice([self.seq_rm_tail, self.seq_clone, self.seq_new])()

    # -- sequence verbs
    def seq_new(self):
        self.both("seq_new()", self.cache.seq_new, self.model.seq_new)

    def seq_clone(self):
        src = self.live_seq()
        if src is None:
            return
        upto = None if self.rng.random() < 0.3 else self.edge(src)
        self.both(f"seq_clone({src}, upto={upto})", lambda: self.cache.seq_clone(src, upto=upto),
                  lambda: self.model.seq_clone(src, upto))

    def seq_rm_tail(self):
        seq = self.live_seq()
        if seq is None:
            return
        p0 = self.edge(seq)
        self.both(f"seq_rm({seq}, {p0})", lambda: self.cache.seq_rm(seq, p0),
                  lambda: self.model.seq_rm(seq, p0, None))

    def seq_rm_range(self):
        seq = self.live_seq()
        if seq is None:
            return
        p0 = self.edge(seq)
        p1 = p0 + self.rng.randint(0, 6)
        self.both(f"seq_rm({seq}, {p0}, {p1})", lambda: self.cache.seq_rm(seq, p0, p1),
                  lambda: self.model.seq_rm(seq, p0, p1))

    def seq_free(self):
        seq = self.live_seq()
        if seq is not None:
            self.both(f"seq_free({seq})", lambda: self.cache.seq_free(seq),
                      lambda: self.model.seq_free(seq))

    def holds_prefix(self):
        seq = self.live_seq()
        if seq is not None:
            upto = self.edge(seq)
            self.both(f"holds_prefix({seq}, {upto})", lambda: self.cache.holds_prefix(seq, upto),
                      lambda: self.model.holds_prefix(seq, upto))

    def run(self, n_verbs):
        verbs = ([self.decode] * 10 + [self.seq_new] * 2 + [self.seq_clone] * 2
                 + [self.seq_rm_tail] * 3 + [self.seq_rm_range, self.seq_free,
                                             self.holds_prefix, self.interrupted_step])
        self.seq_new()
        for _ in range(n_verbs):
            self.rng.choice(verbs)()
            check_agrees(self.cache, self.model)


def run_streams(n, seed=SEED):
    """Runs n streams; returns the summed stats. A divergence fails with the
    stream's config and verbs."""
    totals = {"reclaimed": 0, "refused": 0, "reused": 0, "pooled": 0}
    for i in range(n):
        stream = Stream(seed + i)
        try:
            stream.run(VERBS)
        except (AssertionError, CellCacheError) as e:  # check_invariants() raises
            raise AssertionError(f"stream {seed + i} diverged: {e!r}\nconfig {stream.config}\n"
                                 "verbs:\n  " + "\n  ".join(stream.log)) from None
        for k, v in stream.stats.items():
            totals[k] += v
        totals["pooled"] += stream.config["window_cells"] is not None
    return totals


def test_random_streams_agree_with_the_model():
    """>= 10,000 seeded random streams, no divergence, and they exercise what
    they are meant to."""
    start = time.perf_counter()
    totals = run_streams(STREAMS)
    elapsed = time.perf_counter() - start
    print(f"{STREAMS} streams in {elapsed:.1f} s: {totals}")
    assert totals["pooled"] > STREAMS / 2
    assert totals["reclaimed"] > STREAMS  # steps that reclaimed cells
    assert totals["refused"] > STREAMS / 10  # BelowReclaimedError raised by both
    assert totals["reused"] > STREAMS / 10  # steps placed into cells freed before


@pytest.mark.parametrize("mutation", ["margin", "rollback"])
def test_the_streams_catch_a_model_off_by_one(mutation, monkeypatch):
    """The differential has teeth: a model that keeps one position more (margin
    + 1) or lets a rollback go one position deeper diverges within 300 streams."""
    if mutation == "margin":
        init = Model.__init__

        def wider(self, n_cells, windows, window_cells=None, margin=None):
            init(self, n_cells, windows, window_cells, margin)
            self.margin += 1

        monkeypatch.setattr(Model, "__init__", wider)
    else:
        keeps = Model._keeps_windows

        def looser(self, seq, p0, p1):
            keeps(self, seq, p0 + 1 if p1 is None and p0 > 0 else p0, p1)

        monkeypatch.setattr(Model, "_keeps_windows", looser)
    with pytest.raises(AssertionError, match="diverged"):
        run_streams(300, seed=SEED + 7)
    assert core_model.Model is Model
