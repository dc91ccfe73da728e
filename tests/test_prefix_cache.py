"""The prefix cache's index (tests/spec/prefix_cache.py) on a real CellCache, no
model: a hypothesis state machine drives requests (match, clone, evict for
room, extend, insert), running sequences that share cached cells, bounds,
evictions and clears, and compares with brute force:

- match = the longest common prefix over the cached token lists, capped at
  len(prompt) - 1, served by the most recently used entry sharing it;
- dedupe, LRU order and eviction = a list model of the rules in the module
  docstring;
- cells = an ownership model of its own (each position a test sequence ever
  placed is a distinct cell; clones share them), never the cache's counts.

Plus bad input: bounds out of range, inserting a sequence that does not hold
its tokens, entries changed or freed behind the index's back.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from executorch_cellcache.cache._core import MAX_SEQUENCES, CellCache
from executorch_cellcache.cache.errors import InvalidConfigError, UnknownSequenceError
from spec.prefix_cache import PrefixCache


def extend(cache, seq, start, n):
    """Places positions start .. start+n-1 of seq (a step on every layer)."""
    if n:
        assert cache.declare_step([seq] * n)
        for layer in range(cache.n_layers):
            cache.place_step(list(range(start, start + n)), layer)


def lcp(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


class Oracle:
    """Brute force: cells as identities per (sequence, position), entries as
    token lists with a last-used clock."""

    def __init__(self, n_cells, max_cells):
        self.n_cells = n_cells
        self.max_cells = max_cells
        self.cells = {}      # live test sequence -> {position: cell identity}
        self.entries = {}    # seq -> [tokens, last_used]
        self.clock = 0
        self.next_cell = 0

    # -- cells
    def new_cells(self, seq, start, n):
        for p in range(start, start + n):
            self.cells[seq][p] = self.next_cell
            self.next_cell += 1

    def used(self, seqs=None):
        seqs = self.cells if seqs is None else seqs
        return set().union(*[set(self.cells[s].values()) for s in seqs])

    @property
    def free(self):
        return self.n_cells - len(self.used())

    def reclaim(self, victims):
        others = [s for s in self.cells if s not in victims]
        return len(self.used(victims) - self.used(others)) if victims else 0

    def free_seq(self, seq):
        del self.cells[seq]
        self.entries.pop(seq, None)

    # -- index
    def touch(self, seq):
        self.clock += 1
        self.entries[seq][1] = self.clock

    def lru(self):
        return sorted(self.entries, key=lambda s: self.entries[s][1])

    def latest(self, seqs):
        return max(seqs, key=lambda s: self.entries[s][1])

    def match(self, prompt):
        if not self.entries:
            return None, 0
        best = max(lcp(t, prompt) for t, _ in self.entries.values())
        usable = min(best, len(prompt) - 1)
        if usable <= 0:
            return None, 0
        seq = self.latest([s for s, (t, _) in self.entries.items() if lcp(t, prompt) == best])
        self.touch(seq)
        return seq, usable

    def evict(self, cells, ids, keep, live_ids):
        if self.free >= cells and MAX_SEQUENCES - live_ids >= ids:
            return True
        victims = [s for s in self.lru() if s != keep]
        if self.free + self.reclaim(victims) < cells or \
                MAX_SEQUENCES - live_ids + len(victims) < ids:
            return False
        for s in victims:
            self.free_seq(s)
            live_ids -= 1
            if self.free >= cells and MAX_SEQUENCES - live_ids >= ids:
                break
        return True

    def insert(self, tokens, seq):
        if self.max_cells is not None and len(tokens) > self.max_cells:
            tokens = tokens[:self.max_cells]
            self.cells[seq] = {p: c for p, c in self.cells[seq].items() if p < self.max_cells}
        if not tokens:
            self.free_seq(seq)
            self.enforce_bound()
            return
        covering = [s for s, (t, _) in self.entries.items() if t[:len(tokens)] == tokens]
        if covering:
            self.free_seq(seq)
            self.touch(self.latest(covering))
            self.enforce_bound()
            return
        for s, (t, _) in list(self.entries.items()):
            if tokens[:len(t)] == t:
                self.free_seq(s)
        self.entries[seq] = [tokens, 0]
        self.touch(seq)
        self.enforce_bound(keep=seq)

    def enforce_bound(self, keep=None):
        if self.max_cells is None:
            return
        while self.reclaim(list(self.entries)) > self.max_cells:
            self.free_seq(next(s for s in self.lru() if s != keep))


TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=10)


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(n_cells=st.integers(6, 40), data=st.data())
    def setup(self, n_cells, data):
        max_cells = data.draw(st.one_of(st.none(), st.integers(0, n_cells)), label="max_cells")
        self.cache = CellCache(n_cells, windows=[None])
        self.index = PrefixCache(self.cache, max_cells=max_cells)
        self.oracle = Oracle(n_cells, max_cells)
        self.running = []  # (seq, tokens) of requests that have not finished

    def start(self, seq, src, upto):
        self.oracle.cells[seq] = {p: c for p, c in self.oracle.cells.get(src, {}).items()
                                  if p < upto}

    @rule(prompt=TOKENS, generated=st.lists(st.integers(1, 3), max_size=4),
          keep_running=st.booleans())
    def request(self, prompt, generated, keep_running):
        """What a scheduler does for a request: match, clone, make room, prefill."""
        if len(self.running) >= 3:
            keep_running = False
        got = self.index.match(prompt)
        assert got == self.oracle.match(prompt), f"prompt {prompt}"
        cached, upto = got
        seq = self.cache.seq_clone(cached, upto=upto) if cached is not None \
            else self.cache.seq_new()
        self.start(seq, cached, upto)
        tokens = prompt + generated
        need = len(tokens) - upto
        ok = self.index.evict(need, keep=cached)
        assert ok == self.oracle.evict(need, 0, cached, self.cache.n_sequences)
        if not ok:
            self.cache.seq_free(seq)
            self.oracle.free_seq(seq)
            return
        extend(self.cache, seq, upto, need)
        self.oracle.new_cells(seq, upto, need)
        if keep_running:
            self.running.append((seq, tokens))
        else:
            self.insert(tokens, seq)

    def insert(self, tokens, seq):
        self.index.insert(tokens, seq)
        self.oracle.insert(tokens, seq)

    @rule(data=st.data())
    def finish_running(self, data):
        if self.running:
            i = data.draw(st.integers(0, len(self.running) - 1), label="which")
            seq, tokens = self.running.pop(i)
            self.insert(tokens, seq)

    @rule(data=st.data())
    def fork_running(self, data):
        """A request's n > 1 samples: clones sharing all its cells."""
        if self.running and len(self.running) < 4:
            seq, tokens = self.running[data.draw(st.integers(0, len(self.running) - 1))]
            fork = self.cache.seq_clone(seq)
            self.start(fork, seq, len(tokens))
            self.running.append((fork, tokens))

    @rule(data=st.data())
    def abandon_running(self, data):
        """A request stopped by an error: freed, not cached."""
        if self.running:
            seq, _ = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
            self.cache.seq_free(seq)
            self.oracle.free_seq(seq)
            self.index.enforce_bound()
            self.oracle.enforce_bound()

    @rule(cells=st.integers(0, 45), ids=st.sampled_from([0, 0, 1, MAX_SEQUENCES - 2,
                                                         MAX_SEQUENCES]))
    def evict(self, cells, ids):
        live = self.cache.n_sequences
        assert self.index.evict(cells, ids) == self.oracle.evict(cells, ids, None, live)

    @rule(outside=st.booleans())
    def clear(self, outside):
        if outside:  # runner.cache.clear(): the index must notice, free nothing twice
            self.cache.clear()
            self.oracle.cells.clear()
            self.oracle.entries.clear()
            self.running.clear()
            assert len(self.index) == 0
        else:
            self.index.clear()
            for seq in list(self.oracle.entries):
                self.oracle.free_seq(seq)

    @invariant()
    def agrees(self):
        if not hasattr(self, "cache"):
            return
        c, o = self.cache, self.oracle
        c.check_invariants()
        assert self.index.seqs() == o.lru()
        for seq in o.entries:
            assert self.index.tokens(seq) == o.entries[seq][0]
            assert c.seq_len(seq) == c.next_pos(seq) == len(o.entries[seq][0])
        assert self.index.reclaimable_cells() == o.reclaim(list(o.entries))
        assert c.free_cells == o.free
        assert c.n_sequences == len(o.cells)
        if o.max_cells is not None:
            assert self.index.reclaimable_cells() <= o.max_cells
        for seq, tokens in self.running:  # eviction never takes a running request's cells
            assert c.seq_len(seq) == c.next_pos(seq) == len(tokens)
            assert c.seq_len(seq) == len(o.cells[seq])


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


