"""The pools of a CellCache as the runtime's admission sees them (issue #25).

A cache holds one pool of cells (every layer shares it) or, for a pooled
program, one pool per window policy of its layers: a full-attention pool that
keeps every position, and one pool per sliding window W that reclaims the
cells no owner can see again (cpp/cellcache/cell_pool.h). Every step places
each token once in every pool, so a request needs room in each.

Admission's worst case per pool is the core's (cpp/cellcache/admission.h,
``request_worst_case_cells_in_pool``): in a full pool, every position a
request can still place; in a reclaiming pool at most
n * (W + max(R, T - 1) + T) cells for its n sequences, however long they
grow (R: the retained rollback margin; T: the most tokens of one sequence a
step carries, the program's max_tokens_per_step). This module only applies
that rule to running requests (``reserve``) and names pools in messages.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from executorch_cellcache.cache._core import (
    check_request_fits,
    check_request_fits_pools,
    request_worst_case_cells,
    request_worst_case_cells_in_pool,
)
from executorch_cellcache.cache.admission import window_pool_bound
from executorch_cellcache.cache.errors import InvalidConfigError

@dataclass(frozen=True)
class Pool:
    """One pool: ``window`` W when it reclaims (None: it keeps every position:
    the full-attention pool, or a single pool every layer shares), its cells."""
    index: int
    window: Optional[int]
    capacity: int

    @property
    def name(self) -> str:
        """'window-6 pool', or 'full-attention pool' for one that reclaims nothing."""
        return f"window-{self.window} pool" if self.window is not None else \
            "full-attention pool"

    def describe(self, n_pools: int) -> str:
        """A pool's name in messages: 'the window-6 pool (96 cells)'."""
        if n_pools == 1:
            return f"the cache ({self.capacity} cells)"
        return f"the {self.name} ({self.capacity} cells)"


class Pools:
    """``cache``'s pools with the admission rule applied to them.

    step_tokens: T, the most tokens of one sequence a step carries (the
    program's max_tokens_per_step; >= 1). Raises InvalidConfigError for
    step_tokens < 1."""

    def __init__(self, cache, step_tokens: int):
        if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
            raise InvalidConfigError(f"step_tokens must be an integer >= 1, got {step_tokens!r}")
        self.cache = cache
        self.step_tokens = step_tokens
        self.margin = cache.retained_margin
        states = [cache.pool(i) for i in range(cache.n_pools)]
        self.pools: List[Pool] = [Pool(i, st.window if st.reclaims else None, st.capacity)
                                  for i, st in enumerate(states)]
        self.reclaiming = [p.index for p in self.pools if p.window is not None]

    def __len__(self) -> int:
        return len(self.pools)

    @property
    def pooled(self) -> bool:
        """Whether any pool reclaims (otherwise every rule is the single pool's)."""
        return bool(self.reclaiming)

    def describe(self, pool: int) -> str:
        return self.pools[pool].describe(len(self.pools))

    def capacities(self) -> List[int]:
        return [p.capacity for p in self.pools]

    def free(self) -> List[int]:
        """[n_pools] free cells of each pool now."""
        if len(self.pools) == 1:
            return [self.cache.free_cells]
        return [self.cache.pool(i).free_cells for i in range(len(self.pools))]

    def summary(self) -> str:
        """'12 of 96 free in the window-6 pool, 40 of 256 in the full-attention
        pool' (or 'the N free cells of C' for one pool), for messages."""
        free = self.free()
        if len(self.pools) == 1:
            return f"{free[0]} free cells of {self.pools[0].capacity}"
        return ", ".join(f"{f} of {p.capacity} free in {p.describe(len(self.pools))}"
                         for f, p in zip(free, self.pools))

    # ------------------------------------------------------------------ admission

    def check_fits(self, label: str, prompt_len: int, n: int, max_new_tokens: int) -> None:
        """Raises CapacityError (the core's message, naming the pool that is too
        small) when a request could not run even in an empty cache."""
        if not self.pooled:
            check_request_fits(label, prompt_len, n, max_new_tokens, self.pools[0].capacity)
            return
        check_request_fits_pools(label, prompt_len, n, max_new_tokens,
                                 [(p.window, p.capacity) for p in self.pools], self.margin,
                                 self.step_tokens)

    def first_short(self, prompt_len: int, n: int,
                    max_new_tokens: int) -> Optional[Tuple[Pool, int]]:
        """(pool, cells) of the first pool whose capacity is below the
        request's worst case (``worst_case`` with nothing cached) even in an
        empty cache, or None when every pool can hold it. ``check_fits``
        raises the core's message for the same rule; this is for callers that
        word their own (the server, in HTTP's terms)."""
        needs = self.worst_case(prompt_len, 0, n, max_new_tokens)
        return next(((p, need) for p, need in zip(self.pools, needs, strict=True)
                     if need > p.capacity), None)

    def worst_case(self, prompt_len: int, cached: int, n: int,
                   max_new_tokens: int) -> List[int]:
        """[n_pools] the cells a request not yet started can claim in each pool
        (cached: prompt tokens it clones instead of placing)."""
        return [request_worst_case_cells_in_pool(prompt_len, cached, n, max_new_tokens,
                                                 p.window, self.margin, self.step_tokens)
                for p in self.pools]

    def sequences_bound(self, pool: int, n: int) -> int:
        """The most cells n sequences can own at once in reclaiming pool
        ``pool`` (the core's worst case with no limit on the tokens)."""
        return window_pool_bound(self.pools[pool].window, self.margin, self.step_tokens, n)

    def reserve(self, remaining: int, seqs: Sequence[int], n_seqs: int) -> List[int]:
        """[n_pools] the free cells a running request can still take from each
        pool: ``remaining`` positions it may still place (admission's full
        count), its live sequences ``seqs``, ``n_seqs`` sequences it will run
        (its samples, clones not yet made included).

        In a full pool: ``remaining``. In a reclaiming pool the request owns at
        most B = sequences_bound(n_seqs) cells at any time; the cells only it
        owns now (X) free as it gives them up, those it shares (with a cached
        prefix, another request) may not, so it takes at most B - X free cells
        (and never more than it places): max(0, min(remaining, B - X))."""
        out = []
        for p in self.pools:
            if p.window is None or remaining <= 0:
                out.append(max(remaining, 0))
                continue
            owned = self.cache.cells_owned_only_by(list(seqs), p.index) if seqs else 0
            out.append(max(0, min(remaining, self.sequences_bound(p.index, n_seqs) - owned)))
        return out


def full_count(prompt_len: int, cached: int, n: int, max_new_tokens: int) -> int:
    """The positions a request not yet started may place (admission.h)."""
    return request_worst_case_cells(prompt_len, cached, n, max_new_tokens)
