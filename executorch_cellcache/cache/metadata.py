"""What a cell-cache .pte carries besides ``forward``: constant methods that
configure the cache and the runner, so no side files are needed.

The methods (name, kind, default) are declared once, in
``ops/program_metadata.yaml``, which the C++ runner reads too (CMake generates
its names from it): ``int`` one int64, ``ints`` a list of int64, ``text`` UTF-8
as a uint8 tensor. Windows travel as int64 with 0 = full causal; a missing BOS
as -1; no EOS ids as [-1]. ``cellcache_format`` marks a program as ours.

Optional methods (those with a ``default``, ``OPTIONAL``) were added after
format 1 without bumping it: a program that lacks one reads as the default for
it, so older programs still load (``kv_dtype``: "fp32"; ``attention``:
"reference", the dense-mask path programs used before ``cellcache::attend``;
``window_cells``: [0], one pool for every layer).

Pools (issue #25): ``window_cells`` travels as [W1, cells1, W2, cells2, ...],
one pair per sliding window of the layers, each sizing that window's pool;
``n_cells`` then sizes the full-attention pool. ``ProgramInfo.new_cache``
builds the cache a program's forward runs on.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import yaml

from executorch_cellcache.cache._core import DEFAULT_RETAINED_MARGIN, CellCache


def _declared() -> dict:
    path = Path(__file__).resolve().parent / "program_metadata.yaml"
    if not path.exists():  # editable checkout: the file lives in ops/
        path = Path(__file__).resolve().parents[2] / "ops" / "program_metadata.yaml"
    return yaml.safe_load(path.read_text())


_DECLARED = _declared()
FORMAT_VERSION: int = _DECLARED["format_version"]
# Every method: name -> kind ("int", "ints" or "text"), in the file's order.
KINDS: Dict[str, str] = {m["name"]: m["kind"] for m in _DECLARED["methods"]}
# Optional methods: name -> what a program without it reads as (in the
# method's own terms: "" is no text).
OPTIONAL: Dict[str, object] = {m["name"]: m["default"] for m in _DECLARED["methods"]
                               if "default" in m}

# Tokenizer kinds a program names in ``tokenizer_kind``:
TOKENIZER_BYTES = "bytes"   # UTF-8 bytes are ids 0-255, then BOS and EOS below (older programs)
TOKENIZER_HF = "hf"         # a Hugging Face tokenizer.json carried in ``tokenizer_json``
TOKENIZER_NONE = "none"     # token ids only
BYTES_BOS_ID = 256
BYTES_EOS_ID = 257
BYTES_VOCAB_SIZE = 258

# K/V storage dtypes a program may name in ``kv_dtype`` (SPEC sections 7 and 12;
# int8: cpp/attention/kv_int8.h).
KV_DTYPES = ("fp32", "fp16", "int8")
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
    # Pools (issue #25): {W: cells} for every sliding window W of the layers,
    # or None = one pool of n_cells cells for every layer.
    window_cells: Optional[Dict[int, int]] = None
    retained_margin: int = DEFAULT_RETAINED_MARGIN  # R of each windowed pool

    def new_cache(self) -> CellCache:
        """An empty CellCache shaped as this program's K/V buffers: n_cells
        cells for one pool, or one pool per window policy (window_cells)."""
        if self.window_cells is None:
            return CellCache(self.n_cells, self.n_layers, self.windows)
        return CellCache(self.n_cells, self.n_layers, self.windows,
                         window_cells=dict(self.window_cells),
                         retained_margin=self.retained_margin)

    def pool_cells(self) -> List[int]:
        """Each layer's K/V buffer length in cells: its pool's capacity."""
        if self.window_cells is None:
            return [self.n_cells] * self.n_layers
        windows = self.windows if len(self.windows) == self.n_layers else \
            self.windows * self.n_layers
        return [self.n_cells if w is None else self.window_cells[w] for w in windows]


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
    """The methods to write for ``info``, one per declared method: an int, a
    list of ints, or a uint8 tensor of UTF-8."""
    special = {
        "cellcache_format": FORMAT_VERSION,
        "windows": [w or 0 for w in info.windows],
        "bos_id": -1 if info.bos_id is None else info.bos_id,
        "eos_ids": info.eos_ids or [-1],
        "window_cells": [v for w, cells in sorted((info.window_cells or {}).items())
                         for v in (w, cells)] or [0],
    }
    methods = {}
    for name, kind in KINDS.items():
        if name in special:
            value = special[name]
        elif hasattr(info, name):
            value = getattr(info, name)
        else:
            raise AttributeError(f"ProgramInfo has no field for the declared metadata method "
                                 f"{name!r} (ops/program_metadata.yaml)")
        methods[name] = _text(value or "") if kind == "text" else value
    return methods


def read(program) -> ProgramInfo:
    """Reads the metadata of a loaded ``executorch.runtime`` Program.
    Raises ValueError when the program is not a cell-cache program or its
    metadata is malformed."""
    names = set(program.method_names)
    if "cellcache_format" not in names or "forward" not in names:
        raise ValueError("this .pte has no cell-cache metadata; export it with "
                         "`cellcache export` or executorch_cellcache.export")

    def get(name):
        """A declared method's value: an int, a list of ints or a str."""
        kind = KINDS[name]
        if name not in names:
            if name in OPTIONAL:
                # An ints method's default is one int: it reads as [default],
                # as the C++ reader (program.cpp) reads it.
                return [OPTIONAL[name]] if kind == "ints" else OPTIONAL[name]
            raise ValueError(f"this program lacks the metadata method {name!r}; re-export "
                             f"the model")
        out = list(program.load_method(name).execute([]))
        if kind == "text":
            if len(out) != 1 or not isinstance(out[0], torch.Tensor) or \
                    out[0].dtype != torch.uint8:
                raise ValueError(f"cannot read the metadata text {name!r} (not one uint8 "
                                 f"tensor of UTF-8)")
            return bytes(out[0].tolist()).rstrip(b"\0").decode("utf-8")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
            raise ValueError(f"metadata method {name!r} does not return integers")
        if not out:
            raise ValueError(f"metadata method {name!r} returns nothing")
        return out[0] if kind == "int" else out

    version = get("cellcache_format")
    if version != FORMAT_VERSION:
        raise ValueError(f"cell-cache format {version} is not supported by this version "
                         f"(expects {FORMAT_VERSION}); re-export the model")
    v = {name: get(name) for name in KINDS}
    quantize = v["quantize"] or None
    if quantize is not None and quantize not in WEIGHT_QUANTIZE_MODES:
        raise ValueError(f"this program's weights are quantized as {quantize!r}, which this "
                         f"version cannot run (it knows {', '.join(WEIGHT_QUANTIZE_MODES)}); "
                         f"upgrade executorch-cellcache or re-export the model")
    embedding_quantize = v["embedding_quantize"] or None
    if embedding_quantize is not None:
        embedding_bits(embedding_quantize)
    window_cells = None
    if v["window_cells"] != [0]:
        pairs = v["window_cells"]
        if len(pairs) % 2 or any(x < 1 for x in pairs):
            raise ValueError(f"metadata method 'window_cells' must hold (window, cells) pairs "
                             f"of positive integers, got {pairs}")
        window_cells = dict(zip(pairs[0::2], pairs[1::2]))
    return ProgramInfo(
        window_cells=window_cells,
        retained_margin=v["retained_margin"],
        n_cells=v["n_cells"],
        n_layers=v["n_layers"],
        windows=[w or None for w in v["windows"]],
        vocab_size=v["vocab_size"],
        bos_id=v["bos_id"] if v["bos_id"] >= 0 else None,
        eos_ids=[e for e in v["eos_ids"] if e >= 0],
        max_tokens_per_step=v["max_tokens_per_step"],
        model_type=v["model_type"],
        model_name=v["model_name"],
        tokenizer_kind=v["tokenizer_kind"],
        tokenizer_json=v["tokenizer_json"] or None,
        chat_template=v["chat_template"] or None,
        kv_dtype=v["kv_dtype"],
        attention=v["attention"],
        quantize=quantize,
        group_size=v["group_size"],
        embedding_quantize=embedding_quantize,
    )
