"""The chat page of `cellcache serve` (``GET /``, issue 50) in a real browser:
Debian's chromium, headless, driven by selenium through Debian's chromedriver
(scripts/install_browser.sh installs both; selenium is pinned in
requirements.txt). Without them the browser tests skip, naming what is
missing, and fail when ``CI`` is set.

The server is the real command on the default model (512 cells), with an API
key: the page and its files are open, its /v1 calls send the key typed into it.
A person's session: type the key, send a message and watch the reply stream
in, send a second turn and read back the prompt tokens the prefix cache served,
stop a long reply (the server cancels it and frees its cells), see the server's
refusals and a reply the server cut. The conversation's screenshot is kept:
``$CELLCACHE_TEST_ARTIFACTS/chat_page.png`` when that variable names a folder,
else in the test's tmp_path.
"""

import json
import os
import re
import shutil
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from missing import missing

from executorch_cellcache.serving.app import STATIC

from serve_support import serving

pytestmark = pytest.mark.slow

KEY = "page-key"
WAIT_S = 120


def _browser_missing():
    """Why no browser can be driven here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements.txt)"
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"{exe} is not on PATH (scripts/install_browser.sh installs it)"
    return None


@pytest.fixture(scope="module")
def browser():
    why = _browser_missing()
    if why:
        missing(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server(default_pte, tmp_path_factory):
    log = tmp_path_factory.mktemp("chat-page") / "serve.log"
    with serving(default_pte, log, "--api-key", KEY) as base:
        yield base


# ------------------------------------------------------------------ the page, as a person uses it


def _wait(driver, what, timeout=WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: what(d))


def _el(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def _els(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def _type(driver, css, text):
    field = _el(driver, css)
    field.clear()
    field.send_keys(text)


def _open(driver, base, key=KEY):
    """The page, fresh, with the API key typed in and the model list loaded."""
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{base}/")
    if key is not None:
        _type(driver, "#api-key", key + Keys.TAB)   # TAB: the field's change event
        _wait(driver, lambda d: _el(d, "#model").get_attribute("value"))


def _send(driver, text):
    _type(driver, "#input", text)
    _el(driver, "#send").click()


def _last_reply(driver):
    """The last assistant message once it finished: (text, its line of
    stats or 'stopped', its error or '')."""
    def finished(d):
        replies = _els(d, ".message.assistant")
        if not replies or "streaming" in replies[-1].get_attribute("class"):
            return None
        return replies[-1]
    reply = _wait(driver, finished)
    lines = {kind: [e.text for e in reply.find_elements("css selector", f".{kind}")]
             for kind in ("stats", "error")}
    return (reply.find_element("css selector", ".text").get_attribute("textContent"),
            " ".join(lines["stats"]), " ".join(lines["error"]))


def _usage(stats):
    """(completion tokens, tokens/s, cached, prompt tokens) from a reply's line."""
    m = re.fullmatch(r"(\d+) tokens · ([\d.]+) tokens/s · first token \d+ ms · "
                     r"(\d+) of (\d+) prompt tokens cached · \w+", stats)
    assert m, stats
    n, rate, cached, prompt = m.groups()
    return int(n), float(rate), int(cached), int(prompt)


WATCH_STREAMING = """
window.seenLengths = [];
new MutationObserver(() => {
  const reply = document.querySelector(".message.assistant.streaming .text");
  if (reply) window.seenLengths.push(reply.textContent.length);
}).observe(document.getElementById("messages"),
           {subtree: true, childList: true, characterData: true});
"""


def _artifact(tmp_path, name):
    folder = os.environ.get("CELLCACHE_TEST_ARTIFACTS")
    folder = Path(folder) if folder else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def test_a_conversation_streams_resends_its_history_and_reports_cached_tokens(
        server, browser, tmp_path):
    _open(browser, server)
    assert _el(browser, "#model").get_attribute("value") == "default"
    _type(browser, "#system", "You are a helpful assistant who answers briefly.")
    _type(browser, "#temperature", "0")
    _type(browser, "#max-tokens", "40")
    browser.execute_script(WATCH_STREAMING)
    _send(browser, "What is a list in Python?")
    first, stats1, error = _last_reply(browser)
    assert first and not error, error
    # Streamed: the reply's text grew in the page more than once before it finished.
    partial = [n for n in browser.execute_script("return window.seenLengths") if 0 < n]
    assert len(set(partial)) >= 2, partial
    n1, rate1, _, prompt1 = _usage(stats1)
    assert n1 >= 1 and rate1 > 0

    _send(browser, "And a tuple?")
    second, stats2, error = _last_reply(browser)
    assert second and not error, error
    n2, rate2, cached2, prompt2 = _usage(stats2)
    # The whole conversation was sent again, and the first turn's prompt came from the
    # prefix cache.
    assert prompt2 > prompt1 + 1 and rate2 > 0
    assert 0 < cached2 < prompt2 and cached2 >= prompt1 - 1, (cached2, prompt1, prompt2)
    assert [e.text for e in _els(browser, ".message.user .text")] == \
        ["What is a list in Python?", "And a tuple?"]
    assert browser.execute_script("return chat.history.map(m => m.role)") == \
        ["user", "assistant", "user", "assistant"]
    shot = _artifact(tmp_path, "chat_page.png")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def _metric(base, name):
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


