"""What an export is asked for, in one type: ``ExportOptions``.

The CLI, the bench and the tests build one, and ``ExportOptions.checked``
is the one validation (before any model is loaded or traced). The pools a
program gets depend on its layers' windows too, so ``window_pools`` sizes
them once the model is known (issue #25).
"""

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch

from executorch_cellcache.cache import _core
from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.admission import window_pool_bound
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting.quiet_imports import quiet_third_party_imports

with quiet_third_party_imports():
    from executorch_cellcache.exporting import outliers
    from executorch_cellcache.exporting import quantize as quantization
    from executorch_cellcache.graph.attention import check_attention_path

KV_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
WINDOW_CELLS_AUTO = "auto"
DEFAULT_POOL_SEQUENCES = 8


def default_kv_dtype(quantize: Optional[str]) -> str:
    """K/V storage when the caller names none: "fp16" for weight-quantized
    programs (llama.cpp's default K/V type for every model; their activations
    already round to int8 steps of (max - min) / 255 a token, against fp16's
    2^-11 relative rounding), "fp32" otherwise (fp32 programs match
    transformers to 1e-4)."""
    return "fp16" if quantize is not None else "fp32"


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise InvalidConfigError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class ExportOptions:
    """Everything ``export`` takes besides the model and the output path.

    n_cells: cells of the cache (with window pools: of the full-attention
      pool, unused when every layer slides); 1 .. MAX_CELLS, >= max_tokens_per_step.
    max_tokens_per_step: the most tokens one forward takes (prefill chunk).
    attention: "cells" (each token reads only its own cells, SPEC section 8) or
      "reference" (the dense-mask path, for comparison; one pool only).
    kv_dtype: "fp32", "fp16" or "int8"; None = ``default_kv_dtype(quantize)``.
    quantize, group_size, embedding_quantize, weight_scales: weight
      quantization (exporting/quantize.py).
    lm_head_quantize: the output layer's own mode ("fp32", "8da4w", "8da8w");
      None = as ``quantize``, except a GGUF checkpoint whose output weight is
      not 4-bit (llama.cpp files keep it at Q8_0 or Q6_K), which gets 8da8w:
      at int4 SmolLM2-135M's held-out perplexity rose ~15%.
    outlier_channels: input channels of each quantized linear computed in fp32
      beside its int8-activation GEMM (exporting/outliers.py), 0..64; None =
      8 for a GGUF checkpoint with ``quantize`` (its weights are kept as the
      file stores them, so the activations' int8 rounding is the error left:
      SmolLM2-135M's held-out KL from fp32 0.021 -> 0.0047), else 0.
    window_cells: the cell pools (issue #25). None or "none" (the default) = one pool
      of n_cells for every layer (pools cost prefix-cache hits in a tight
      windowed pool: docs/sizing-and-limits.md). {W: cells} = one pool per window policy: n_cells for the
      full-attention layers, `cells` for the layers of sliding window W (every
      sliding window of the model needs one); each such pool reclaims the cells
      no sequence can see again. "auto" = {W: pool_sequences sequences' worst
      case, W + max(R, T - 1) + T cells each (cpp/cellcache/admission.h)} for
      each window where that is fewer than n_cells; one pool when none is, or
      on the reference path.
    retained_margin: R, positions a windowed pool keeps below each sequence's
      window for rollback; None = DEFAULT_RETAINED_MARGIN (32). Refused with
      one pool (nothing is reclaimed there).
    pool_sequences: the sequences "auto" sizes each windowed pool for; None =
      DEFAULT_POOL_SEQUENCES (8). Refused unless window_cells is "auto".
    fuse_projections: compute q/k/v and gate/up as one linear each
      (graph/fused_projections.py: the same values, four GEMMs a layer where
      there were seven). None = for 8da4w programs only, where it measured
      faster (135M bench model, 2-core Xeon: one sequence 1.03-1.06x, eight
      even); 8da8w and fp32 programs decoded eight sequences 0.93-0.97x as
      fast fused. True or False for any program.
    Errors (``checked``, ``window_pools``): InvalidConfigError naming the option.
    """

    n_cells: int = 1024
    max_tokens_per_step: int = 64
    attention: str = "cells"
    kv_dtype: Optional[str] = None
    quantize: Optional[str] = None
    group_size: int = 32
    embedding_quantize: Optional[str] = None
    weight_scales: Optional[str] = None
    lm_head_quantize: Optional[str] = None
    outlier_channels: Optional[int] = None
    window_cells: Union[None, str, Dict[int, int]] = None
    retained_margin: Optional[int] = None
    pool_sequences: Optional[int] = None
    fuse_projections: Optional[bool] = None
    # Set on what checked() returns: checking it again returns it as it is (its
    # filled-in defaults would read as options given for nothing). Not an init
    # field, so dataclasses.replace() makes an unchecked copy.
    _checked: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def checked(self) -> "ExportOptions":
        """These options validated, with kv_dtype, retained_margin and
        pool_sequences filled in; options that are already the result of
        checked() come back as they are. Raises InvalidConfigError (or
        quantize.check_options' errors)."""
        if self._checked:
            return self
        n_cells = _positive_int("n_cells", self.n_cells)
        step = _positive_int("max_tokens_per_step", self.max_tokens_per_step)
        if n_cells > _core.MAX_CELLS:
            raise InvalidConfigError(f"n_cells must be <= {_core.MAX_CELLS}, got {n_cells}")
        if n_cells < step:
            raise InvalidConfigError(
                f"n_cells ({n_cells}) is smaller than max_tokens_per_step ({step}): one "
                f"forward could never fit in the cache")
        kv_dtype = self.kv_dtype if self.kv_dtype is not None else \
            default_kv_dtype(self.quantize)
        if kv_dtype not in metadata.KV_DTYPES:
            raise InvalidConfigError(f"kv_dtype must be one of {', '.join(metadata.KV_DTYPES)}, "
                                     f"got {kv_dtype!r}")
        check_attention_path(self.attention, KV_TORCH_DTYPES[kv_dtype])
        quantization.check_options(self.quantize, self.group_size, self.embedding_quantize,
                                   self.weight_scales, self.lm_head_quantize)
        if self.outlier_channels is not None:
            outliers.check_channels(self.outlier_channels, self.quantize)
        margin = _core.DEFAULT_RETAINED_MARGIN if self.retained_margin is None else \
            self.retained_margin
        if isinstance(margin, bool) or not isinstance(margin, numbers.Integral) or margin < 0:
            raise InvalidConfigError(f"retained_margin must be an integer >= 0, got {margin!r}")
        if margin > _core.MAX_CELLS:
            raise InvalidConfigError(f"retained_margin must be <= {_core.MAX_CELLS}, got {margin}")
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise InvalidConfigError(f"fuse_projections must be True, False or None (for "
                                     f"8da4w programs only), got {self.fuse_projections!r}")
        fuse = self.quantize == "8da4w" if self.fuse_projections is None else \
            self.fuse_projections
        cells = None if self.window_cells == "none" else self.window_cells  # as the CLI takes it
        if self.pool_sequences is not None:
            _positive_int("pool_sequences", self.pool_sequences)
            if cells != WINDOW_CELLS_AUTO:
                raise InvalidConfigError(
                    f"pool_sequences sizes the pools of window_cells={WINDOW_CELLS_AUTO!r}; "
                    f"with window_cells={self.window_cells!r} it would do nothing: leave it out")
        if self.retained_margin is not None and self.window_cells in (None, "none"):
            raise InvalidConfigError(
                "retained_margin is what a windowed pool keeps below each sequence's window "
                "(window_cells); with one pool nothing is reclaimed: leave it out")
        pool_sequences = DEFAULT_POOL_SEQUENCES if self.pool_sequences is None else \
            self.pool_sequences
        if cells == WINDOW_CELLS_AUTO and self.attention != "cells":
            cells = None  # auto: pools where a program can have them; the reference path cannot
        if cells is not None:
            if self.attention != "cells":
                raise InvalidConfigError(
                    f"window_cells (a cell pool per window policy) needs the 'cells' attention "
                    f"path, not {self.attention!r}: the dense-mask reference path reads one "
                    f"extent of one pool")
            if isinstance(cells, str):
                if cells != WINDOW_CELLS_AUTO:
                    raise InvalidConfigError(f"window_cells must be None, {WINDOW_CELLS_AUTO!r} "
                                             f"or {{window: cells}}, got {cells!r}")
            elif isinstance(cells, dict):
                cells = {_positive_int("a window_cells window", w):
                         _positive_int(f"window_cells[{w}]", c) for w, c in cells.items()}
                if not cells:
                    raise InvalidConfigError("window_cells is empty; pass None for one pool")
            else:
                raise InvalidConfigError(f"window_cells must be None, {WINDOW_CELLS_AUTO!r} or "
                                         f"{{window: cells}}, got {type(cells).__name__}")
        done = dataclasses.replace(self, n_cells=n_cells, max_tokens_per_step=step,
                                   kv_dtype=kv_dtype, retained_margin=int(margin),
                                   pool_sequences=int(pool_sequences),
                                   window_cells=cells, fuse_projections=fuse)
        object.__setattr__(done, "_checked", True)
        return done

    def window_pools(self, windows: List[Optional[int]]) -> Optional[Dict[int, int]]:
        """{W: cells} for the program's pools, or None for one pool, given the
        layers' windows (None = full causal). On ``checked`` options. Raises
        InvalidConfigError: a window_cells entry for a window no layer has, a
        sliding window without one, or a pool too small for one sequence
        stepping max_tokens_per_step tokens."""
        sliding = sorted({w for w in windows if w is not None})
        step, margin = self.max_tokens_per_step, self.retained_margin

        def one_sequence(w: int) -> int:
            return window_pool_bound(w, margin, step, 1)

        if self.window_cells is None or not sliding:
            if isinstance(self.window_cells, dict):
                raise InvalidConfigError(
                    f"window_cells sizes pools of sliding windows, but every layer of this "
                    f"model has full attention; leave window_cells out")
            return None
        if self.window_cells == WINDOW_CELLS_AUTO:
            sized = {w: min(self.n_cells, window_pool_bound(w, margin, step,
                                                           self.pool_sequences))
                     for w in sliding}
            return sized if any(c < self.n_cells for c in sized.values()) else None
        extra = sorted(set(self.window_cells) - set(sliding))
        if extra:
            raise InvalidConfigError(
                f"window_cells names window {extra[0]}, which no layer has (the layers' "
                f"sliding windows: {', '.join(map(str, sliding))})")
        missing = [w for w in sliding if w not in self.window_cells]
        if missing:
            raise InvalidConfigError(
                f"window_cells must size the pool of every sliding window of the layers; "
                f"window {missing[0]} has none")
        for w, cells in sorted(self.window_cells.items()):
            if cells < one_sequence(w):
                raise InvalidConfigError(
                    f"window_cells[{w}] = {cells} is too small for one sequence stepping "
                    f"{step} tokens: a pool of window {w} needs at least W + max(R, T - 1) + "
                    f"T = {one_sequence(w)} cells (R = retained_margin {margin}, T = "
                    f"max_tokens_per_step {step})")
            if cells > _core.MAX_CELLS:
                raise InvalidConfigError(f"window_cells[{w}] must be <= {_core.MAX_CELLS}, "
                                         f"got {cells}")
        return dict(sorted(self.window_cells.items()))
