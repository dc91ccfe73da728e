"""OpenAI requests -> engine submissions, engine outputs -> OpenAI responses
and server-sent-event chunks. Knows the wire format (protocol) and the engine;
never the cache, never HTTP.

Rules taken from OpenAI's API: ``temperature`` defaults to 1; ``n`` samples
of one prompt are ``index`` 0..n-1 (prompt ``i`` of a completions batch owns
indices ``i*n .. i*n+n-1``); at most 4 ``stop`` strings, the text ends before
the first match; ``max_completion_tokens`` wins over ``max_tokens``; a stream
sends the role first, ``finish_reason`` last, the same ``id`` in every chunk,
an optional usage chunk (``stream_options.include_usage``) and ``[DONE]``.
Fields this server does not implement (penalties, logit_bias, echo, suffix,
best_of other than n) are refused with a 400 naming the field, never silently
ignored.

Tools (serving/tool_calls.py has the formats): ``tools`` are rendered by the
chat template; ``tool_choice`` "none" leaves the reply as text, "auto" (the
default with tools) lets the reply run free until the format's trigger
appears, then holds the call to its tool's schema (a lazy grammar; with
``response_format`` or ``grammar`` the reply follows those and calls are only
parsed), "required" and ``{"type": "function", "function":
{"name"}}`` force the reply to be a call (one, or one or more with
``parallel_tool_calls`` under "required"; a named function gets one) through
a grammar, like ``response_format``. A reply with calls has ``finish_reason``
"tool_calls"; a stream sends content until a call starts, then the calls as
``delta.tool_calls`` once the sample ends.
"""

import asyncio
import functools
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Dict, List, Optional, Sequence, Tuple

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.constraints import Grammar
from executorch_cellcache.runtime.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from executorch_cellcache.serving import protocol as p
from executorch_cellcache.serving.chat_template import ChatTemplate, ChatTemplateError
from executorch_cellcache.serving.engine import Engine, EngineError, Handle, Output, RequestError
from executorch_cellcache.serving.strict_schema import strict_schema
from executorch_cellcache.serving.text import token_string
from executorch_cellcache.serving.tool_calls import (
    ParsedReply,
    Tool,
    ToolCallFormat,
    format_for,
    tools_from_request,
)

MAX_STOPS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")


class ClientGone(Exception):
    """The client disconnected; its request was cancelled."""


def served_names(names: Optional[Sequence[str]], default: str) -> Tuple[str, ...]:
    """The model names a server answers to: ``names`` (``default``, the
    program file's stem, when None); the first is the id responses report.
    ValueError for no name, an empty (or blank) name, a duplicate, or a
    plain string where a sequence of names is wanted."""
    if names is None:
        names = [default]
    if isinstance(names, str):
        raise ValueError(f"served model names must be a sequence of names, got the string "
                         f"{names!r}")
    names = tuple(names)
    if not names:
        raise ValueError("served model names: give at least one name")
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"served model names: {name!r} is not a name (an empty or blank "
                             f"name cannot be requested)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"served model names: {', '.join(map(repr, repeated))} given more "
                         f"than once")
    return names


@dataclass
class Served:
    """What the routes serve: the engine, the model names (``served_names``:
    what ``/v1/models`` lists and a request's ``model`` may name; the first is
    the id responses report) and the chat template."""
    engine: Engine
    names: Tuple[str, ...]
    template: ChatTemplate

    @property
    def model_id(self) -> str:
        return self.names[0]

    @functools.cached_property
    def tool_format(self) -> ToolCallFormat:
        """How this program's model writes tool calls (from its template, once)."""
        return format_for(self.template.source)

    def check_model(self, name: Optional[str]) -> None:
        """LookupError (listing the served names) for a name not served; None
        (no model given) is the served model."""
        if name is not None and name not in self.names:
            served = ", ".join(f"'{n}'" for n in self.names)
            raise LookupError(f"the model '{name}' does not exist; this server serves "
                              f"{served} (GET /v1/models)")


# ---------------------------------------------------------------------- requests


def _refuse_unsupported(req) -> None:
    def refuse(param, what):
        raise RequestError(f"{param} is not supported by this server: {what}", param)

    if req.logit_bias:
        refuse("logit_bias", "leave it out")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            refuse(name, "only 0")
    if getattr(req, "echo", False):
        refuse("echo", "only false")
    if getattr(req, "suffix", None) is not None:
        refuse("suffix", "leave it out")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        refuse("best_of", "only equal to n")


