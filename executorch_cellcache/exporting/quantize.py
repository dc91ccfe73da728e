"""Weight quantization (SPEC 7): a source transform applied to the transformers
model before ``torch.export``, the way ExecuTorch's own LLM export does it.

Schemes, chosen by ``QuantizeOptions.mode``:
- ``8da4w``: int8 dynamic activations (asymmetric, per token) x int4
  symmetric weights in groups of ``group_size`` input features;
- ``8da8w``: int8 dynamic activations x int8 symmetric per-channel weights
  (one scale per output row; ``group_size`` does not apply).
Both run in XNNPACK's dynamically quantized linear kernels
(``lowering.lower_exported(quantized=True)``).
Scales (``weight_scales``, every quantized weight): "hqq", HQQ scale-only, the
post-training choice ExecuTorch's LLM export makes; or "minmax", a group's
max|w| / ((qmax - qmin) / 2), i.e. / 7.5 at int4 (torchao's "affine" choice),
the scales torchao's QAT fake quantizers train against. Unset, a checkpoint
whose config carries ``quantization_aware_training`` (written by a QAT
fine-tune, as scripts/train_default_model.py does for the default model) gets
the scales it names; any other gets "hqq" (``resolve_scales``).
Embeddings (``embedding_quantize``, independent of ``mode``) are int8 or int4
weight-only, symmetric, per row or per group; the quant fusion pass turns them
into the runtime's quantized embedding kernels.

``plan`` lists the torchao configs a model gets; export applies them, a QAT
fine-tune wraps them in torchao's QATConfig. Rules, stated once:
- every ``nn.Linear`` is quantized, ``lm_head`` included;
- a linear whose ``in_features`` the group size does not divide (8da4w) is
  quantized per channel at the same width instead, and listed in the report;
- tied embeddings: quantizing ``lm_head`` gives it its own quantized weight,
  so the tie is broken (the report says so); the input embedding stays fp32
  unless ``embedding_quantize`` is given;
- an embedding whose width the embedding group does not divide is quantized
  per row instead, and the report says so.

Quality, measured on the default model's held-out slice (``cellcache eval``,
window 256). Post-training, on an earlier checkpoint before its QAT fine-tune: fp32
6.735, 8da8w 6.737, 8da4w g32 7.181 (+6.6%; the int4 error is spread over
every linear of that 128-wide model: one kind of linear kept fp32 at a time
7.05-7.16, lm_head at int8 7.14, min/max scales 7.25, a Hadamard rotation
folded into the weights 7.19). After 600 steps of torchao QAT for 8da4w
(scripts/train_default_model.py; the checkpoint of 2026-12-02, also trained
on copy examples): fp32 5.270, 8da4w g32 with the min/max scales it trained
against 4.431 (-15.9%), with HQQ scales 6.114 (+16.0%), 8da8w 5.161 (-2.1%).
"""

import dataclasses
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
# weight_scales -> (torchao's intx_choose_qparams_algorithm, what the export summary says)
WEIGHT_SCALES = {"hqq": ("hqq_scale_only", "HQQ scale-only"), "minmax": ("affine", "min/max")}
DEFAULT_WEIGHT_SCALES = "hqq"
# The transformers config attribute a QAT fine-tune leaves: {"weight_scales": ..., and the
# quantization it trained against}.
QAT_CONFIG_KEY = "quantization_aware_training"
# Weight bits of each mode (metadata.WEIGHT_QUANTIZE_MODES); 8da8w is per channel.
MODE_BITS = {"8da4w": 4, "8da8w": 8}


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
    weight_scales: Optional[str] = None          # a WEIGHT_SCALES key; None = the checkpoint's
    lm_head: Optional[str] = None                # a mode or "fp32"; None = as ``mode``

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
    lm_head: str = ""                                      # its mode where it is not ``mode``
    exact: List[str] = field(default_factory=list)         # kept as a GGUF stores them
    weight_scales: str = ""                                # the summary's words for the scales
    outlier_channels: Dict[str, List[int]] = field(default_factory=dict)  # exporting/outliers.py


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


def _check_scales(value, what: str) -> str:
    if not isinstance(value, str) or value not in WEIGHT_SCALES:
        raise InvalidConfigError(f"{what} must be one of {', '.join(WEIGHT_SCALES)}, "
                                 f"got {value!r}")
    return value


LM_HEAD_CHOICES = ("fp32",) + tuple(metadata.WEIGHT_QUANTIZE_MODES)


