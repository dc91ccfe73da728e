"""Export a transformers decoder with the cell cache to an ExecuTorch .pte.

The program's ``forward(tokens, positions, logits_for, handle, extent)`` is
``CellCacheLM.forward`` (model.py): n_tok is dynamic in [1,
max_tokens_per_step], n_out in [1, max_tokens_per_step], extent in [1,
n_cells]. Metadata methods (metadata.py) carry the cache configuration and
the tokenizer.
"""

import copy
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
from torch.export import Dim

from executorch_cellcache.cache import metadata
from executorch_cellcache.exporting import checkpoint_files, packaged_models
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting.options import (KV_TORCH_DTYPES, ExportOptions,  # noqa: F401
                                                    default_kv_dtype)
from executorch_cellcache.exporting.quiet_imports import (quiet_third_party_imports,
                                                          third_party_warnings_silenced)

with quiet_third_party_imports():
    from executorch_cellcache.exporting import gguf, outliers
    from executorch_cellcache.exporting import quantize as quantization
    from executorch_cellcache.exporting.lowering import (cache_reads, delegated_linears,
                                                         full_cache_copies, lower, torchao_ops)
    from executorch_cellcache.exporting.summary import ExportSummary
    from executorch_cellcache.graph.block_offsets import has_block_offsets
    from executorch_cellcache.graph.model import (
        SUPPORTED,
        CellCacheLM,
        UnsupportedModelError,
        layer_windows,
    )


@dataclass
class ExportResult:
    path: Path
    seconds: float
    size_bytes: int
    info: metadata.ProgramInfo
    summary: Optional[ExportSummary] = None


def _check_writable(out_path: Path) -> None:
    """Refuses an output path that cannot be written, before minutes of export."""
    if out_path.is_dir():
        raise InvalidConfigError(f"output path {out_path} is a folder; name a .pte file")
    if not out_path.parent.exists():
        raise FileNotFoundError(f"output folder {out_path.parent} does not exist")
    if not os.access(out_path.parent, os.W_OK) or \
            (out_path.exists() and not os.access(out_path, os.W_OK)):
        raise PermissionError(f"cannot write {out_path}")


@dataclass
class _FolderFiles:
    tokenizer_json: Optional[str]
    chat_template: Optional[str]
    eos_ids: List[int]   # generation_config.json's


def _load_folder(folder: Path):
    """A local checkpoint folder -> (model, _FolderFiles)."""
    if not folder.exists():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise InvalidConfigError(f"model path {folder} is not a folder (expected a Hugging Face "
                                 f"checkpoint folder with config.json and weights)")
    if not (folder / "config.json").exists():
        raise InvalidConfigError(f"{folder} has no config.json: not a Hugging Face checkpoint "
                                 f"folder")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InvalidConfigError(f"{folder}/config.json cannot be read: {e}") from e
    # Refused here, cheaply: transformers' own error for a config without a causal-LM
    # class imports every causal-LM module to list them (seconds) and names ~200 classes.
    if getattr(config, "is_encoder_decoder", False) or \
            config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise UnsupportedModelError(
            f"{folder}: model type '{config.model_type}' ({archs}) is not a decoder-only "
            f"causal LM; supported: {SUPPORTED}")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                     local_files_only=True)
    except OSError as e:
        raise InvalidConfigError(f"{folder}: the weights cannot be loaded ({e})") from e
    except ValueError as e:
        raise UnsupportedModelError(
            f"{folder}: transformers cannot load it as a causal LM ({e})") from e
    return model, _FolderFiles(checkpoint_files.tokenizer_json(folder),
                               checkpoint_files.chat_template(folder),
                               checkpoint_files.generation_eos_ids(folder))


def _gguf_head(model, options, exact):
    """options with the output layer's mode a GGUF's own: unset under 8da4w,
    a file whose output weight is neither 4-bit nor Q8_0 blocks (which 8da4w
    keeps exact: quantize.split_int8_head) -> 8da8w."""
    head = model.get_output_embeddings()
    if options.mode != "8da4w" or options.lm_head is not None or head is None:
        return options
    rows = exact.rows(head.weight)
    if rows is not None and options.group_size == 32 and \
            (rows.bits == 4 or rows.offsets is None):
        return options
    return dataclasses.replace(options, lm_head="8da8w")


def _stop_ids(model, config, extra: List[int]) -> List[int]:
    """EOS ids of config.json and of the generation config, their union
    (ExecuTorch #10365: a chat model's end-of-turn token is often only in
    generation_config.json)."""
    eos = config.eos_token_id if config.eos_token_id is not None else \
        getattr(model.config, "eos_token_id", None)
    generation = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return checkpoint_files.union(checkpoint_files.eos_ids(eos),
                                  checkpoint_files.eos_ids(generation), extra)