def _stops(req) -> List[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return [s for s in stops if s]


def _json_schema(spec: dict) -> dict:
    """``response_format.json_schema``'s schema as it is compiled: made strict
    (serving/strict_schema.py) under ``"strict": true``, as given otherwise.
    RequestError (param response_format)."""
    strict = spec.get("strict", False)
    if not isinstance(strict, bool):
        raise RequestError(f"response_format json_schema.strict must be true or false, got "
                           f"{strict!r}", "response_format")
    if not strict:
        return spec["schema"]
    try:
        return strict_schema(spec["schema"])
    except ValueError as e:
        raise RequestError(str(e), "response_format") from e


def _constraint(req, served: Served):
    """Structured output: ``response_format`` (OpenAI's json_object and
    json_schema, ``strict`` as _json_schema says) or our ``grammar`` extension
    (Lark/GBNF) compiled for the program (runtime/constraints.py), or None.
    RequestError naming the field."""
    fmt, grammar = req.response_format, req.grammar
    if fmt is not None and fmt.get("type", "text") != "text":
        if grammar is not None:
            raise RequestError("pass response_format or grammar, not both", "grammar")
        kind = fmt.get("type")
        if kind == "json_object":
            source = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise RequestError("response_format json_schema needs json_schema.schema, a JSON "
                                   "schema object", "response_format")
            source = _json_schema(spec)
        else:
            raise RequestError(f"response_format type must be text, json_object or json_schema, "
                               f"got {kind!r}", "response_format")
        field_name, spec = "response_format", Grammar("json_schema", source)
    elif grammar is not None:
        field_name, spec = "grammar", Grammar("lark", grammar)
    else:
        return None
    try:
        return served.engine.runner.constraint(spec)
    except InvalidConfigError as e:
        raise RequestError(str(e), field_name) from e


@dataclass(frozen=True)
class _ToolUse:
    """What a chat request does with its tools.

    tools: the offered functions ([] without tools).
    choice: None (no tools, or tool_choice "none": the reply is text), "auto",
      "required", or "function" (the reply must call ``function``).
    """
    tools: List[Tool]
    choice: Optional[str]
    function: Optional[str] = None


def _tool_choice(req: p.ChatCompletionRequest, names: List[str]
                 ) -> Tuple[Optional[str], Optional[str]]:
    """tool_choice -> (_ToolUse.choice, _ToolUse.function); RequestError
    (param tool_choice)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if names else None), None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                               '"function", "function": {"name": NAME}}', "tool_choice")
        if name not in names:
            raise RequestError(f"tool_choice names the function '{name}', which tools does "
                               f"not offer", "tool_choice")
        return "function", name
    if choice not in TOOL_CHOICES:
        raise RequestError(f'tool_choice must be "none", "auto", "required" or a function, '
                           f'got {choice!r}', "tool_choice")
    if choice != "none" and not names:
        raise RequestError(f'tool_choice "{choice}" needs tools', "tool_choice")
    return (None if choice == "none" else choice), None


def _tool_use(req: p.ChatCompletionRequest, served: Served) -> _ToolUse:
    """Checks tools and tool_choice (the schemas are compiled with the
    reply's grammar: _tool_constraint). RequestError naming the field."""
    try:
        tools = tools_from_request(req.tools or [])
    except ValueError as e:
        raise RequestError(str(e), "tools") from e
    choice, function = _tool_choice(req, [t.name for t in tools])
    return _ToolUse(tools, choice, function)


def _tool_constraint(req: p.ChatCompletionRequest, served: Served, use: _ToolUse):
    """The grammar of the reply's calls, or None: "required" or a named
    function force a call; "auto" holds a call to its schema once the
    format's trigger appears (a lazy grammar), unless response_format or
    grammar constrains the reply (then calls are only parsed). RequestError
    naming the field."""
    if use.choice is None:
        return None
    reply_constrained = [name for name in ("response_format", "grammar")
                         if getattr(req, name) is not None and not (
                             name == "response_format" and
                             getattr(req, name).get("type", "text") == "text")]
    if use.choice == "auto":
        if reply_constrained:
            return None
        text = served.tool_format.lazy_grammar(use.tools, req.parallel_tool_calls)
    else:
        if reply_constrained:
            name = reply_constrained[0]
            raise RequestError(f"{name} cannot be combined with tool_choice "
                               f"{use.function or use.choice!r}: the reply must be a tool call",
                               name)
        forced = [t for t in use.tools if use.choice == "required" or t.name == use.function]
        parallel = req.parallel_tool_calls and use.choice == "required"
        text = served.tool_format.grammar(forced, parallel)
    try:
        return served.engine.runner.constraint(Grammar("structural_tag", text))
    except InvalidConfigError as e:
        # Only now is each schema compiled alone, to name the one at fault.
        for i, tool in enumerate(use.tools):
            try:
                served.engine.runner.constraint(Grammar("json_schema", tool.parameters))
            except InvalidConfigError as alone:
                raise RequestError(f"tools[{i}].function.parameters: {alone}", "tools") from alone
        raise RequestError(f"the tools cannot be used: {e}", "tools") from e


def _params(req, served: Served, prompt_len: int, max_tokens: Optional[int],
            logprobs: Optional[int]) -> SamplingParams:
    if max_tokens is None:
        max_tokens = served.engine.default_max_tokens(prompt_len, req.n)
    seed = None if req.seed is None else req.seed % 2 ** 64
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                          top_k=req.top_k, top_p=None if req.top_p in (None, 1) else req.top_p,
                          seed=seed, n=req.n, max_new_tokens=max_tokens,
                          stop_on_eos=not req.ignore_eos, logprobs=logprobs,
                          stop_token_ids=_stop_token_ids(req, served))


def _stop_token_ids(req, served: Served) -> Tuple[int, ...]:
    """vLLM's extension: token ids that end a sample. Unlike vLLM (which keeps
    a stop token that is not special in the text), the text leaves it out, as it
    leaves out EOS and a matched stop string. RequestError (400, param
    stop_token_ids) for more than MAX_STOP_TOKEN_IDS ids or an id outside the
    vocabulary."""
    ids = list(req.stop_token_ids or ())
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
                           f"{len(ids)}", "stop_token_ids")
    vocab = served.engine.runner.info.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"stop_token_ids: token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {vocab})", "stop_token_ids")
    return tuple(ids)


