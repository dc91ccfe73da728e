"""`cellcache serve` end to end (issue 12, SPEC section 9): the real command on
a loopback port, driven by ExecuTorch's conformance suite, the official
`openai` client, raw HTTP for bad input, and 8 concurrent clients.

Oracles: the conformance suite's own assertions; for tokens, our `Runner`
in this process on the same .pte (its greedy output is checked against
transformers in test_runner.py) — a response must equal the Runner's
generate() of the same prompt ids, parameters and seed, whatever else the
server was doing; for cells, `/metrics` (`cellcache_cells_in_use` back to 0).

The server serves the default model (its byte-level BPE tokenizer and chat template, 512 cells, 32 tokens per
step, exported once per session in conftest.py) under the id "default".
"""

import importlib.util
import codecs
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import executorch_cellcache as ecc
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer
from executorch_cellcache.serving.chat_template import ChatTemplate

from serve_support import serving

pytestmark = pytest.mark.slow

MODEL = "default"
CELLS = 512
CONFORMANCE = Path(importlib.util.find_spec("executorch").submodule_search_locations[0]) / \
    "examples/llm_server/conformance/test_openai_contract.py"


@pytest.fixture(scope="module")
def server(default_pte, tmp_path_factory):
    """The base URL of `cellcache serve` on a free loopback port."""
    with serving(default_pte, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def runner(default_pte):
    return ecc.Runner(default_pte)


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(cellcache_\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _settled(base: str, timeout: float = 20.0) -> dict:
    """Metrics once no request runs or waits (the engine finishes a step
    after the last response is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        idle = m["cellcache_requests_running"] == 0 and m["cellcache_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _assert_no_cells_held(base: str) -> None:
    m = _settled(base)
    assert m["cellcache_requests_running"] == 0 and m["cellcache_requests_waiting"] == 0
    assert m["cellcache_cells_in_use"] == 0, f"cells still held: {m}"
    assert m["cellcache_cells_total"] == CELLS


# ------------------------------------------------------------------ what the server must equal

TOK = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
EOS = 1  # </s>
SPECIAL = {0: "<s>", 1: "</s>"}


def _chat_ids(messages):
    # The checkpoint's own template, read from its folder (the server reads the .pte's).
    template = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())["chat_template"]
    return ChatTemplate(template, TOK, bos_token="<s>", eos_token="</s>").encode(messages)


def _token_bytes(token):
    """A token's own bytes, from its byte-level vocabulary string (GPT-2's
    byte <-> printable-character table), also when they are a piece of a
    character (logprobs' bytes exist so a client can rebuild it)."""
    if token in SPECIAL:
        return SPECIAL[token].encode()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    byte_of = dict(zip(map(chr, chars), printable + [b for b in range(256) if b not in printable]))
    return bytes(byte_of[c] for c in TOK._tok.id_to_token(token))


def test_logprob_bytes_of_a_split_character_are_the_tokens_own():
    """A user report: an em dash split over two tokens gave U+FFFD's bytes."""
    from executorch_cellcache.runtime.tokenizer import HFTokenizer
    from executorch_cellcache.serving.text import token_string

    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    for text in ("a \u2014 b", "caf\u00e9 \u00fc", "\u4e2d\u6587"):
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [token_string(tok, t)[1] for t in ids]
        assert any(bytes(b).decode("utf-8", "replace") != bytes(b).decode("utf-8", "ignore")
                   for b in pieces), (text, pieces)   # some token splits a character
        assert [bytes(b) for b in pieces] == [_token_bytes(t) for t in ids]
        assert b"".join(bytes(b) for b in pieces) == text.encode("utf-8")
    assert token_string(tok, EOS) == ("</s>", list(b"</s>"))


def _expected_text(runner, prompt_ids, max_tokens, n=1, temperature=0.0, seed=None):
    """Per sample: (text, finish_reason, completion tokens) that generate()
    gives, with the stop token left out of the text."""
    samples = runner.generate([prompt_ids], max_tokens, n=n, temperature=temperature,
                              seed=seed)[0]
    out = []
    for ids in samples:
        stopped = ids[-1] == EOS
        out.append((TOK.decode(ids[:-1] if stopped else ids), "stop" if stopped else "length",
                    len(ids)))
    return out


# ------------------------------------------------------------------ conformance


def test_executorch_conformance_suite_passes(server):
    assert CONFORMANCE.exists(), f"the executorch wheel has no conformance suite at {CONFORMANCE}"
    env = {**os.environ, "OPENAI_BASE_URL": f"{server}/v1", "OPENAI_MODEL": MODEL}
    # -c /dev/null: the suite runs under pytest's defaults, not this repo's pytest.ini.
    # Whole: its tool test (tool_choice auto, greedy) needs a model that chooses to call a
    # tool, which the default model was taught to (a demo; the lazy grammar does the rest).
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", os.devnull, "-p", "no:cacheprovider", "-q",
         "-rA", str(CONFORMANCE)],
        capture_output=True, text=True, env=env, timeout=600, cwd=CONFORMANCE.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"\b7 passed\b", out.stdout), out.stdout
    assert "deselected" not in out.stdout, out.stdout
    assert "skipped" not in out.stdout, out.stdout
    _assert_no_cells_held(server)


