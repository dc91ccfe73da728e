"""GGUF checkpoints (llama.cpp's file format) as export input.

``load`` reads a ``.gguf`` file (or a folder holding exactly one) through
transformers' own GGUF loader (``from_pretrained(folder, gguf_file=...)``,
which dequantizes every tensor to fp32 with the ``gguf`` package), its
tokenizer and chat template included. Refused before anything is exported,
with one line naming the problem: a file that is not GGUF or is cut short, an
architecture transformers cannot map, a tensor type the ``gguf`` package
cannot dequantize.

``ExactWeights`` keeps the file's own quantized values where our kernels can
run them as they are, instead of requantizing the dequantized fp32 (which
costs a real model dearly: SmolLM2-135M's Q4_1 weights requantized to
symmetric int4 raised held-out perplexity by ~25-30%, measured in
transformers). Exact, per block of 32 input features (ggml-quants.c's
layouts):
- Q4_0 ``w = d (q - 8)``: XNNPACK's blockwise int4 as it is;
- Q4_1 ``w = d q + m``: ``d (q - 8)`` plus a per-block offset
  ``m + 8 d`` (graph/block_offsets.py);
- Q8_0 ``w = d q``: an int8 embedding in groups of 32 as it is.
Rows are found by value (each weight row of the loaded model is matched to
the file's dequantized row it came from), so no tensor-name table and no
knowledge of transformers' q/k row permutation is needed, and every match is
checked by recomputing the weight from the decoded values.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.graph.block_offsets import dequantized
from executorch_cellcache.graph.model import SUPPORTED, UnsupportedModelError

SUFFIX = ".gguf"
MAGIC = b"GGUF"
BLOCK = 32   # Q4_0, Q4_1 and Q8_0 blocks (QK4_0 = QK4_1 = QK8_0 in ggml)


def find(path: Path) -> Optional[Path]:
    """The GGUF file ``path`` names: itself if it ends in .gguf, the one .gguf
    in a folder that has no config.json; None otherwise. Raises
    InvalidConfigError for a folder with several .gguf files (naming them)."""
    if path.suffix.lower() == SUFFIX and not path.is_dir():
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX)
        if len(found) > 1:
            raise InvalidConfigError(
                f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                f"name the one to export")
        return found[0] if found else None
    return None


def _reader(path: Path):
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise InvalidConfigError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:   # the reader's errors for a cut file are ValueError, IndexError...
        raise InvalidConfigError(f"{path} is truncated or corrupt: its GGUF header or tensor "
                                 f"table cannot be read ({str(e)[:120]})") from e


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8", "replace") if value.dtype == np.uint8 else value[0]


def check_file(path: Path) -> None:
    """``check`` on the file at ``path``, read here (the header and tensor
    table only): what a command calls before it announces any work."""
    check(path, _reader(path))


def check(path: Path, reader=None) -> None:
    """Refuses a GGUF transformers or the ``gguf`` package cannot read, in
    milliseconds (only the header and tensor table are read): an architecture
    outside transformers' GGUF mapping, a tensor type with no dequantizer.
    Raises InvalidConfigError / UnsupportedModelError naming it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise InvalidConfigError(f"{path} has no general.architecture: not a model GGUF")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture '{arch}' cannot be loaded by transformers' GGUF reader "
            f"(it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); the cell cache "
            f"serves {SUPPORTED}")
    tried: Dict[int, Optional[str]] = {}
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in tried:
            qtype = GGMLQuantizationType(kind)
            try:
                from gguf.constants import GGML_QUANT_SIZES

                block, size = GGML_QUANT_SIZES[qtype]
                dequantize(np.zeros(size, dtype=np.uint8), qtype)
                tried[kind] = None
            except (NotImplementedError, KeyError) as e:
                tried[kind] = f"{qtype.name} ({type(e).__name__})"
        if tried[kind]:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name} is of type {tried[kind]}, which the gguf "
                f"package cannot dequantize; requantize the model to a common type (Q4_0, "
                f"Q4_1, Q4_K, Q8_0, F16)")


