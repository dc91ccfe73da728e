"""The cell cache by brute force, written from SPEC sections 1 and 12 and the
pool rules of cpp/cellcache/cell_pool.h: the reference of the core's
hypothesis state machine (test_core_state_machine.py) and of its random
differential streams (test_core_fuzz.py).

The model keeps, per live sequence, every position it holds (``logical``:
what a cache that never reclaims would hold), and per pool every cell as
(pos, owner set) plus what the pool gave up of each sequence. Which cells a
step uses is the cache's free choice: the model is told them (``place``) and
only checks that they were free and distinct. Reclaim is recomputed here from
its rule, each cell by scanning; the masks a layer may attend are checked both
against the model's pool (exact mask) and against ``logical`` (the positions
the SPEC's rule lets a token see if nothing were ever reclaimed): reclaim must
never change them.
"""

import numpy as np

from executorch_cellcache import (BelowReclaimedError, CapacityError, InvalidConfigError,
                                  LayerOutOfRangeError, PositionConflictError,
                                  StepInvalidatedError, StepNotDeclaredError,
                                  UnknownSequenceError)

MAX_SEQS = 256
DEFAULT_MARGIN = 32


def window_sees(window, key_pos, query_pos):
    """SPEC 1: a query at p sees key k iff k <= p and (full, or p - k < W)."""
    if key_pos > query_pos:
        return False
    return window is None or query_pos - key_pos < window


class Pool:
    """One pool: cells (None = empty, else [pos, set(owners)]), and per sequence
    (below, count): the pool gave up the sequence's `count` positions < below."""

    def __init__(self, n_cells, window, reclaims):
        self.cells = [None] * n_cells
        self.window = window
        self.reclaims = reclaims
        self.gave_up = {}
        self.freed_by_reclaim = set()  # cells reclaim emptied, not placed into since
        self.step_cells = None
        self.step_used_end = 0

    @property
    def free_cells(self):
        return self.cells.count(None)

    @property
    def used_end(self):
        return max((i + 1 for i, c in enumerate(self.cells) if c is not None), default=0)

    def cell_positions(self):
        return [-1 if c is None else c[0] for c in self.cells]

    def reclaimed(self, seq):
        return self.gave_up.get(seq, (0, 0))

    def drop(self, seq, keep):
        """seq stops owning every cell whose position fails keep(pos)."""
        n = 0
        for i, c in enumerate(self.cells):
            if c is not None and seq in c[1] and not keep(c[0]):
                c[1].discard(seq)
                n += 1
                if not c[1]:
                    self.cells[i] = None
        return n

    def owns_any(self, seq):
        return any(c is not None and seq in c[1] for c in self.cells)


