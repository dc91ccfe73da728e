"""Weight quantization (SPEC 7): a source transform applied to the transformers
model before ``torch.export``, the way ExecuTorch's own LLM export does it.

One function per scheme, chosen by ``QuantizeOptions.mode``:
- ``8da4w``: int8 dynamic activations (asymmetric, per token) x int4
  symmetric weights in groups of ``group_size`` input features;
- ``8da8w``: int8 dynamic activations x int8 symmetric per-channel weights
  (one scale per output row; ``group_size`` does not apply).
Scales are chosen with HQQ (scale only). Both run in XNNPACK's dynamically
quantized linear kernels (``lowering.lower_exported(quantized=True)``).
Embeddings (``embedding_quantize``, independent of ``mode``) are int8 or int4
weight-only, symmetric, per row or per group; the quant fusion pass turns them
into the runtime's quantized embedding kernels.

Rules, stated once:
- every ``nn.Linear`` is quantized, ``lm_head`` included;
- a linear whose ``in_features`` the group size does not divide (8da4w) is
  quantized per channel at the same width instead, and listed in the report;
- tied embeddings: quantizing ``lm_head`` gives it its own quantized weight,
  so the tie is broken (the report says so); the input embedding stays fp32
  unless ``embedding_quantize`` is given;
- an embedding whose width the embedding group does not divide is quantized
  per row instead, and the report says so.

Quality, measured on the default model's held-out slice (``cellcache eval``,
window 256): fp32 6.735, 8da8w 6.737, 8da4w g32 7.181 (+6.6%). On that
128-wide model the int4 error is spread over every linear (eager torchao,
one kind of linear kept fp32 at a time: 7.05-7.16; lm_head at int8: 7.14;
min/max scales instead of HQQ: 7.25; a Hadamard rotation folded into the
weights: 7.19), so no rule short of keeping whole layers at 8 bits brings it
within +5%; larger models lose less.
"""

import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.graph.model import UnsupportedModelError

GROUP_MULTIPLE = 32  # XNNPACK's blockwise int4 kernels take groups of a multiple of 32
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class EmbeddingFormat:
    bits: int                  # 8 or 4
    group_size: int            # 0 = one scale per row

    @property
    def spec(self) -> str:
        """The canonical ``embedding_quantize`` text ("8", "4,32")."""
        return f"{self.bits},{self.group_size}" if self.group_size else str(self.bits)

    def describe(self) -> str:
        per = f"groups of {self.group_size}" if self.group_size else "per row"
        return f"int{self.bits} {per}"


@dataclass(frozen=True)
class QuantizeOptions:
    mode: Optional[str] = None                   # None = fp32 linears
    group_size: int = DEFAULT_GROUP_SIZE         # 8da4w only
    embedding: Optional[EmbeddingFormat] = None  # None = fp32 embedding

    @property
    def any(self) -> bool:
        return self.mode is not None or self.embedding is not None

    @property
    def recorded_group_size(self) -> int:
        """What the .pte records: the 8da4w group, 0 (per channel) otherwise."""
        return self.group_size if self.mode == "8da4w" else 0


@dataclass
class QuantizeReport:
    """What ``quantize_model`` did."""
    mode: Optional[str]
    group_size: int
    linears: List[str] = field(default_factory=list)       # quantized, by module name
    per_channel: List[str] = field(default_factory=list)   # of those: group fallback
    untied_lm_head: bool = False
    embedding: str = "fp32"