@dataclass
class ExactRows:
    """A weight [n, k] as the file stores it: ``w = scale * q (+ offsets)``
    per block of 32 input features.

    q: int8 [n, k] (-8..7 for 4-bit types, -127..127 for Q8_0);
    scale: fp32 [n, k / 32]; offsets: fp32 [n, k / 32] or None (all zero);
    bits: 4 or 8."""
    q: torch.Tensor
    scale: torch.Tensor
    offsets: Optional[torch.Tensor]
    bits: int

    def weight(self) -> torch.Tensor:
        n, k = self.q.shape
        w = dequantized(self.q, self.scale, BLOCK)
        if self.offsets is not None:
            w = (w.view(n, k // BLOCK, BLOCK) + self.offsets.unsqueeze(-1)).view(n, k)
        return w


def _decode(raw: np.ndarray, kind: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """raw uint8 [n, n_blocks * block bytes] of one type -> (q int8 [n, k],
    scale f32 [n, n_blocks], offsets f32 [n, n_blocks] or None)."""
    n = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(n, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), d, None
    start = 2 if kind == "Q4_0" else 4
    packed = blocks[..., start:start + 16]
    # element j of a block is packed[j] & 15, element j + 16 is packed[j] >> 4
    q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int8) - 8
    offsets = None
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        offsets = m + 8 * d
    return q.reshape(n, -1), d, offsets


class ExactWeights:
    """The file's Q4_0 / Q4_1 / Q8_0 rows, found by their dequantized values."""

    KINDS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}

    def __init__(self, reader):
        from gguf.quants import dequantize

        self._tensors: List[Tuple[str, np.ndarray]] = []
        self._rows: Dict[int, Tuple[int, int]] = {}
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in self.KINDS or len(tensor.shape) != 2:
                continue
            raw = np.asarray(tensor.data)
            index = len(self._tensors)
            self._tensors.append((kind, raw))
            values = dequantize(raw, tensor.tensor_type)
            for r in range(values.shape[0]):
                self._rows.setdefault(hash(values[r].tobytes()), (index, r))

    def __len__(self) -> int:
        return len(self._tensors)

    def rows(self, weight: torch.Tensor) -> Optional[ExactRows]:
        """``weight`` [n, k] fp32 as the file stores it, or None where some
        row is not one of the file's rows of these types, rows mix widths, or
        the decoded values do not give the weight back."""
        w = weight.detach().to(torch.float32).contiguous().numpy()
        if w.ndim != 2 or w.shape[1] % BLOCK:
            return None
        found = [self._rows.get(hash(w[r].tobytes())) for r in range(w.shape[0])]
        if any(f is None for f in found):
            return None
        bits = {self.KINDS[self._tensors[t][0]] for t, _ in found}
        if len(bits) != 1:
            return None
        n, k = w.shape
        q = np.empty((n, k), np.int8)
        scale = np.empty((n, k // BLOCK), np.float32)
        off = np.zeros((n, k // BLOCK), np.float32)
        tensor_of = np.array([t for t, _ in found])
        row_of = np.array([r for _, r in found])
        for t in np.unique(tensor_of):   # one decode per source tensor
            at = np.nonzero(tensor_of == t)[0]
            kind, raw = self._tensors[t]
            q[at], scale[at], part = _decode(raw[row_of[at]], kind)
            if part is not None:
                off[at] = part
        exact = ExactRows(torch.from_numpy(q), torch.from_numpy(scale),
                          torch.from_numpy(off) if off.any() else None, bits.pop())
        ok = torch.allclose(exact.weight(), weight.detach().float(), rtol=1e-5,
                            atol=1e-6 * float(weight.detach().abs().max()))
        return exact if ok else None


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer_json: Optional[str]
    chat_template: Optional[str]
    exact: ExactWeights


def load(path: Path, progress=None) -> Loaded:
    """A GGUF file -> the transformers model (fp32, dequantized; its config
    and generation config carry the EOS ids), its tokenizer.json text, chat
    template and the file's exact rows.
    Raises FileNotFoundError, InvalidConfigError, UnsupportedModelError."""
    say = progress or (lambda _line: None)
    reader = _reader(path)
    check(path, reader)
    say(f"reading {path.name} through transformers' GGUF loader (dequantizing to fp32) ...")
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32,
                                                     local_files_only=True)
    except ValueError as e:
        raise UnsupportedModelError(f"{path}: transformers cannot load it as a causal LM "
                                    f"({e})") from e
    except (OSError, KeyError, IndexError) as e:
        raise InvalidConfigError(f"{path}: the GGUF cannot be read ({e})") from e
    # The weights are fp32 now; the GGUF quantizer and the config's marker would make
    # transformers treat the model as quantized (.float() and save_pretrained refuse it).
    model.hf_quantizer = None
    model.__dict__.pop("is_quantized", None)   # set on the instance by the loader
    for config in (model.config, model.config.get_text_config()):
        if "quantization_config" in config.__dict__:
            del config.quantization_config
    model.name_or_path = path.stem
    from executorch_cellcache.exporting import checkpoint_files

    tokenizer_json = chat_template = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:   # transformers' converters raise many kinds
        say(f"no tokenizer: transformers cannot build one from {name} ({type(e).__name__}: "
            f"{e}); the program will take and give token ids only")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            tokenizer_json = checkpoint_files.tokenizer_json(Path(tmp))
            chat_template = checkpoint_files.chat_template(Path(tmp))
    say("indexing the file's Q4_0 / Q4_1 / Q8_0 rows to keep them exact ...")
    return Loaded(model, tokenizer_json, chat_template, ExactWeights(reader))