def test_a_tool_whose_parameters_are_no_schema_gets_a_400(server):
    # Tool calls themselves: tests/test_serve_tools.py (the app in-process).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                                                        "parameters": "city"}}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools" and "must be a JSON schema object" in err["message"]


# ------------------------------------------------------------------ the openai client


def test_openai_chat_greedy_equals_the_runner(client, runner):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0)
    [(text, reason, n_tokens)] = _expected_text(runner, _chat_ids(messages), 12)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(_chat_ids(messages))
    assert r.usage.completion_tokens == n_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_tokens


def test_openai_chat_stream_matches_non_stream(client, runner):
    messages = [{"role": "user", "content": "Count to three"}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    [(text, reason, n_tokens)] = _expected_text(runner, _chat_ids(messages), 16)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == reason and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens


def test_openai_completions_stream_and_not(client, runner):
    prompt = "Once upon a time"
    [(text, reason, _)] = _expected_text(runner, TOK.encode(prompt), 10)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_openai_n3_seeded_samples_equal_the_runner_and_repeat(client, runner):
    prompt = "The cell cache"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, n=3, seed=1234)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    expected = _expected_text(runner, TOK.encode(prompt), 12, n=3, temperature=0.9, seed=1234)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [t for t, _, _ in expected]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "three seeded samples should differ"
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts
    assert first.usage.completion_tokens == sum(k for _, _, k in expected)


def test_openai_chat_n3_stream_indices(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
        temperature=0.7, seed=5, stream=True)
    by_index = {}
    reasons = {}
    for c in stream:
        for ch in c.choices:
            by_index.setdefault(ch.index, []).append(ch.delta.content or "")
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert sorted(by_index) == [0, 1, 2] and sorted(reasons) == [0, 1, 2]
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
        temperature=0.7, seed=5)
    assert ["".join(by_index[i]) for i in range(3)] == \
        [c.message.content for c in sorted(plain.choices, key=lambda c: c.index)]