def check_options(quantize=None, group_size=DEFAULT_GROUP_SIZE,
                  embedding_quantize=None, weight_scales=None,
                  lm_head_quantize=None) -> QuantizeOptions:
    """Validates export's quantization arguments (before anything is traced):
    quantize a metadata.WEIGHT_QUANTIZE_MODES entry or None, group_size a
    positive multiple of GROUP_MULTIPLE (8da8w: the default only),
    embedding_quantize as ``parse_embedding`` reads it, weight_scales a
    WEIGHT_SCALES key or None, and only with some quantization. Raises
    InvalidConfigError naming the bad value."""
    if weight_scales is not None:
        _check_scales(weight_scales, "weight_scales")
    if quantize is not None and quantize not in metadata.WEIGHT_QUANTIZE_MODES:
        raise InvalidConfigError(f"unknown quantize mode {quantize!r}; choose one of "
                                 f"{', '.join(metadata.WEIGHT_QUANTIZE_MODES)} (or none: fp32)")
    group_size = _check_group(group_size, "group_size")
    if quantize == "8da8w" and group_size != DEFAULT_GROUP_SIZE:
        raise InvalidConfigError(f"8da8w quantizes weights per channel; group_size "
                                 f"({group_size}) applies to 8da4w only")
    if lm_head_quantize is not None:
        if lm_head_quantize not in LM_HEAD_CHOICES:
            raise InvalidConfigError(f"unknown lm_head quantization {lm_head_quantize!r}; "
                                     f"choose one of {', '.join(LM_HEAD_CHOICES)}")
        if quantize is None:
            raise InvalidConfigError(f"lm_head_quantize={lm_head_quantize!r} sets the output "
                                     f"layer apart from the other linears; pass quantize too")
    options = QuantizeOptions(quantize, group_size, parse_embedding(embedding_quantize),
                              weight_scales, lm_head_quantize)
    if weight_scales is not None and not options.any:
        raise InvalidConfigError(f"weight_scales={weight_scales!r} applies to quantized "
                                 f"weights; pass quantize or embedding_quantize too")
    return options


def resolve_scales(options: QuantizeOptions, model: nn.Module) -> QuantizeOptions:
    """``options`` with ``weight_scales`` set: as given, else the scales the
    model's config names under QAT_CONFIG_KEY, else DEFAULT_WEIGHT_SCALES
    (unchanged when nothing is quantized). Raises InvalidConfigError for a
    QAT_CONFIG_KEY entry that is not a mapping naming WEIGHT_SCALES' keys."""
    if options.weight_scales is not None or not options.any:
        return options
    qat = getattr(getattr(model, "config", None), QAT_CONFIG_KEY, None)
    if qat is None:
        return dataclasses.replace(options, weight_scales=DEFAULT_WEIGHT_SCALES)
    if not isinstance(qat, dict) or "weight_scales" not in qat:
        raise InvalidConfigError(
            f"the checkpoint config's {QAT_CONFIG_KEY} must be a mapping with a "
            f"'weight_scales' entry ({', '.join(WEIGHT_SCALES)}), got {qat!r}; pass "
            f"weight_scales (--weight-scales) to choose the scales instead")
    _check_scales(qat["weight_scales"],
                  f"the checkpoint config's {QAT_CONFIG_KEY}['weight_scales']")
    return dataclasses.replace(options, weight_scales=qat["weight_scales"])


def describe_scales(options: QuantizeOptions, model: nn.Module) -> str:
    """What the export summary says of resolved scales."""
    text = WEIGHT_SCALES[options.weight_scales][1]
    qat = getattr(getattr(model, "config", None), QAT_CONFIG_KEY, None)
    if isinstance(qat, dict) and qat.get("weight_scales") == options.weight_scales:
        text += " (the checkpoint was fine-tuned quantization-aware against them)"
    return text


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


def linear_config(bits: int, group_size: int, scales: str = DEFAULT_WEIGHT_SCALES):
    """torchao's config for int8 dynamic activations x int``bits`` symmetric
    weights; group_size 0 = per channel; scales a WEIGHT_SCALES key."""
    # Imported here: torchao is needed only for quantized exports.
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType
    from torchao.quantization.granularity import PerAxis, PerGroup

    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=getattr(torch, f"int{bits}"),
        weight_granularity=PerGroup(group_size) if group_size else PerAxis(0),
        weight_mapping_type=MappingType.SYMMETRIC,
        intx_choose_qparams_algorithm=WEIGHT_SCALES[scales][0])


