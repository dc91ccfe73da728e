"""transformers decoder models running on the cell cache.

Integration goes through transformers' own extension points, not a copy of its
modeling code:
- the attention interface: ``AttentionInterface.register("cellcache", fn)``,
  selected with ``set_attn_implementation``; ``fn`` places the step's tokens,
  writes K/V into per-layer cache buffers in place and attends with the cell
  cache's mask;
- masks: "cellcache" is deliberately *not* registered in
  ``AttentionMaskInterface``, so transformers builds no mask of its own (its
  mask helpers return None for an unknown implementation);
- per-forward inputs reach the attention function through ``_ACTIVE_STEP``,
  set while ``CellCacheLM.forward`` runs (not the model's ``**kwargs``, which
  some attention layers, StableLM's, do not pass on to it);
- ``logits_to_keep`` with an index tensor computes logits only for the rows a
  caller asked for.

Any decoder whose attention layers call ``ALL_ATTENTION_FUNCTIONS`` (Llama,
Qwen3, Mistral, Gemma3 and most others) works without code here.
"""

from contextvars import ContextVar
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.graph.attention import (StepInputs, cell_cache_layer,
                                                  check_attention_path, kv_cache_buffer)
from executorch_cellcache.graph.fused_projections import fuse_projections as fuse

ATTN_IMPLEMENTATION = "cellcache"
SUPPORTED = "decoder-only transformers models whose attention uses the standard " \
    "attention interface with full-causal and sliding-window layers (Llama, Qwen2/3, " \
    "Mistral, Gemma2/3, Phi-3, StableLM, SmolLM, ...)"


class UnsupportedModelError(ValueError):
    """The model cannot be exported with the cell cache; the message says why."""


# The step of the CellCacheLM.forward running on this thread (None outside one).
_ACTIVE_STEP: ContextVar[Optional[StepInputs]] = ContextVar("cellcache_active_step",
                                                            default=None)


