"""Tool calls (OpenAI ``tools``): how the served model writes a call, the
grammar that forces one, and the parser that turns a reply into
``message.tool_calls``. Knows no HTTP and no engine. The rules are the C++
engine's (cpp/text/tool_calls.h, bound as ``_core.CppToolCallFormat``), so
``cellcache_runner --stdio`` and this server read and force calls alike;
this module gives them Python's types (str offsets, dicts).

A format is chosen from the program's chat template source (``format_for``):

- ``hermes``: each call is ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
  calls one after another separated by "\\n" (Hermes 2 Pro, Qwen 2.5 / 3: their
  templates mention ``<tool_call>``). Text before the first call is the reply's
  content.
- ``llama3_json``: the whole reply is ``{"name": N, "parameters": {...}}``,
  optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3: their templates
  mention ``"parameters"`` and the ``ipython`` role). One call per reply (those
  templates refuse an assistant message with more); a reply that does not start
  with ``{`` is content.
- Any other template: ``hermes``, the most common format. A model that was not
  trained on it will rarely call a tool unless the call is forced.

Parsing never fails a request: a reply whose call text does not parse (broken
JSON, no name, arguments that are not an object, JSON nested past 64 levels)
stays content, whole. Text between and after calls is dropped, as vLLM's
parsers drop it. A call's arguments are JSON text as ``json.dumps`` writes it.

Forcing (``ToolCallFormat.grammar``, for tool_choice "required" or a named
function): a structural tag (XGrammar's, compiled by the C++ grammar layer as
every constraint is: runtime/constraints.py) for the whole reply, each call
``{"name": N, "arguments": <the tool's parameters>}`` (objects that list
properties take no others unless the schema allows them: ``closed_objects``)
(``parameters`` for llama3_json), written compactly as ``json.dumps`` writes
it. The reply starts with the call: no content before it. Under tool_choice
"auto" (``ToolCallFormat.lazy_grammar``) the reply runs free until the
format's trigger, then the call is held to the same schemas, lazily as
llama.cpp's lazy grammars do.

Example (hermes)::

    >>> fmt = HERMES
    >>> fmt.parse('Let me look.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    ParsedReply(content='Let me look.', calls=[ParsedCall(name='f', arguments='{"x": 1}')])
"""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from executorch_cellcache.cache import _core


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name and its parameters' JSON
    schema (an object schema; ``{"type": "object", "properties": {}, ...}``
    when the request gave none, OpenAI's "no parameters"), as its calls are
    held to it (``closed_objects`` of the request's)."""
    name: str
    parameters: Dict[str, Any]


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object
    schema that lists ``properties`` and says nothing of extra ones, at any
    depth; a copy, the request's schema untouched. A call's arguments are
    held to this form: JSON Schema lets such an object carry any other key,
    and a small model under that grammar runs on with invented keys until
    max_tokens (seen with the default model). llama.cpp's
    json-schema-to-grammar and XGrammar's strict mode read the schema the
    same way; ``"additionalProperties": true`` (or a schema) keeps extras.
    InvalidConfigError (a ValueError): nested past 64 levels."""
    try:
        text = json.dumps(schema)
    except RecursionError:
        raise ValueError("the schema nests too deeply") from None
    return json.loads(_core.closed_objects(text))


def tools_from_request(raw: Sequence[Any]) -> List[Tool]:
    """OpenAI's ``tools`` -> Tools. ValueError naming the entry at fault for
    anything but ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}, ...]`` with distinct names. The schemas are
    not compiled here (the runner's vocabulary does that)."""
    try:
        text = json.dumps(list(raw))
    except RecursionError:
        raise ValueError("tools nest too deeply") from None
    return [Tool(name, json.loads(params)) for name, params in _core.tools_from_request(text)]


@dataclass
class ParsedCall:
    name: str
    arguments: str          # JSON text of an object, as OpenAI sends it


@dataclass
class ParsedReply:
    content: Optional[str]  # text before the first call; None when there is none
    calls: List[ParsedCall] = field(default_factory=list)


def _chars(text: str, n_bytes: int) -> int:
    """How many characters the first ``n_bytes`` of ``text``'s UTF-8 hold."""
    return len(text.encode()[:n_bytes].decode())


class ToolCallFormat:
    """How a model family writes tool calls (HERMES, LLAMA3_JSON).

    name: "hermes" or "llama3_json".
    trigger: the text a call starts with ("<tool_call>"; "{" for llama3_json).
    closer: the text a call ends with ("</tool_call>"; "" for llama3_json).
    at_start: the trigger counts only at the start of the reply (after
      whitespace and ``prefix``): llama3_json's calls are the whole reply.
    prefix: text the model may write before the trigger (``<|python_tag|>``).
    arguments_key: the key of a call's arguments ("arguments" / "parameters").
    """

    def __init__(self, name: str):
        self._cpp = _core.CppToolCallFormat.named(name)
        self.name = name
        self.trigger, self.closer = self._cpp.trigger, self._cpp.closer
        self.at_start, self.prefix = self._cpp.at_start, self._cpp.prefix
        self.arguments_key = self._cpp.arguments_key

    def __repr__(self) -> str:
        return f"ToolCallFormat({self.name!r})"

    # ------------------------------------------------------------------ parsing

    def call_start(self, text: str) -> int:
        """Where the first call (with its prefix) starts in ``text``, or -1.
        For an at-start format: 0 when the reply, stripped of leading
        whitespace and the prefix, begins with the trigger."""
        at = self._cpp.call_start(text)
        return at if at <= 0 else _chars(text, at)

    def undecided(self, text: str) -> int:
        """How many characters at the end of ``text`` (which has no call
        start) could still begin one: the stream holds them back."""
        k = self._cpp.undecided(text)
        return 0 if k == 0 else len(text) - _chars(text, len(text.encode()) - k)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply -> content and calls. No calls when the reply has
        none or when any call text does not parse (then all of it is
        content)."""
        content, calls = self._cpp.parse(text)
        return ParsedReply(content, [ParsedCall(n, a) for n, a in calls])

    # ------------------------------------------------------------------ forcing

    @staticmethod
    def _pairs(tools: Sequence[Tool]):
        return [(t.name, json.dumps(t.parameters)) for t in tools]

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> Dict[str, Any]:
        """A structural tag (XGrammar's; runtime/constraints.py) for a whole
        reply that is a call of one of ``tools``: one call, or one or more
        separated by "\n" when ``parallel`` (hermes only: llama3_json
        replies hold one call). Nothing before, between or after them. Each
        call is ``{"name": N, "arguments": <the tool's parameters>}``
        (``parameters`` for llama3_json), written as ``json.dumps`` writes it."""
        return json.loads(self._cpp.grammar(self._pairs(tools), parallel))

    def lazy_grammar(self, tools: Sequence[Tool], parallel: bool) -> Dict[str, Any]:
        """tool_choice "auto": a structural tag that lets the reply run free
        until the format's trigger appears, then holds it to a call of one of
        ``tools`` as ``grammar`` does; after the call only the end of text
        (unless ``parallel``: then free text and more calls). The trigger ends
        free text the moment it is written (llama.cpp's lazy grammars do the
        same), so no call escapes its schema. hermes: "<tool_call>"
        anywhere; llama3_json: '{"name": ' (its ``<|python_tag|>`` prefix is
        not allowed here)."""
        return json.loads(self._cpp.lazy_grammar(self._pairs(tools), parallel))


HERMES = ToolCallFormat("hermes")
LLAMA3_JSON = ToolCallFormat("llama3_json")
_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def format_for(template_source: Optional[str]) -> ToolCallFormat:
    """The format a chat template's model writes calls in (module docstring)."""
    return _FORMATS[_core.CppToolCallFormat.for_template(template_source or "").name]
