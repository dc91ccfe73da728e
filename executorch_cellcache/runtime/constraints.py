"""Structured output: constrained decoding with llguidance token masks.

A request may carry a ``Constraint``: a JSON schema, a Lark (or GBNF) grammar,
or a regular expression, compiled by llguidance (the Guidance project's Rust
library; the engine behind vLLM's and SGLang's "guidance" backend) against
the program's own tokenizer. Each sample gets a matcher; before a token is
chosen, the tokens the grammar does not allow next are masked out of its
logits row (greedy takes the argmax of what is left; sampling draws from the
distribution renormalized over it), and the chosen token advances the
matcher. A sample whose grammar is complete ends with finish reason "stop":
on the token that completes it when nothing may follow (llguidance's matcher
stops there; no end-of-text token is emitted), else when the model chooses
the end of text, which the mask then allows (any of the program's EOS ids:
llguidance knows one, the first; another one is consumed as that one).

- Forks (n > 1) each get their own matcher; the first token of every sample
  comes from the prompt's last row under the grammar's initial mask.
- Logprobs are those of the model's own (unmasked) distribution, as vLLM
  reports them by default: a client sees how likely the model found the
  token, not the renormalized share.
- Constrained samples take no speculative proposals (a proposal would have to
  be checked against the mask and the matcher rolled back with the cells);
  the rest of a batch speculates as usual.
- A step's masks are computed in one call (``batch_masks``: llguidance's
  parallel fill into one packed bitmask, one executor per Vocabulary, then
  one unpack to bool rows); sampling.choose_tokens applies them (a greedy
  row's argmax over the allowed tokens without a masked copy of the row).
- The C++ engine has no constraints: llguidance is a Rust library, and the
  registries here ship only its Python wheel; the engine would need its C API
  (``llguidance.h``, built with cargo) linked into cellcache_runner.
"""

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from executorch_cellcache.cache.errors import InvalidConfigError

KINDS = ("json_schema", "lark", "regex")


