"""`cellcache_runner --stdio` with text, chats and grammars (issue #49), on the
embedded default model's program (its tokenizer.json and chat template are
inside the .pte).

Oracles: the Python runtime's tokenizer and chat template (the ids a text or
a chat must become), its StreamDecoder (the text pieces), the same request
sent as token ids (the tokens), ``jsonschema`` (an independent validator) and
the Python runtime's greedy tokens under the same schema (the same grammar
layer: the same masks).
"""

import json
import re

import jsonschema
import pytest
from stdio_support import sessions
from test_structured_output import SCHEMAS

import executorch_cellcache as ecc
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer, StreamDecoder
from executorch_cellcache.serving.chat_template import ChatTemplate

SAMPLES = 100
MAX_NEW = 128
CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}]


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())


@pytest.fixture
def session(runner_exe, default_pte):
    with sessions(runner_exe, default_pte) as open_session:
        yield open_session


def _run(s, *requests):
    """Sends the requests, waits for all of them; {id: {sample: (tokens, text, finish)}}."""
    for r in requests:
        s.send(r)
    for r in requests:
        def done(r=r):
            mine = [a for a in s.seen if a.get("id") == r["id"]]
            return any("error" in a for a in mine) or \
                len({a["sample"] for a in mine if "finish" in a}) >= r.get("n", 1)
        while not done():
            s.next()
    out = {}
    for a in s.seen:
        if "error" in a:
            out[a["id"]] = a["error"]
            continue
        got = out.setdefault(a["id"], {}).setdefault(a["sample"], [[], "", None])
        if "token" in a:
            got[0].append(a["token"])
        got[1] += a.get("text", "")
        if "finish" in a:
            got[2] = a["finish"]
    return out


def test_text_prompt_is_the_python_ids_and_streams_python_text(session, tok):
    texts = ["Once upon a time", "The cat sat on the mat. 日本語 😀", "  spaces\n\tand tabs"]
    s = session()
    by_text = _run(s, *[{"id": f"t{i}", "text": t, "max_new_tokens": 24}
                        for i, t in enumerate(texts)])
    by_ids = _run(s, *[{"id": f"i{i}", "prompt": tok.encode(t), "max_new_tokens": 24}
                       for i, t in enumerate(texts)])
    for i in range(len(texts)):
        tokens, text, finish = by_text[f"t{i}"][0]
        assert tokens == by_ids[f"i{i}"][0][0]  # the same prompt ids, so the same tokens
        stream = StreamDecoder(tok)
        assert text == "".join(stream.push(t) for t in tokens) + stream.flush()
        assert finish in ("stop", "length")
    ids_lines = [a for a in s.seen if a.get("id", "").startswith("i") and "token" in a]
    assert all("text" not in a for a in ids_lines)  # token-id requests stay ids only


def test_chat_messages_render_with_the_programs_template(session, tok, default_pte):
    info = ecc.Runner(default_pte).info
    template = ChatTemplate.for_program(info, tok)
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    s = session()
    got = _run(s, {"id": "c", "messages": chat, "max_new_tokens": 20},
               {"id": "ct", "messages": chat, "tools": tools, "tool_choice": "none",
                "max_new_tokens": 20},  # "none": the rendering alone, no grammar
               {"id": "p", "prompt": template.encode(chat), "max_new_tokens": 20},
               {"id": "pt", "prompt": template.encode(chat, tools=tools), "max_new_tokens": 20})
    assert got["c"][0][0] == got["p"][0][0]
    assert got["ct"][0][0] == got["pt"][0][0]
    assert template.encode(chat) != template.encode(chat, tools=tools)  # the tools were rendered
    finishes = [a for a in s.seen if a.get("id") == "c" and "finish" in a]
    assert finishes[0]["usage"]["prompt_tokens"] == len(template.encode(chat))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sample_under_a_schema_is_valid(session, name):
    """100 of 100 samples at temperature 1, seeded, each a request of its own,
    parse and validate, and each ends on the token that completes it."""
    schema = SCHEMAS[name]
    s = session()
    got = _run(s, *[{"id": i, "text": "Data:", "json_schema": schema, "temperature": 1.0,
                     "seed": i, "max_new_tokens": MAX_NEW} for i in range(SAMPLES)])
    for i in range(SAMPLES):
        tokens, text, finish = got[i][0]
        assert finish == "stop" and 0 < len(tokens) < MAX_NEW, (i, finish, text)
        jsonschema.validate(json.loads(text), schema)


def test_without_a_schema_the_same_sampling_is_not_valid(session):
    """Teeth: the model alone writes no valid JSON for any of the schemas."""
    s = session()
    got = _run(s, *[{"id": i, "text": "Data:", "temperature": 1.0, "seed": i,
                     "max_new_tokens": 64} for i in range(20)])
    valid = 0
    for i in range(20):
        try:
            value = json.loads(got[i][0][1])
        except ValueError:
            continue
        valid += any(jsonschema.Draft202012Validator(sch).is_valid(value)
                     for sch in SCHEMAS.values())
    assert valid == 0