def embedding_config(bits: int, group_size: int, scales: str = DEFAULT_WEIGHT_SCALES):
    """torchao's config for int``bits`` symmetric weight-only embeddings;
    group_size 0 = per row; scales a WEIGHT_SCALES key."""
    from torchao.quantization import IntxWeightOnlyConfig, MappingType
    from torchao.quantization.granularity import PerAxis, PerGroup

    return IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{bits}"),
        granularity=PerGroup(group_size) if group_size else PerAxis(0),
        mapping_type=MappingType.SYMMETRIC,
        intx_choose_qparams_algorithm=WEIGHT_SCALES[scales][0])


@dataclass
class Step:
    """One torchao ``quantize_`` call of a plan: ``config`` on the modules named."""
    names: List[str]
    config: object


def plan(model: nn.Module, options: QuantizeOptions,
         report: Optional[QuantizeReport] = None) -> List[Step]:
    """The torchao configs ``options`` puts on ``model``'s modules, by the rules
    above, in the order they apply (filling ``report``'s linears, per_channel
    and embedding when given); unset weight_scales are resolved as
    ``resolve_scales`` does. Export applies the steps; a quantization-aware
    fine-tune (scripts/train_default_model.py) wraps each in torchao's
    QATConfig. Raises InvalidConfigError as resolve_scales does."""
    report = report if report is not None else QuantizeReport(options.mode, 0)
    steps = []
    scales = resolve_scales(options, model).weight_scales
    if options.mode is not None:
        bits = MODE_BITS[options.mode]
        group_size = options.group_size if options.mode == "8da4w" else 0
        linears = _linears(model)
        head = _head_name(model)
        apart = head in linears and options.lm_head not in (None, options.mode)
        if apart:
            head_linear = linears.pop(head)
        grouped = [n for n, m in linears.items()
                   if group_size and m.in_features % group_size == 0]
        rest = [n for n in linears if n not in grouped]
        if group_size:
            report.per_channel = rest
        steps += [Step(names, linear_config(bits, group, scales))
                  for names, group in ((grouped, group_size), (rest, 0)) if names]
        report.linears = list(linears)
        if apart:
            report.lm_head = options.lm_head
            if options.lm_head != "fp32":
                group = group_size if options.lm_head == "8da4w" and group_size and \
                    head_linear.in_features % group_size == 0 else 0
                steps.append(Step([head], linear_config(MODE_BITS[options.lm_head], group,
                                                        scales)))
                report.linears.append(head)
    if options.embedding is not None:
        fmt = options.embedding
        embedding = model.get_input_embeddings()
        name = next(n for n, m in model.named_modules() if m is embedding)
        group = fmt.group_size if fmt.group_size and \
            embedding.embedding_dim % fmt.group_size == 0 else 0
        steps.append(Step([name], embedding_config(fmt.bits, group, scales)))
        report.embedding = EmbeddingFormat(fmt.bits, group).describe()
        if group != fmt.group_size:
            report.embedding += (f" (width {embedding.embedding_dim} is not a multiple of "
                                 f"{fmt.group_size})")
    return steps


def apply(model: nn.Module, steps: List[Step], wrap: Callable = lambda config: config) -> None:
    """torchao ``quantize_`` for each step (``wrap``: config -> the config applied)."""
    from torchao.quantization import quantize_

    for step in steps:
        chosen = set(step.names)
        quantize_(model, wrap(step.config), filter_fn=lambda m, fqn: fqn in chosen)


def _head_name(model: nn.Module) -> Optional[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) \
        if head is not None else None


def exact_candidates(model: nn.Module, options: QuantizeOptions, exact) -> Dict[str, object]:
    """The modules ``options`` quantizes whose weights ``exact`` (a
    gguf.ExactWeights) holds in a form the program's kernels run as they are:
    int4 blocks of 32 (8da4w, group 32) and int8 embedding groups of 32 ->
    their ExactRows, by module name."""
    found: Dict[str, object] = {}
    if exact is None:
        return found
    head = _head_name(model)
    for name, m in _linears(model).items():
        mode = options.lm_head if name == head and options.lm_head else options.mode
        if mode == "8da4w" and options.group_size == 32 and m.in_features % 32 == 0:
            rows = exact.rows(m.weight)
            if rows is not None and rows.bits == 4:
                found[name] = rows
    fmt = options.embedding
    if fmt is not None and fmt.bits == 8 and fmt.group_size == 32:
        embedding = model.get_input_embeddings()
        rows = exact.rows(embedding.weight)
        if rows is not None and rows.bits == 8 and rows.offsets is None:
            found[next(n for n, m in model.named_modules() if m is embedding)] = rows
    return found