# ----------------------------------------------------------------------------- examples


def cached(cache, index, tokens, src=None, upto=0):
    seq = cache.seq_clone(src, upto=upto) if src is not None else cache.seq_new()
    extend(cache, seq, upto, len(tokens) - upto)
    index.insert(tokens, seq)
    return seq


def test_system_prompt_shared_by_sessions_is_held_once():
    cache = CellCache(64)
    index = PrefixCache(cache)
    system = [9] * 20
    latest = cached(cache, index, system + [1, 2])
    for turn in ([3, 4], [5, 6, 7]):
        assert index.match(system + turn) == (latest, 20)  # the most recently used serves
        latest = cached(cache, index, system + turn, latest, 20)
    assert len(index) == 3
    assert cache.free_cells == 64 - (20 + 2 + 2 + 3)
    assert index.reclaimable_cells() == 27


def test_match_leaves_the_last_prompt_token_to_compute():
    cache = CellCache(16)
    index = PrefixCache(cache)
    seq = cached(cache, index, [1, 2, 3])
    assert index.match([1, 2, 3]) == (seq, 2)
    assert index.match([1, 2, 3, 4]) == (seq, 3)
    assert index.match([1]) == (None, 0)
    assert index.match([5, 1, 2]) == (None, 0)


def test_running_request_keeps_cells_it_shares_with_an_evicted_entry():
    cache = CellCache(12)
    index = PrefixCache(cache)
    entry = cached(cache, index, [1, 2, 3, 4, 5, 6])
    running = cache.seq_clone(entry, upto=4)
    assert index.reclaimable_cells() == 2          # positions 4, 5 only
    assert not index.evict(12)                     # cannot reach 12: evicts nothing
    assert index.seqs() == [entry]
    assert index.evict(8)
    assert index.seqs() == [] and cache.free_cells == 8
    assert cache.seq_len(running) == cache.next_pos(running) == 4
    cache.check_invariants()


