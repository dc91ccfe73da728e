"""`cellcache serve` as a process, for the tests that drive the real command
(tests/test_serve.py, tests/test_serve_chat_page.py)."""

import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc, log: Path, timeout: float = 180.0) -> None:
    """Until ``GET base/health`` answers 200; AssertionError with the server's
    log when it exits first or takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"cellcache serve exited with {proc.returncode}:\n"
                                 f"{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"cellcache serve did not become healthy:\n{log.read_text()}")


@contextmanager
def serving(pte: Path, log: Path, *options: str):
    """The base URL of `cellcache serve PTE --port P OPTIONS...` on a free
    loopback port, once healthy; its output goes to ``log``. Stopped on exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "executorch_cellcache", "serve", str(pte),
                                 "--port", str(port), *options],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
