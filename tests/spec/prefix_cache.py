"""Prefix cache (the executable specification of cpp/engine/prefix_cache.h,
checked against it by tests/test_engine_differential.py): finished requests'
sequences stay in the cell cache, indexed by
their token ids, so a later request that starts with the same tokens clones
their cells (``seq_clone(cached, upto=L)``: no K/V copied, no cell allocated)
and prefills only the rest (SPEC section 9).

The index is a radix tree over token ids (edges are runs of tokens). Each
cached entry is a sequence id of the ``CellCache`` that holds the K/V of
exactly the positions ``0 .. len(tokens) - 1`` of its tokens: a request's
prompt plus the generated tokens that were fed back (a sample's last token
never is, so its K/V does not exist and it is not part of the entry).

Rules:

- Match: the longest common prefix of the prompt with any entry, capped at
  ``len(prompt) - 1`` so the prompt's last token is always computed (its
  logits choose the first new token). Of the entries sharing that longest
  prefix, the most recently used serves; it is marked used.
- Dedupe on insert: a sequence whose tokens are a prefix of (or equal to) an
  entry's is freed instead of kept when that entry covers it, and the most
  recently used covering entry is marked used; an entry whose tokens are a
  prefix of the new one is freed when the new one covers it. An entry covers
  a shorter one when it can serve every prefix the shorter one can: always in
  a cache that reclaims nothing, so there entries are exactly the tree's
  leaves. In a pooled cache a long entry whose windowed pools gave up its
  early positions no longer serves short prefixes (``holds_prefix``), so a
  short entry it does not cover stays, at an inner node. Every path in the
  tree leads to an entry.
- LRU: entries are evicted least recently used first (inserted or matched).
  Evicting frees the entry's sequence: only cells no other sequence owns
  become free (owner bits), so a cell shared with a running request is never
  freed by eviction. ``evict`` evicts nothing when even evicting every entry
  would not free enough.
- Bound (``max_cells``): the cells held only by the cache in each pool
  (``reclaimable_cells_per_pool()``) stay at or below it after every insert;
  an entry holding more cells than the bound in some pool is cut to the
  longest prefix within it (in a single pool: its first ``max_cells``
  positions), or dropped when a windowed pool no longer holds that prefix
  (``holds_prefix``), then older entries are evicted.
- Ids: an entry holds a sequence id (256 in a cache); eviction frees ids too.
  An entry whose id was freed or cleared by someone else (``cache.clear()``)
  is recognised by the id's serial (``seq_serial``) and dropped without
  freeing anything, so ``runner.cache.clear()`` also empties this index.

Sliding windows: a prefix of length L is reusable by a request iff the cached
sequence still holds every position a token of the request could attend under
every layer's policy. The request's own tokens start at position L, and a token
at position p >= L with window W sees p-W+1 .. p. A pooled cache (issue #25)
reclaims, in each windowed pool, the cells below a sequence's window and
retained margin, so an entry may no longer hold what a shorter prefix of it
needs; the core answers the question (``cache.holds_prefix(seq, L)``: whether
``seq_clone(seq, upto=L)`` passes every pool's reclaim check). ``match``
serves a prefix only from an entry that holds it, falling back to shorter
prefixes (other entries) when the longest one's entries do not. Entries must
still hold exactly positions 0 .. len(tokens)-1 (``seq_len == next_pos ==
len(tokens)``; ``seq_len`` counts reclaimed positions as held), checked when
the index takes a sequence in and before each use, so a sequence with positions
removed is never served.

Pools: every count of cells (``reclaimable_cells_per_pool``, ``evict``'s
needs, the ``max_cells`` bound) is per pool; a single-pool cache has one.

Not thread-safe; one scheduler drives it, like the cache.
"""

import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from executorch_cellcache.cache._core import MAX_SEQUENCES
from executorch_cellcache.cache.errors import InvalidConfigError, UnknownSequenceError
from executorch_cellcache.runtime.engine import PrefixCacheStats  # noqa: F401 - the spec's API


@dataclass(eq=False)
class _Node:
    edge: Tuple[int, ...]                    # tokens from the parent to this node
    parent: Optional["_Node"]
    children: Dict[int, "_Node"] = field(default_factory=dict)  # by first edge token
    entry: Optional["_Entry"] = None         # set on leaves only


@dataclass(eq=False)
class _Entry:
    seq: int
    serial: int       # the id's lifetime when the cache took it (seq_serial)
    length: int       # positions held: 0 .. length-1
    node: _Node
    last_used: int = 0  # the index's clock when last inserted or matched