CANCELLED = 'cellcache_requests_total{finish_reason="cancelled"}'
# A reply of at least 2,000 characters (the 480 tokens allowed end it long before):
# 20 strings of 100 or more (a string's bound is at most 128: grammar.cpp).
LONG_REPLY_SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 100}, "minItems": 20}
STOP_AT_CHARS = 20
# Stop once the reply has begun: clicked from the page's own event loop, as the
# text arrives (the default model writes ~1,000 tokens/s: a WebDriver round trip
# could come after the end).
STOP_WHEN_STARTED = """
new MutationObserver((records, observer) => {
  const reply = document.querySelector(".message.assistant.streaming .text");
  if (reply && reply.textContent.length >= %d) {
    observer.disconnect();
    document.getElementById("stop").click();
  }
}).observe(document.getElementById("messages"),
           {subtree: true, childList: true, characterData: true});
""" % STOP_AT_CHARS


def test_stop_ends_a_long_reply_and_the_server_cancels_it(server, browser):
    _open(browser, server)
    cancelled = _metric(server, CANCELLED)
    _el(browser, "#json-mode").click()
    _el(browser, "#strict").click()           # strict applies to objects; this is an array
    _type(browser, "#schema", json.dumps(LONG_REPLY_SCHEMA))
    _type(browser, "#max-tokens", "480")
    _type(browser, "#temperature", "0.7")
    browser.execute_script(STOP_WHEN_STARTED)
    _send(browser, "Tell me a very long story")
    text, stats, error = _last_reply(browser)
    assert stats == "stopped" and not error, (stats, error)
    assert text.startswith('["') and STOP_AT_CHARS <= len(text) < 2000, text
    assert _el(browser, "#send").is_enabled() and not _el(browser, "#stop").is_enabled()
    # The stopped reply stays in the conversation as far as it got.
    assert browser.execute_script("return chat.history[1].content") == text
    _wait(browser, lambda d: _metric(server, CANCELLED) == cancelled + 1, timeout=30)
    _wait(browser, lambda d: _metric(server, "cellcache_cells_in_use") == 0, timeout=30)


def test_a_strict_json_schema_reply_has_exactly_the_named_keys(server, browser):
    _open(browser, server)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                "ok": {"type": "boolean"}}}
    _el(browser, "#json-mode").click()
    _type(browser, "#schema", json.dumps(schema))
    _send(browser, "Pick a color, in JSON")
    text, stats, error = _last_reply(browser)
    assert not error and stats.endswith("· stop"), (stats, error)
    assert set(json.loads(text)) == {"color", "ok"}, text


def test_the_page_shows_what_it_refuses_and_what_the_server_refuses(server, browser):
    _open(browser, server, key=None)
    # Without the key: the model list's 401, in the server's words.
    _wait(browser, lambda d: "invalid or missing API key" in _el(d, "#status").text)
    _open(browser, server)
    assert _el(browser, "#status").text == ""
    # An empty message is not sent.
    _send(browser, "   ")
    assert _el(browser, "#status").text == "Type a message first."
    assert not _els(browser, ".message")
    # A schema that is not JSON is the page's own refusal; nothing is sent.
    _el(browser, "#json-mode").click()
    _type(browser, "#schema", "{not json")
    _send(browser, "hi")
    assert _el(browser, "#status").text.startswith("the JSON schema is not JSON")
    assert not _els(browser, ".message")
    # A schema the server refuses: its 400 message under the message, which goes back to the
    # input to be sent again, and stays out of the conversation.
    _type(browser, "#schema", '{"type": "nope"}')
    _send(browser, "hi")
    text, stats, error = _last_reply(browser)
    assert error.startswith("400: ") and 'Unsupported type "nope"' in error, error
    assert text == "" and stats == ""
    assert _el(browser, "#input").get_attribute("value") == "hi"
    assert browser.execute_script("return chat.history.length") == 0


class _CuttingServer(BaseHTTPRequestHandler):
    """Serves the page, and a chat reply that stops after its first words
    (no finish, no usage, no [DONE]): a server that went away mid-reply."""

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, "application/json", b'{"object": "list", "data": '
                                                       b'[{"id": "cut", "object": "model"}]}')
        name = "index.html" if self.path == "/" else self.path.removeprefix("/static/")
        types = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
        path = STATIC / name
        if not path.is_file() or path.suffix not in types:
            return self._send(404, "text/plain", b"no such file")
        self._send(200, types[path.suffix], path.read_bytes())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta in ({"role": "assistant", "content": ""}, {"content": "Once upon"}):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True

    def _send(self, status, content_type, body):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def _cutting_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _CuttingServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_reply_the_server_cuts_is_kept_and_the_cut_is_shown(browser):
    with _cutting_server() as base:
        _open(browser, base, key=None)
        _wait(browser, lambda d: _el(d, "#model").get_attribute("value") == "cut")
        _send(browser, "Tell me a story")
        text, stats, error = _last_reply(browser)
    assert text == "Once upon" and stats == ""
    assert error == "the server closed the connection before the reply finished"
    assert browser.execute_script("return chat.history.length") == 2


# ------------------------------------------------------------------ no browser needed


def test_the_page_needs_no_key_and_nothing_from_elsewhere_but_the_api_does(server):
    page = httpx.get(f"{server}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("chat.js", "chat.css"):
        assert f'"static/{name}"' in page.text
        r = httpx.get(f"{server}/static/{name}")
        assert r.status_code == 200 and r.text == (STATIC / name).read_text()
    for path in STATIC.iterdir():   # no CDN, no font service: nothing but this server
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", path.read_text()), path
    assert httpx.get(f"{server}/static/nothing.js").status_code == 404
    assert httpx.get(f"{server}/v1/models").status_code == 401
    ok = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and [m["id"] for m in ok.json()["data"]] == ["default"]


def test_the_package_ships_the_page(tmp_path):
    """setup.py's package_data: what build_py copies (a wheel's files) has them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shipped = tmp_path / "executorch_cellcache" / "serving" / "static"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in STATIC.iterdir())