def test_openai_logprobs_equal_the_programs_log_softmax(client, runner):
    import numpy as np

    messages = [{"role": "user", "content": "abc"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    # Oracle: the program's own logits for the prompt plus the generated tokens.
    prompt = _chat_ids(messages)
    generated = runner.generate([prompt], 6)[0][0]
    ids = prompt + generated
    s = runner.cache.seq_new()
    try:
        logits = runner.step([s] * len(ids), ids, list(range(len(ids))),
                             list(range(len(prompt) - 1, len(ids) - 1))).numpy()
    finally:
        runner.cache.seq_free(s)
    z = logits.astype(np.float64)
    logsm = z - z.max(axis=1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(axis=1, keepdims=True))
    for j, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert entry.logprob == pytest.approx(logsm[j, token], abs=1e-4)
        assert entry.bytes == list(_token_bytes(token))
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == pytest.approx(sorted(logsm[j])[::-1][:3], abs=1e-4)

    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_openai_error_classes(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=5)
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="longer|holds"):
        client.completions.create(model=MODEL, prompt="x" * 600, max_tokens=4)


def test_stop_strings_cut_the_text_and_end_the_sample(server, runner):
    prompt = "Once upon a time"
    # Seeded sampling: the default model's greedy text repeats itself.
    [(full, _, _)] = _expected_text(runner, TOK.encode(prompt), 20, temperature=1.0, seed=3)
    # A two-character stop string whose first occurrence is at offset k >= 1.
    k = next(k for k in range(1, len(full) - 2)
             if "\ufffd" not in full[k:k + 2] and full.find(full[k:k + 2]) == k)
    stop = full[k:k + 2]
    for stream in (False, True):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 1.0,
                "seed": 3, "stop": [stop, "never-there"], "stream": stream}
        r = httpx.post(f"{server}/v1/completions", json=body)
        assert r.status_code == 200
        if stream:
            data = [json.loads(line[6:]) for line in r.text.splitlines()
                    if line.startswith("data: {")]
            text = "".join(d["choices"][0]["text"] for d in data)
            reason = data[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == full[:k] and reason == "stop"
    _assert_no_cells_held(server)


def test_text_offsets_follow_the_tokens_when_a_stop_string_holds_text_back(server, runner):
    """A user report: with logprobs and a stop string, text_offset followed the
    text released after hold-back instead of each token's place in the text."""
    prompt = "Once upon a time"
    ids = runner.generate([TOK.encode(prompt)], 24, temperature=1.0, seed=5)[0][0]
    full = TOK.decode(ids[:-1] if ids[-1] == EOS else ids)
    k = next(k for k in range(len(full) // 2, len(full) - 3)
             if "\ufffd" not in full[k:k + 3] and full.find(full[k:k + 3]) == k)
    stop = full[k:k + 3]   # three characters: hold-back delays text by two
    for stream in (False, True):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 1.0,
                "seed": 5, "logprobs": 1, "stop": [stop], "stream": stream}
        r = httpx.post(f"{server}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            data = [json.loads(line[6:]) for line in r.text.splitlines()
                    if line.startswith("data: {")]
            offsets = [o for d in data if d["choices"] and d["choices"][0]["logprobs"]
                       for o in d["choices"][0]["logprobs"]["text_offset"]]
            text = "".join(d["choices"][0]["text"] for d in data if d["choices"])
        else:
            choice = r.json()["choices"][0]
            offsets, text = choice["logprobs"]["text_offset"], choice["text"]
        assert text == full[:k]
        # Oracle: the characters of the tokens before each one, complete characters only
        # (a token that finishes a character split over two starts where it starts).
        expected = [len(codecs.getincrementaldecoder("utf-8")("replace").decode(
            b"".join(_token_bytes(t) for t in ids[:i]))) for i in range(len(offsets))]
        assert len(offsets) >= 2 and offsets == expected, (offsets, expected)


def test_stop_token_ids_and_ignore_eos(server, runner):
    """vLLM's extensions: stop_token_ids end a sample at the first of them
    (finish "stop", its text left out like EOS's); ignore_eos decodes past EOS."""
    prompt = "Once upon a time"
    ids = runner.generate([TOK.encode(prompt)], 20)[0][0]
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k] and ids[k] != EOS)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "stop_token_ids": [ids[k], 1023]}
    r = httpx.post(f"{server}/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == TOK.decode(ids[:k])
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == k + 1   # the stop token was generated
    # A prompt whose greedy text ends with EOS, then the same with ignore_eos.
    from executorch_cellcache.exporting.copy_task import heldout_copy_prompts

    ended = None
    for c in heldout_copy_prompts():
        out = runner.generate([TOK.encode(c.prompt)], 64)[0][0]
        if out[-1] == EOS and len(out) < 64:
            ended = (c.prompt, out)
            break
    assert ended is not None, "no copy prompt ends with EOS within 64 tokens"
    body = {"model": MODEL, "prompt": ended[0], "max_tokens": 64, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == len(ended[1])
    r = httpx.post(f"{server}/v1/completions", json={**body, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 64
    expected = runner.generate([TOK.encode(ended[0])], 64, stop_on_eos=False)[0][0]
    assert r["choices"][0]["text"] == TOK.decode(expected)
    _assert_no_cells_held(server)


BOUNDS_SCHEMA = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "name": {"type": "string", "maxLength": 8}},
    "required": ["age", "name"], "additionalProperties": False}


def test_response_format_and_grammar_constrain_the_output(server):
    import jsonschema

    messages = [{"role": "user", "content": "who are you? answer in JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": BOUNDS_SCHEMA,
                                                   "strict": True}}
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "n": 4, "temperature": 1.0, "max_tokens": 64,
        "response_format": fmt}).json()
    assert len(r["choices"]) == 4
    for c in r["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), BOUNDS_SCHEMA)
        assert c["finish_reason"] == "stop"
    # streamed: the deltas add up to a valid object
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "temperature": 1.0, "max_tokens": 64,
        "stream": True, "response_format": fmt})
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in r.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    jsonschema.validate(json.loads(text), BOUNDS_SCHEMA)
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_object"}}).json()
    # Any object: its length is the model's choice; complete ones parse, cut ones are a prefix.
    content, reason = r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]
    assert content.startswith("{") and reason in ("stop", "length")
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    r = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Answer:", "max_tokens": 8, "temperature": 1.0, "n": 3,
        "grammar": 'start: "yes" | "no"'}).json()
    assert {c["text"] for c in r["choices"]} <= {"yes", "no"}
    _assert_no_cells_held(server)