def _common_prefix_len(edge: Tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    k = 0
    while k < n and edge[k] == tokens[start + k]:
        k += 1
    return k


class PrefixCache:
    """The index of cached sequences of one ``CellCache`` (see the module doc).

    PrefixCache(cache, max_cells=None): max_cells bounds the cells held only by
    the cache in each pool (None = no bound; an integer in [0, the largest
    pool's capacity]); raises InvalidConfigError for another value.
    """

    def __init__(self, cache, max_cells: Optional[int] = None):
        self._n_pools = cache.n_pools
        largest = max(cache.pool(i).capacity for i in range(self._n_pools))
        if max_cells is not None and (isinstance(max_cells, bool) or not isinstance(
                max_cells, numbers.Integral) or not 0 <= max_cells <= largest):
            raise InvalidConfigError(
                f"prefix_cache_cells must be an integer in [0, {largest}] (the cache's "
                f"cells{' in its largest pool' if self._n_pools > 1 else ''}), got "
                f"{max_cells!r}; omit it for no bound")
        self.cache = cache
        self.max_cells = None if max_cells is None else int(max_cells)
        self.stats = PrefixCacheStats()
        self._root = _Node((), None)
        self._lru: "OrderedDict[int, _Entry]" = OrderedDict()  # seq -> entry, oldest first
        self._clock = 0

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        self._prune()
        return len(self._lru)

    def seqs(self) -> List[int]:
        """The cached sequence ids, least recently used first."""
        self._prune()
        return list(self._lru)

    def tokens(self, seq: int) -> List[int]:
        """The token ids cached sequence ``seq`` holds (KeyError if not cached)."""
        node, out = self._lru[seq].node, []
        while node is not None:
            out[:0] = node.edge
            node = node.parent
        return out

    def reclaimable_cells(self) -> int:
        """Cells only cached sequences own (those evicting them all would
        free), summed over the pools; a cell shared with any other sequence is
        not counted."""
        return sum(self.reclaimable_cells_per_pool())

    def reclaimable_cells_per_pool(self) -> List[int]:
        """[n_pools] reclaimable_cells of each pool."""
        self._prune()
        seqs = list(self._lru)
        return [self.cache.cells_owned_only_by(seqs, p) for p in range(self._n_pools)]

    def match(self, prompt: Sequence[int]) -> Tuple[Optional[int], int]:
        """(cached sequence, L): the entry holding the longest prefix of
        ``prompt`` that is usable, L <= len(prompt) - 1; (None, 0) on a miss.
        The caller clones it (``seq_clone(seq, upto=L)``) before anything
        else may evict it. Marks the entry used."""
        self._prune()
        while True:
            broken = None
            # Deepest match first; an entry failing holds_prefix at a length fails at
            # every shorter one too (the reclaim check is monotone in upto), so going
            # up a level only finds other entries.
            for top, depth in self._levels(prompt):
                usable = min(depth, len(prompt) - 1)
                if usable <= 0:
                    return None, 0
                for entry in self._entries_below(top):
                    if not self._holds_exactly(entry.seq, entry.length):
                        broken = entry
                        break
                    if self.cache.holds_prefix(entry.seq, usable):
                        self._touch(entry)
                        return entry.seq, usable
                if broken is not None:
                    break
            if broken is None:
                return None, 0
            self._remove(broken)  # someone changed our sequence: never serve it
            self.cache.seq_free(broken.seq)

    def record(self, prompt_len: int, cached: int) -> None:
        """Counts one admitted request of ``prompt_len`` tokens, ``cached`` of
        them served from the cache (for hit rate and cached-token counts)."""
        self.stats.requests += 1
        self.stats.hits += cached > 0
        self.stats.prompt_tokens += prompt_len
        self.stats.cached_tokens += cached

    # ------------------------------------------------------------------ changes

    def insert(self, tokens: Sequence[int], seq: int) -> None:
        """Takes ownership of ``seq``, which must hold exactly the K/V of
        ``tokens`` at positions 0 .. len(tokens)-1 (InvalidConfigError
        otherwise, and ``seq`` stays the caller's). The sequence becomes an
        entry, or is freed when an entry covers it (dedupe rule); then the
        bound is enforced."""
        tokens = tuple(tokens)
        self._prune()  # an entry whose id was freed and handed out again is not seq's
        if seq in self._lru:
            raise InvalidConfigError(f"sequence {seq} is already cached")
        if not self._holds_exactly(seq, len(tokens)):
            raise InvalidConfigError(
                f"sequence {seq} holds {self.cache.seq_len(seq)} positions below "
                f"{self.cache.next_pos(seq)}; a cached sequence must hold exactly positions "
                f"0..{len(tokens) - 1} of its {len(tokens)} tokens")
        self._place(tokens, seq)
        # Also when seq was freed: cells it shared with entries are theirs alone now.
        self.enforce_bound(keep=seq if seq in self._lru else None)

    def evict(self, cells_needed: int, ids_needed: int = 0, keep: Optional[int] = None) -> bool:
        """Frees least-recently-used entries (never ``keep``) until the cache
        has ``cells_needed`` free cells (an int: in every pool; or a list, one
        count per pool) and ``ids_needed`` free sequence ids. Returns whether
        it has them; evicts nothing when even evicting every entry but
        ``keep`` would not be enough."""
        self._prune()
        need = [cells_needed] * self._n_pools if isinstance(cells_needed, numbers.Integral) \
            else list(cells_needed)
        if len(need) != self._n_pools:
            raise InvalidConfigError(f"cells_needed must hold one count per pool "
                                     f"({self._n_pools}), got {cells_needed!r}")
        if self._room(need, ids_needed):
            return True
        victims = [s for s in self._lru if s != keep]
        free = self._free()
        if any(f < c and f + self.cache.cells_owned_only_by(victims, p) < c
               for p, (f, c) in enumerate(zip(free, need))) or \
                MAX_SEQUENCES - self.cache.n_sequences + len(victims) < ids_needed:
            return False
        for seq in victims:
            self._evict(seq)
            if self._room(need, ids_needed):
                break
        return True

    def clear(self) -> None:
        """Frees every cached sequence (those still this cache's) and empties
        the index."""
        self._prune()
        for seq in list(self._lru):
            self.cache.seq_free(seq)
        self._root = _Node((), None)
        self._lru.clear()

    # ------------------------------------------------------------------ internals

    def _place(self, tokens: Tuple[int, ...], seq: int) -> None:
        """insert's dedupe rule: seq becomes an entry (a leaf, or an inner node
        of a pooled cache), or is freed if covered."""
        if self.max_cells is not None:
            tokens = self._cut(tokens, seq)
            if tokens is None:
                return
        if not tokens:
            self.cache.seq_free(seq)
            return
        node, depth, partial = self._walk(tokens)
        if depth == len(tokens):  # a prefix of (or equal to) a cached path
            cover = self._covering(partial or node, seq, len(tokens))
            if cover is not None:
                self.cache.seq_free(seq)
                self._touch(cover)
                return
            if partial is None and node.entry is not None:
                # The same tokens, in an entry that serves fewer prefixes: take its place.
                old = node.entry
                del self._lru[old.seq]
                self.cache.seq_free(old.seq)
            elif partial is not None:
                node = self._split(partial, depth - self._depth(node))
            self._set_entry(node, seq, len(tokens))
            return
        if partial is not None:
            node = self._split(partial, depth - self._depth(node))
        leaf = _Node(tokens[depth:], node)
        node.children[tokens[depth]] = leaf
        self._set_entry(leaf, seq, len(tokens))
        old = node.entry  # an entry that is a prefix of the new one
        if old is not None and \
                self.cache.holds_prefix(seq, self._shortest_held(old.seq, old.length)):
            self._remove(old)
            self.cache.seq_free(old.seq)

    def _set_entry(self, node: _Node, seq: int, length: int) -> None:
        node.entry = _Entry(seq, self.cache.seq_serial(seq), length, node)
        self._lru[seq] = node.entry
        self._touch(node.entry)

    def _shortest_held(self, seq: int, length: int) -> int:
        """The shortest prefix length >= 1 that ``seq`` (holding positions 0 ..
        length-1) can still serve: 1 unless a windowed pool reclaimed some of
        it. holds_prefix is monotone in the length (cell_pool.h: a clone of L
        needs L past the floor and L - W + 1 >= floor), so a binary search."""
        lo, hi = 1, length  # holds_prefix(seq, length) always: nothing is cut
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cache.holds_prefix(seq, mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _covering(self, top: _Node, seq: int, length: int) -> Optional[_Entry]:
        """The most recently used entry at or below ``top`` (whose tokens
        extend seq's ``length`` tokens) that serves every prefix ``seq`` can
        serve, or None."""
        shortest = self._shortest_held(seq, length)
        for entry in self._entries_below(top):
            if self.cache.holds_prefix(entry.seq, shortest):
                return entry
        return None

    def _cut(self, tokens: Tuple[int, ...], seq: int) -> Optional[Tuple[int, ...]]:
        """The bound's cut of a new entry: ``seq`` (holding positions 0 ..
        len(tokens)-1) cut to the longest prefix that holds at most max_cells
        cells in every pool, or freed (returning None) when a windowed pool no
        longer holds that prefix. A pool that reclaimed positions below
        ``below`` holds len - below of them, so the cut length is max_cells +
        the smallest ``below`` (max_cells in a pool that reclaims nothing)."""
        below = min(self.cache.reclaimed(seq, p)[0] for p in range(self._n_pools))
        keep = self.max_cells + below
        if len(tokens) <= keep:
            return tokens
        if not self.cache.holds_prefix(seq, keep):
            self.cache.seq_free(seq)
            return None
        self.cache.seq_rm(seq, keep)
        return tokens[:keep]

    def _free(self) -> List[int]:
        if self._n_pools == 1:
            return [self.cache.free_cells]
        return [self.cache.pool(p).free_cells for p in range(self._n_pools)]

    def _room(self, cells: List[int], ids: int) -> bool:
        return all(f >= c for f, c in zip(self._free(), cells)) and \
            MAX_SEQUENCES - self.cache.n_sequences >= ids

    def _holds_exactly(self, seq: int, length: int) -> bool:
        return self.cache.seq_len(seq) == self.cache.next_pos(seq) == length

    def _prune(self) -> None:
        """Drops entries whose id is no longer ours (freed or cleared by
        another user of the cache), freeing nothing."""
        for seq, entry in list(self._lru.items()):
            try:
                ours = self.cache.seq_serial(seq) == entry.serial
            except UnknownSequenceError:
                ours = False
            if not ours:
                self._remove(entry)

    def _levels(self, tokens: Sequence[int]) -> List[Tuple[_Node, int]]:
        """[(node, depth)] deepest first: the nodes along ``tokens``' path (the
        child inside whose edge the match ended first, if any), each with the
        number of tokens its subtree's entries share with ``tokens``."""
        out = []
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            k = _common_prefix_len(child.edge, tokens, depth)
            if k < len(child.edge):
                out.append((child, depth + k))
                break
            node, depth = child, depth + k
            out.append((node, depth))
        return out[::-1]

    @staticmethod
    def _entries_below(node: _Node) -> List[_Entry]:
        """The entries at or below ``node``, most recently used first."""
        found, stack = [], [node]
        while stack:
            n = stack.pop()
            if n.entry is not None:
                found.append(n.entry)
            stack.extend(n.children.values())
        return sorted(found, key=lambda e: -e.last_used)

    def _walk(self, tokens: Sequence[int]):
        """(node, depth, partial): the deepest node whose whole path is a
        prefix of ``tokens``, the number of tokens matched, and the child of
        that node inside whose edge the match ended (None if at the node)."""
        levels = self._levels(tokens)
        if not levels:
            return self._root, 0, None
        top, depth = levels[0]
        above = levels[1][1] if len(levels) > 1 else 0
        if depth - above < len(top.edge):  # the match ended inside top's edge
            return top.parent, depth, top
        return top, depth, None

    @staticmethod
    def _depth(node: _Node) -> int:
        d = 0
        while node is not None:
            d += len(node.edge)
            node = node.parent
        return d

    def _touch(self, entry: _Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
        self._lru.move_to_end(entry.seq)

    @staticmethod
    def _split(child: _Node, k: int) -> _Node:
        """Cuts ``child``'s edge after k tokens; returns the new middle node."""
        parent = child.parent
        mid = _Node(child.edge[:k], parent)
        parent.children[mid.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def _remove(self, entry: _Entry) -> None:
        """Takes ``entry`` out of the index (the caller frees its sequence or
        knows it is gone); prunes and re-compresses the tree."""
        del self._lru[entry.seq]
        node = entry.node
        node.entry = None
        while node is not self._root and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node is not self._root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            node.edge += child.edge
            node.children = child.children
            for grandchild in node.children.values():
                grandchild.parent = node
            node.entry = child.entry
            if node.entry is not None:
                node.entry.node = node

    def enforce_bound(self, keep: Optional[int] = None) -> None:
        """Evicts least-recently-used entries (never ``keep``, whose own
        length is within the bound) until the cells held only by the cache are
        within ``max_cells``. Insert calls it; a scheduler calls it too when a
        request ends without becoming an entry, since cells it shared with
        entries then count as the cache's."""
        if self.max_cells is None:
            return
        # _cut keeps an entry within the bound in every pool: ``keep`` alone fits.
        while max(self.reclaimable_cells_per_pool()) > self.max_cells:
            self._evict(next(s for s in self._lru if s != keep))

    def _evict(self, seq: int) -> None:
        self._remove(self._lru[seq])
        self.cache.seq_free(seq)
        self.stats.evictions += 1
