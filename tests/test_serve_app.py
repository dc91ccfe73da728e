"""The server's parts in this process (issue 12): chat templates against
transformers' apply_chat_template, stop strings while streaming, the OpenAI
request schema, and the app on a loopback port for what needs a server of its
own: /health while the program loads, the API key, a full wait queue (429),
a program that cannot be served.
"""

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executorch_cellcache.runtime.tokenizer import ByteTokenizer, HFTokenizer
from executorch_cellcache.serving import protocol
from executorch_cellcache.serving.chat_template import ChatTemplate, ChatTemplateError
from executorch_cellcache.serving.text import SampleText

# A Llama-3-style template: bos_token, loop controls, raise_exception, tojson.
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if loop.index0 > 10 %}{% break %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}"
    "{% if meta is defined %}{{ meta | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "  héllo wörld  "},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}]


def _hf_tokenizer():
    """A small byte-level BPE tokenizer with Llama-3's special tokens, as
    tokenizers and transformers see it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world héllo wörld you are terse again hi assistant"] * 20,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_LIKE
    return fast, HFTokenizer(tok.to_str())


def test_chat_template_renders_and_encodes_like_transformers():
    fast, ours = _hf_tokenizer()
    template = ChatTemplate(LLAMA3_LIKE, ours, bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>")
    for add in (True, False):
        assert template.render(MESSAGES, add_generation_prompt=add) == \
            fast.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
    expected = fast.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    assert template.encode(MESSAGES) == list(expected)
    assert template.encode(MESSAGES)[0] == ours.encode("<|begin_of_text|>",
                                                       add_special_tokens=False)[0]
    # chat_template_kwargs reach the template; tojson keeps non-ASCII text.
    rendered = template.render(MESSAGES, meta={"k": "é"})
    assert rendered == fast.apply_chat_template(MESSAGES, tokenize=False,
                                                add_generation_prompt=True, meta={"k": "é"})
    assert '{"k": "é"}' in rendered


def test_chat_template_errors_are_named():
    tok = ByteTokenizer()
    with pytest.raises(ChatTemplateError, match="no tools here"):
        ChatTemplate(LLAMA3_LIKE, tok).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", tok)
    with pytest.raises(ChatTemplateError, match="refused|failed"):
        ChatTemplate("{{ messages[0]['content'].nope() }}", tok).render(MESSAGES)
    # The sandbox: no reaching into Python internals.
    with pytest.raises(ChatTemplateError,
                       match="access to attribute '__class__' of 'list' object is unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                     tok).render(MESSAGES)


def test_plain_template_of_the_byte_model():
    tok = ByteTokenizer()
    t = ChatTemplate(None, tok)
    text = t.render([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant:"
    assert t.encode([{"role": "user", "content": "hi"}]) == [tok.bos_id] + list(text.encode())


def _stream(tokens, stops, tok=ByteTokenizer()):
    st = SampleText(tok, stops)
    pieces = [st.push(t) for t in tokens]
    pieces.append(st.finish())
    return pieces, st


@pytest.mark.parametrize("text, stops, released", [
    ("hello world", [], "hello world"),
    ("hello world", ["o w"], "hell"),
    ("hello world", ["world", "lo"], "hel"),
    ("hello world", ["xyz"], "hello world"),
    ("héllo wörld", ["ö"], "héllo w"),
    ("aaab", ["aab"], "a"),
    ("stop at the end!", ["!"], "stop at the end"),
])
def test_stop_strings_end_the_text_before_the_match(text, stops, released):
    pieces, st = _stream(list(text.encode()), stops)
    assert "".join(pieces) == released
    assert st.stopped == (released != text) and st.text == released
    # Streaming never shows a prefix of a stop string that later completes.
    shown = ""
    for piece in pieces:
        shown += piece
        assert shown == released[:len(shown)]


def test_stream_waits_for_multibyte_characters():
    pieces, _ = _stream(list("é🌍".encode()), [])
    assert [p for p in pieces if p] == ["é", "🌍"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1023), min_size=1, max_size=40))
def test_streamed_text_of_the_byte_level_default_tokenizer_is_its_decode(ids):
    """The byte-level path (token bytes through an incremental UTF-8 decoder)
    against tokenizers' own decode of the whole list; specials (0, 1) skipped."""
    from executorch_cellcache.exporting import default_model
    from executorch_cellcache.runtime.tokenizer import StreamDecoder

    tok = HFTokenizer((default_model.CHECKPOINT / "tokenizer.json").read_text())
    assert tok.byte_level
    d = StreamDecoder(tok)
    pieces = [d.push(t) for t in ids]
    whole = tok.decode(ids)
    assert "".join(pieces) + d.flush() == whole
    for i in range(len(ids)):   # what streamed is never taken back
        assert whole.startswith("".join(pieces[:i + 1]))