def _program_info(model, options: ExportOptions, pools, tokenizer_kind, files: _FolderFiles):
    config = model.config.get_text_config()
    eos_ids = _stop_ids(model, config, files.eos_ids)
    windows = layer_windows(config)
    return metadata.ProgramInfo(
        n_cells=options.n_cells, n_layers=len(windows), windows=windows,
        vocab_size=config.vocab_size, bos_id=config.bos_token_id, eos_ids=eos_ids,
        max_tokens_per_step=options.max_tokens_per_step, model_type=config.model_type,
        model_name=str(getattr(model, "name_or_path", "") or config.model_type),
        tokenizer_kind=tokenizer_kind, tokenizer_json=files.tokenizer_json,
        chat_template=files.chat_template, kv_dtype=options.kv_dtype,
        attention=options.attention, window_cells=pools,
        retained_margin=options.retained_margin)


@third_party_warnings_silenced
def export(model: Union["torch.nn.Module", str, Path, None], out_path: Union[str, Path],
           options: Optional[ExportOptions] = None, *,
           progress: Optional[Callable[[str], None]] = None, **fields) -> ExportResult:
    """Exports ``model`` with a cell cache to ``out_path``.

    model: a transformers ``PreTrainedModel`` (copied, never modified), a local
    checkpoint folder, or None for the embedded default model (its checkpoint
    folder, ``default_model.CHECKPOINT``, loaded as any other folder).
    options: an ``ExportOptions`` (exporting/options.py: cells, tokens a step,
    attention path, K/V dtype, quantization, window pools), or its fields as
    keywords (``export(m, path, n_cells=256, quantize="8da4w")``), not both.
    progress: called with a line on each long phase.
    ``result.summary`` says what was quantized and delegated; ``result.info``
    is the metadata written (window pools included).
    Raises InvalidConfigError (bad sizes, choices, quantization or pool
    options, a checkpoint config whose ``quantization_aware_training`` names
    no known weight scales, not a checkpoint folder), FileNotFoundError
    (missing folder), PermissionError (an output path that cannot be written),
    UnsupportedModelError (an architecture or attention the cell cache cannot
    serve), and TypeError (an unknown keyword), all before tracing.
    """
    t0 = time.perf_counter()
    if options is not None and fields:
        raise TypeError(f"pass ExportOptions or its fields as keywords, not both "
                        f"(got options and {', '.join(sorted(fields))})")
    if options is not None and not isinstance(options, ExportOptions):
        raise TypeError(f"options must be an ExportOptions, got {type(options).__name__}")
    options = (options or ExportOptions(**fields)).checked()
    quant_options = quantization.check_options(options.quantize, options.group_size,
                                               options.embedding_quantize,
                                               options.weight_scales, options.lm_head_quantize)
    out_path = Path(out_path)
    _check_writable(out_path)
    tokenizer_kind, files = metadata.TOKENIZER_NONE, _FolderFiles(None, None, [])
    exact = None
    if isinstance(model, str) and not Path(model).exists():
        model = packaged_models.resolve(model) or model
    gguf_path = gguf.find(Path(model)) if isinstance(model, (str, Path)) else None
    if gguf_path is not None:
        loaded = gguf.load(gguf_path, progress)
        model, exact = loaded.model, loaded.exact
        files = _FolderFiles(loaded.tokenizer_json, loaded.chat_template, [])
        tokenizer_kind = metadata.TOKENIZER_HF if files.tokenizer_json else \
            metadata.TOKENIZER_NONE
        quant_options = _gguf_head(model, quant_options, exact)
    elif model is None or isinstance(model, (str, Path)):
        from executorch_cellcache.exporting import default_model

        folder = default_model.CHECKPOINT if model is None else Path(model)
        model, files = _load_folder(folder)
        tokenizer_kind = metadata.TOKENIZER_HF if files.tokenizer_json else \
            metadata.TOKENIZER_NONE
        if folder.resolve() == default_model.CHECKPOINT:
            model.name_or_path = default_model.NAME  # the .pte names the model, not a path
    else:
        if not isinstance(model, torch.nn.Module) or \
                not hasattr(getattr(model, "config", None), "get_text_config"):
            raise UnsupportedModelError(
                f"expected a transformers PreTrainedModel or a checkpoint folder, got "
                f"{type(model).__name__}")
        model = copy.deepcopy(model)
    model = model.float().eval()
    quantization.check_quantizable(model, quant_options)
    quant_options = quantization.resolve_scales(quant_options, model)
    n_outliers = options.outlier_channels if options.outlier_channels is not None else \
        (outliers.DEFAULT_CHANNELS if gguf_path is not None and quant_options.mode else 0)
    magnitudes = {}
    if n_outliers:
        (progress or (lambda _line: None))(
            f"calibrating: {n_outliers} outlier input channels per linear, from "
            f"{outliers.CALIBRATION_SEQUENCES} x {outliers.CALIBRATION_TOKENS} tokens "
            f"the model samples ...")
        magnitudes = outliers.sample_magnitudes(model)

    # CellCacheLM refuses unsupported architectures (encoder-decoders, no lm_head, ...)
    # with UnsupportedModelError before _program_info reads decoder-only config fields.
    pools = options.window_pools(layer_windows(model.config.get_text_config()))
    wrapped = CellCacheLM(model, options.n_cells, options.attention,
                          KV_TORCH_DTYPES[options.kv_dtype], window_cells=pools,
                          fuse_projections=options.fuse_projections)
    info = _program_info(model, options, pools, tokenizer_kind, files)
    n_cells, max_tokens_per_step = options.n_cells, options.max_tokens_per_step
    if quant_options.any:
        say = progress or (lambda _line: None)
        say(f"quantizing (weights {quant_options.mode or 'fp32'}, embedding "
            f"{quant_options.embedding.spec if quant_options.embedding else 'fp32'}, "
            f"{quant_options.weight_scales} scales) ...")
    report = quantization.quantize_model(model, quant_options, exact)
    report.outlier_channels = outliers.keep_outliers(model, magnitudes, n_outliers) \
        if n_outliers else {}
    info = dataclasses.replace(
        info, quantize=quant_options.mode, group_size=quant_options.recorded_group_size,
        embedding_quantize=quant_options.embedding.spec if quant_options.embedding else None)
    # Dims must span >= 2 values; the runner enforces the real limits.
    n_tok = Dim("n_tok", min=1, max=max(2, max_tokens_per_step))
    n_out = Dim("n_out", min=1, max=max(2, max_tokens_per_step))
    extent = Dim("extent", min=1, max=max(2, n_cells, *(info.window_cells or {}).values()))
    examples = (
        torch.zeros(2, dtype=torch.int64),  # tokens
        torch.arange(2, dtype=torch.int64),  # positions
        torch.zeros(2, dtype=torch.int64),  # logits_for
        torch.zeros(1, dtype=torch.int64),  # handle
        torch.empty(2, dtype=torch.uint8),  # extent
    )
    dynamic = ({0: n_tok}, {0: n_tok}, {0: n_out}, None, {0: extent})
    program = lower(wrapped, examples, dynamic, metadata.constant_methods(info), progress,
                    quantized=quant_options.any)
    summary = _summarize(program, report, model, wrapped.fused_projections)
    cache_shapes = {tuple(b.shape) for name, b in wrapped.named_buffers()
                    if name.endswith(("cellcache_k", "cellcache_v"))}
    copies = full_cache_copies(program, cache_shapes)
    if copies:
        raise RuntimeError(f"the exported program copies a whole K/V cache per step: {copies}")
    reads = cache_reads(program) if options.attention == "cells" else []
    if reads:
        raise RuntimeError(f"the exported program reads the K/V caches outside "
                           f"cellcache::attend (a per-layer copy): {reads}")
    out_path.write_bytes(program.buffer)
    summary.size_bytes = out_path.stat().st_size
    return ExportResult(out_path, time.perf_counter() - t0, summary.size_bytes, info, summary)