def _message_dict(i: int, m: p.ChatMessage) -> dict:
    if m.role not in CHAT_ROLES:
        raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                           f"'{m.role}'", f"messages[{i}].role")
    content = m.content
    if isinstance(content, list):
        kinds = [part.type for part in content if part.type != "text"]
        if kinds:
            raise RequestError(f"messages[{i}].content: only text parts are supported, got "
                               f"'{kinds[0]}'", f"messages[{i}].content")
        content = "".join(part.text or "" for part in content)
    return {"role": m.role, "content": content or "", "name": m.name,
            "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}


def chat_submissions(req: p.ChatCompletionRequest, served: Served):
    """-> [(prompt ids, SamplingParams, stop strings, constraint)]. Raises
    RequestError."""
    _refuse_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    use = _tool_use(req, served)
    constraint = _tool_constraint(req, served, use) or _constraint(req, served)
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    # tools reach the template as sent (transformers' apply_chat_template(tools=...));
    # chat_template_kwargs cannot replace them.
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "tools"}
    try:
        prompt = served.template.encode(messages, tools=req.tools or None, **kwargs)
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from e
    if not prompt:
        raise RequestError("the messages render to an empty prompt", "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return [(prompt, _params(req, served, len(prompt), max_tokens, logprobs), _stops(req),
             constraint)]


