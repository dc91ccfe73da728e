"""Exceptions of the cell cache (SPEC section 6).

Every failure kind of the C++ core (``cpp/cellcache/status.h``) raises one class
here; the binding maps status codes to classes by name. A call that raises
changes nothing in the cache.
"""


class CellCacheError(Exception):
    """Base class of every cell-cache error."""


class UnknownSequenceError(CellCacheError):
    """A sequence id the cache did not hand out, or one already freed."""


class PositionConflictError(CellCacheError):
    """Positions that rewrite, repeat or go backwards, a bad range, or a
    position count that differs from the declared step."""


class StepNotDeclaredError(CellCacheError):
    """A forward (a layer served) with no declared step, or a layer served
    twice in one step."""


class StepInvalidatedError(CellCacheError):
    """A sequence verb ran between ``declare_step`` and the end of the forward."""


class LayerOutOfRangeError(CellCacheError):
    """A layer index < 0 or >= n_layers."""


class InvalidConfigError(CellCacheError, ValueError):
    """A bad configuration or argument: zero cells, window < 1, a window list
    neither 1 nor n_layers long, an attention extent too small, ..."""


class CapacityError(CellCacheError):
    """Every sequence id is in use, or a single request that can never fit."""


class UnknownCacheError(CellCacheError):
    """A cache handle that names no live cache (destroyed, or never created)."""


class BelowReclaimedError(CellCacheError):
    """A rollback (``seq_rm`` of a tail) or a prefix ``seq_clone(upto=...)`` that
    would need positions a windowed pool already reclaimed: the pool keeps a
    sequence's window plus its retained rollback margin, no more."""


# C++ StatusCode name (status_code_name) -> exception class.
BY_STATUS = {
    "UnknownSequence": UnknownSequenceError,
    "PositionConflict": PositionConflictError,
    "StepNotDeclared": StepNotDeclaredError,
    "StepInvalidated": StepInvalidatedError,
    "LayerOutOfRange": LayerOutOfRangeError,
    "InvalidConfig": InvalidConfigError,
    "Capacity": CapacityError,
    "UnknownCache": UnknownCacheError,
    "BelowReclaimed": BelowReclaimedError,
}
