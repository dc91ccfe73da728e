"""An independent reading of the tool-call formats' parse rules
(serving/tool_calls.py's module docstring), in Python's json and str: the
oracle the C++ parser (cpp/text/tool_calls.h) is checked against on random
replies in tests/test_serve_tools.py. Python's str offsets and whitespace
(str.isspace), json.loads / raw_decode, json.dumps(ensure_ascii=False)."""

import json
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

Call = Tuple[str, str]  # (name, arguments JSON text)


def _call_of(obj: Any, arguments_key: str) -> Optional[Call]:
    """A decoded call object -> (name, arguments), or None when it is not one."""
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
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """The fields of serving/tool_calls.py's ToolCallFormat."""
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

    def parse(self, text: str) -> Tuple[Optional[str], List[Call]]:
        """A whole reply -> content and calls. No calls when the reply has
        none or when any call text does not parse (then all of it is
        content)."""
        start = self.call_start(text)
        as_content = (text or None, [])
        if start < 0:
            return as_content
        calls = self._calls(text[start:])
        if not calls:
            return as_content
        return text[:start] or None, calls

    def _calls(self, text: str) -> Optional[List[Call]]:
        if self.at_start:
            return self._json_calls(text)
        # Each call: the trigger, a JSON object (raw_decode: a string holding the
        # closer stays inside it), then the closer or the end of the text.
        decoder, calls, at = json.JSONDecoder(), [], text.find(self.trigger)
        while at >= 0:
            i = at + len(self.trigger)
            while i < len(text) and text[i].isspace():
                i += 1
            if not text.startswith("{", i):
                return None
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _call_of(obj, self.arguments_key)
            if call is None:
                return None
            calls.append(call)
            while i < len(text) and text[i].isspace():
                i += 1
            if i == len(text):
                break
            if not text.startswith(self.closer, i):
                return None
            at = text.find(self.trigger, i + len(self.closer))
        return calls

    def _json_calls(self, text: str) -> Optional[List[Call]]:
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



HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", at_start=False,
                        arguments_key="arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "{", "", at_start=True, arguments_key="parameters",
                             prefix="<|python_tag|>")
