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


def _byte_level_chars() -> dict:
    """The byte-level BPE alphabet (GPT-2's rule, which ``tokenizers``'
    ByteLevel pre-tokenizer and decoder use): printable Latin-1 bytes stand for
    themselves, the other bytes for chr(256 + k) in byte order. -> {char: byte}."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(json_text: str) -> set:
    """The ``type`` of the tokenizer's decoder and of every decoder of a Sequence."""
    import json

    kinds, todo = set(), [json.loads(json_text).get("decoder")]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            kinds.add(d.get("type"))
            todo += d.get("decoders") or []
    return kinds


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from tokenizer.json text."""

    def __init__(self, json_text: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(json_text)
        kinds = _decoder_kinds(json_text)
        self._byte_level = _byte_level_chars() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        # Decoding is then exactly: the tokens' bytes (token_bytes), special tokens
        # skipped, as UTF-8 with U+FFFD for invalid bytes (what StreamDecoder relies on).
        self.byte_level = kinds == {"ByteLevel"}
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """add_special_tokens: the post-processor's BOS and the like (False
        for text a chat template rendered, which carries them itself)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, also when they are part of a
        multi-byte character (logprobs' ``bytes``, which lets a client rebuild
        such a character): from the vocabulary string of a byte-level BPE
        (GPT-2's byte alphabet) or a byte-fallback token (``<0xE2>``); other
        tokens as the UTF-8 of their decoded text. Special tokens read as
        their names."""
        name = self._tok.id_to_token(token)
        if name is not None and not self.is_special(token):
            if self._byte_level is not None and all(c in self._byte_level for c in name):
                return bytes(self._byte_level[c] for c in name)
            if self._byte_fallback and len(name) == 6 and name.startswith("<0x") and \
                    name.endswith(">"):
                try:
                    return bytes([int(name[3:5], 16)])
                except ValueError:
                    pass
        return self._tok.decode([token], skip_special_tokens=False).encode("utf-8")

    def is_special(self, token: int) -> bool:
        """A token that decoding leaves out (an added token marked special:
        BOS, EOS, chat markers)."""
        return token in self._special

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
        # Byte tokenizers and byte-level BPEs: an incremental UTF-8 decoder over the
        # tokens' bytes, O(1) a token, exact; other tokenizers: decode the whole list.
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") \
            if isinstance(tokenizer, ByteTokenizer) or getattr(tokenizer, "byte_level", False) \
            else None

    def push(self, token: int) -> str:
        if self._bytes is not None:
            if isinstance(self._tok, ByteTokenizer):
                return self._bytes.decode(bytes([token]) if 0 <= token < 256 else b"")
            return "" if self._tok.is_special(token) else \
                self._bytes.decode(self._tok.token_bytes(token))
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