def test_request_schema_is_strict():
    ok = protocol.ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "temperature": 1, "unknown_field": 3}))
    assert ok.temperature == 1.0 and ok.n == 1
    bad = [({"messages": [], "temperature": 1}, "messages", "List should have at least 1 item"),
           ({"messages": [{"role": "user"}], "n": "2"}, "n", "Input should be a valid integer"),
           ({"messages": [{"role": "user"}], "seed": 1.5}, "seed",
            "Input should be a valid integer"),
           ({"messages": [{"role": "user"}], "stream": "yes"}, "stream",
            "Input should be a valid boolean")]
    for body, field, message in bad:
        with pytest.raises(pydantic.ValidationError, match=rf"\n{field}\n  {message}"):
            protocol.ChatCompletionRequest.model_validate_json(json.dumps(body))


# ------------------------------------------------------------------ the app on a port


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serving(app):
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _metric(base, name) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _wait(base, timeout=60):
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/health").status_code != 200:
        assert time.monotonic() < deadline, "the program did not load"
        time.sleep(0.05)


@pytest.mark.slow
def test_health_is_503_while_loading_then_200(default_pte, monkeypatch):
    from executorch_cellcache.serving import app as app_module

    release = threading.Event()
    real_runner = app_module.Runner

    def slow_runner(path):
        assert release.wait(60)
        return real_runner(path)

    monkeypatch.setattr(app_module, "Runner", slow_runner)
    with _serving(app_module.create_app(default_pte)) as base:
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.get(f"{base}/v1/models")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/metrics").status_code == 200
        release.set()
        _wait(base)
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_a_program_that_cannot_be_served_is_reported(tmp_path):
    from executorch_cellcache.serving.app import create_app

    bad = tmp_path / "notes.pte"
    bad.write_text("not a program" * 10)
    failed = threading.Event()
    app = create_app(bad, on_load_failure=failed.set)
    with _serving(app) as base:
        assert failed.wait(60)
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "not a loadable ExecuTorch program" in r.json()["error"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "not loaded" in r.json()["error"]["message"]


@pytest.mark.slow
def test_api_key_guards_the_v1_routes(default_pte):
    import openai

    from executorch_cellcache.serving.app import create_app

    with _serving(create_app(default_pte, api_key="sekrit")) as base:
        _wait(base)
        for key in ("wrong", "sekrit2"):
            with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as c:
                with pytest.raises(openai.AuthenticationError, match="API key"):
                    c.models.list()
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0) as c:
            assert [m.id for m in c.models.list()] == ["default"]
            r = c.completions.create(model="default", prompt="hi", max_tokens=2)
            assert r.usage.completion_tokens >= 1
        assert httpx.get(f"{base}/health").status_code == 200  # open, like /metrics


@pytest.mark.parametrize("names, message", [
    ([], "give at least one name"),
    (["m", ""], "'' is not a name"),
    (["  "], "'  ' is not a name"),
    (["m", "alias", "m"], "'m' given more than once"),
    ("m", "a sequence of names, got the string 'm'"),
], ids=["none", "empty", "blank", "repeated", "string"])
def test_served_model_names_are_refused_before_anything_loads(tmp_path, names, message):
    from executorch_cellcache.serving.app import create_app

    with pytest.raises(ValueError, match=f"^served model names.*{message}"):
        create_app(tmp_path / "never-loaded.pte", served_model_names=names)


