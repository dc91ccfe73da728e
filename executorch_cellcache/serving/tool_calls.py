"""Tool calls (OpenAI ``tools``): how the served model writes a call, the
grammar that forces one, and the parser that turns a reply into
``message.tool_calls``. Knows no HTTP and no engine.

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
JSON, no name, arguments that are not an object) stays content, whole. Text
between and after calls is dropped, as vLLM's parsers drop it.

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
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name and its parameters' JSON
    schema (an object schema; ``{"type": "object", "properties": {}, ...}``
    when the request gave none, OpenAI's "no parameters"), as its calls are
    held to it (``closed_objects`` of the request's)."""
    name: str
    parameters: Dict[str, Any]


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# Keys whose value is one subschema / a list of them / a map of them (JSON Schema 2020-12).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "propertyNames", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object
    schema that lists ``properties`` and says nothing of extra ones, at any
    depth; a copy, the request's schema untouched. A call's arguments are
    held to this form: JSON Schema lets such an object carry any other key,
    and a small model under that grammar runs on with invented keys until
    max_tokens (seen with the default model). llama.cpp's
    json-schema-to-grammar and XGrammar's strict mode read the schema the
    same way; ``"additionalProperties": true`` (or a schema) keeps extras."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(s) for k, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tools_from_request(raw: Sequence[Any]) -> List[Tool]:
    """OpenAI's ``tools`` -> Tools. ValueError naming the entry at fault for
    anything but ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}, ...]`` with distinct names. The schemas are
    not compiled here (the runner's vocabulary does that)."""
    tools: List[Tool] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                             f"'-', got {name!r}")
        if name in (t.name for t in tools):
            raise ValueError(f"{where}.function.name '{name}' is offered twice")
        if not isinstance(fn.get("description", ""), str):
            raise ValueError(f"{where}.function.description must be a string")
        if not isinstance(fn.get("strict", False), bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got "
                             f"{type(params).__name__}")
        tools.append(Tool(name, closed_objects(params)))
    return tools


@dataclass
class ParsedCall:
    name: str
    arguments: str          # JSON text of an object, as OpenAI sends it


@dataclass
class ParsedReply:
    content: Optional[str]  # text before the first call; None when there is none
    calls: List[ParsedCall] = field(default_factory=list)


def _call_of(obj: Any, arguments_key: str) -> Optional[ParsedCall]:
    """A decoded call object -> ParsedCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls.

    name: "hermes" or "llama3_json".
    trigger: the text a call starts with ("<tool_call>"; "{" for llama3_json).
    closer: the text a call ends with ("</tool_call>"; "" for llama3_json).
    at_start: the trigger counts only at the start of the reply (after
      whitespace and ``prefix``): llama3_json's calls are the whole reply.
    prefix: text the model may write before the trigger (``<|python_tag|>``).
    arguments_key: the key of a call's arguments ("arguments" / "parameters").
    """
    name: str
    trigger: str
    closer: str
    at_start: bool
    arguments_key: str
    prefix: str = ""

    # ------------------------------------------------------------------ parsing

    def call_start(self, text: str) -> int:
        """Where the first call (with its prefix) starts in ``text``, or -1.
        For an at-start format: 0 when the reply, stripped of leading
        whitespace and the prefix, begins with the trigger."""
        if not self.at_start:
            return text.find(self.trigger)
        body = text.lstrip()
        if self.prefix and body.startswith(self.prefix):
            body = body[len(self.prefix):].lstrip()
        return 0 if body.startswith(self.trigger) else -1

    def undecided(self, text: str) -> int:
        """How many characters at the end of ``text`` (which has no call
        start) could still begin one: the stream holds them back."""
        if self.at_start:
            body = text.lstrip()
            could = not body or self.prefix.startswith(body) or \
                (self.prefix and body.startswith(self.prefix) and
                 not body[len(self.prefix):].strip())
            return len(text) if could else 0
        for k in range(min(len(self.trigger) - 1, len(text)), 0, -1):
            if self.trigger.startswith(text[-k:]):
                return k
        return 0

    def parse(self, text: str) -> ParsedReply:
        """A whole reply -> content and calls. No calls when the reply has
        none or when any call text does not parse (then all of it is
        content)."""
        start = self.call_start(text)
        as_content = ParsedReply(text or None)
        if start < 0:
            return as_content
        calls = self._calls(text[start:])
        if not calls:
            return as_content
        return ParsedReply(text[:start] or None, calls)

    def _calls(self, text: str) -> Optional[List[ParsedCall]]:
        if self.at_start:
            return self._json_calls(text)
        calls = []
        pattern = re.escape(self.trigger) + r"(.*?)(?:" + re.escape(self.closer) + r"|\Z)"
        for body in re.findall(pattern, text, flags=re.S):
            try:
                call = _call_of(json.loads(body), self.arguments_key)
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls

    def _json_calls(self, text: str) -> Optional[List[ParsedCall]]:
        """llama3_json: one or more objects separated by ";" (as vLLM's
        llama3_json parser reads them), nothing else."""
        body = text.lstrip()
        if self.prefix and body.startswith(self.prefix):
            body = body[len(self.prefix):]
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(body) and body[i].isspace():
                i += 1
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                return None
            call = _call_of(obj, self.arguments_key)
            if call is None:
                return None
            calls.append(call)
            rest = body[i:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            i = len(body) - len(rest) + 1

    # ------------------------------------------------------------------ forcing

    def _tag(self, tool: Tool) -> Dict[str, Any]:
        """One call of ``tool`` as a structural tag: the call's opening (its
        trigger, the name, the arguments' key), the arguments held to the
        tool's parameters (``$defs`` at their root), the call's closing."""
        head = "" if self.at_start else self.trigger + "\n"
        begin = head + "{" + json.dumps("name") + ": " + json.dumps(tool.name) + ", " + \
            json.dumps(self.arguments_key) + ": "
        end = "}" + ("" if self.at_start else "\n" + self.closer)
        return {"type": "tag", "begin": begin, "end": end,
                "content": {"type": "json_schema", "json_schema": tool.parameters}}

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> Dict[str, Any]:
        """A structural tag (XGrammar's; runtime/constraints.py) for a whole
        reply that is a call of one of ``tools``: one call, or one or more
        separated by "\n" when ``parallel`` (hermes only: llama3_json
        replies hold one call). Nothing before, between or after them."""
        return {"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": [self._tag(t) for t in tools],
            "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}}

    def lazy_grammar(self, tools: Sequence[Tool], parallel: bool) -> Dict[str, Any]:
        """tool_choice "auto": a structural tag that lets the reply run free
        until the format's trigger appears, then holds it to a call of one of
        ``tools`` as ``grammar`` does; after the call only the end of text
        (unless ``parallel``: then free text and more calls). The trigger ends
        free text the moment it is written (llama.cpp's lazy grammars do the
        same), so no call escapes its schema. hermes: "<tool_call>"
        anywhere; llama3_json: '{"name": ' (its ``<|python_tag|>`` prefix is
        not allowed here)."""
        trigger = '{"name": ' if self.at_start else self.trigger
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [trigger], "tags": [self._tag(t) for t in tools],
            "stop_after_first": not parallel}}


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", at_start=False,
                        arguments_key="arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "{", "", at_start=True, arguments_key="parameters",
                             prefix="<|python_tag|>")


def format_for(template_source: Optional[str]) -> ToolCallFormat:
    """The format a chat template's model writes calls in (module docstring)."""
    source = template_source or ""
    if "<tool_call>" in source:
        return HERMES
    if '"parameters"' in source and "ipython" in source:
        return LLAMA3_JSON
    return HERMES
