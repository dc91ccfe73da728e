"""Tokenizers a cell-cache program carries.

- Hugging Face ``tokenizers`` JSON from a checkpoint folder (the default
  model's included), embedded in the .pte by ``export`` so ``generate`` needs
  no side files.
- ``ByteTokenizer``: ids 0-255 are UTF-8 bytes, then BOS, EOS; kept for
  programs of kind "bytes" (the earlier random-weight default model).
"""

import codecs
from typing import List, Optional

from executorch_cellcache.cache import metadata


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus BOS (256) and EOS (257)."""

    vocab_size = metadata.BYTES_VOCAB_SIZE
    bos_id = metadata.BYTES_BOS_ID
    eos_id = metadata.BYTES_EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return [self.bos_id] * add_special_tokens + list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for BOS and EOS)."""
        return bytes([token]) if 0 <= token < 256 else b""

    def token_name(self, token: int) -> Optional[str]:
        """The text form of a special token (None: no text form)."""
        return None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from tokenizer.json text."""

    def __init__(self, json_text: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(json_text)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """add_special_tokens: the post-processor's BOS and the like (False
        for text a chat template rendered, which carries them itself)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 of one token alone (a piece of a multi-byte character
        reads as U+FFFD); special tokens read as their names."""
        return self._tok.decode([token], skip_special_tokens=False).encode("utf-8")

    def token_name(self, token: int) -> Optional[str]:
        """The vocabulary's string for a token id (None outside it)."""
        return self._tok.id_to_token(token)


class StreamDecoder:
    """Text of a growing token list, piece by piece, for streaming: a piece
    never ends inside a multi-byte character (it waits for the rest), while
    invalid bytes still come out as U+FFFD at once."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: List[int] = []
        self._shown = ""
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") \
            if isinstance(tokenizer, ByteTokenizer) else None

    def push(self, token: int) -> str:
        if self._bytes is not None:
            return self._bytes.decode(bytes([token]) if 0 <= token < 256 else b"")
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # maybe a character split across tokens: wait for the next one
        piece, self._shown = text[len(self._shown):], text
        return piece

    def flush(self) -> str:
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        text = self._tok.decode(self._ids)
        piece, self._shown = text[len(self._shown):], text
        return piece


def from_metadata(kind: str, payload: Optional[str]):
    """The tokenizer a program's metadata names, or None when it has none."""
    if kind == metadata.TOKENIZER_BYTES:
        return ByteTokenizer()
    if kind == metadata.TOKENIZER_HF and payload:
        return HFTokenizer(payload)
    return None
