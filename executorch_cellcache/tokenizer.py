"""Tokenizers a cell-cache program carries.

- ``ByteTokenizer``: the default model's byte-level tokenizer (ids 0-255 are
  bytes; then BOS, EOS).
- Hugging Face ``tokenizers`` JSON from a checkpoint folder, embedded in the
  .pte by ``export`` so ``generate`` needs no side files.
"""

from typing import List, Optional

BYTE_TOKENIZER = "bytes"


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus BOS (256) and EOS (257)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> List[int]:
        return [self.bos_id] + list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from tokenizer.json text."""

    def __init__(self, json_text: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(json_text)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def from_metadata(kind: str, payload: Optional[str]):
    """The tokenizer a program's metadata names, or None when it has none."""
    if kind == BYTE_TOKENIZER:
        return ByteTokenizer()
    if kind == "hf" and payload:
        return HFTokenizer(payload)
    return None