def _cellcache_attention(module, query, key, value, attention_mask, scaling=None,
                         dropout=0.0, **kwargs):
    """transformers attention function. query: [1, n_heads, n_tok, hd];
    key, value: [1, n_kv_heads, n_tok, hd] (RoPE applied); returns
    ([1, n_tok, n_heads, hd], None) like transformers' eager attention."""
    step = _ACTIVE_STEP.get()
    if step is None:
        raise RuntimeError("the cellcache attention runs only inside CellCacheLM.forward")
    window = module.cellcache_window
    passed = kwargs.get("sliding_window")
    if passed is not None and passed != window:
        raise UnsupportedModelError(
            f"layer {module.layer_idx} attends with sliding_window={passed}, but its config "
            f"says {window}")
    out = cell_cache_layer(
        step, module.layer_idx, window,
        _token_major(query), _token_major(key), _token_major(value),
        module.cellcache_k, module.cellcache_v,
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        softcap=kwargs.get("softcap"))
    return out.view(1, *out.shape), None


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, n_tok, hd] -> [n_tok, heads, hd]. A transpose and a view
    (XNNPACK takes both into the neighbouring partition) rather than x[0],
    whose select_copy runs outside the delegate and splits its partition. At
    export the transpose cancels transformers' own to head-major
    (exporting/xnnpack_rewrites.py token_major_rope)."""
    return x.transpose(1, 2).flatten(0, 1)


AttentionInterface.register(ATTN_IMPLEMENTATION, _cellcache_attention)


def layer_windows(config) -> List[Optional[int]]:
    """Each layer's attention window in positions (None = full causal), from a
    transformers text config: ``layer_types`` when present ('sliding_attention'
    layers use ``sliding_window``), else ``sliding_window`` on every layer
    (Mistral), else full causal (Llama)."""
    n_layers = config.num_hidden_layers
    sliding = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{config.model_type} with use_bidirectional_attention is not causal; "
            f"supported: {SUPPORTED}")
    if layer_types is None:
        return [sliding] * n_layers
    windows = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(sliding)
        else:
            raise UnsupportedModelError(
                f"layer {i} of {config.model_type} uses '{kind}' attention; the cell cache "
                f"supports 'full_attention' and 'sliding_attention'")
    return windows


def _attention_layers(model: PreTrainedModel, n_layers: int) -> List[nn.Module]:
    layers = [m for m in model.modules()
              if hasattr(m, "layer_idx") and isinstance(m.layer_idx, int)
              and any(hasattr(m, p) for p in ("q_proj", "qkv_proj", "query_key_value"))]
    if len(layers) != n_layers or sorted(m.layer_idx for m in layers) != list(range(n_layers)):
        raise UnsupportedModelError(
            f"found {len(layers)} attention layers with a layer_idx in "
            f"{type(model).__name__}, expected {n_layers}; supported: {SUPPORTED}")
    return sorted(layers, key=lambda m: m.layer_idx)


class CellCacheLM(nn.Module):
    """A causal LM whose attention layers keep K/V in cell-cache buffers.

    forward(tokens, positions, logits_for, handle, extent):
      tokens: int64 [n_tok] token ids of every sequence of the step, packed;
      positions: int64 [n_tok] each token's position in its sequence;
      logits_for: int64 [n_out] indices into tokens whose logits are wanted;
      handle: int64 [1] the CellCache handle the step was declared on;
      extent: any tensor of length extent (values unused), the number of cells
        attention reads (the cache's planned_used_end);
      returns float32 logits [n_out, vocab].
    Buffers: ``cellcache_k`` / ``cellcache_v`` on every attention layer, in
    ``kv_dtype`` (default: the model's dtype): [cells, n_kv_heads, head_dim],
    or for int8 the layout of graph/attention.py's ``kv_cache_buffer``; cells
    = the layer's pool's: n_cells, or ``window_cells[W]`` for a layer of
    sliding window W when the cache holds a pool per window policy (issue
    #25; the CellCache must be built with the same window_cells).
    attention: "cells" (``cellcache::attend``) or "reference" (dense mask);
    see graph/attention.py.
    fuse_projections: q/k/v and gate/up computed as one linear each, in
    place in ``model`` (graph/fused_projections.py; export decides, see
    ExportOptions.fuse_projections); ``fused_projections`` counts the groups
    fused.
    """

    def __init__(self, model: PreTrainedModel, n_cells: int, attention: str = "cells",
                 kv_dtype: Optional[torch.dtype] = None,
                 window_cells: Optional[Dict[int, int]] = None,
                 fuse_projections: bool = False):
        super().__init__()
        config = model.config.get_text_config()
        if getattr(config, "is_encoder_decoder", False) or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a decoder-only causal LM; supported: "
                f"{SUPPORTED}")
        self.windows = layer_windows(config)
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = kv_dtype or next(model.parameters()).dtype
        check_attention_path(attention, dtype)
        self.attention = attention
        missing = sorted({w for w in self.windows if w is not None} - set(window_cells or {}))
        if window_cells is not None and missing:
            raise InvalidConfigError(f"window_cells has no pool for sliding window {missing[0]}")
        for layer, window in zip(_attention_layers(model, len(self.windows)), self.windows,
                                 strict=True):
            head_dim = getattr(layer, "head_dim", None) or config.hidden_size // config.num_attention_heads
            layer.cellcache_window = window
            cells = n_cells if window is None or window_cells is None else window_cells[window]
            layer.register_buffer("cellcache_k", kv_cache_buffer(cells, n_kv, head_dim, dtype),
                                  persistent=False)
            layer.register_buffer("cellcache_v", kv_cache_buffer(cells, n_kv, head_dim, dtype),
                                  persistent=False)
        self.fused_projections = fuse(model) if fuse_projections else 0
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        except (ValueError, NotImplementedError) as e:
            raise UnsupportedModelError(
                f"{type(model).__name__} does not accept a custom attention implementation "
                f"({e}); supported: {SUPPORTED}") from e
        self.model = model.eval()
        self.n_cells = n_cells

    def forward(self, tokens, positions, logits_for, handle, extent):
        step = StepInputs(handle, positions, extent, self.attention)
        active = _ACTIVE_STEP.set(step)
        try:
            out = self.model(input_ids=tokens[None], position_ids=positions[None],
                             use_cache=False, logits_to_keep=logits_for)
        finally:
            _ACTIVE_STEP.reset(active)
        logits = out.logits  # [1, n_out, vocab]
        # A view (the emitted program aliases it); logits[0] copied them all.
        return logits.view(-1, logits.shape[-1]).float()