# No required list, no additionalProperties: strict makes both keys the only ones, and required.
LOOSE_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "ok": {"type": "boolean"}}}


def test_strict_json_schema_replies_have_every_named_key_and_no_other(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": LOOSE_SCHEMA,
                                                   "strict": True}}
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "pick a color, in JSON"}],
        "n": 8, "temperature": 1.0, "seed": 7, "max_tokens": 40, "response_format": fmt})
    assert r.status_code == 200, r.text
    replies = [json.loads(c["message"]["content"]) for c in r.json()["choices"]]
    assert [sorted(reply) for reply in replies] == [["color", "ok"]] * 8, replies
    _assert_no_cells_held(server)


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "does not compile: Unsupported type \"nope\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "must be text, json_object or json_schema"),
    ({"grammar": "start: ("}, "grammar", "lark does not compile"),
    ({"grammar": 'start: "a"', "response_format": {"type": "json_object"}}, "grammar",
     "not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "strict": True, "schema": {"type": "object", "properties": {
            "user": {"type": "object", "additionalProperties": True}}}}}},
     "response_format", "#/properties/user sets additionalProperties to True; strict mode"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "strict": "yes", "schema": {"type": "object"}}}},
     "response_format", "json_schema.strict must be true or false, got 'yes'"),
], ids=["bad-schema", "no-schema", "unknown-type", "bad-grammar", "both", "strict-open-object",
        "strict-not-bool"])
def test_bad_structured_output_requests_get_400_naming_the_field(server, extra, param,
                                                                 message):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err
    _assert_no_cells_held(server)


# ------------------------------------------------------------------ concurrency


