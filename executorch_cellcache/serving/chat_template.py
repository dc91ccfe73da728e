"""Chat messages -> prompt token ids, rendering a jinja2 chat template the way
transformers' ``apply_chat_template`` does: a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``; the template sees ``messages`` (keys whose value is None
left out), ``add_generation_prompt``, ``tools`` (the request's list of
``{"type": "function", "function": {...}}`` as sent, or None), ``bos_token`` /
``eos_token`` and the request's ``chat_template_kwargs``. The rendered text
carries its special tokens itself, so it is encoded without adding any.

Tool calls in the history: OpenAI sends an assistant message's
``tool_calls[].function.arguments`` as JSON text, while transformers'
templates expect the mapping (Qwen 2.5 and Llama 3.1 write ``arguments |
tojson``); ``render`` decodes JSON text that holds an object, as vLLM does,
and leaves any other string as it is.

A program that carries no template (a checkpoint without one; the default
model carries its own "User: / Assistant:" template with a tools section,
written by scripts/train_default_model.py) gets ``PLAIN_TEMPLATE``: "role:
content" lines, then "assistant:"; its rendered text is encoded like any
prompt (BOS first).
"""

import json
from datetime import datetime
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused a conversation
    (``raise_exception``); the message says which."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _for_template(message: Dict[str, Any]) -> Dict[str, Any]:
    """A message as transformers' templates take it: None values left out,
    tool-call arguments that are JSON object text decoded (module docstring)."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("tool_calls"):
        out["tool_calls"] = [_decoded_arguments(c) for c in out["tool_calls"]]
    return out


def _decoded_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


class ChatTemplate:
    """A compiled template and the tokenizer it feeds.

    source: the program's template, or None for PLAIN_TEMPLATE.
    bos_token / eos_token: their text (None: the tokenizer has none).
    Raises ChatTemplateError when the template does not compile.
    """

    def __init__(self, source: Optional[str], tokenizer, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None):
        self.builtin = source is None
        self.source = PLAIN_TEMPLATE if source is None else source
        self._tokenizer = tokenizer
        self._tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token))
                        if v is not None}
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the program's chat template does not compile: {e}") from e

    @classmethod
    def for_program(cls, info, tokenizer) -> "ChatTemplate":
        """A program's template (``info``: its metadata.ProgramInfo; None
        means PLAIN_TEMPLATE), its BOS and first EOS token named by
        ``tokenizer``. Raises ChatTemplateError as the constructor does."""
        return cls(info.chat_template, tokenizer,
                   bos_token=None if info.bos_id is None else tokenizer.token_name(info.bos_id),
                   eos_token=tokenizer.token_name(info.eos_ids[0]) if info.eos_ids else None)

    def render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[List[Dict[str, Any]]] = None, **kwargs) -> str:
        """messages: [{"role": ..., "content": ..., "tool_calls"?: ...,
        "tool_call_id"?: ...}, ...]; tools: the tool dicts, or None. Raises
        ChatTemplateError with the template's own message when it refuses."""
        messages = [_for_template(m) for m in messages]
        context = {**self._tokens, **kwargs, "messages": messages,
                   "add_generation_prompt": add_generation_prompt, "tools": tools or None,
                   "documents": None}
        try:
            return self._template.render(context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on the messages ({e})") from e

    def encode(self, messages: List[Dict[str, Any]],
               tools: Optional[List[Dict[str, Any]]] = None, **kwargs) -> List[int]:
        """The prompt token ids of a conversation, ready for the assistant's turn."""
        text = self.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=self.builtin)