def _summarize(program, report, model, fused_projections: int) -> ExportSummary:
    """The export summary (fused_projections: the q/k/v and gate/up groups
    CellCacheLM fused); raises RuntimeError for a program that would run
    slowly or not load: a quantized linear outside the XNNPACK delegate, or a
    torchao op left in the program."""
    delegated = delegated_linears(program)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    if delegated["quantized"] < len(report.linears):
        raise RuntimeError(
            f"{len(report.linears) - delegated['quantized']} of {len(report.linears)} quantized "
            f"linear layers were left outside the XNNPACK delegate (they would run as slow "
            f"dequantize + matmul); left over: {torchao_ops(program)[:5]}")
    leftover = torchao_ops(program)
    if leftover:
        raise RuntimeError(f"the program still holds torchao ops the runtime has no kernel "
                           f"for: {leftover[:5]}")
    return ExportSummary(
        quantize=report.mode, group_size=report.group_size, linears=n_linear,
        linears_quantized=len(report.linears), per_channel=report.per_channel,
        delegated_quantized=delegated["quantized"], delegated_fp32=delegated["fp32"],
        embedding=report.embedding, weight_scales=report.weight_scales,
        untied_lm_head=report.untied_lm_head, fused_projections=fused_projections,
        lm_head=report.lm_head, exact=report.exact,
        block_offsets=sum(has_block_offsets(m) for m in model.modules()),
        outlier_channels=report.outlier_channels)