def test_greedy_under_a_schema_equals_the_python_runtime(session, tok, default_pte):
    """One grammar layer under both runtimes (the Python runner and the server
    mask through the same C++ compiler and matchers): the same greedy tokens
    for each schema, from ids and from text."""
    runner = ecc.Runner(default_pte)
    prompt = tok.encode("Data:")
    s = session()
    for name, schema in SCHEMAS.items():
        want = runner.generate([prompt], MAX_NEW, json_schema=schema)[0][0]
        got = _run(s, {"id": name, "prompt": prompt, "json_schema": schema,
                       "max_new_tokens": MAX_NEW},
                   {"id": name + "-text", "text": "Data:", "json_schema": schema,
                    "max_new_tokens": MAX_NEW})
        assert got[name][0][0] == list(want) == got[name + "-text"][0][0], name


def test_a_gbnf_grammar_constrains_the_output(session):
    grammar = 'root ::= ("yes" | "no") " because " [a-z]{1,8} "."'
    s = session()
    got = _run(s, *[{"id": i, "text": "Question:", "grammar": grammar, "temperature": 1.0,
                     "seed": i, "max_new_tokens": 40} for i in range(30)])
    for i in range(30):
        tokens, text, finish = got[i][0]
        assert re.fullmatch(r"(yes|no) because [a-z]{1,8}\.", text), text
        assert finish == "stop"


def test_forks_each_follow_the_grammar(session):
    s = session()
    got = _run(s, {"id": "f", "text": "Data:", "json_schema": SCHEMAS["enums"], "n": 3,
                   "temperature": 1.0, "seed": 5, "max_new_tokens": 64})
    texts = [got["f"][k][1] for k in range(3)]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMAS["enums"])
    assert len(set(texts)) > 1  # the forks sampled apart


def test_constrained_and_free_requests_share_a_batch(session, tok):
    """A free request beside constrained ones decodes as it does alone."""
    s = session()
    alone = _run(s, {"id": "alone", "text": "Once upon a time", "max_new_tokens": 30})
    s2 = session()
    mixed = _run(s2, {"id": "a", "text": "Data:", "json_schema": SCHEMAS["nested"],
                      "max_new_tokens": MAX_NEW},
                 {"id": "free", "text": "Once upon a time", "max_new_tokens": 30},
                 {"id": "b", "text": "Data:", "json_schema": SCHEMAS["bounds"], "temperature": 1,
                  "seed": 3, "max_new_tokens": MAX_NEW})
    assert mixed["free"][0][0] == alone["alone"][0][0]
    for rid, name in (("a", "nested"), ("b", "bounds")):
        jsonschema.validate(json.loads(mixed[rid][0][1]), SCHEMAS[name])