def completion_prompts(req: p.CompletionRequest, served: Served) -> List[List[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty", "prompt")
    tok = served.engine.tokenizer
    return [x if isinstance(x, list) else tok.encode(x) for x in prompts]


def completion_submissions(req: p.CompletionRequest, served: Served):
    """-> [(prompt ids, SamplingParams, stop strings, constraint)] one per
    prompt."""
    _refuse_unsupported(req)
    stops = _stops(req)
    constraint = _constraint(req, served)
    return [(ids, _params(req, served, len(ids), req.max_tokens, req.logprobs), stops,
             constraint) for ids in completion_prompts(req, served)]


# ---------------------------------------------------------------------- engine outputs


async def _next(queue: asyncio.Queue, gone: Awaitable):
    get = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get not in done:
        get.cancel()
        raise ClientGone()
    return get.result()


async def outputs(handles: List[Handle], engine: Engine, gone: asyncio.Future
                  ) -> AsyncIterator[Tuple[int, Output]]:
    """(handle index, Output) of several handles in arrival order until every
    sample finished. Cancels the unfinished ones when the consumer stops
    early (the client went away) or an EngineError ends one."""
    merged: asyncio.Queue = asyncio.Queue()
    left = {i: h.n for i, h in enumerate(handles)}
    pumps = [asyncio.ensure_future(_pump(i, h, merged)) for i, h in enumerate(handles)]
    try:
        while any(left.values()):
            i, item = await _next(merged, gone)
            if isinstance(item, EngineError):
                raise item
            if item.finish_reason is not None:
                left[i] -= 1
            yield i, item
    finally:
        for pump in pumps:
            pump.cancel()
        for i, h in enumerate(handles):
            if left[i]:
                engine.cancel(h)


async def _pump(i: int, handle: Handle, merged: asyncio.Queue) -> None:
    while True:
        merged.put_nowait((i, await handle.queue.get()))


@dataclass
class _Choice:
    text: List[str] = field(default_factory=list)
    tokens: List[Output] = field(default_factory=list)
    finish_reason: Optional[str] = None


def usage(handles: List[Handle]) -> p.Usage:
    prompt = sum(h.prompt_tokens for h in handles)
    completion = sum(h.completion_tokens for h in handles)
    cached = sum(h.cached_tokens for h in handles)
    proposed = sum(h.proposed_tokens for h in handles)
    accepted = sum(h.accepted_tokens for h in handles)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
                   completion_tokens_details=p.CompletionTokensDetails(
                       accepted_prediction_tokens=accepted,
                       rejected_prediction_tokens=proposed - accepted))


def _chat_logprobs(tok, outs: List[Output]) -> p.ChatLogprobs:
    entries = []
    for o in outs:
        text, raw = token_string(tok, o.token)
        top = []
        for t, lp in o.logprobs.top:
            t_text, t_raw = token_string(tok, t)
            top.append(p.TopLogprob(token=t_text, logprob=lp, bytes=t_raw))
        entries.append(p.ChatTokenLogprob(token=text, logprob=o.logprobs.logprob, bytes=raw,
                                          top_logprobs=top))
    return p.ChatLogprobs(content=entries)


def _completion_logprobs(tok, outs: List[Output]) -> p.CompletionLogprobs:
    tokens, values, tops = [], [], []
    for o in outs:
        text, _ = token_string(tok, o.token)
        tokens.append(text)
        values.append(o.logprobs.logprob)
        tops.append({token_string(tok, t)[0]: lp for t, lp in o.logprobs.top})
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                                text_offset=[o.offset for o in outs])


async def _collect(handles, engine, gone, n) -> Dict[int, _Choice]:
    choices: Dict[int, _Choice] = {}
    async for i, o in outputs(handles, engine, gone):
        c = choices.setdefault(i * n + o.sample, _Choice())
        c.text.append(o.text)
        if o.logprobs is not None:
            c.tokens.append(o)
        c.finish_reason = o.finish_reason or c.finish_reason
    return choices


def _call_format(req: p.ChatCompletionRequest, served: Served) -> Optional[ToolCallFormat]:
    """The format to parse calls in, or None when the reply is text (no
    tools, or tool_choice "none"; the request was checked by _tool_use)."""
    return served.tool_format if req.tools and req.tool_choice != "none" else None


def _tool_calls(parsed: ParsedReply) -> List[p.ToolCall]:
    return [p.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                       function=p.FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls]


def _chat_choice(k: int, c: _Choice, fmt: Optional[ToolCallFormat], logprobs
                 ) -> p.ChatChoice:
    text = "".join(c.text)
    parsed = fmt.parse(text) if fmt is not None else ParsedReply(text)
    if not parsed.calls:
        return p.ChatChoice(index=k, message=p.AssistantMessage(content=text),
                            logprobs=logprobs, finish_reason=c.finish_reason)
    return p.ChatChoice(index=k, message=p.AssistantMessage(content=parsed.content,
                                                            tool_calls=_tool_calls(parsed)),
                        logprobs=logprobs, finish_reason="tool_calls")


