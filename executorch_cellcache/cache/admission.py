"""Admission's bound on a windowed pool, as the core states it
(cpp/cellcache/admission.h, ``request_worst_case_cells_in_pool``): the one
place the Python side asks it with no limit on the tokens (export sizes
pools by it, the runtime reserves by it)."""

from executorch_cellcache.cache._core import request_worst_case_cells_in_pool

# max_new_tokens that leaves the count of positions unbounded: the core's worst
# case of n sequences in a reclaiming pool is then its per-sequence bound x n.
_UNBOUNDED = 2**63 - 1


def window_pool_bound(window: int, retained_margin: int, step_tokens: int,
                      sequences: int) -> int:
    """Cells ``sequences`` sequences of unbounded length can own at once in a
    pool of sliding window ``window`` (positions): sequences x (W + max(R,
    T - 1) + T), R = retained_margin, T = step_tokens (the most tokens of one
    sequence a step carries). Raises InvalidConfigError for R < 0 or T < 1;
    saturates at INT64_MAX."""
    return request_worst_case_cells_in_pool(0, 0, sequences, _UNBOUNDED, window,
                                            retained_margin, step_tokens)