@pytest.mark.parametrize("fields, words", [
    ({"json_schema": {"type": "object", "properties": {"x": {"type": "nonsense"}}}},
     "json_schema does not compile"),
    ({"json_schema": "{not json"}, "not JSON"),
    ({"json_schema": 5}, "must be a JSON schema"),
    ({"json_schema": {"type": "number", "multipleOf": 0.5}}, "needs a minimum and a maximum"),
    ({"grammar": "root ::= undefined_rule"}, "grammar does not compile"),
    ({"grammar": ""}, "must be a GBNF grammar"),
    ({"grammar": "root ::= \"a\"", "json_schema": {}}, "not both"),
    ({"text": "x" * 5000}, "cells"),
    ({"text": 5}, "text must be a string"),
    ({"text": ""}, "text is empty"),
    ({"text": "a", "prompt": [1]}, "one of"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "tools must be"),
    ({"text": "a", "tools": []}, "goes with \"messages\""),
    # what the break-it pass found: each once crashed or stalled the server, or killed
    # the requests beside it
    ({"json_schema": '{"not":' * 10000 + "{}" + "}" * 10000}, "nests deeper than 64 levels"),
    ({"json_schema": {"type": "string", "pattern": "(" * 1000 + "a" + ")" * 1000}},
     "nests groups deeper than 64"),
    ({"json_schema": {"$defs": {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(4200)},
                      "$ref": "#/$defs/0"}}, "more than 4096 subschemas"),
    ({"json_schema": {"enum": list(range(30000))}}, "at most 131072 are taken"),
    ({"json_schema": {"$ref": "#"}}, "allows no output"),
    ({"grammar": "root ::= root \"a\""}, "allows no output"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text parts"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "a string or a list of text parts"),
    # what the second break-it pass found: a hang (multipleOf past 2^53), picojson's
    # internal messages, an empty oneOf explained as an overlap
    ({"json_schema": {"type": "integer", "multipleOf": 1, "minimum": 9007199254740992,
                      "maximum": 9007199254740993}}, "bounds too large for its step"),
    ({"json_schema": {"type": "number", "multipleOf": 3, "minimum": 1e300, "maximum": 1e300}},
     "bounds too large for its step"),
    ({"json_schema": {"type": "string", "pattern": 5}}, "pattern at # must be a string"),
    ({"json_schema": {"type": "string", "format": None}}, "format at # must be a string"),
    ({"json_schema": {"type": "integer", "minimum": 1e300}}, "past what a 64-bit integer holds"),
    ({"json_schema": {"type": "number", "exclusiveMinimum": True}}, "draft 4's boolean form"),
    ({"json_schema": {"oneOf": []}}, "oneOf at # must be a non-empty list"),
    ({"json_schema": {"type": "string", "maxLength": 500}}, "past 128 characters"),
    # tool calls: each field named, as the Python server names it
    ({"messages": CHAT, "tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"messages": CHAT, "tools": [], "tool_choice": "auto"}, 'tool_choice "auto" needs tools'),
    ({"messages": CHAT, "tools": WEATHER, "tool_choice": "always"}, 'got "always"'),
    ({"messages": CHAT, "tools": WEATHER, "tool_choice": {"type": "function"}},
     '"function": {"name": NAME}}'),
    ({"messages": CHAT, "tools": WEATHER,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     '"nope", which tools does not offer'),
    ({"messages": CHAT, "tools": WEATHER, "tool_choice": "required", "json_schema": {}},
     'json_schema cannot be combined with tool_choice "required"'),
    ({"messages": CHAT, "tools": WEATHER, "parallel_tool_calls": "yes"},
     "parallel_tool_calls must be true or false"),
    ({"text": "a", "tool_choice": "auto"}, 'tool_choice goes with "messages"'),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name must be 1 to 64 letters"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]},
     "tools[0].function.parameters: the json_schema does not compile"),
    ({"messages": CHAT, "tools": WEATHER + WEATHER}, "'get_weather' is offered twice"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(3000)]},
     "at most 131072 are taken"),
])
def test_each_bad_text_request_gets_one_error_and_serving_goes_on(session, fields, words):
    s = session()
    line = {"id": "bad", "max_new_tokens": 4, **fields}
    if not {"text", "prompt", "messages"} & set(fields):
        line["text"] = "Data:"
    s.send(line)
    answer = s.next()
    assert answer["id"] == "bad" and words in answer["error"], answer
    got = _run(s, {"id": "ok", "text": "Hello", "max_new_tokens": 4})
    assert got["ok"][0][2] in ("stop", "length")
    rc, stderr = s.close()
    assert rc == 0, stderr
    m = re.search(r"(\d+) cells held at exit, (\d+) of them by the prefix cache", stderr)
    assert m and m.group(1) == m.group(2), stderr  # the refused request took nothing


def test_a_grammar_that_reaches_a_dead_end_ends_only_its_own_sample(session):
    """The grammar's one string is a lone surrogate's UTF-8 (ED A0 80), which
    the UTF-8 rule never lets out: after its first byte nothing may follow,
    so that sample ends there; the request beside it runs to its length."""
    s = session()
    got = _run(s, {"id": "free", "text": "Once upon a time", "max_new_tokens": 40,
                   "stop_on_eos": False},
               {"id": "dead", "text": "x", "grammar": 'root ::= "\\ud800"', "max_new_tokens": 8})
    assert got["free"][0][2] == "length" and len(got["free"][0][0]) == 40
    assert got["dead"][0][2] == "stop" and len(got["dead"][0][0]) <= 2
    rc, stderr = s.close()
    assert rc == 0 and "failed" not in stderr, stderr


def test_text_parts_and_deep_tool_call_arguments(session, tok, default_pte):
    """Content given as OpenAI's text parts is their text joined (as the
    Python server takes it); tool-call arguments too deep to parse stay text
    (they once crashed the runner), and their 100,000 brackets in a row are
    refused by the tokenizer with one error line."""
    info = ecc.Runner(default_pte).info
    template = ChatTemplate.for_program(info, tok)
    deep = '{"a":' + "[" * 50000 + "]" * 50000 + "}"
    s = session()
    got = _run(s, {"id": "parts", "messages": [{"role": "user", "content": [
                   {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
                   "max_new_tokens": 6},
               {"id": "text", "prompt": template.encode([{"role": "user",
                                                           "content": "Hello there"}]),
                "max_new_tokens": 6},
               {"id": "deep", "messages": [
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "f", "arguments": deep}}]},
                   {"role": "user", "content": "x"}], "max_new_tokens": 2})
    assert got["parts"][0][0] == got["text"][0][0]
    assert "in a row" in got["deep"]  # one error line (100,000 brackets in a row), no crash


# ------------------------------------------------------------------ tool calls


def _calls_by_hand(text):
    """The hermes calls in a reply, read without our parser: each
    "<tool_call>\\n{json}\\n</tool_call>" (the last may lack its closer)."""
    bodies = re.findall(r"<tool_call>\n(.*?)(?:\n</tool_call>|\Z)", text, flags=re.S)
    try:
        return [(json.loads(b)["name"], json.loads(b)["arguments"]) for b in bodies]
    except ValueError:
        return None  # a call cut off by max_new_tokens: no calls


def _finish(s, rid, sample=0):
    return next(a for a in s.seen if a.get("id") == rid and a.get("sample") == sample
                and "finish" in a)


def test_tool_calls_under_auto_are_the_python_runtimes_and_parse_as_written(session, tok,
                                                                           default_pte):
    """tool_choice "auto" (the default with tools), greedy, on the default
    model's tool-use demo: the same tokens as the Python runtime under the
    lazy grammar the server builds, and the finish line's calls are what the
    reply's text holds (read here by hand) and valid for the tool's schema."""
    from executorch_cellcache.exporting.tool_task import heldout_tool_requests
    from executorch_cellcache.runtime.constraints import Grammar
    from executorch_cellcache.serving.tool_calls import HERMES, tools_from_request

    runner = ecc.Runner(default_pte)
    template = ChatTemplate.for_program(runner.info, tok)
    requests = heldout_tool_requests(6)
    s = session()
    got = _run(s, *[{"id": f"r{i}", "messages": r.messages, "tools": r.tools,
                     "max_new_tokens": 96} for i, r in enumerate(requests)])
    called = 0
    for i, r in enumerate(requests):
        lazy = HERMES.lazy_grammar(tools_from_request(r.tools), parallel=True)
        want = runner.generate([template.encode(r.messages, tools=r.tools)], 96,
                               grammar=Grammar("structural_tag", lazy))[0][0]
        tokens, text, finish = got[f"r{i}"][0]
        assert tokens == list(want), i
        line = _finish(s, f"r{i}")
        by_hand = _calls_by_hand(text)
        if "tool_calls" not in line:
            assert finish in ("stop", "length") and not by_hand, (text, line)
            continue
        called += 1
        assert finish == "tool_calls"
        assert line["content"] == (text[:text.index("<tool_call>")] or None)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in line["tool_calls"]] == by_hand
        assert all(c["type"] == "function" and c["id"].startswith("call_")
                   for c in line["tool_calls"])
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in r.tools}
        for name, args in by_hand:
            jsonschema.validate(args, offered[name])
    assert called >= 4, f"{called} of {len(requests)} replies held a call"