def test_bound_cuts_a_long_entry_and_evicts_older_ones():
    cache = CellCache(32)
    index = PrefixCache(cache, max_cells=6)
    old = cached(cache, index, [7, 7, 7])
    new = cached(cache, index, [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.seqs() == [new] and index.tokens(new) == [1, 2, 3, 4, 5, 6]
    assert cache.seq_len(new) == 6 and cache.free_cells == 26
    with pytest.raises(UnknownSequenceError, match=rf"unknown sequence id {old} \("):
        cache.seq_len(old)
    assert index.match([1, 2, 3, 4, 5, 6, 7]) == (new, 6)


@pytest.mark.parametrize("bad", [-1, 33, 2.5, True, "8"])
def test_bound_out_of_range_is_refused(bad):
    got = repr(bad).replace(".", r"\.")
    with pytest.raises(InvalidConfigError,
                       match=r"prefix_cache_cells must be an integer in \[0, 32\].*got " + got):
        PrefixCache(CellCache(32), max_cells=bad)


def test_insert_refuses_a_sequence_that_does_not_hold_its_tokens():
    cache = CellCache(16)
    index = PrefixCache(cache)
    seq = cache.seq_new()
    extend(cache, seq, 0, 4)
    with pytest.raises(InvalidConfigError, match="must hold exactly positions 0..4 of its 5"):
        index.insert([1, 2, 3, 4, 5], seq)
    cache.seq_rm(seq, 1, 2)  # a hole
    with pytest.raises(InvalidConfigError, match="holds 3 positions below 4"):
        index.insert([1, 2, 3, 4], seq)
    assert len(index) == 0 and cache.seq_len(seq) == 3  # still the caller's
    full = cached(cache, index, [1, 2])
    with pytest.raises(InvalidConfigError, match=f"sequence {full} is already cached"):
        index.insert([1, 2], full)


def test_an_entry_changed_behind_the_index_is_never_served():
    cache = CellCache(16)
    index = PrefixCache(cache)
    seq = cached(cache, index, [1, 2, 3, 4])
    cache.seq_rm(seq, 2)  # someone cut our entry's tail
    assert index.match([1, 2, 3, 4, 5]) == (None, 0)
    assert len(index) == 0 and cache.n_sequences == 0 and cache.free_cells == 16


def test_an_id_freed_and_handed_out_again_is_not_taken_for_the_entry():
    cache = CellCache(16)
    index = PrefixCache(cache)
    seq = cached(cache, index, [1, 2, 3])
    cache.seq_free(seq)
    other = cache.seq_new()      # the same id, someone else's sequence
    extend(cache, other, 0, 3)
    assert other == seq
    assert index.match([1, 2, 3, 4]) == (None, 0)
    index.clear()
    assert cache.seq_len(other) == 3   # not freed by the index


def test_bound_holds_when_a_covered_fork_leaves_its_cells_to_the_cache():
    """Two samples of one request: the first becomes an entry while the second
    still shares its cells; when the second finishes (covered, so freed) the
    shared cells become the cache's alone and the bound evicts for them."""
    cache = CellCache(32)
    index = PrefixCache(cache, max_cells=8)
    older = cached(cache, index, [5, 5, 5, 5])
    first = cache.seq_new()
    extend(cache, first, 0, 6)
    second = cache.seq_clone(first)
    index.insert([1, 2, 3, 4, 5, 6], first)
    assert index.seqs() == [older, first] and index.reclaimable_cells() == 4
    index.insert([1, 2, 3, 4, 5, 6], second)
    assert index.seqs() == [first] and index.reclaimable_cells() == 6


def test_inserting_an_id_freed_and_handed_out_again_is_not_refused_as_cached():
    """An entry's id freed behind the index and handed out again by seq_new is a
    new sequence: inserting it must succeed (the stale entry is pruned first),
    not be refused as "already cached"."""
    cache = CellCache(32, 1, [None])
    pc = PrefixCache(cache)
    old = cache.seq_new()
    extend(cache, old, 0, 3)
    pc.insert([1, 2, 3], old)
    cache.seq_free(old)                 # someone else frees the entry's id
    again = cache.seq_new()
    assert again == old                 # the lowest free id is handed out again
    extend(cache, again, 0, 2)
    pc.insert([7, 8], again)
    assert pc.seqs() == [again]
    assert pc.tokens(again) == [7, 8]
    assert pc.match([7, 8, 9]) == (again, 2)