def split_int8_head(model: nn.Module, options: QuantizeOptions, exact) -> Dict[str, object]:
    """A GGUF's Q8_0 output layer kept exact under 8da4w: replaced (in place)
    by a graph.block_offsets.Int8AsInt4Pair, whose int4 linear gets the file's
    values; returns {its linear's name: those rows} (empty where it does not
    apply: no ``exact``, another mode or group, a head not stored as Q8_0)."""
    from executorch_cellcache.graph.block_offsets import Int8AsInt4Pair, dequantized, int4_pair

    head_name = _head_name(model)
    mode = options.lm_head or options.mode
    if exact is None or head_name is None or mode != "8da4w" or options.group_size != 32:
        return {}
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return {}
    rows = exact.rows(head.weight)
    if rows is None or rows.bits != 8 or rows.offsets is not None:
        return {}
    q4, scale4, offsets = int4_pair(rows.q, rows.scale)
    pair = Int8AsInt4Pair(head.in_features, head.out_features, offsets)
    with torch.no_grad():
        pair.linear.weight.copy_(dequantized(q4, scale4))
    model.set_output_embeddings(pair)
    from executorch_cellcache.exporting.gguf import ExactRows

    return {f"{head_name}.linear": ExactRows(q4, scale4, None, 4)}


def _cheap_scales_for(steps: List[Step], kept) -> List[Step]:
    """``steps`` with the modules in ``kept`` (whose values _keep_exact
    overwrites) moved to min/max scales: HQQ's search would be thrown away."""
    out = []
    for step in steps:
        mine = [n for n in step.names if n in kept]
        rest = [n for n in step.names if n not in kept]
        if rest:
            out.append(Step(rest, step.config))
        if mine:
            out.append(Step(mine, dataclasses.replace(
                step.config, intx_choose_qparams_algorithm=WEIGHT_SCALES["minmax"][0])))
    return out


def _keep_exact(model: nn.Module, found: Dict[str, object]) -> None:
    """Overwrites the quantized weights torchao made with the file's own
    values (same layout: qdata int8 [n, k], one scale per block of 32, zero
    points 0) and adds the Q4_1 block offsets."""
    from executorch_cellcache.graph.block_offsets import add_block_offsets

    modules = dict(model.named_modules())
    for name, rows in found.items():
        weight = modules[name].weight
        if tuple(weight.qdata.shape) != tuple(rows.q.shape) or \
                tuple(weight.scale.shape) != tuple(rows.scale.shape):
            raise RuntimeError(f"{name}: torchao's quantized weight has qdata "
                               f"{tuple(weight.qdata.shape)} and scales "
                               f"{tuple(weight.scale.shape)}; the file's are "
                               f"{tuple(rows.q.shape)} and {tuple(rows.scale.shape)}")
        weight.qdata.copy_(rows.q)
        weight.scale.copy_(rows.scale.to(weight.scale.dtype))
        weight.zero_point.zero_()
        if rows.offsets is not None:
            add_block_offsets(modules[name], rows.offsets)


def _tied(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    embedding = model.get_input_embeddings()
    return isinstance(head, nn.Linear) and embedding is not None and \
        head.weight is getattr(embedding, "weight", None)


def quantize_model(model: nn.Module, options: QuantizeOptions,
                   exact=None) -> QuantizeReport:
    """Quantizes ``model`` in place (the caller's copy) as ``options`` says
    (unset weight_scales resolved as ``resolve_scales`` does, before anything
    changes); ``exact`` (a gguf.ExactWeights) keeps a GGUF's own quantized
    values where ``exact_candidates`` finds them. Raises InvalidConfigError
    as resolve_scales does."""
    options = resolve_scales(options, model)
    report = QuantizeReport(options.mode, options.recorded_group_size)
    tied = _tied(model)
    if options.embedding is not None:
        # padding_idx only masks gradients; left set, the graph's embedding carries it and
        # the quant fusion pattern (which has none) no longer matches.
        model.get_input_embeddings().padding_idx = None
    with torch.no_grad():
        found = exact_candidates(model, options, exact)
        pair = split_int8_head(model, options, exact)
        found.update(pair)
        apply(model, _cheap_scales_for(plan(model, options, report), found))
        _keep_exact(model, found)
    report.exact = list(found)
    if pair:
        report.lm_head = "8da4w (the file's Q8_0 blocks as int4 pairs, exact)"
    if options.any:
        report.weight_scales = describe_scales(options, model)
    # Either side quantized gives it a weight of its own: lm_head and the embedding
    # are stored (and quantized) separately from here on.
    report.untied_lm_head = tied and options.any
    return report
