"""``cellcache chat`` and ``cellcache generate --chat`` end to end.

The chat runs on a pseudo-terminal (python's ``pty``: the program gets a
controlling terminal, so Ctrl-C and Ctrl-D reach it as they do from a
keyboard) and is read off the screen as a person would. Oracle: transformers'
``apply_chat_template`` with the checkpoint's tokenizer (its folder, not the
.pte) renders each conversation, and the Runner generates greedily from it.

Programs: the session's default model export (conftest ``default_pte``: the
embedded default model carries a chat template) and the runner tests' tiny
Llama (``roomy_pte``: exported from a model object, no chat template).
"""

import codecs
import fcntl
import json
import os
import platform
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

import executorch_cellcache as ecc
from executorch_cellcache.cli import main
from executorch_cellcache.exporting.default_model import CHECKPOINT

pytestmark = pytest.mark.slow  # the default model's export (shared with other modules)

MAX_TOKENS = 24
SYSTEM = "Answer briefly."
TURNS = ["What is a list?", "How do I sort it?"]
TIMEOUT = 180
# The system calls a program sleeps in while it waits for its terminal's input (read,
# poll, select, pselect6, ppoll), by machine: the first field of /proc/PID/syscall.
INPUT_WAITS = {"x86_64": {0, 7, 23, 270, 271}, "aarch64": {63, 72, 73}}
# What a terminal shows but a person does not read as text: CSI sequences
# (readline's bracketed paste mode, the status line's dim), keypad modes.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
STATUS = r"\[(?P<tokens>\d+) tokens, (?P<rate>[0-9.]+) tok/s, (?P<end>\d+ cached|stopped)\]\n"


def _env():
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["TERM"] = "xterm"
    env.pop("NO_COLOR", None)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "executorch_cellcache", *map(str, args)]


class Terminal:
    """A command on a pseudo-terminal of 200 columns: ``send`` types keys,
    ``expect`` waits for a pattern on the screen (ANSI sequences removed,
    "\\r\\n" read as "\\n")."""

    def __init__(self, *args):
        argv = _cmd(*args)
        env = _env()
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw = ""      # everything the program wrote
        self.seen = 0      # where in screen() the last expect's match ended
        self.closed = False

    def screen(self) -> str:
        return ANSI.sub("", self.raw).replace("\r\n", "\n")

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the program ended and closed the terminal
            data = b""
        if not data:
            self.closed = True
        self.raw += self._decoder.decode(data, final=not data)

    def expect(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        """The first match of ``pattern`` after the last match (DOTALL)."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern, re.DOTALL).search(self.screen(), self.seen)
            if m:
                self.seen = m.end()
                return m
            if self.closed or time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not on the screen; it shows:\n"
                                     f"{self.screen()[-3000:]}")
            self._read(min(1.0, max(0.0, deadline - time.monotonic())))

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait_reading(self, timeout: float = TIMEOUT) -> None:
        """Returns once the program sleeps waiting for the terminal's input. The
        prompt is on the screen a moment before readline calls select(): a SIGINT
        (Ctrl-C) in that moment only sets Python's flag, which CPython's readline
        looks at when select() is interrupted, so the chat would wait at its prompt
        as if the key had never come (keys that are input wait in the terminal)."""
        waits = INPUT_WAITS[platform.machine()]
        deadline = time.monotonic() + timeout
        while True:
            with open(f"/proc/{self.pid}/syscall") as f:
                call = f.read().split()[0]
            if call.isdigit() and int(call) in waits:
                return
            if self.closed or time.monotonic() > deadline:
                raise AssertionError(f"the chat did not wait for input (system call {call}); "
                                     f"the screen:\n{self.screen()[-3000:]}")
            self._read(0.05)

    def turn(self, message: str):
        """Types ``message`` at the prompt -> (reply text, status match)."""
        self.expect(r"> $")
        self.send(message + "\r")
        m = self.expect(re.escape(message) + r"\n(?P<reply>.*?)\n" + STATUS)
        return m["reply"], m

    def exit_code(self, timeout: float = TIMEOUT) -> int:
        """The program's exit status, its output read to the end; it has
        ``timeout`` seconds to end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while not self.closed and time.monotonic() < deadline:
                    self._read(1.0)  # what it wrote before it ended
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if self.closed:
                time.sleep(0.05)
            else:
                self._read(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"the chat did not end; the screen:\n{self.screen()[-3000:]}")


# ------------------------------------------------------------------ the oracle


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(CHECKPOINT))