def _check_group(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1 or \
            value % GROUP_MULTIPLE:
        raise InvalidConfigError(f"{what} must be a positive multiple of {GROUP_MULTIPLE}, "
                                 f"got {value!r}")
    return int(value)


def parse_embedding(spec) -> Optional[EmbeddingFormat]:
    """"8" / "4" (per row) or "BITS,GROUP" (GROUP a positive multiple of 32,
    or 0 = per row) -> EmbeddingFormat; None stays None."""
    if spec is None:
        return None
    text = str(spec).strip()
    parts = [p.strip() for p in text.split(",")]
    bad = InvalidConfigError(
        f"embedding quantization {spec!r} is not one of '8', '4', '8,GROUP', '4,GROUP' "
        f"(GROUP a positive multiple of {GROUP_MULTIPLE}, e.g. '4,32')")
    if len(parts) > 2 or not parts[0].isdigit() or \
            int(parts[0]) not in metadata.EMBEDDING_QUANTIZE_BITS:
        raise bad
    group = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise bad
        group = int(parts[1])
        if group:
            _check_group(group, f"embedding quantization {spec!r}: the group")
    return EmbeddingFormat(int(parts[0]), group)


def check_options(quantize=None, group_size=DEFAULT_GROUP_SIZE,
                  embedding_quantize=None) -> QuantizeOptions:
    """Validates export's quantization arguments (before anything is traced).
    Raises InvalidConfigError naming the bad value."""
    if quantize is not None and quantize not in metadata.WEIGHT_QUANTIZE_MODES:
        raise InvalidConfigError(f"unknown quantize mode {quantize!r}; choose one of "
                                 f"{', '.join(metadata.WEIGHT_QUANTIZE_MODES)} (or none: fp32)")
    group_size = _check_group(group_size, "group_size")
    if quantize == "8da8w" and group_size != DEFAULT_GROUP_SIZE:
        raise InvalidConfigError(f"8da8w quantizes weights per channel; group_size "
                                 f"({group_size}) applies to 8da4w only")
    return QuantizeOptions(quantize, group_size, parse_embedding(embedding_quantize))


def _linears(model: nn.Module) -> Dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def check_quantizable(model: nn.Module, options: QuantizeOptions) -> None:
    """Refuses, before tracing, a model the options cannot quantize: no
    nn.Linear outside lm_head for a weight mode, no nn.Embedding for
    embedding_quantize. Raises UnsupportedModelError."""
    name = type(model).__name__
    if options.mode is not None and not [n for n in _linears(model) if n != "lm_head"]:
        kinds = sorted({type(m).__name__ for m in model.modules()
                        if getattr(m, "weight", None) is not None and m is not model})
        raise UnsupportedModelError(
            f"{name} has no nn.Linear layer besides lm_head for quantize={options.mode!r} "
            f"(its weighted modules: {', '.join(kinds) or 'none'}); quantization covers "
            f"nn.Linear layers only")
    if options.embedding is not None and not isinstance(model.get_input_embeddings(),
                                                        nn.Embedding):
        raise UnsupportedModelError(
            f"{name}'s input embedding is not an nn.Embedding; embedding_quantize="
            f"{options.embedding.spec!r} cannot apply")


def _linear_config(bits: int, group_size: int):
    # Imported here: torchao is needed only for quantized exports.
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType
    from torchao.quantization.granularity import PerAxis, PerGroup

    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=getattr(torch, f"int{bits}"),
        weight_granularity=PerGroup(group_size) if group_size else PerAxis(0),
        weight_mapping_type=MappingType.SYMMETRIC,
        intx_choose_qparams_algorithm="hqq_scale_only")


def _quantize_linears(model: nn.Module, bits: int, group_size: int,
                      report: QuantizeReport) -> None:
    """int8 dynamic activations x int``bits`` weights on every nn.Linear;
    group_size 0 = per channel. Linears the group does not divide fall back
    to per channel (report.per_channel)."""
    from torchao.quantization import quantize_

    linears = _linears(model)
    grouped = [n for n, m in linears.items() if group_size and m.in_features % group_size == 0]
    rest = [n for n in linears if n not in grouped]
    if group_size:
        report.per_channel = rest
    for names, group in ((grouped, group_size), (rest, 0)):
        if names:
            chosen = set(names)
            quantize_(model, _linear_config(bits, group),
                      filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen)
    report.linears = list(linears)


def quantize_8da4w(model: nn.Module, group_size: int, report: QuantizeReport) -> None:
    _quantize_linears(model, 4, group_size, report)


def quantize_8da8w(model: nn.Module, group_size: int, report: QuantizeReport) -> None:
    del group_size  # per channel by definition
    _quantize_linears(model, 8, 0, report)


SCHEMES: Dict[str, Callable[[nn.Module, int, QuantizeReport], None]] = {
    "8da4w": quantize_8da4w,
    "8da8w": quantize_8da8w,
}


def quantize_embedding(model: nn.Module, fmt: EmbeddingFormat, report: QuantizeReport) -> None:
    """Weight-only int8/int4 symmetric quantization of the input embedding
    (per row when its width is not a multiple of the group)."""
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    embedding = model.get_input_embeddings()
    # padding_idx only masks gradients; left set, the graph's embedding carries it and the
    # quant fusion pattern (which has none) no longer matches.
    embedding.padding_idx = None
    group = fmt.group_size if fmt.group_size and \
        embedding.embedding_dim % fmt.group_size == 0 else 0
    config = IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{fmt.bits}"),
        granularity=PerGroup(group) if group else PerAxis(0),
        mapping_type=MappingType.SYMMETRIC, intx_choose_qparams_algorithm="hqq_scale_only")
    quantize_(model, config, filter_fn=lambda m, fqn: m is embedding)
    report.embedding = EmbeddingFormat(fmt.bits, group).describe()
    if group != fmt.group_size:
        report.embedding += (f" (width {embedding.embedding_dim} is not a multiple of "
                             f"{fmt.group_size})")


def _tied(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    embedding = model.get_input_embeddings()
    return isinstance(head, nn.Linear) and embedding is not None and \
        head.weight is getattr(embedding, "weight", None)


def quantize_model(model: nn.Module, options: QuantizeOptions) -> QuantizeReport:
    """Quantizes ``model`` in place (the caller's copy) as ``options`` says."""
    report = QuantizeReport(options.mode, options.recorded_group_size)
    tied = _tied(model)
    with torch.no_grad():
        if options.mode is not None:
            SCHEMES[options.mode](model, options.group_size, report)
        if options.embedding is not None:
            quantize_embedding(model, options.embedding, report)
    # Either side quantized gives it a weight of its own: lm_head and the embedding
    # are stored (and quantized) separately from here on.
    report.untied_lm_head = tied and options.any
    return report