async def chat_response(req: p.ChatCompletionRequest, served: Served, handle: Handle,
                        gone) -> p.ChatCompletion:
    choices = await _collect([handle], served.engine, gone, req.n)
    tok = served.engine.tokenizer
    fmt = _call_format(req, served)
    return p.ChatCompletion(
        id=p.new_id("chatcmpl"), created=p.now(), model=served.model_id, usage=usage([handle]),
        choices=[_chat_choice(k, c, fmt, _chat_logprobs(tok, c.tokens) if req.logprobs
                              else None)
                 for k, c in sorted(choices.items())])


async def completion_response(req: p.CompletionRequest, served: Served,
                              handles: List[Handle], gone) -> p.Completion:
    choices = await _collect(handles, served.engine, gone, req.n)
    tok = served.engine.tokenizer
    return p.Completion(
        id=p.new_id("cmpl"), created=p.now(), model=served.model_id, usage=usage(handles),
        choices=[p.CompletionChoice(
            index=k, text="".join(c.text), finish_reason=c.finish_reason,
            logprobs=_completion_logprobs(tok, c.tokens) if req.logprobs is not None
            else None)
            for k, c in sorted(choices.items())])


def sse(model) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


DONE = "data: [DONE]\n\n"


class _CallSplitter:
    """One streamed sample's text when calls are parsed: content is released
    as it comes, but for what may begin a call (held back as a stop string
    is); once a call starts, the rest is held until the sample ends."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.text = ""          # all of the sample's text so far
        self.sent = 0           # characters released as content
        self.in_call = False

    def push(self, piece: str) -> str:
        """The content to release now."""
        self.text += piece
        if self.in_call:
            return ""
        start = self.fmt.call_start(self.text)
        self.in_call = start >= 0
        end = start if self.in_call else len(self.text) - self.fmt.undecided(self.text)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> Tuple[str, ParsedReply]:
        """(content still to release, the whole reply parsed). The content
        released before a call is the parsed reply's content."""
        parsed = self.fmt.parse(self.text)
        return ("" if parsed.calls else self.text[self.sent:]), parsed


async def chat_stream(req: p.ChatCompletionRequest, served: Served, handle: Handle,
                      gone) -> AsyncIterator[str]:
    tok = served.engine.tokenizer
    base = dict(id=p.new_id("chatcmpl"), created=p.now(), model=served.model_id)
    with_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = _call_format(req, served)
    splitters = {k: _CallSplitter(fmt) for k in range(req.n)} if fmt is not None else {}

    def chunk(choices, usage_=None):
        return sse(p.ChatCompletionChunk(**base, choices=choices, usage=usage_))

    for k in range(req.n):
        yield chunk([p.ChatChunkChoice(index=k, delta={"role": "assistant", "content": ""})])
    async for _, o in outputs([handle], served.engine, gone):
        lp = _chat_logprobs(tok, [o]) if req.logprobs else None
        splitter = splitters.get(o.sample)
        text = o.text if splitter is None else splitter.push(o.text)
        if text or lp is not None:
            yield chunk([p.ChatChunkChoice(index=o.sample, delta={"content": text},
                                           logprobs=lp)])
        if o.finish_reason is None:
            continue
        reason = o.finish_reason
        if splitter is not None:
            rest, parsed = splitter.finish()
            if rest:
                yield chunk([p.ChatChunkChoice(index=o.sample, delta={"content": rest})])
            for i, call in enumerate(_tool_calls(parsed)):
                yield chunk([p.ChatChunkChoice(index=o.sample, delta={"tool_calls": [
                    {"index": i, **call.model_dump()}]})])
            reason = "tool_calls" if parsed.calls else reason
        yield chunk([p.ChatChunkChoice(index=o.sample, delta={}, finish_reason=reason)])
    if with_usage:
        yield chunk([], usage([handle]))
    yield DONE


async def completion_stream(req: p.CompletionRequest, served: Served, handles: List[Handle],
                            gone) -> AsyncIterator[str]:
    tok = served.engine.tokenizer
    base = dict(id=p.new_id("cmpl"), created=p.now(), model=served.model_id)
    async for i, o in outputs(handles, served.engine, gone):
        k = i * req.n + o.sample
        lp = _completion_logprobs(tok, [o]) if req.logprobs is not None else None
        if o.text or lp is not None or o.finish_reason is not None:
            yield sse(p.Completion(**base, choices=[p.CompletionChoice(
                index=k, text=o.text, logprobs=lp, finish_reason=o.finish_reason)]))
    if req.stream_options and req.stream_options.include_usage:
        yield sse(p.Completion(**base, choices=[], usage=usage(handles)))
    yield DONE