@pytest.fixture(scope="module")
def runner(default_pte):
    return ecc.Runner(default_pte, prefix_cache=False)


def _lcp(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _greedy(runner, hf, messages, max_tokens=MAX_TOKENS):
    """(prompt ids, generated ids, reply text) for ``messages``: rendered by
    transformers, generated greedily by the Runner, the stop token left out
    of the text."""
    from tokenizers import Tokenizer

    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = hf.encode(text, add_special_tokens=False)
    [[ids]] = runner.generate([prompt], max_tokens)
    shown = ids[:-1] if ids and ids[-1] in runner.info.eos_ids else ids
    tok = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    return prompt, ids, tok.decode(shown)


def _conversation(system, *pairs):
    """[system, user, assistant, ..., user] from (user, reply or None) pairs."""
    messages = [{"role": "system", "content": system}] if system else []
    for user, reply in pairs:
        messages.append({"role": "user", "content": user})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return messages


# ------------------------------------------------------------------ the chat on a terminal


@pytest.fixture(scope="module")
def session(default_pte):
    """Two turns, /reset, the first message again, then Ctrl-D; and on a
    second terminal (started alongside: loading takes seconds), Ctrl-C at
    the prompt."""
    quitter = Terminal("chat", default_pte)
    term = Terminal("chat", default_pte, "--system", SYSTEM, "--max-tokens", MAX_TOKENS)
    term.expect(r"chatting with .*?/reset clears the history")
    first = term.turn(TURNS[0])
    second = term.turn(TURNS[1])
    term.expect(r"> $")
    term.send("/reset\r")
    term.expect(r"\[history cleared\]\n")
    again = term.turn(TURNS[0])
    term.expect(r"> $")
    term.wait_reading()
    term.send("\x04")  # Ctrl-D
    code = term.exit_code()
    print(term.screen())  # the transcript, for -s
    quitter.expect(r"> $")
    quitter.wait_reading()
    quitter.send("\x03")  # Ctrl-C
    return {"turns": [first, second, again], "code": code, "screen": term.screen(),
            "raw": term.raw, "quitter": (quitter.exit_code(), quitter.screen())}


def test_chat_replies_equal_the_runner_on_the_rendered_chat(session, runner, hf):
    (reply1, _), (reply2, _), _ = session["turns"]
    _, _, expected1 = _greedy(runner, hf, _conversation(SYSTEM, (TURNS[0], None)))
    assert reply1 == expected1
    # the history holds the first reply as shown, whitespace stripped
    _, _, expected2 = _greedy(runner, hf, _conversation(SYSTEM, (TURNS[0], reply1.strip()),
                                                        (TURNS[1], None)))
    assert reply2 == expected2


def test_the_second_turn_is_served_from_the_prefix_cache(session, runner, hf):
    (reply1, status1), (_, status2), _ = session["turns"]
    prompt1, ids1, _ = _greedy(runner, hf, _conversation(SYSTEM, (TURNS[0], None)))
    prompt2, ids2, _ = _greedy(runner, hf, _conversation(SYSTEM, (TURNS[0], reply1.strip()),
                                                         (TURNS[1], None)))
    assert status1["end"] == "0 cached" and int(status1["tokens"]) == len(ids1)
    assert int(status2["tokens"]) == len(ids2) and float(status2["rate"]) > 0
    cached = int(status2["end"].split()[0])
    # prefix_cache.py: the first turn's prompt and fed-back tokens (all but its last)
    # serve the longest common prefix, leaving at least the last prompt token to compute
    assert cached == min(_lcp(prompt2, prompt1 + ids1[:-1]), len(prompt2) - 1)
    assert cached > len(prompt1) // 2


def test_reset_clears_the_history(session):
    (reply1, _), _, (again, status) = session["turns"]
    assert again == reply1   # the same conversation as the first turn's
    assert int(status["end"].split()[0]) > 0  # still served from the prefix cache


def test_the_status_line_is_dim_and_ctrl_d_leaves_with_status_0(session):
    assert session["code"] == 0
    assert "\x1b[2m[" in session["raw"]
    assert "Traceback" not in session["screen"]


def test_ctrl_c_at_the_prompt_leaves_with_status_0(session):
    code, screen = session["quitter"]
    assert code == 0, screen
    assert "Traceback" not in screen and "interrupted" not in screen


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_partial_reply(
        default_pte, runner, hf, monkeypatch, capsys):
    """In this process: SIGINT arrives during the reply's 5th forward, after its
    4th token was shown; the reply stops there, the prompt comes back, and the next turn's
    conversation holds the partial reply."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    from executorch_cellcache.runtime.runner import Runner

    _, full, _ = _greedy(runner, hf, _conversation(None, (TURNS[0], None)))
    assert len(full) > 4 and not set(full[:4]) & set(runner.info.eos_ids)
    real_step = Runner.step
    forwards = []

    def step(self, *args):
        forwards.append(args)
        if len(forwards) == 5:  # the 4th token was chosen and shown in the step before
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler, \
                "no SIGINT handler while the reply streams"
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, *args)

    lines = iter(TURNS)

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(Runner, "step", step)
    monkeypatch.setattr("builtins.input", typed)
    handler = signal.getsignal(signal.SIGINT)
    assert main(["chat", str(default_pte), "--max-tokens", str(MAX_TOKENS)]) == 0
    assert signal.getsignal(signal.SIGINT) is handler  # the chat's own handler is gone
    out, err = capsys.readouterr()
    from tokenizers import Tokenizer

    partial = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).decode(full[:4])
    statuses = re.findall(STATUS, err + "\n")
    assert statuses[0][0] == "4" and statuses[0][2] == "stopped", err
    _, _, expected2 = _greedy(runner, hf, _conversation(None, (TURNS[0], partial.strip()),
                                                        (TURNS[1], None)))
    assert out == partial + "\n" + expected2 + "\n"


# ------------------------------------------------------------------ errors and generate --chat


def _one_error_line(rc, err, command, pattern):
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"cellcache {command}: error: "), lines[0]
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_a_program_without_a_chat_template_is_refused(roomy_pte, command, capsys):
    """chat end to end (the exit status of the command); generate --chat in
    this process."""
    pattern = re.escape(f"{roomy_pte} has no chat template") + ".*`cellcache generate"
    if command == "chat":
        r = subprocess.run(_cmd("chat", roomy_pte), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=TIMEOUT, env=_env())
        rc, out, err = r.returncode, r.stdout, r.stderr
    else:
        rc = main(["generate", str(roomy_pte), "--chat", "--prompt", "hi"])
        out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(rc, err, command, pattern)


def test_generate_chat_equals_the_runner_on_the_rendered_chat(default_pte, runner, hf):
    r = subprocess.run(_cmd("generate", default_pte, "--chat", "--system", SYSTEM, "--prompt",
                            TURNS[0], "--max-new-tokens", MAX_TOKENS),
                       capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert r.returncode == 0, r.stderr
    _, _, expected = _greedy(runner, hf, _conversation(SYSTEM, (TURNS[0], None)))
    assert r.stdout == expected + "\n"
    [[raw]] = runner.generate([runner.tokenizer.encode(TURNS[0])], MAX_TOKENS)
    assert runner.tokenizer.decode(raw) != expected  # the prompt as raw text: another reply


def test_generate_messages_file_equals_the_runner(default_pte, runner, hf, tmp_path, capsys):
    messages = _conversation("Be terse.", ("Name a type.", "int"), ("Another?", None))
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(messages))
    assert main(["generate", str(default_pte), "--messages", str(path),
                 "--max-new-tokens", str(MAX_TOKENS)]) == 0
    _, _, expected = _greedy(runner, hf, messages)
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
     r"message 1 has the unknown role 'robot'; roles are system, developer, user, "
     r"assistant, tool"),
    ([{"content": "hi"}], r"message 0 is not an object with a \"role\""),
    ({"role": "user"}, r"expected a non-empty JSON list"),
])
def test_a_bad_messages_file_is_one_line(default_pte, tmp_path, capsys, messages, pattern):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(messages))
    rc = main(["generate", str(default_pte), "--messages", str(path)])
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(rc, err, "generate", pattern)
