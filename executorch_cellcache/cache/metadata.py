"""What a cell-cache .pte carries besides ``forward``: constant methods that
configure the cache and the runner, so no side files are needed.

Strings travel as uint8 tensors (UTF-8); windows as int64 with 0 = full
causal. ``cellcache_format`` marks a program as ours.

Optional methods (``OPTIONAL``) were added after format 1 without bumping
it: a program that lacks one reads as the field's default for it, so older
programs still load (``kv_dtype``: "fp32"; ``attention``: "reference", the
dense-mask path programs used before ``cellcache::attend``).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

FORMAT_VERSION = 1

# Tokenizer kinds a program names in ``tokenizer_kind``:
TOKENIZER_BYTES = "bytes"   # UTF-8 bytes are ids 0-255, then BOS and EOS below (older programs)
TOKENIZER_HF = "hf"         # a Hugging Face tokenizer.json carried in ``tokenizer_json``
TOKENIZER_NONE = "none"     # token ids only
BYTES_BOS_ID = 256
BYTES_EOS_ID = 257
BYTES_VOCAB_SIZE = 258

# K/V storage dtypes a program may name in ``kv_dtype`` (SPEC section 7).
KV_DTYPES = ("fp32", "fp16")
# Weight quantization (SPEC 7) a program names in ``quantize``; "" in the .pte = fp32.
WEIGHT_QUANTIZE_MODES = ("8da4w", "8da8w")
# ``embedding_quantize``: "BITS" (per row) or "BITS,GROUP"; "" in the .pte = fp32.
EMBEDDING_QUANTIZE_BITS = (4, 8)
# The runtime kernel a quantized embedding of each width runs on.
EMBEDDING_KERNELS = {8: "quantized_decomposed::embedding_byte.out",
                     4: "quantized_decomposed::embedding_4bit.out"}


@dataclass
class ProgramInfo:
    n_cells: int
    n_layers: int
    windows: List[Optional[int]]  # per layer; None = full causal
    vocab_size: int
    bos_id: Optional[int]
    eos_ids: List[int]
    max_tokens_per_step: int
    model_type: str
    model_name: str
    tokenizer_kind: str           # TOKENIZER_BYTES, TOKENIZER_HF or TOKENIZER_NONE
    tokenizer_json: Optional[str]
    chat_template: Optional[str] = None  # jinja2 source (tokenizer_config.json), None = none
    kv_dtype: str = "fp32"        # one of KV_DTYPES (an unknown one is read as is)
    attention: str = "cells"      # "cells" (cellcache::attend) or "reference" (dense mask)
    # Weight quantization (SPEC 7); a program without these methods is fp32.
    quantize: Optional[str] = None             # a WEIGHT_QUANTIZE_MODES entry
    group_size: int = 0                        # 8da4w weight group; 0 = per channel
    embedding_quantize: Optional[str] = None   # "8", "4,32", ...


def embedding_bits(spec: str) -> int:
    """The bit width of an ``embedding_quantize`` spec ("8", "4,32", ...).
    Raises ValueError naming a spec this version cannot run."""
    bits = spec.split(",")[0].strip()
    if not bits.isdigit() or int(bits) not in EMBEDDING_QUANTIZE_BITS:
        raise ValueError(f"embedding quantization {spec!r} is not one this version knows "
                         f"(bits {', '.join(map(str, EMBEDDING_QUANTIZE_BITS))})")
    return int(bits)


def _text(s: str) -> torch.Tensor:
    return torch.tensor(list(s.encode("utf-8")) or [0], dtype=torch.uint8)


def constant_methods(info: ProgramInfo) -> Dict[str, object]:
    return {
        "cellcache_format": FORMAT_VERSION,
        "n_cells": info.n_cells,
        "n_layers": info.n_layers,
        "windows": [w or 0 for w in info.windows],
        "vocab_size": info.vocab_size,
        "bos_id": -1 if info.bos_id is None else info.bos_id,
        "eos_ids": info.eos_ids or [-1],
        "max_tokens_per_step": info.max_tokens_per_step,
        "model_type": _text(info.model_type),
        "model_name": _text(info.model_name),
        "tokenizer_kind": _text(info.tokenizer_kind),
        "tokenizer_json": _text(info.tokenizer_json or ""),
        "chat_template": _text(info.chat_template or ""),
        "kv_dtype": _text(info.kv_dtype),
        "attention": _text(info.attention),
        "quantize": _text(info.quantize or ""),
        "group_size": info.group_size,
        "embedding_quantize": _text(info.embedding_quantize or ""),
    }


# Optional methods and their defaults when a program lacks them.
OPTIONAL = {"chat_template": None, "kv_dtype": "fp32", "attention": "reference",
            "quantize": None, "group_size": 0, "embedding_quantize": None}


def read(program) -> ProgramInfo:
    """Reads the metadata of a loaded ``executorch.runtime`` Program.
    Raises ValueError when the program is not a cell-cache program."""
    names = set(program.method_names)
    if "cellcache_format" not in names or "forward" not in names:
        raise ValueError("this .pte has no cell-cache metadata; export it with "
                         "`cellcache export` or executorch_cellcache.export")

    def get(name):
        out = program.load_method(name).execute([])
        return out

    version = get("cellcache_format")[0]
    if version != FORMAT_VERSION:
        raise ValueError(f"cell-cache format {version} is not supported by this version "
                         f"(expects {FORMAT_VERSION}); re-export the model")

    def text(name):
        if name in OPTIONAL and name not in names:
            return OPTIONAL[name]
        data = bytes(get(name)[0].tolist()).rstrip(b"\0")
        return data.decode("utf-8")

    quantize = text("quantize") or None
    if quantize is not None and quantize not in WEIGHT_QUANTIZE_MODES:
        raise ValueError(f"this program's weights are quantized as {quantize!r}, which this "
                         f"version cannot run (it knows {', '.join(WEIGHT_QUANTIZE_MODES)}); "
                         f"upgrade executorch-cellcache or re-export the model")
    embedding_quantize = text("embedding_quantize") or None
    if embedding_quantize is not None:
        embedding_bits(embedding_quantize)
    return ProgramInfo(
        n_cells=get("n_cells")[0],
        n_layers=get("n_layers")[0],
        windows=[w or None for w in get("windows")],
        vocab_size=get("vocab_size")[0],
        bos_id=bos if (bos := get("bos_id")[0]) >= 0 else None,
        eos_ids=[e for e in get("eos_ids") if e >= 0],
        max_tokens_per_step=get("max_tokens_per_step")[0],
        model_type=text("model_type"),
        model_name=text("model_name"),
        tokenizer_kind=text("tokenizer_kind"),
        tokenizer_json=text("tokenizer_json") or None,
        chat_template=text("chat_template") or None,
        kv_dtype=text("kv_dtype"),
        attention=text("attention"),
        quantize=quantize,
        group_size=get("group_size")[0] if "group_size" in names else OPTIONAL["group_size"],
        embedding_quantize=embedding_quantize,
    )