@pytest.mark.slow
def test_the_served_names_are_what_v1_models_lists_and_requests_may_name(default_pte):
    from executorch_cellcache.serving.app import create_app

    with _serving(create_app(default_pte, served_model_names=["smol", "chat"])) as base:
        _wait(base)
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == \
            ["smol", "chat"]
        for name in ("smol", "chat", None):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(f"{base}/v1/chat/completions",
                           json=body if name is None else {**body, "model": name})
            assert r.status_code == 200 and r.json()["model"] == "smol", r.text
        for other in ("default", str(default_pte)):   # the file's stem and path are not served
            r = httpx.post(f"{base}/v1/completions", json={"model": other, "prompt": "hi"})
            assert r.status_code == 404, r.text
            assert r.json()["error"] == {
                "message": f"the model '{other}' does not exist; this server serves 'smol', "
                           f"'chat' (GET /v1/models)",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


@pytest.mark.slow
def test_a_flood_past_the_queue_gets_429_and_loses_nothing(default_pte):
    import openai

    from executorch_cellcache.serving.app import create_app

    app = create_app(default_pte, max_queue=1)
    # Each request reserves 26 + 479 of the 512 cells: one runs, one waits, the rest 429.
    body = {"model": "default", "prompt": "tell me a very long story", "max_tokens": 480,
            "temperature": 0}
    with _serving(app) as base:
        _wait(base)
        results = [None] * 12

        def send(i):
            results[i] = httpx.post(f"{base}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 1
        assert _metric(base, "cellcache_requests_rejected_total") == codes.count(429)
        for r in results:
            if r.status_code == 429:
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                assert "--max-queue 1" in err["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] in range(1, 481)
        texts = {r.json()["choices"][0]["text"] for r in results if r.status_code == 200}
        assert len(texts) == 1, "the same greedy request gave different texts"
        # One request runs, the next waits: a third is refused. The engine is held once
        # it runs a request (a short request could otherwise finish before the next one
        # is queued, so that none ever waits).
        engine = app.state.served.engine
        release = threading.Event()
        real_step = engine.runner.step

        entered = threading.Event()

        def held_step(*args, **kwargs):  # the engine's forward: something runs
            entered.set()
            assert release.wait(120), "the test never released the engine"
            return real_step(*args, **kwargs)

        engine.runner.step = held_step
        blockers = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        try:
            with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as c:
                blockers[0].start()
                deadline = time.monotonic() + 30
                assert entered.wait(30), "the first request never ran"
                blockers[1].start()
                while engine._core.waiting_requests < 1:  # the held engine cannot admit it
                    assert time.monotonic() < deadline, "the second request never queued"
                    time.sleep(0.002)
                with pytest.raises(openai.RateLimitError, match="--max-queue"):
                    c.completions.create(**body)
        finally:
            release.set()
            for t in blockers:
                t.join(timeout=120)
        assert [r.status_code for r in results[:2]] == [200, 200]
        deadline = time.monotonic() + 30
        while _metric(base, "cellcache_requests_running") or \
                _metric(base, "cellcache_requests_waiting"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Only the prefix cache holds cells and ids afterwards (the finished requests).
        cached = engine.runner.prefix_cache
        assert engine.runner.cache.free_cells == engine.capacity - cached.reclaimable_cells()
        assert engine.runner.cache.n_sequences == len(cached)
        assert _metric(base, "cellcache_cells_in_use") == 0
        engine.runner.cache.check_invariants()


def test_serve_command_refuses_what_it_cannot_serve(tmp_path):
    import subprocess
    import sys

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "executorch_cellcache", "serve", *args],
                              capture_output=True, text=True, timeout=120)

    out = serve(str(tmp_path / "missing.pte"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == \
        f"cellcache serve: error: {tmp_path / 'missing.pte'} does not exist"
    bad = tmp_path / "notes.pte"
    bad.write_text("not a program" * 10)
    out = serve(str(bad), "--port", str(_free_port()))
    assert out.returncode == 2
    assert "cellcache serve: error:" in out.stderr and "not a loadable ExecuTorch program" in \
        out.stderr.strip().splitlines()[-1]
    out = serve("--help")
    assert out.returncode == 0
    for option in ("--host", "--port", "--api-key", "--max-queue", "127.0.0.1"):
        assert option in out.stdout


@pytest.mark.slow
def test_a_failed_forward_fails_its_requests_and_the_server_goes_on(default_pte):
    from executorch_cellcache.serving.app import create_app

    app = create_app(default_pte)
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
    with _serving(app) as base:
        _wait(base)
        engine = app.state.served.engine
        expected = httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"]
        real_step = engine.runner.step
        calls = []

        def failing_step(*args):
            calls.append(1)
            if len(calls) in (3, 6):  # mid-decode of each of the next two requests
                raise RuntimeError("the forward failed (injected)")
            return real_step(*args)

        engine.runner.step = failing_step
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 500
        assert "generation failed: the forward failed (injected)" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        # A stream that already began reports the error in the stream, then ends.
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "server_error" and "injected" in error["message"]
        engine.runner.step = real_step
        assert httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"] \
            == expected
        deadline = time.monotonic() + 30
        while _metric(base, "cellcache_requests_running"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # every cell is free again but for those only the prefix cache holds
        while _metric(base, "cellcache_cells_in_use"):
            assert time.monotonic() < deadline, "cells still in use"
            time.sleep(0.02)