class Model:
    """The cache as the SPEC and cell_pool.h describe it, by brute force.

    window_cells: None = one pool for every layer (nothing reclaimed); else
    {W: cells} = one pool per distinct window, in order of first appearance."""

    def __init__(self, n_cells, windows, window_cells=None, margin=None):
        self.windows = list(windows)  # one per layer
        self.margin = DEFAULT_MARGIN if margin is None else margin
        policies = list(dict.fromkeys(self.windows))
        if window_cells:
            self.pools = [Pool(n_cells if w is None else window_cells[w], w, w is not None)
                          for w in policies]
            self.layer_pool = [policies.index(w) for w in self.windows]
        else:
            self.pools = [Pool(n_cells, None, False)]
            self.layer_pool = [0] * len(self.windows)
        self.logical = {}  # live seq -> set of positions it holds, reclaimed or not
        self.reused = 0  # tokens placed into cells that reclaim had emptied
        # Step: state in {"none", "declared", "invalidated"}.
        self.state = "none"
        self.step_seqs = []
        self.step_pos = None
        self.served = set()

    # -- derived state
    @property
    def live(self):
        return self.logical.keys()

    @property
    def n_layers(self):
        return len(self.windows)

    @property
    def free_cells(self):
        """Pool 0's, as CellCache.free_cells."""
        return self.pools[0].free_cells

    @property
    def admits(self):
        """The most tokens a step may declare: every pool must place each."""
        return min(p.free_cells for p in self.pools)

    def positions(self, seq):
        return sorted(self.logical.get(seq, ()))

    def next_pos(self, seq):
        held = self.logical[seq]
        return max(held) + 1 if held else 0

    # -- verbs: each returns the expected value or raises the expected class
    def _live(self, seq):
        if seq not in self.logical:
            raise UnknownSequenceError(seq)

    def _invalidate(self):
        if self.state == "declared":
            self.state = "invalidated"

    def _partial(self):
        return self.state == "declared" and self.step_pos is not None \
            and len(self.served) < self.n_layers

    def _abandon_partial(self):
        """A step placed but not yet served on every layer holds positions whose K/V
        the remaining layers never wrote: a verb or a new declaration removes them."""
        if self._partial():
            for s, p in zip(self.step_seqs, self.step_pos):
                self.logical[s].discard(p)
                for pool in self.pools:
                    pool.drop(s, lambda q, p=p: q != p)

    def _remove(self, seq, p0, p1):
        inside = lambda q: p0 <= q and (p1 is None or q < p1)  # noqa: E731
        self.logical[seq] = {q for q in self.logical[seq] if not inside(q)}
        for pool in self.pools:
            pool.drop(seq, lambda q: not inside(q))
            below, _ = pool.reclaimed(seq)
            if p0 == 0 and (p1 is None or p1 >= below):
                pool.gave_up.pop(seq, None)

    def _keeps_windows(self, seq, p0, p1):
        """BelowReclaimedError when a windowed pool gave up positions of seq that
        removing [p0, p1) would need back (the rule of CellPool::check_keeps_window),
        judged as if a partly served step were already abandoned."""
        pending = set()
        if self._partial():
            pending = {p for s, p in zip(self.step_seqs, self.step_pos) if s == seq}
        held = sorted(self.logical[seq] - pending)
        top = held[-1] if held else -1
        for pool in self.pools:
            below, count = pool.reclaimed(seq)
            if count == 0:
                continue
            if p1 is not None and p1 <= top:  # a middle range
                ok = p0 >= below or (p0 == 0 and p1 >= below)
            elif p0 == 0:
                ok = True
            else:
                kept = [q for q in held if below <= q < p0]
                ok = bool(kept) and kept[-1] + 1 - pool.window + 1 >= below
            if not ok:
                raise BelowReclaimedError(seq, p0, p1)

    def seq_new(self):
        free = [s for s in range(MAX_SEQS) if s not in self.logical]
        if not free:
            raise CapacityError()
        self._abandon_partial()
        self.logical[free[0]] = set()
        self._invalidate()
        return free[0]

    def seq_clone(self, src, upto):
        self._live(src)
        if upto is not None and upto < 0:
            raise PositionConflictError(upto)
        if upto is not None:
            self._keeps_windows(src, upto, None)
        dst = self.seq_new()
        below_upto = lambda q: upto is None or q < upto  # noqa: E731
        self.logical[dst] = {q for q in self.logical[src] if below_upto(q)}
        for pool in self.pools:
            for c in pool.cells:
                if c is not None and src in c[1] and below_upto(c[0]):
                    c[1].add(dst)
            if pool.owns_any(dst) and src in pool.gave_up:
                pool.gave_up[dst] = pool.gave_up[src]
        return dst

    def seq_rm(self, seq, p0, p1):
        self._live(seq)
        if p0 < 0 or (p1 is not None and p1 < p0):
            raise PositionConflictError(p0, p1)
        if p1 != p0:  # an empty range removes nothing: never refused
            self._keeps_windows(seq, p0, p1)
        self._abandon_partial()
        self._remove(seq, p0, p1)
        self._invalidate()

    def seq_free(self, seq):
        self._live(seq)
        self._abandon_partial()
        self._remove(seq, 0, None)
        del self.logical[seq]
        self._invalidate()

    def clear(self):
        for pool in self.pools:
            pool.cells = [None] * len(pool.cells)
            pool.gave_up = {}
        self.logical = {}
        self._invalidate()

    def holds_prefix(self, seq, upto):
        self._live(seq)
        if upto < 0:
            raise PositionConflictError(upto)
        try:
            self._keeps_windows(seq, upto, None)
        except BelowReclaimedError:
            return False
        return True

    def cells_owned_only_by(self, seqs, pool=0):
        for s in seqs:
            self._live(s)
        if not 0 <= pool < len(self.pools):
            raise InvalidConfigError(pool)
        return sum(c is not None and c[1] <= set(seqs) for c in self.pools[pool].cells)

    def declare_step(self, seq_ids):
        for s in seq_ids:
            self._live(s)
        if len(seq_ids) > self.admits:
            return False
        self._abandon_partial()
        self.state = "declared"
        self.step_seqs = list(seq_ids)
        self.step_pos = None
        self.served = set()
        return True

    def check_place(self, positions, layer):
        """Raises what place_step must raise; returns whether it would place cells."""
        if not 0 <= layer < self.n_layers:
            raise LayerOutOfRangeError(layer)
        if self.state == "invalidated":
            raise StepInvalidatedError()
        if self.state == "none":
            raise StepNotDeclaredError()
        if layer in self.served:
            raise StepNotDeclaredError(layer)
        if len(positions) != len(self.step_seqs):
            raise PositionConflictError(len(positions))
        if self.step_pos is not None:
            if list(positions) != self.step_pos:
                raise PositionConflictError(positions)
            return False
        last = {}
        for s, p in zip(self.step_seqs, positions):
            if p < 0 or p >= 2**31 - 1:
                raise PositionConflictError(p)
            if p in self.logical[s]:
                raise PositionConflictError(p)  # a rewrite
            if s not in last:
                last[s] = self.next_pos(s) - 1
            if p <= last[s]:
                raise PositionConflictError(p)  # backwards or repeated
            last[s] = p
        return True

    def place(self, positions, pool_cells):
        """The step's positions land in pool_cells[i] ([n_tok] cells) of pool i."""
        for pool, cells in zip(self.pools, pool_cells):
            assert len(cells) == len(self.step_seqs)
            assert len(set(cells)) == len(cells), f"a step placed two tokens in one cell: {cells}"
            for c, s, p in zip(cells, self.step_seqs, positions):
                assert 0 <= c < len(pool.cells), f"cell {c} out of range"
                assert pool.cells[c] is None, f"step placed into occupied cell {c}"
                pool.cells[c] = [p, {s}]
                self.reused += c in pool.freed_by_reclaim
                pool.freed_by_reclaim.discard(c)
            pool.step_cells = list(cells)
            pool.step_used_end = pool.used_end
        for s, p in zip(self.step_seqs, positions):
            self.logical[s].add(p)
        self.step_pos = list(positions)

    def serve(self, layer):
        self.served.add(layer)
        if len(self.served) == self.n_layers:
            self.state = "none"
            self._reclaim()

    def _reclaim(self):
        """A completed step: each windowed pool gives up each step sequence's
        positions below min(next_pos - W - R, its first step position - W + 1)."""
        first = {}
        for s, p in zip(self.step_seqs, self.step_pos):
            first.setdefault(s, p)
        for s, p_first in first.items():
            for pool in self.pools:
                if not pool.reclaims:
                    continue
                floor = min(self.next_pos(s) - pool.window - self.margin,
                            p_first - pool.window + 1)
                empty = {i for i, c in enumerate(pool.cells) if c is None}
                n = pool.drop(s, lambda q: q >= floor)
                pool.freed_by_reclaim |= {i for i, c in enumerate(pool.cells) if c is None} - empty
                if n:
                    pool.gave_up[s] = (floor, pool.reclaimed(s)[1] + n)

    def expected_mask(self, layer):
        """bool [n_tok, pool's used_end at placement] by the rule, over the model's pool."""
        w = self.windows[layer]
        pool = self.pools[self.layer_pool[layer]]
        end = pool.step_used_end
        mask = np.zeros((len(self.step_seqs), end), dtype=bool)
        for i, (s, p) in enumerate(zip(self.step_seqs, self.step_pos)):
            for j in range(end):
                c = pool.cells[j]
                mask[i, j] = c is not None and s in c[1] and window_sees(w, c[0], p)
        return mask

    def expected_attends(self, layer):
        """Per token, the positions the rule lets it see if nothing were reclaimed."""
        w = self.windows[layer]
        return [sorted(q for q in self.logical[s] if window_sees(w, q, p))
                for s, p in zip(self.step_seqs, self.step_pos)]


