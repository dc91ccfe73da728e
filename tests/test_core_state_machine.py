"""CellCache against a brute-force model written from SPEC sections 1 and 12
(tests/core_model.py).

The model keeps every cell of every pool as (pos, owner set), every live
sequence's positions, what each windowed pool gave up, and the current step's
state; masks are recomputed from the attention rule for every token and every
cell. Which cells a step uses is the cache's free choice: the model reads them
from each pool's ``step_cells`` and only checks that they were free and
distinct. Everything else -- return values, error classes, each pool's
free_cells, used_end and cell positions, next_pos/seq_len and what each pool
reclaimed of every live sequence, every mask (also against the positions it
would attend had nothing been reclaimed) and attention plan -- must agree after
every rule, and check_invariants() must pass. Half the caches hold one pool per
window policy with a small rollback margin, so reclaim, its refusals
(BelowReclaimedError) and cells reused after reclaim are frequent.

The second half holds explicit bad-input tests: exact class, the message names
the offending value, and the cache is unchanged afterwards.
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

sys.path.insert(0, str(Path(__file__).parent))

from core_errors import MESSAGES
from core_model import MAX_SEQS, Model, check_agrees, check_served, snapshot

from executorch_cellcache import (BelowReclaimedError, CapacityError, CellCache, CellCacheError,
                                  InvalidConfigError, LayerOutOfRangeError, PositionConflictError,
                                  StepInvalidatedError, StepNotDeclaredError,
                                  UnknownSequenceError)

# ----------------------------------------------------------------------------- machine

# Ids the cache never hands out in these runs, or that overflow int32.
FOREIGN_IDS = [-1, -7, MAX_SEQS, 300, 2**31, 2**40, -(2**40)]
WINDOW = st.one_of(st.none(), st.integers(1, 4))


class CellCacheMachine(RuleBasedStateMachine):
    # Mostly tiny caches (admission refusals, full caches); sometimes one that
    # spans several 64-cell words of the free bitmap.
    ALWAYS_POOLED = False  # PooledCellCacheMachine: one pool per window, every run
    @initialize(n_cells=st.one_of(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12),
                                  st.integers(60, 140)), data=st.data())
    def setup(self, n_cells, data):
        n_layers = data.draw(st.integers(1, 3), label="n_layers")
        per_layer = data.draw(st.booleans(), label="per_layer_windows")
        if per_layer:
            windows = data.draw(st.lists(WINDOW, min_size=n_layers, max_size=n_layers),
                                label="windows")
            arg_layers = data.draw(st.sampled_from([None, n_layers]), label="n_layers_arg")
        else:
            windows = [data.draw(WINDOW, label="window")]
            arg_layers = n_layers
        if self.ALWAYS_POOLED and all(w is None for w in windows):
            windows[0] = data.draw(st.integers(1, 3), label="sliding_window")
        per = windows if len(windows) == n_layers else windows * n_layers
        sliding = sorted({w for w in per if w is not None})
        window_cells, margin = None, None
        if sliding and (self.ALWAYS_POOLED or data.draw(st.sampled_from([True, True, False]),
                                                        label="pooled")):
            event("pooled")
            if None in per:  # a full pool that holds long sequences
                n_cells = data.draw(st.integers(n_cells, n_cells + 40), label="full_cells")
            margin = data.draw(st.sampled_from([0, 0, 1, 2]), label="retained_margin")
            window_cells = {w: data.draw(st.integers(w + margin + 1, w + margin + 6),
                                         label="window_cells") for w in sliding}
        self.cache = CellCache(n_cells, n_layers=arg_layers, windows=windows,
                               window_cells=window_cells, retained_margin=margin)
        self.model = Model(n_cells, per, window_cells, margin)
        assert self.cache.n_layers == n_layers
        assert self.cache.n_pools == len(self.model.pools)
        for layer, w in enumerate(per):
            assert self.cache.window(layer) == w
            assert self.cache.pool_of(layer) == self.model.layer_pool[layer]
            assert layer in self.cache.pool(self.model.layer_pool[layer]).layers
        self.ever = set()  # ids ever handed out (freed ones are interesting)
        self.serials = {}  # live id -> the serial it got when handed out
        if self.ALWAYS_POOLED:  # start from a sequence its windowed pools reclaimed
            self.seq_new()
            for _ in range(data.draw(st.integers(0, 14), label="history")):
                self.decode_one(0)

    # -- helpers
    def both(self, real, model):
        """Runs real() and model(); they must return equal values or raise one class,
        and a call that raises changes nothing."""
        seqs = sorted(self.model.live)
        before = snapshot(self.cache, seqs)
        try:
            want = model()
        except CellCacheError as e:
            want_exc = type(e)
        else:
            want_exc = None
        try:
            got = real()
        except CellCacheError as e:
            assert want_exc is not None, f"cache raised {e!r}, model returned {want!r}"
            assert type(e) is want_exc, f"cache raised {e!r}, model raised {want_exc.__name__}"
            assert snapshot(self.cache, seqs) == before, f"{e!r} changed the cache"
            if want_exc is BelowReclaimedError:
                assert re.search(MESSAGES[want_exc.__name__], str(e)), str(e)
            event(f"raised {want_exc.__name__}")
            return None, e
        assert want_exc is None, f"cache returned {got!r}, model raised {want_exc.__name__}"
        assert got == want, f"cache returned {got!r}, model {want!r}"
        return got, None

    def seq_id(self, data):
        options = [st.sampled_from(FOREIGN_IDS)]
        if self.model.live:
            options = [st.sampled_from(sorted(self.model.live))] * 4 + options
        dead = sorted(self.ever - self.model.live)
        if dead:
            options.append(st.sampled_from(dead))
        return data.draw(st.one_of(*options), label="seq")

    def near(self, seq):
        """Positions at or next to those seq holds, and around each windowed pool's
        floor for seq (where a rollback starts to be refused)."""
        m = self.model
        held = m.positions(seq) if seq in m.live else []
        near = {q + d for q in held for d in (0, 1)} | {0}
        for pool in m.pools:
            below, count = pool.reclaimed(seq) if seq in m.live else (0, 0)
            if count:
                near |= {below + d for d in range(-1, pool.window + 1)}
        return st.sampled_from(sorted(near))

    def handed_out(self, seq):
        """Records a new id; its serial is larger than every earlier one."""
        self.ever.add(seq)
        serial = self.cache.seq_serial(seq)
        assert all(serial > earlier for earlier in self.serials.values())
        self.serials[seq] = serial

    # -- sequence verbs
    @rule()
    def seq_new(self):
        got, _ = self.both(self.cache.seq_new, self.model.seq_new)
        if got is not None:
            self.handed_out(got)

    @rule(data=st.data())
    def seq_clone(self, data):
        src = self.seq_id(data)
        upto = data.draw(st.one_of(st.none(), self.near(src), st.integers(-2, 12)),
                         label="upto")
        got, _ = self.both(lambda: self.cache.seq_clone(src, upto=upto),
                           lambda: self.model.seq_clone(src, upto))
        if got is not None:
            self.handed_out(got)

    @rule(data=st.data())
    def holds_prefix(self, data):
        seq = self.seq_id(data)
        held = self.model.positions(seq) if seq in self.model.live else []
        upto = data.draw(st.one_of(st.sampled_from(held + [0, -1]), st.integers(0, 14)),
                         label="upto")
        self.both(lambda: self.cache.holds_prefix(seq, upto),
                  lambda: self.model.holds_prefix(seq, upto))

    @rule(data=st.data())
    def cells_owned_only_by(self, data):
        seqs = [self.seq_id(data) for _ in range(data.draw(st.integers(0, 4), label="n_seqs"))]
        pool = data.draw(st.integers(-1, len(self.model.pools)), label="pool")
        self.both(lambda: self.cache.cells_owned_only_by(seqs, pool=pool),
                  lambda: self.model.cells_owned_only_by(seqs, pool))

    @rule(data=st.data())
    def seq_rm(self, data):
        seq = self.seq_id(data)
        # Mostly bounds at or next to positions the sequence holds, or to the
        # edges of what its windowed pools still hold.
        near = self.near(seq)
        p0 = data.draw(st.one_of(near, near, st.integers(-2, 12),
                                 st.sampled_from([2**31, -(2**31) - 5])), label="p0")
        p1 = data.draw(st.one_of(st.none(), near, near, st.integers(-2, 14)), label="p1")
        self.both(lambda: self.cache.seq_rm(seq, p0=p0, p1=p1),
                  lambda: self.model.seq_rm(seq, p0, p1))

    @rule(data=st.data())
    def seq_rm_default(self, data):
        seq = self.seq_id(data)
        self.both(lambda: self.cache.seq_rm(seq), lambda: self.model.seq_rm(seq, 0, None))

    @rule(data=st.data())
    def seq_free(self, data):
        seq = self.seq_id(data)
        self.both(lambda: self.cache.seq_free(seq), lambda: self.model.seq_free(seq))

    @rule(data=st.data())
    def clear(self, data):
        # Rare, so that states stay non-trivial.
        if data.draw(st.integers(0, 4), label="clear_roll") == 0:
            self.both(self.cache.clear, self.model.clear)

    # -- step protocol
    def draw_seqs(self, data, size):
        """`size` token ids: live ones, sometimes with one unknown id among them."""
        live = sorted(self.model.live)
        if not live:
            return [self.seq_id(data) for _ in range(size)]
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=size, max_size=size),
                         label="seqs")
        if seqs and data.draw(st.integers(0, 7), label="poison") == 0:
            seqs[data.draw(st.integers(0, size - 1))] = self.seq_id(data)
        return seqs

    def declare(self, seqs):
        got, err = self.both(lambda: self.cache.declare_step(seqs),
                             lambda: self.model.declare_step(seqs))
        event(f"declare_step -> {type(err).__name__ if err else got}")
        return got

    @rule(data=st.data())
    def declare_step(self, data):
        n_free = self.model.admits
        size = data.draw(st.one_of(st.integers(0, n_free), st.integers(0, n_free + 3)),
                         label="n_tok")
        self.declare(self.draw_seqs(data, size))

    @rule(data=st.data())
    def forward(self, data):
        """A whole step: declare, then serve every layer in some order, sometimes
        with a sequence verb (successful or failing) between two layers."""
        n_free = self.model.admits
        size = data.draw(st.integers(0, n_free + 1), label="n_tok")
        if not self.declare(self.draw_seqs(data, size)):
            return
        order = data.draw(st.permutations(range(self.model.n_layers)), label="order")
        verb_at = data.draw(st.integers(0, 3 * len(order)), label="verb_at")
        for i, layer in enumerate(order):
            if i == verb_at and i > 0:
                verb = data.draw(st.sampled_from(
                    [self.seq_new, self.seq_rm_default, self.seq_free, self.seq_clone]),
                    label="mid_step_verb")
                verb(data) if verb != self.seq_new else verb()
            self.place(self.draw_positions(data), layer)

    @rule(data=st.data())
    def decode(self, data):
        """A whole step that extends one or two live sequences by 1-4 tokens each:
        long sequences, so that windowed pools reclaim (and refuse rollbacks)."""
        live = sorted(self.model.live)
        if not live:
            return
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True),
                         label="decoding")
        ids = [s for s in seqs for _ in range(data.draw(st.integers(1, 4), label="tokens"))]
        if not self.declare(ids):
            return
        positions = self.valid_positions(data)
        for layer in range(self.model.n_layers):
            self.place(positions, layer)

    def decode_one(self, seq):
        """One token of seq at its next position, every layer."""
        if self.declare([seq]):
            positions = [self.model.next_pos(seq)]
            for layer in range(self.model.n_layers):
                self.place(positions, layer)

    @rule(data=st.data())
    def decode_more(self, data):
        self.decode(data)

    def valid_positions(self, data):
        """Positions that extend each sequence of the declared step."""
        nxt = {}
        out = []
        for s in self.model.step_seqs:
            base = nxt.get(s, self.model.next_pos(s) if s in self.model.live else 0)
            gap = data.draw(st.sampled_from([0, 0, 0, 1, 3]), label="gap")
            out.append(base + gap)
            nxt[s] = base + gap + 1
        return out

    def draw_positions(self, data):
        m = self.model
        if m.state == "declared" and m.step_pos is not None:
            base = list(m.step_pos)
        elif m.state == "declared":
            base = self.valid_positions(data)
        else:
            base = [data.draw(st.integers(0, 12)) for _ in range(len(m.step_seqs))]
        how = data.draw(st.sampled_from(
            ["ok"] * 12 + ["random", "drop", "add", "rewrite", "repeat", "repeat", "backwards",
                          "swap", "negative"]),
            label="corruption")
        pos = list(base)
        if how == "random":
            pos = data.draw(st.lists(st.integers(-1, 12), min_size=len(pos), max_size=len(pos)))
        elif how == "drop" and pos:
            pos.pop()
        elif how == "add":
            pos.append(data.draw(st.integers(0, 12)))
        elif how == "rewrite" and pos:
            i = data.draw(st.integers(0, len(pos) - 1))
            held = m.positions(m.step_seqs[i]) if i < len(m.step_seqs) else []
            if held:
                pos[i] = data.draw(st.sampled_from(held))
        elif how in ("repeat", "backwards"):
            # A later token of a sequence at (or before) an earlier one's position.
            pairs = [(j, i) for i in range(min(len(pos), len(m.step_seqs))) for j in range(i)
                     if m.step_seqs[i] == m.step_seqs[j]]
            if pairs:
                j, i = data.draw(st.sampled_from(pairs), label="pair")
                pos[i] = pos[j] - (how == "backwards")
        elif how == "swap" and len(pos) > 1:
            i = data.draw(st.integers(1, len(pos) - 1))
            pos[i - 1], pos[i] = pos[i], pos[i - 1]
        elif how == "negative" and pos:
            pos[data.draw(st.integers(0, len(pos) - 1))] = -1
        return pos

    @rule(data=st.data())
    def place_step(self, data):
        m = self.model
        unserved = [layer for layer in range(m.n_layers) if layer not in m.served]
        layer_options = [st.integers(-2, m.n_layers + 1), st.sampled_from([-(2**40), 2**40])]
        if unserved:
            layer_options = [st.sampled_from(unserved)] * 6 + layer_options
        layer = data.draw(st.one_of(*layer_options), label="layer")
        self.place(self.draw_positions(data), layer)

    def place(self, positions, layer):
        m = self.model
        try:
            places = m.check_place(positions, layer)
        except CellCacheError as e:
            want = type(e)
            event(f"place_step -> {want.__name__}")
            before = self.snapshot()
            with pytest.raises(want, match=MESSAGES[want.__name__]) as info:
                self.cache.place_step(positions, layer=layer)
            assert type(info.value) is want, f"cache raised {info.value!r}, model {want.__name__}"
            assert self.snapshot() == before
            return
        event("place_step -> placed" if places else "place_step -> reused")
        placed = self.cache.place_step(positions, layer=layer)
        cells = [int(c) for c in placed.cells]
        assert placed.cells.dtype == np.int32 and placed.cells.shape == (len(positions),)
        pool = m.layer_pool[layer]
        if places:
            m.place(positions, [self.cache.pool(i).step_cells.tolist()
                                for i in range(len(m.pools))])
        assert cells == m.pools[pool].step_cells, "a layer reads its pool's placement"
        n_reclaimed = sum(p.reclaimed(s)[1] for p in m.pools for s in m.live)
        m.serve(layer)
        if sum(p.reclaimed(s)[1] for p in m.pools for s in m.live) > n_reclaimed:
            event("step reclaimed cells")
        check_served(self.cache, m, layer, placed)

    # -- comparisons after every rule
    def snapshot(self):
        return snapshot(self.cache, sorted(self.model.live))

    @invariant()
    def agrees(self):
        if not hasattr(self, "cache"):
            return
        c, m = self.cache, self.model
        check_agrees(c, m, self.serials)
        for s in (self.ever - m.live) | {FOREIGN_IDS[0], MAX_SEQS}:
            with pytest.raises(UnknownSequenceError, match=rf"unknown sequence id {s} \("):
                c.next_pos(s)
            with pytest.raises(UnknownSequenceError, match=rf"unknown sequence id {s} \("):
                c.seq_len(s)


CellCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCellCacheMachine = CellCacheMachine.TestCase


class PooledCellCacheMachine(CellCacheMachine):
    """The same rules on caches that always hold one pool per window policy, in
    longer runs: sequences grow past their windows, so windowed pools reclaim,
    reuse the cells and refuse rollbacks below what they hold."""

    ALWAYS_POOLED = True


PooledCellCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPooledCellCacheMachine = PooledCellCacheMachine.TestCase


# ----------------------------------------------------------------------------- bad input


def prefilled(n_cells=8, windows=(None,), n_layers=None, length=3):
    """A cache with sequence 0 holding positions 0..length-1 (step complete)."""
    c = CellCache(n_cells, n_layers=n_layers, windows=list(windows))
    a = c.seq_new()
    assert c.declare_step([a] * length)
    for layer in range(c.n_layers):
        c.place_step(list(range(length)), layer=layer)
    return c, a


@pytest.mark.parametrize("bad", [77, 255, 256, -1, 2**40])
@pytest.mark.parametrize("verb", ["next_pos", "seq_len", "seq_rm", "seq_free", "seq_clone",
                                  "declare_step"])
def test_unknown_id(verb, bad):
    c, a = prefilled()
    before = snapshot(c, [a])
    call = {
        "next_pos": lambda: c.next_pos(bad),
        "seq_len": lambda: c.seq_len(bad),
        "seq_rm": lambda: c.seq_rm(bad, 0, 1),
        "seq_free": lambda: c.seq_free(bad),
        "seq_clone": lambda: c.seq_clone(bad),
        "declare_step": lambda: c.declare_step([a, bad]),
    }[verb]
    shown = str(bad)
    with pytest.raises(UnknownSequenceError, match=rf"(?<![\d-]){shown}(?!\d)"):
        call()
    assert snapshot(c, [a]) == before
    c.check_invariants()


def test_freed_id_is_unknown_and_declaration_survives_a_failed_verb():
    c, a = prefilled()
    b = c.seq_clone(a, upto=2)
    c.seq_free(b)
    assert c.declare_step([a])
    before = snapshot(c, [a])
    for call in (lambda: c.seq_free(b), lambda: c.seq_rm(b), lambda: c.next_pos(b),
                 lambda: c.seq_clone(b), lambda: c.declare_step([b])):
        with pytest.raises(UnknownSequenceError, match=rf"\b{b}\b"):
            call()
    assert snapshot(c, [a]) == before
    # Failed verbs neither invalidate nor replace the declared step.
    st_ = c.place_step([3], layer=0)
    assert c.cell_positions()[st_.cells[0]] == 3
    c.check_invariants()


@pytest.mark.parametrize("positions, value, what", [
    ([1], 1, "rewrite"),              # position 1 is held
    ([0], 0, "rewrite"),
    ([3, 3], 3, "repeat"),            # repeated within the step
    ([4, 3], 3, "backwards"),         # goes backwards within the step
    ([5, -1], -1, "negative"),
])
def test_bad_positions(positions, value, what):
    c, a = prefilled()
    assert c.declare_step([a] * len(positions))
    before = snapshot(c, [a])
    with pytest.raises(PositionConflictError, match=rf"position {value}\b"):
        c.place_step(positions, layer=0)
    assert snapshot(c, [a]) == before
    c.check_invariants()
    # The declaration stands: corrected positions place.
    c.place_step(list(range(3, 3 + len(positions))), layer=0)
    assert c.next_pos(a) == 3 + len(positions)
    c.check_invariants()


def test_later_layer_must_repeat_the_placed_positions():
    c, a = prefilled(n_layers=2)
    assert c.declare_step([a])
    c.place_step([3], layer=0)
    before = snapshot(c, [a])
    with pytest.raises(PositionConflictError, match=r"\b4\b"):
        c.place_step([4], layer=1)
    assert snapshot(c, [a]) == before
    c.place_step([3], layer=1)
    c.check_invariants()


@pytest.mark.parametrize("value", [2**31 - 1, 2**31, 2**40])
def test_position_beyond_int32(value):
    # Positions are int32 in the cache; a larger one must be refused, not wrapped.
    c, a = prefilled()
    assert c.declare_step([a])
    before = snapshot(c, [a])
    with pytest.raises(PositionConflictError, match=rf"\b{value}\b"):
        c.place_step([value], layer=0)
    assert snapshot(c, [a]) == before
    c.place_step([3], layer=0)
    c.check_invariants()


@pytest.mark.parametrize("n", [0, 1, 3])
def test_count_mismatch(n):
    c, a = prefilled()
    assert c.declare_step([a, a])
    before = snapshot(c, [a])
    with pytest.raises(PositionConflictError, match=rf"\b{n}\b"):
        c.place_step(list(range(3, 3 + n)), layer=0)
    assert snapshot(c, [a]) == before
    c.check_invariants()


@pytest.mark.parametrize("layer", [-1, 2, 3, -(2**31)])
def test_layer_out_of_range(layer):
    c, a = prefilled(n_layers=2, windows=[None, 2])
    assert c.declare_step([a])
    before = snapshot(c, [a])
    with pytest.raises(LayerOutOfRangeError, match=rf"(?<![\d-]){layer}(?!\d)"):
        c.place_step([3], layer=layer)
    with pytest.raises(LayerOutOfRangeError, match=rf"(?<![\d-]){layer}(?!\d)"):
        c.window(layer)
    assert snapshot(c, [a]) == before
    c.place_step([3], layer=1)  # the declaration stands
    c.check_invariants()


def test_repeated_layer_and_undeclared_forward():
    c, a = prefilled(n_layers=2)
    assert c.declare_step([a])
    c.place_step([3], layer=1)
    before = snapshot(c, [a])
    with pytest.raises(StepNotDeclaredError, match=r"layer 1\b"):
        c.place_step([3], layer=1)
    assert snapshot(c, [a]) == before
    c.place_step([3], layer=0)  # step complete
    with pytest.raises(StepNotDeclaredError, match=r"layer 0\b"):
        c.place_step([4], layer=0)
    assert c.next_pos(a) == 4
    c.check_invariants()


def test_verb_invalidates_and_redeclare_recovers():
    c, a = prefilled(n_layers=2)
    assert c.declare_step([a])
    c.place_step([3], layer=0)
    b = c.seq_new()
    with pytest.raises(StepInvalidatedError, match=MESSAGES["StepInvalidatedError"]):
        c.place_step([3], layer=1)
    assert c.declare_step([b])
    c.place_step([0], layer=0)
    c.place_step([0], layer=1)
    c.check_invariants()


@pytest.mark.parametrize("kwargs, value", [
    (dict(n_cells=0), r"\b0\b"),
    (dict(n_cells=-5), r"-5"),
    (dict(n_cells=8, windows=[0]), r"\b0\b"),
    (dict(n_cells=8, windows=[None, -3]), r"-3"),
    (dict(n_cells=8, n_layers=2, windows=[None, 4, None]), r"\b3\b"),
    (dict(n_cells=8, n_layers=3, windows=[None, 4]), r"\b2\b"),
    (dict(n_cells=8, n_layers=0), r"\b0\b"),
    (dict(n_cells=8, windows=[]), r"\b0\b"),
])
def test_bad_config(kwargs, value):
    with pytest.raises(InvalidConfigError, match=value):
        CellCache(**kwargs)


def test_invalid_config_is_a_value_error():
    assert issubclass(InvalidConfigError, ValueError)
    assert issubclass(InvalidConfigError, CellCacheError)
    # Caught as a plain ValueError, which is the point of this test.
    with pytest.raises(ValueError, match=r"n_cells must lie in \[1, \d+\], got 0"):
        CellCache(0)


def test_more_than_256_live_sequences():
    c, a = prefilled()
    ids = [a] + [c.seq_new() for _ in range(MAX_SEQS - 1)]
    assert ids == list(range(MAX_SEQS))
    assert c.declare_step([a])
    before = snapshot(c, ids)
    with pytest.raises(CapacityError, match=r"256"):
        c.seq_new()
    with pytest.raises(CapacityError, match=r"256"):
        c.seq_clone(a)
    assert snapshot(c, ids) == before
    c.place_step([3], layer=0)  # the failed verbs did not invalidate the step
    c.seq_free(100)
    assert c.seq_new() == 100  # the lowest free id again
    c.check_invariants()


def test_bad_ranges():
    c, a = prefilled()
    before = snapshot(c, [a])
    with pytest.raises(PositionConflictError, match=r"-1"):
        c.seq_rm(a, -1)
    with pytest.raises(PositionConflictError, match=r"\[2, 1\)"):
        c.seq_rm(a, 2, 1)
    with pytest.raises(PositionConflictError, match=r"-4"):
        c.seq_clone(a, upto=-4)
    assert snapshot(c, [a]) == before
    c.check_invariants()


def test_oversized_declare_keeps_the_earlier_declaration():
    c, a = prefilled(n_cells=4)
    assert c.declare_step([a])
    before = snapshot(c, [a])
    assert c.declare_step([a, a]) is False
    assert snapshot(c, [a]) == before
    c.place_step([3], layer=0)  # the one-token declaration still stands
    assert c.free_cells == 0
    c.check_invariants()


def test_sizes_beyond_the_limits_are_refused_with_the_value_passed():
    for kwargs, value in [(dict(n_cells=8, n_layers=2**40), "1099511627776"),
                          (dict(n_cells=2**40), "1099511627776"),
                          (dict(n_cells=2**31 - 1), "2147483647"),
                          (dict(n_cells=8, n_layers=5000), "5000"),
                          (dict(n_cells=8, windows=[2**40]), "1099511627776")]:
        with pytest.raises(InvalidConfigError, match=value):
            CellCache(**kwargs)


def test_non_integer_positions_are_refused_not_truncated():
    c, a = prefilled()
    assert c.declare_step([a, a])
    before = snapshot(c, [a])
    for bad in (np.array([3.0, 4.9]), [3.5, 4.0], np.array([True, False]), ["3", "4"]):
        with pytest.raises(TypeError, match="integers"):
            c.place_step(bad, layer=0)
        assert snapshot(c, [a]) == before
    c.place_step(np.array([3, 4], dtype=np.int32), layer=0)
    c.check_invariants()


def test_partly_served_step_is_abandoned_by_a_new_declaration():
    c, a = prefilled(n_layers=2)
    assert c.declare_step([a])
    c.place_step([3], layer=0)  # the forward stopped here: layer 1 never wrote position 3
    assert c.declare_step([a])
    assert c.next_pos(a) == 3 and c.seq_len(a) == 3
    c.place_step([3], layer=0)
    st = c.place_step([3], layer=1)
    used = c.cell_positions()[:st.mask.shape[1]]
    assert sorted(used[st.mask[0]].tolist()) == [0, 1, 2, 3]
    c.check_invariants()


# ----------------------------------------------------------------------------- pools


def decoded(steps=10, margin=1):
    """Layers [window 4, full] in two pools (16 and 32 cells); sequence 0 decoded
    positions 0..steps-1 one a step, so its window-4 pool reclaimed below
    steps - 4 - margin."""
    c = CellCache(32, windows=[4, None], window_cells={4: 16}, retained_margin=margin)
    a = c.seq_new()
    for p in range(steps):
        assert c.declare_step([a])
        for layer in range(2):
            c.place_step([p], layer=layer)
    return c, a


def test_pools_are_one_per_window_only_when_asked_for():
    c = CellCache(16, windows=[4, None, 4])
    assert c.n_pools == 1 and not c.pool(0).reclaims and c.pool(0).layers == [0, 1, 2]
    c = CellCache(16, windows=[4, None, 4], window_cells={4: 9}, retained_margin=0)
    assert c.n_pools == 2
    assert [c.pool_of(layer) for layer in range(3)] == [0, 1, 0]
    assert (c.pool(0).window, c.pool(0).capacity, c.pool(0).layers) == (4, 9, [0, 2])
    assert (c.pool(1).window, c.pool(1).capacity, c.pool(1).reclaims) == (None, 16, False)
    assert CellCache(16, windows=[4], window_cells={4: 40}).retained_margin == 32


@pytest.mark.parametrize("kwargs, value", [
    (dict(windows=[4, None], window_cells={8: 20}), r"window 8: no layer has that window"),
    (dict(windows=[4, 2], window_cells={4: 40}), r"window 2 has none"),
    (dict(windows=[4], window_cells={}), r"window 4 has none, got \{\}"),
    (dict(windows=[4], window_cells={4: 5}, retained_margin=1), r"must lie in \[6, .*got 5"),
    (dict(windows=[4], window_cells={4: 20}, retained_margin=-1), r"retained_margin.*got -1"),
    (dict(windows=[4], window_cells={4: 2**40}), r"1099511627776"),
    (dict(windows=[None], window_cells={4: 20}), r"window 4: no layer has that window"),
])
def test_pool_sizes_that_do_not_fit_the_layers(kwargs, value):
    with pytest.raises(InvalidConfigError, match=value) as info:
        CellCache(32, **kwargs)
    assert re.search(MESSAGES["InvalidConfigError"], str(info.value))


@pytest.mark.parametrize("call, value", [
    (lambda c, a: c.seq_rm(a, 7), r"from position 7\b.*below 5\b.*>= 8\b"),
    (lambda c, a: c.seq_rm(a, 1), r"from position 1\b"),
    (lambda c, a: c.seq_rm(a, 2, 6), r"range starting below 5 must start at 0 and reach 5"),
    (lambda c, a: c.seq_rm(a, 0, 4), r"range starting below 5"),
    (lambda c, a: c.seq_clone(a, upto=6), r"seq_clone of sequence 0 upto 6\b"),
])
def test_below_reclaimed_is_refused_and_changes_nothing(call, value):
    c, a = decoded()  # the window-4 pool holds 5..9 of a (floor 10 - 4 - 1)
    assert c.reclaimed(a, 0) == (5, 5) and c.reclaimed(a, 1) == (0, 0)
    before = snapshot(c, [a])
    with pytest.raises(BelowReclaimedError, match=value) as info:
        call(c, a)
    assert re.search(MESSAGES["BelowReclaimedError"], str(info.value))
    assert snapshot(c, [a]) == before and c.n_sequences == 1
    c.check_invariants()


def test_rollbacks_and_forks_the_pools_still_hold_pass():
    c, a = decoded()
    assert [c.holds_prefix(a, upto) for upto in (0, 1, 7, 8, 10, 99)] == \
        [True, False, False, True, True, True]
    b = c.seq_clone(a, upto=8)  # a query at 8 sees 5..8: all kept
    assert (c.next_pos(b), c.seq_len(b), c.reclaimed(b, 0)) == (8, 8, (5, 5))
    c.seq_rm(a, 8)
    c.seq_rm(a, 6, 7)  # a middle range at or above the floor
    assert (c.next_pos(a), c.seq_len(a)) == (8, 7)
    c.seq_rm(b, 0, 5)  # from 0 past the floor: every reclaimed position goes
    assert (c.seq_len(b), c.reclaimed(b, 0)) == (3, (0, 0))
    c.seq_rm(a, 0)
    assert (c.next_pos(a), c.seq_len(a), c.reclaimed(a, 0)) == (0, 0, (0, 0))
    c.check_invariants()


def test_a_pool_index_out_of_range_is_named():
    c, a = decoded()
    for bad in (2, -1, 2**40):
        with pytest.raises(InvalidConfigError, match=rf"pool {bad} is out of range"):
            c.pool(bad)
    with pytest.raises(InvalidConfigError, match=r"pool 5 is out of range \[0, 2\)"):
        c.reclaimed(a, 5)
    with pytest.raises(UnknownSequenceError, match=r"unknown sequence id 3\b"):
        c.reclaimed(3, 0)


def test_below_reclaimed_error_is_a_cell_cache_error():
    assert issubclass(BelowReclaimedError, CellCacheError)
    assert not issubclass(BelowReclaimedError, ValueError)