@pytest.mark.parametrize("choice", ["required", "function"])
def test_forced_tool_calls_are_valid_calls_of_the_offered_tools(session, choice):
    """tool_choice "required" / a named function, sampled (temperature 1):
    every sample is one call (parallel_tool_calls false) of an offered tool
    (the named one), nothing before it, its arguments valid for the tool's
    schema (jsonschema), the reply's text exactly the call as the template
    writes it."""
    tools = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}}}]
    tool_choice = "required" if choice == "required" else \
        {"type": "function", "function": {"name": "get_time"}}
    n = 5
    s = session()
    got = _run(s, {"id": "f", "messages": CHAT, "tools": tools, "tool_choice": tool_choice,
                   "parallel_tool_calls": False, "n": n, "temperature": 1.0, "seed": 3,
                   "max_new_tokens": 80})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    names = set()
    for k in range(n):
        tokens, text, finish = got["f"][k]
        line = _finish(s, "f", k)
        assert finish == "tool_calls" and line["content"] is None, (text, line)
        [(name, args)] = _calls_by_hand(text)
        assert text == "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + \
            "\n</tool_call>"
        jsonschema.validate(args, schemas[name])
        [call] = line["tool_calls"]
        assert call["function"]["name"] == name and json.loads(call["function"]["arguments"]) == args
        names.add(name)
    assert names == ({"get_time"} if choice == "function" else names) and names


def test_tool_choice_none_renders_the_tools_but_leaves_the_reply_text(session, tok, default_pte):
    info = ecc.Runner(default_pte).info
    template = ChatTemplate.for_program(info, tok)
    s = session()
    got = _run(s, {"id": "none", "messages": CHAT, "tools": WEATHER, "tool_choice": "none",
                   "max_new_tokens": 48},
               {"id": "ids", "prompt": template.encode(CHAT, tools=WEATHER), "max_new_tokens": 48})
    assert got["none"][0][0] == got["ids"][0][0]  # no grammar: the tokens of the bare prompt
    line = _finish(s, "none")
    assert line["finish"] in ("stop", "length") and "tool_calls" not in line