# ----------------------------------------------------------------------------- checks


def check_served(cache, model, layer, placed):
    """A served layer's mask against the model: the exact mask over the model's
    pool, the positions each token attends against what it would attend had
    nothing been reclaimed, and the layer's attention plan (its ranges attend
    the same positions; its anchor, group_reclaimed, counts every position of the
    sequence below a range's first cell)."""
    pool_index = model.layer_pool[layer]
    pool = model.pools[pool_index]
    cell_pos = pool.cell_positions()
    mask = np.asarray(placed.mask)
    assert mask.dtype == np.bool_
    assert mask.shape == (len(model.step_seqs), pool.step_used_end)
    want_att = model.expected_attends(layer)
    got_att = [sorted(cell_pos[j] for j in np.flatnonzero(row)) for row in mask]
    assert got_att == want_att, f"layer {layer} window {model.windows[layer]}"
    assert np.array_equal(mask, model.expected_mask(layer))
    plan = cache.attend_plan(layer)
    groups = list(dict.fromkeys(model.step_seqs))
    for i, (s, p) in enumerate(zip(model.step_seqs, model.step_pos)):
        g = int(plan["tok_group"][i])
        assert groups[g] == s
        b, e = int(plan["tok_begin"][i]), int(plan["tok_end"][i])
        attended = [cell_pos[c] for c in plan["cells"][b:e]]
        assert attended == want_att[i]
        if attended:
            anchor = int(plan["group_reclaimed"][g]) + b - int(plan["group_begin"][g])
            assert anchor == sum(q < attended[0] for q in model.logical[s]), \
                f"token {i}: cell index {anchor} from the anchor"


