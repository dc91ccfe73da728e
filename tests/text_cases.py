"""Varied strings for tokenizer parity (C++ vs Hugging Face ``tokenizers``):
seeded, so a failure names a string that reproduces.

Each string mixes pieces that tokenizers split or merge differently: words in
several scripts, contractions in both cases ('s 'T 'LL), digit runs (ASCII and
other scripts' digits), whitespace runs of every kind (tabs, CR LF, no-break
and ideographic spaces, line and paragraph separators), punctuation and
symbols, combining marks, emoji with ZWJ and variation selectors, code points
from every plane (private use included), and the tokenizer's special tokens,
glued to text or alone.

Random code points are characters Unicode 14 assigns (Python 3.11's
``unicodedata``), private use included: the two libraries' character tables
are of different Unicode versions (Hugging Face tokenizers' Rust regex knows
Unicode 16, the C++ tokenizer's llama.cpp tables an older one), so a letter
added since (e.g. Egyptian Hieroglyphs Extended-A, Unicode 16) splits
differently there: 4 of 10,000 SmolLM2 strings before this rule.
"""

import random
import unicodedata
from typing import List, Sequence

WORDS = ["hello", "world", "The", "quick", "brown", "fox", "jumps", "über", "naïve", "café",
         "Straße", "日本語", "中文字符", "한국어", "русский", "ελληνικά", "עברית", "العربية",
         "हिन्दी", "ไทย", "tiếng", "Việt", "emoji", "x", "I", "a", "def", "return", "self",
         "__init__", "camelCase", "snake_case", "URL", "https://example.com/a?b=1&c=2"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M",
                "'LL", "'D", "’s", "n't"]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\u00a0", "\u1680",
              "\u2000", "\u2003", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f",
              "\u3000", "\u0085", "\x0b", "\x0c", "\t \t", "    \n"]
DIGITS = ["0", "7", "42", "123", "2024", "3.14159", "1,000,000", "٣٤٥", "१२३", "๑๒๓", "１２３",
          "⁴²", "½", "000123"]
PUNCT = [".", ",", "!", "?", "...", "--", "—", "–", "(", ")", "[", "]", "{", "}", "\"", "'",
         "`", "~", "@", "#", "$", "%", "^", "&", "*", "+", "=", "<", ">", "/", "\\", "|", ";",
         ":", "«", "»", "¿", "¡", "•", "→", "∑", "€", "£", "¥", "©", "®", "™", "°"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "\u0915\u093f", "o\u0302\u0323", "\u0301",
             "Z\u0351\u0352\u0353"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "❤️", "🏳️‍🌈", "🇫🇷", "🤖", "✨", "☕", "🧑‍💻"]


def _code_point(rng: random.Random) -> str:
    """One code point from a random plane (no surrogates: not encodable)."""
    ranges = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF),
              (0x1100, 0x11FF), (0x1E00, 0x1FFF), (0x2000, 0x2BFF), (0x3000, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xF900, 0xFFFD),
              (0x10000, 0x1FFFF), (0x20000, 0x2FFFF), (0xE0000, 0xE007F), (0xF0000, 0x10FFFF),
              (0x0, 0x1F)]
    while True:
        lo, hi = rng.choice(ranges)
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) != "Cn":
            return c


def strings(count: int, special_tokens: Sequence[str], seed: int = 49) -> List[str]:
    """count strings, the first few fixed edge cases, the rest random mixes."""
    rng = random.Random(seed)
    fixed = ["", " ", "a", "\n", "  hello", "hello  ", "I'm", "don't", "DON'T", "x" * 300,
             " " * 40, "\n" * 10, "1234567890" * 5, "😀" * 10]
    fixed += list(special_tokens)
    fixed += [t + "text" + t for t in special_tokens] + [" " + t + " " for t in special_tokens]
    out = fixed[:count]
    kinds = [WORDS, CONTRACTIONS, WHITESPACE, DIGITS, PUNCT, COMBINING, EMOJI]
    while len(out) < count:
        pieces = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            if r < 0.08 and special_tokens:
                pieces.append(rng.choice(special_tokens))
            elif r < 0.25:
                pieces.append("".join(_code_point(rng) for _ in range(rng.randint(1, 6))))
            else:
                pieces.append(rng.choice(rng.choice(kinds)))
        sep = rng.choice(["", " ", "", "\n", " "])
        out.append(sep.join(pieces))
    return out
