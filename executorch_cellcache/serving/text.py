"""Token ids -> the text a client sees: incremental decoding, stop strings,
and the per-token strings of logprobs.

A stop string ends its sample; the text stops before it (OpenAI's rule). While
streaming, the last ``len(longest stop) - 1`` characters are held back until
they can no longer begin a stop string, so streamed text never shows a
prefix of a stop that then completes.
"""

from typing import List, Optional, Tuple

from executorch_cellcache.runtime.tokenizer import StreamDecoder


class SampleText:
    """The text of one sample as its tokens arrive."""

    def __init__(self, tokenizer, stops: List[str]):
        self._decoder = StreamDecoder(tokenizer)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._all = ""     # decoded so far
        self._sent = 0     # characters of _all released
        self.stopped = False  # a stop string matched

    @property
    def offset(self) -> int:
        """Where the next token's text starts in the sample's text (logprobs'
        text_offset): counted in decoded text, whatever is held back."""
        return len(self._all)

    @property
    def text(self) -> str:
        """What has been released."""
        return self._all[:self._sent]

    def push(self, token: int) -> str:
        """Adds a generated token (never a stop token); returns the text to
        release now ("" while held back or after a stop string)."""
        if self.stopped:
            return ""
        self._all += self._decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the sample ended."""
        if self.stopped:
            return ""
        self._all += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # A match cannot start in released text: hold-back kept every char that could.
        start = max(0, self._sent - self._hold)
        hits = [i for i in (self._all.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(self._all) if final else max(self._sent, len(self._all) - self._hold)
        piece, self._sent = self._all[self._sent:end], end
        if self.stopped:
            self._all = self._all[:end]
        return piece


def token_string(tokenizer, token: int) -> Tuple[str, List[int]]:
    """(text, UTF-8 bytes) of one token for a logprobs entry. A token with no
    text (a special token) shows its vocabulary name, or its id."""
    raw = tokenizer.token_bytes(token)
    if raw:
        return raw.decode("utf-8", errors="replace"), list(raw)
    name: Optional[str] = tokenizer.token_name(token)
    return (name if name is not None else f"<{token}>"), []