def check_agrees(cache, model, serials=None):
    """Every query of the cache against the model, and check_invariants()."""
    c, m = cache, model
    c.check_invariants()
    assert c.n_pools == len(m.pools)
    for index, pool in enumerate(m.pools):
        got = c.pool(index)
        assert got.capacity == len(pool.cells)
        assert got.free_cells == pool.free_cells
        assert got.used_end == pool.used_end
        assert got.cell_positions.tolist() == pool.cell_positions()
        assert got.reclaims == pool.reclaims
    assert c.free_cells == m.free_cells
    assert c.used_end == m.pools[0].used_end
    assert c.cell_positions().tolist() == m.pools[0].cell_positions()
    for s in m.live:
        assert c.next_pos(s) == m.next_pos(s)
        assert c.seq_len(s) == len(m.logical[s])
        for index, pool in enumerate(m.pools):
            assert c.reclaimed(s, index) == pool.reclaimed(s)
        if serials is not None:
            assert c.seq_serial(s) == serials[s]
    admits = m.admits
    for n in (-1, 0, admits, admits + 1):
        assert c.can_extend(n) == (0 <= n <= admits)


def snapshot(cache, seqs):
    """What a failed call must leave unchanged."""
    return ([(p.free_cells, p.used_end, p.cell_positions.tolist())
             for p in (cache.pool(i) for i in range(cache.n_pools))],
            [(cache.next_pos(s), cache.seq_len(s),
              [cache.reclaimed(s, i) for i in range(cache.n_pools)]) for s in seqs])