def _chat_body(i):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i} says hi"}],
            "max_tokens": 16 + 2 * i}
    if i % 2:
        body.update(temperature=0.8, seed=100 + i, n=1 + i % 3)
    else:
        body.update(temperature=0)
    return body


def _run_client(base, i, body, results):
    stream = i % 4 in (1, 2)
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": stream}, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        results[i] = sorted((c["index"], c["message"]["content"], c["finish_reason"])
                            for c in r.json()["choices"])
        return
    texts, reasons = {}, {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
    results[i] = sorted((k, texts[k], reasons[k]) for k in texts)


def test_eight_staggered_clients_each_get_what_they_get_alone(server, runner):
    bodies = [_chat_body(i) for i in range(8)]
    expected = {}
    for i, b in enumerate(bodies):
        samples = _expected_text(runner, _chat_ids(b["messages"]), b["max_tokens"],
                                 n=b.get("n", 1), temperature=b["temperature"],
                                 seed=b.get("seed"))
        expected[i] = [(k, t, reason) for k, (t, reason, _) in enumerate(samples)]
    alone = {}
    steps0 = _settled(server)["cellcache_steps_total"]
    t0 = time.perf_counter()
    for i, b in enumerate(bodies):
        _run_client(server, i, b, alone)
    # Staggered by a fraction of one request's time: later clients arrive while
    # earlier ones decode.
    stagger = (time.perf_counter() - t0) / len(bodies) / 6
    steps_alone = _settled(server)["cellcache_steps_total"] - steps0
    assert alone == expected

    together = {}
    threads = [threading.Thread(target=_run_client, args=(server, i, b, together))
               for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(timeout=300)
    steps_together = _settled(server)["cellcache_steps_total"] - steps0 - steps_alone
    assert together == expected
    # They shared forwards: far fewer steps than one request at a time (how many
    # fewer depends on how far the stagger lets them overlap on a loaded machine:
    # 0.5-0.71 seen).
    assert steps_together < 0.8 * steps_alone, (steps_together, steps_alone)
    _assert_no_cells_held(server)


# ------------------------------------------------------------------ bad input


def _post_raw(base, path, content, headers=None):
    return httpx.post(f"{base}{path}", content=content,
                      headers={"Content-Type": "application/json", **(headers or {})},
                      timeout=60)


@pytest.mark.parametrize("body, status, param, message", [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "should be an object"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages", "Field required"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages", "valid array"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "temperature": "hot"}).encode(), 400, "temperature", "number"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "n": True}).encode(), 400, "n", "integer"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": 0}).encode(), 400, "max_tokens", "greater than or equal to 1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "n": 0}).encode(), 400, "n", "greater than or equal to 1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "n": 1000}).encode(), 400, "n", "n=1000 samples exceed the 256"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "n": 40, "max_tokens": 16}).encode(), 400, "max_tokens", "needs up to"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}
                ).encode(), 400, "messages",
     f"the prompt has {len(_chat_ids([{'role': 'user', 'content': 'x' * 600}]))} tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": 600}).encode(), 400, "max_tokens", "max_tokens=600"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     400, "messages[0].role", "must be one of"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "top_logprobs": 2}).encode(), 400, "top_logprobs", "needs logprobs"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop", "at most 4"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "presence_penalty": 1.0}).encode(), 400, "presence_penalty", "not supported"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "top_p": 0}).encode(), 400, "top_p", "greater than 0"),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
     404, "model", "'nope' does not exist"),
], ids=["malformed", "not-object", "missing", "messages-type", "temperature-type", "n-bool",
        "max-tokens-0", "n-0", "n-1000", "n-too-many-cells", "prompt-too-long",
        "max-tokens-never-fits", "role", "top-logprobs-alone", "five-stops", "penalty",
        "top-p-0", "unknown-model"])
