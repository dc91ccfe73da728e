"""Which input channels of each quantized linear stay fp32 (graph/outlier_channels.py).

A linear's outlier channels are the ``k`` with the largest mean |x| over
calibration tokens. The tokens are the model's own: ``sample_magnitudes``
samples a few sequences from it (temperature 1, seeded, from its BOS token),
so no dataset is needed and a chat model's calibration reads like its output.
The outlier channels of LLMs are the same from text to text (LLM.int8());
measured on SmolLM2-135M-Instruct, channels picked from its own samples and
from this project's docs gave held-out KL divergences from fp32 of 0.0047
and 0.0037, against 0.021 with none.

Cost: k fp32 columns per linear and four small ops (a mask, a k-wide
selection GEMM, a k-deep GEMM, an add) beside each quantized GEMM, in the
same XNNPACK partition; linears without marked outliers (MIN_OUTLIER_RATIO)
are left alone.
"""

from typing import Dict, List

import torch
from torch import nn

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.graph.block_offsets import Int8AsInt4Pair, as_projected
from executorch_cellcache.graph.fused_projections import FUSED_NAMES, FusedLinear
from executorch_cellcache.graph.outlier_channels import add_outlier_channels

DEFAULT_CHANNELS = 8          # per linear, for a GGUF checkpoint (ExportOptions.outlier_channels)
# A linear gets outlier channels only where its largest input channel's mean |x| is at least
# this many times the median channel's. SmolLM2-135M: q/k/v 25-87x, lm_head 22x, gate/up
# 9-55x, down 4-264x, o 4-41x (median 6x); leaving out the 55 of 211 linears under 12x
# changed the held-out KL divergence from fp32 by under 1% (0.00465 vs 0.00462) and saves
# their three extra ops each.
MIN_OUTLIER_RATIO = 12.0
MAX_CHANNELS = 64
CALIBRATION_SEQUENCES = 4
CALIBRATION_TOKENS = 128      # sampled per sequence
SEED = 0


def check_channels(value, quantize) -> int:
    """outlier_channels as ExportOptions takes it: an int in 0..MAX_CHANNELS,
    above 0 only with a quantize mode. Raises InvalidConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 0 <= value <= MAX_CHANNELS:
        raise InvalidConfigError(f"outlier_channels must be an integer in 0..{MAX_CHANNELS}, "
                                 f"got {value!r}")
    if value and quantize is None:
        raise InvalidConfigError(f"outlier_channels={value} keeps input channels of "
                                 f"quantized linears in fp32; pass quantize too")
    return value


def sample_magnitudes(model: nn.Module, sequences: int = CALIBRATION_SEQUENCES,
                      tokens: int = CALIBRATION_TOKENS, seed: int = SEED
                      ) -> Dict[str, torch.Tensor]:
    """Mean |x| per input channel (fp32 [in_features]) of every nn.Linear of
    ``model`` (a transformers causal LM, fp32, before quantization), by module
    name, over ``sequences`` x ``tokens`` tokens sampled from the model."""
    sums: Dict[str, torch.Tensor] = {}
    counts: Dict[str, int] = {}

    def hook(name):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.abs().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, nn.Linear)]
    config = model.config.get_text_config()
    bos = getattr(config, "bos_token_id", None)
    bos = bos[0] if isinstance(bos, (list, tuple)) else bos
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((sequences, 1), int(bos) if bos is not None else 0, dtype=torch.int64)
    try:
        with torch.no_grad():
            past, step = None, ids
            for _ in range(tokens):
                out = model(input_ids=step, cache=past, use_cache=True)
                past = out.cache
                probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
                step = torch.multinomial(probs, 1, generator=generator)
    finally:
        for handle in handles:
            handle.remove()
    return {name: sums[name] / counts[name] for name in sums}


def _source(name: str, module: nn.Module) -> str:
    """The calibrated linear whose input ``module`` (named ``name`` after
    fusion) takes: a fused linear's first part."""
    if isinstance(module, FusedLinear):
        parent, _, fused = name.rpartition(".")
        first = next(parts[0] for parts, n in FUSED_NAMES.items() if n == fused)
        return f"{parent}.{first}" if parent else first
    return name


def keep_outliers(model: nn.Module, magnitudes: Dict[str, torch.Tensor],
                  k: int) -> Dict[str, List[int]]:
    """Gives every quantized linear of ``model`` (after quantize_model: torchao
    weights; fused linears and an Int8AsInt4Pair head included) its ``k``
    input channels of largest magnitude as outlier channels, in place;
    returns {module name: channels}. Linears without magnitudes, with no
    more than ``k`` inputs, or whose largest magnitude is under
    MIN_OUTLIER_RATIO times the median one are left as they are."""
    kept: Dict[str, List[int]] = {}
    # a pair's inner linear is handled with its pair (both halves of one input)
    inner = {id(m.linear) for m in model.modules() if isinstance(m, Int8AsInt4Pair)}
    for name, module in list(model.named_modules()):
        pair = isinstance(module, Int8AsInt4Pair)
        linear = module.linear if pair else module
        if not isinstance(linear, nn.Linear) or not hasattr(linear.weight, "qdata") or \
                id(module) in inner:
            continue
        magnitude = magnitudes.get(_source(name, module))
        in_features = module.in_features
        if magnitude is None or magnitude.numel() != in_features or in_features <= k or \
                magnitude.max() < MIN_OUTLIER_RATIO * magnitude.median():
            continue
        channels = torch.topk(magnitude, k).indices.sort().values
        weight = linear.weight.dequantize()
        columns = weight[:, channels]
        if pair:   # the hi and lo halves of each int8 value (Int8AsInt4Pair)
            columns = columns + weight[:, channels + in_features]
        add_outlier_channels(module, channels, columns, in_features)
        if not pair:
            as_projected(module)
        kept[name] = channels.tolist()
    return kept