def _library():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the mask helpers
    except ImportError as e:  # a runtime dependency: pinned in setup.py
        raise InvalidConfigError(f"structured output needs llguidance (pip install "
                                 f"llguidance): {e}") from e
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a request constrains its output with.

    kind: "json_schema" (``source`` a JSON schema: a dict, or its JSON text),
      "lark" (a Lark grammar, or GBNF as llama.cpp writes it; llguidance's
      syntax), or "regex".
    """
    kind: str
    source: object

    def text(self) -> str:
        """The grammar in llguidance's form; InvalidConfigError for an unknown
        kind or a schema that is not JSON."""
        lib = _library()
        if self.kind not in KINDS:
            raise InvalidConfigError(f"grammar kind must be one of {', '.join(KINDS)}, got "
                                     f"{self.kind!r}")
        source = self.source
        if self.kind == "json_schema":
            if isinstance(source, str):
                try:
                    source = json.loads(source)
                except ValueError as e:
                    raise InvalidConfigError(f"json_schema is not JSON: {e}") from e
            if not isinstance(source, (dict, bool)):
                raise InvalidConfigError(f"json_schema must be a JSON object (a schema), got "
                                         f"{type(source).__name__}")
            # JSON as json.dumps writes it (", " and ": ", no other whitespace): with
            # whitespace free, small models fill the object with blank lines (vLLM's
            # --disable-any-whitespace answers the same).
            try:
                return lib.JsonCompiler(whitespace_flexible=False).compile(json.dumps(source))
            except ValueError as e:
                raise InvalidConfigError(f"the json_schema cannot be used: {e}") from e
        if not isinstance(source, str) or not source.strip():
            raise InvalidConfigError(f"a {self.kind} grammar must be non-empty text")
        return lib.grammar_from("grammar" if self.kind == "lark" else "regex", source)


class Vocabulary:
    """llguidance's view of a program's tokenizer (built once per Runner:
    about a second for a 50k-token vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        lib = _library()
        if not tokenizer_json:
            raise InvalidConfigError("structured output needs the program's tokenizer "
                                     "(this .pte carries none)")
        if not eos_ids:
            raise InvalidConfigError("structured output needs an end-of-text token "
                                     "(this program has no EOS id)")
        self.vocab_size = vocab_size
        self.eos = int(eos_ids[0])
        # The other EOS ids (Llama 3: <|eot_id|> beside <|end_of_text|>) end a sample
        # wherever the first may.
        others = sorted({int(e) for e in eos_ids[1:]} - {self.eos})
        self.other_eos = np.array(others, dtype=np.int64)   # indexes a mask row
        self.other_eos_set = frozenset(others)             # per-token membership
        self.lib = lib
        self.tokenizer = lib.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos)
        self._executor = None   # llguidance's thread pool for batched masks: made when needed

    def masks(self, matchers: Sequence["Matcher"]) -> np.ndarray:
        """bool [len(matchers), vocab]: row i, the tokens ``matchers[i]`` (each
        one of this vocabulary's, each at most once) allows next. One
        llguidance call fills every row's packed bitmask (in parallel for
        several), one unpack makes the bool rows."""
        bits = self.lib.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:
            self.lib.numpy.fill_next_token_bitmask(matchers[0]._m, bits, 0)
        elif matchers:
            if self._executor is None:
                self._executor = self.lib.LLExecutor()
            self.lib.numpy.fill_next_token_bitmask_par(
                self._executor, [(m._m, i) for i, m in enumerate(matchers)], bits)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=self.vocab_size,
                                bitorder="little").view(bool)
        if self.other_eos.size:
            ends = np.flatnonzero(allowed[:, self.eos])
            if ends.size:
                allowed[np.ix_(ends, self.other_eos)] = True
        return allowed

    def compile(self, grammar: Grammar) -> "Constraint":
        """InvalidConfigError naming the problem for a grammar llguidance
        cannot compile (an invalid schema, an unsupported feature, a syntax
        error)."""
        text = grammar.text()
        error = self.lib.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise InvalidConfigError(f"the {grammar.kind} cannot be used: {error}")
        return Constraint(self, text)


class Constraint:
    """A compiled grammar; ``matcher()`` gives each sample its own state."""

    def __init__(self, vocab: Vocabulary, text: str):
        self.vocab = vocab
        self._text = text
        self._initial_mask = self.matcher().mask()   # every sample's first mask: once

    def matcher(self) -> "Matcher":
        return Matcher(self.vocab, self.vocab.lib.LLMatcher(self.vocab.tokenizer, self._text))

    def initial_mask(self) -> np.ndarray:
        """bool [vocab]: the tokens a sample may start with (shared: do not
        modify)."""
        return self._initial_mask


class Matcher:
    """One sample's place in its grammar."""

    def __init__(self, vocab: Vocabulary, matcher):
        self.vocab = vocab
        self._m = matcher

    def mask(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (a step's masks
        together: ``batch_masks``)."""
        return self.vocab.masks([self])[0]

    def advance(self, token: int) -> None:
        """Consumes a chosen token (another EOS id as the first); RuntimeError
        if the grammar refused it (a token chosen outside the mask: a bug,
        never a user's error)."""
        if int(token) in self.vocab.other_eos_set:
            token = self.vocab.eos
        if not self._m.consume_token(int(token)) or self._m.is_error():
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar ended (its end of text was consumed)."""
        return self._m.is_stopped()



def batch_masks(matchers: Sequence[Matcher]) -> List[np.ndarray]:
    """Parallel to ``matchers`` (distinct ones): each one's ``mask()``,
    computed in one ``Vocabulary.masks`` call per vocabulary (one, in a
    Runner)."""
    out: List[Optional[np.ndarray]] = [None] * len(matchers)
    by_vocab = {}
    for i, m in enumerate(matchers):
        by_vocab.setdefault(id(m.vocab), (m.vocab, []))[1].append(i)
    for vocab, indices in by_vocab.values():
        for i, row in zip(indices, vocab.masks([matchers[i] for i in indices])):
            out[i] = row
    return out
