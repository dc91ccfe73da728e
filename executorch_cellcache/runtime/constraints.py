"""Structured output: constrained decoding with token masks from the C++
engine's grammar layer (cpp/grammar/grammar.h: XGrammar, the library behind
vLLM's, SGLang's and Ollama's structured output, with our rules on top), the
same one ``cellcache_runner --stdio`` uses, so a schema means the same thing
in Python, behind HTTP and on a device.

A request may carry a ``Grammar``: a JSON schema, a Lark or GBNF grammar, a
regular expression, or a structural tag (tool calls), compiled against the
program's own vocabulary. Each sample gets a matcher; before a token is
chosen, the tokens the grammar does not allow next are masked out of its
logits row (greedy takes the argmax of what is left; sampling draws from the
distribution renormalized over it), and the chosen token advances the
matcher. A sample ends with finish reason "stop" on the token that completes
its grammar when nothing but the end of text could follow (no end-of-text
token is emitted), else when the model chooses an end of text (any of the
program's EOS ids), which the mask then allows.

- JSON is written as ``json.dumps`` writes it (", " and ": ", no other
  whitespace; small models fill free JSON with blank lines), properties in
  the schema's order. Strings with maxLength/minLength hold no control
  characters; a number with multipleOf needs both bounds (its values are
  enumerated; XGrammar alone ignores multipleOf); every mask also keeps the
  output valid UTF-8 (grammar.h says why).
- Forks (n > 1) each get their own matcher; the first token of every sample
  comes from the prompt's last row under the grammar's initial mask.
- Logprobs are those of the model's own (unmasked) distribution, as vLLM
  reports them by default: a client sees how likely the model found the
  token, not the renormalized share.
- Constrained samples take no speculative proposals (a proposal would have to
  be checked against the mask and the matcher rolled back with the cells);
  the rest of a batch speculates as usual.
"""

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError

KINDS = ("json_schema", "lark", "regex", "structural_tag")


@dataclass(frozen=True)
class Grammar:
    """What a request constrains its output with.

    kind: "json_schema" (``source`` a JSON schema: a dict, or its JSON text),
      "lark" (a Lark grammar in XGrammar's dialect, root rule ``start``; or
      GBNF as llama.cpp writes it, root rule ``root``, told apart by its
      ``::=``), "regex", or "structural_tag" (XGrammar's structural tag: a
      dict or its JSON text; serving/tool_calls.py writes them).
    """
    kind: str
    source: object

    def compiled_form(self) -> "tuple[str, str]":
        """(the C++ layer's kind, its source text); InvalidConfigError for an
        unknown kind, a schema that is not JSON, an empty grammar."""
        if self.kind not in KINDS:
            raise InvalidConfigError(f"grammar kind must be one of {', '.join(KINDS)}, got "
                                     f"{self.kind!r}")
        source = self.source
        if self.kind in ("json_schema", "structural_tag"):
            if isinstance(source, str):
                try:
                    source = json.loads(source)
                except ValueError as e:
                    raise InvalidConfigError(f"{self.kind} is not JSON: {e}") from e
            if not isinstance(source, (dict, bool)) or \
                    (self.kind == "structural_tag" and not isinstance(source, dict)):
                raise InvalidConfigError(f"{self.kind} must be a JSON object, got "
                                         f"{type(source).__name__}")
            return self.kind, json.dumps(source)
        if not isinstance(source, str) or not source.strip():
            raise InvalidConfigError(f"a {self.kind} grammar must be non-empty text")
        if self.kind == "lark" and "::=" in source:
            return "grammar", source
        return self.kind, source


class Vocabulary:
    """A program's vocabulary as the grammar layer reads it (built once per
    Runner: about 0.1 s for a 50k-token vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int],
                 tokenizer_kind: str = "hf"):
        if not tokenizer_json and tokenizer_kind != "bytes":
            raise InvalidConfigError("structured output needs the program's tokenizer "
                                     "(this .pte carries none)")
        if not eos_ids:
            raise InvalidConfigError("structured output needs an end-of-text token "
                                     "(this program has no EOS id)")
        self.vocab_size = vocab_size
        self._compiler = _core.CppGrammarCompiler(tokenizer_kind, tokenizer_json or "",
                                                  vocab_size, [int(e) for e in eos_ids])

    def compile(self, grammar: Grammar) -> "Constraint":
        """InvalidConfigError naming the problem for a grammar that cannot be
        compiled (an invalid schema, an unsupported feature, a syntax error)."""
        kind, text = grammar.compiled_form()
        return Constraint(self, self._compiler.compile(kind, text))


class Constraint:
    """A compiled grammar; ``matcher()`` gives each sample its own state."""

    def __init__(self, vocab: Vocabulary, compiled):
        self.vocab = vocab
        self._compiled = compiled
        self._initial_mask = self.matcher().mask()   # every sample's first mask: once
        self._initial_mask.flags.writeable = False

    def matcher(self) -> "Matcher":
        return Matcher(self.vocab, self._compiled.matcher())

    def initial_mask(self) -> np.ndarray:
        """bool [vocab]: the tokens a sample may start with (shared, read-only)."""
        return self._initial_mask


class Matcher:
    """One sample's place in its grammar."""

    def __init__(self, vocab: Vocabulary, matcher):
        self.vocab = vocab
        self._m = matcher
        self.complete = False  # the sample ends here (accept's answer)

    def fill(self, row: np.ndarray) -> None:
        """Writes the tokens the grammar allows next into ``row`` (bool or
        uint8 [vocab], contiguous)."""
        self._m.fill(row)

    def mask(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next."""
        row = np.zeros(self.vocab.vocab_size, dtype=bool)
        self._m.fill(row)
        return row

    def advance(self, token: int) -> None:
        """Consumes a chosen token; sets ``complete`` when the sample ends on
        it. RuntimeError if the grammar refused it (a token chosen outside
        the mask: a bug, never a user's error)."""
        self.complete = self._m.accept(int(token))


def fill_masks(matchers: Sequence[Matcher], out: np.ndarray,
               rows: Optional[Sequence[int]] = None) -> None:
    """Each matcher's next mask into ``out`` (bool [n, vocab]): matcher i's
    into row ``rows[i]`` (default i)."""
    for i, m in enumerate(matchers):
        m.fill(out[i if rows is None else rows[i]])


def batch_masks(matchers: Sequence[Matcher]) -> List[np.ndarray]:
    """Parallel to ``matchers``: each one's next mask (bool [vocab]), from one
    ``fill_masks`` call per vocabulary."""
    out: List[Optional[np.ndarray]] = [None] * len(matchers)
    by_vocab = {}
    for i, m in enumerate(matchers):
        by_vocab.setdefault(id(m.vocab), (m.vocab, []))[1].append(i)
    for vocab, indices in by_vocab.values():
        rows = np.zeros((len(indices), vocab.vocab_size), dtype=bool)
        fill_masks([matchers[i] for i in indices], rows)
        for i, row in zip(indices, rows):
            out[i] = row
    return out
