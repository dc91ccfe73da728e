"""A client of `cellcache_runner --stdio` for the tests (tests/test_cpp_stdio.py,
tests/test_aarch64.py): JSON lines in, JSON lines out.

A runner is an executable's path, or a command list that ends with it (an
emulator in front: ["qemu-aarch64", ..., runner])."""

import contextlib
import json
import os
import queue
import subprocess
import threading

TIMEOUT = 120  # seconds for any one answer


def _command(runner):
    return [runner] if isinstance(runner, (str, os.PathLike)) else list(runner)


class Session:
    """A running `cellcache_runner --stdio`: send lines, read answers as they come."""

    def __init__(self, exe, pte, *flags, timeout=TIMEOUT):
        self.timeout = timeout
        self.proc = subprocess.Popen([*_command(exe), "--model", str(pte), "--stdio", *flags],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines = queue.Queue()
        self.seen = []  # every answer read so far, in order
        self.sent_at = {}  # id (as JSON) -> len(seen) when its last request was sent
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            self.lines.put(raw)
        self.lines.put(None)

    def send(self, obj):
        """A dict is sent as one JSON line; bytes/str as they are."""
        data = obj if isinstance(obj, bytes) else \
            obj.encode() if isinstance(obj, str) else (json.dumps(obj) + "\n").encode()
        if isinstance(obj, dict) and "id" in obj:
            self.sent_at[json.dumps(obj["id"])] = len(self.seen)
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def next(self):
        raw = self.lines.get(timeout=self.timeout)
        assert raw is not None, "the runner closed its output early"
        answer = json.loads(raw)  # every output line is one JSON object
        self.seen.append(answer)
        return answer

    def until(self, pred):
        """Reads answers until one satisfies pred; returns it."""
        while True:
            answer = self.next()
            if pred(answer):
                return answer

    def wait_finished(self, rid, n=1):
        """Reads until every sample of the last request sent with id rid has
        finished (its finish lines may have been read already)."""
        def done():
            since = self.sent_at.get(json.dumps(rid), 0)
            return len({a["sample"] for a in self.seen[since:]
                        if a.get("id") == rid and "finish" in a}) >= n
        while not done():
            self.next()

    def close(self):
        """Closes stdin, reads everything left; (exit status, stderr)."""
        self.proc.stdin.close()
        while True:
            raw = self.lines.get(timeout=self.timeout)
            if raw is None:
                break
            self.seen.append(json.loads(raw))
        rc = self.proc.wait(timeout=self.timeout)
        stderr = self.proc.stderr.read().decode()
        self._release()
        return rc, stderr

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._release()

    def _release(self):
        self._reader.join(timeout=self.timeout)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:  # stdin of a process that has gone: the flush fails
                pass


def run_all(runner_exe, pte, requests, *flags, timeout=300):
    """Sends every request at once, closes stdin; (answers, exit status, stderr)."""
    text = "".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in requests)
    out = subprocess.run([*_command(runner_exe), "--model", str(pte), "--stdio", *flags], input=text,
                         capture_output=True, text=True, timeout=timeout)
    return [json.loads(line) for line in out.stdout.splitlines()], out.returncode, out.stderr


def tokens_of(answers, rid, n=1):
    """[sample] -> token ids of request rid, in the order they came."""
    got = [[] for _ in range(n)]
    for a in answers:
        if a.get("id") == rid and "token" in a:
            got[a["sample"]].append(a["token"])
    return got


def finishes_of(answers, rid):
    """sample -> its finish line (exactly one per sample)."""
    fins = {}
    for a in answers:
        if a.get("id") == rid and "finish" in a:
            assert a["sample"] not in fins, f"two finish lines for {rid} sample {a['sample']}"
            fins[a["sample"]] = a
    return fins


@contextlib.contextmanager
def sessions(exe, pte):
    """A function that opens Sessions (flags as arguments) of one runner and
    program; every one still running is killed at the end."""
    opened = []

    def _open(*flags):
        s = Session(exe, pte, *flags)
        opened.append(s)
        return s

    try:
        yield _open
    finally:
        for s in opened:
            s.kill()