def test_bad_chat_requests_get_openai_errors(server, body, status, param, message):
    r = _post_raw(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    assert err["type"] and (param is None or err["param"] == param), err


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": [5000]}, "prompt", "outside the vocabulary [0, 1024)"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": "x", "logprobs": 9}, "logprobs", "less than or equal to 5"),
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": 12}, "prompt", "valid"),
    ({"prompt": "x", "stop_token_ids": [1024]}, "stop_token_ids",
     "token ids [1024] are outside the vocabulary [0, 1024)"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"prompt": "x", "stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024"),
    ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids", "valid integer"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
], ids=["vocab", "empty-list", "logprobs-9", "echo", "prompt-type", "stop-id-vocab",
        "stop-id-negative", "stop-ids-too-many", "stop-id-bool", "ignore-eos-type"])
def test_bad_completion_requests_get_openai_errors(server, body, param, message):
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err


def test_huge_bodies_and_unknown_routes(server):
    huge = b'{"model": "default", "prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = _post_raw(server, "/v1/completions", huge)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunked():
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"y" * (1024 * 1024)
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunked(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v1/nothing"
    r = httpx.get(f"{server}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_a_client_that_disconnects_has_its_cells_freed(server):
    m0 = _settled(server)
    cancelled0 = m0.get('cellcache_requests_total{finish_reason="cancelled"}', 0)
    # 480 tokens take hundreds of steps: both clients leave long before the end.
    body = {"model": MODEL, "prompt": "tell me a very long story", "max_tokens": 480,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in seen)
    # Non-streaming: the client gives up (read timeout) while the server generates.
    with pytest.raises(httpx.ReadTimeout, match="timed out"):
        httpx.post(f"{server}/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(30, read=0.1))
    m = _settled(server)
    assert m['cellcache_requests_total{finish_reason="cancelled"}'] == cancelled0 + 2
    _assert_no_cells_held(server)
    # ... and the server goes on serving.
    r = httpx.post(f"{server}/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_bad_requests_lose_no_cells_and_the_server_keeps_serving(server, runner):
    _assert_no_cells_held(server)
    prompt = "still here"
    [(text, _, _)] = _expected_text(runner, TOK.encode(prompt), 8)
    r = httpx.post(f"{server}/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


def test_prefix_cache_serves_a_shared_system_prompt(server, runner):
    """The second chat shares the first one's system prompt: its usage reports
    those prompt tokens as cached, its reply equals the Runner's, and /metrics
    counts the hit and the cells the cache holds (not counted as in use)."""
    system = "You are a careful assistant who answers in one short sentence, always. "
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Name a color", "Name a fruit")]
    before = _settled(server)
    usages = []
    for messages in chats:
        r = httpx.post(f"{server}/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200
        [(text, _, _)] = _expected_text(runner, _chat_ids(messages), 8)
        assert r.json()["choices"][0]["message"]["content"] == text
        usages.append(r.json()["usage"])
    first, second = (_chat_ids(m) for m in chats)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    # the shared prefix covers the whole system prompt (BOS and template text included)
    assert shared >= len(TOK.encode(system)) - 1
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == shared
    after = _settled(server)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert after["cellcache_prefix_cache_cached_tokens_total"] - \
        before["cellcache_prefix_cache_cached_tokens_total"] == cached
    assert after["cellcache_prefix_cache_requests_total"] - \
        before["cellcache_prefix_cache_requests_total"] == 2
    assert after["cellcache_prefix_cache_hits_total"] > before["cellcache_prefix_cache_hits_total"]
    assert 0 < after["cellcache_prefix_cache_hit_rate"] <= 1
    assert after["cellcache_prefix_cache_cells"] >= len(second)
    assert after["cellcache_cells_in_use"] == 0


def test_models_health_metrics(server):
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    m = _metrics(server)
    for name in ("cellcache_requests_running", "cellcache_requests_waiting",
                 "cellcache_prompt_tokens_total", "cellcache_generation_tokens_total",
                 "cellcache_steps_total", "cellcache_cells_in_use", "cellcache_cells_total"):
        assert name in m, name
