"""The command blocks of README.md and docs/*.md: finding them, checking their
marks, and running them as a reader pastes them (tests/test_readme_examples.py).

A fenced block's info string says what it is: a command block (``bash``,
``sh``, ``python``, ``cmake``, ``cpp``) or text a reader does not run
(``text``: output, formulas, file trees). A fence without an info string is an
error, so that no command hides in one. Every command block follows a line

    <!-- example: NAME -->                 run it
    <!-- example: NAME server -->          run it in the background: a server
    <!-- example: NAME excerpt FILE -->    check it against FILE (not run)

NAME is unique over all the files. An excerpt block is FILE's own lines, in
pieces separated by a line ``// ...`` or ``# ...``: each piece a run of
consecutive lines of FILE, the pieces in FILE's order (FILE is built and run by
a test of its own).

Running: every block in file order (README.md first, then docs/*.md by name),
in one folder that stands for a clone's root after ``scripts/install.sh``: the
repository's top-level entries linked in (build outputs, programs and ``out/``
left out) and ``.venv`` linked to this interpreter's environment. Each block is
its own process and nothing carries over but files: Python as a script of this
interpreter; a shell block by ``bash -e -o pipefail``, standard input empty,
the environment's ``bin`` first on PATH as after ``. .venv/bin/activate``. A
server block runs in the background until the end of its file; the next block
starts once ``GET /health`` answers 200. The port 8000 that the docs name is
replaced, in a server block and its file's later blocks, by a free one.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from serve_support import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = {"bash", "sh", "python", "cmake", "cpp"}
TEXT_LANGUAGES = {"text"}
SHELLS = {"bash", "sh"}
MARK = re.compile(r"^<!-- example: (?P<name>[a-z0-9][a-z0-9-]*)"
                  r"(?: (?P<kind>server|excerpt)(?: (?P<file>\S+))?)? -->$")
DOCS_PORT = "8000"
# Left out of the stand-in clone: what a build or a run writes, not what a clone holds.
NOT_IN_A_CLONE = {".git", "build", "out", ".venv", ".pytest_cache", ".hypothesis",
                  "__pycache__", "_skbuild", "dist"}
BLOCK_TIMEOUT = 600

# Runs one Python block, given as JSON [label, code] on stdin, as a script named after it.
DRIVER = textwrap.dedent("""
    import json, sys
    label, code = json.load(sys.stdin)
    exec(compile(code, label, "exec"), {"__name__": "__main__"})
""")


@dataclass
class Block:
    path: str           # the markdown file, relative to the repository
    line: int           # its first code line (1-based)
    language: str
    code: str
    name: Optional[str] = None      # from the mark; None for text blocks
    kind: str = "run"               # run, server or excerpt
    excerpt_of: Optional[str] = None

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = REPO) -> List[Path]:
    """README.md, then docs/*.md by name: the order the blocks run in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks_of(markdown: str, path: str) -> List[Block]:
    """Every fenced block of ``markdown``, its mark read. AssertionError (with
    the file and line) for a fence without an info string or of an unknown
    language, a command block without a mark, a mark not right before a
    command block, a malformed mark, or a fence that never closes."""
    lines = markdown.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- example"):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            lang = nxt[3:].strip() if nxt.startswith("```") else ""
            assert MARK.match(line), f"{path}:{i + 1}: a malformed mark: {line}"
            assert lang in COMMAND_LANGUAGES, \
                f"{path}:{i + 1}: the mark is not right before a command block"
        if not line.startswith("```"):
            i += 1
            continue
        lang = line[3:].strip()
        assert lang, f"{path}:{i + 1}: a fence without an info string (`text` for output)"
        assert lang in COMMAND_LANGUAGES | TEXT_LANGUAGES, \
            f"{path}:{i + 1}: unknown block language {lang!r}"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path}:{i + 1}: the block never closes"
        block = Block(path, i + 2, lang, "\n".join(lines[i + 1:end]) + "\n")
        if lang in COMMAND_LANGUAGES:
            mark = MARK.match(lines[i - 1]) if i > 0 else None
            assert mark, (f"{path}:{i + 1}: a {lang} block without a mark: put "
                          f"'<!-- example: NAME -->' on the line before it")
            block.name = mark["name"]
            block.kind = mark["kind"] or "run"
            block.excerpt_of = mark["file"]
            assert (block.kind == "excerpt") == (block.excerpt_of is not None), \
                f"{path}:{i}: 'excerpt' takes one FILE, and only it does"
            assert block.kind != "server" or lang in SHELLS, \
                f"{path}:{i}: a server block is a shell block"
            assert block.kind == "excerpt" or lang in SHELLS | {"python"}, \
                f"{path}:{i}: a {lang} block can only be an excerpt"
        blocks.append(block)
        i = end + 1
    return blocks


def all_blocks(root: Path = REPO) -> List[Block]:
    blocks = []
    for md in doc_files(root):
        blocks += blocks_of(md.read_text(encoding="utf-8"), str(md.relative_to(root)))
    return blocks


def excerpt_problem(block: Block, root: Path = REPO) -> Optional[str]:
    """None when ``block`` is pieces of its file's consecutive lines in the
    file's order; else what does not match."""
    source = root / block.excerpt_of
    if not source.is_file():
        return f"{block.label}: {block.excerpt_of} does not exist"
    have = [line.rstrip() for line in source.read_text(encoding="utf-8").splitlines()]
    pieces, piece = [], []
    for line in block.code.splitlines():
        if line.strip() in ("// ...", "# ..."):
            pieces.append(piece)
            piece = []
        else:
            piece.append(line.rstrip())
    pieces.append(piece)
    start = 0
    for piece in pieces:
        while piece and not piece[0]:
            piece = piece[1:]
        while piece and not piece[-1]:
            piece = piece[:-1]
        found = next((k for k in range(start, len(have) - len(piece) + 1)
                      if have[k:k + len(piece)] == piece), None)
        if found is None:
            first = piece[0] if piece else ""
            return (f"{block.label}: these lines are not {block.excerpt_of}'s (from "
                    f"line {start + 1} on), starting {first!r}")
        start = found + len(piece)
    return None


def cellcache_command_lines(code: str) -> List[List[str]]:
    """The argument lists of the ``cellcache`` command lines of a shell block
    (continuations joined, comments dropped); lines that expand variables or
    commands are left out (their arguments are not known here)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        if not line.startswith("cellcache ") or "$" in line:
            continue
        words = shlex.split(line, comments=True)
        cut = next((k for k, w in enumerate(words) if w in ("|", "&&", ";", ">")), len(words))
        commands.append(words[1:cut])
    return commands


# ------------------------------------------------------------------------ running


def clone_root(workdir: Path, repo: Path = REPO) -> Path:
    """``workdir`` made to stand for a clone's root after the install."""
    for entry in repo.iterdir():
        if entry.name in NOT_IN_A_CLONE or entry.suffix == ".pte" \
                or entry.name.endswith(".egg-info"):
            continue
        (workdir / entry.name).symlink_to(entry)
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    return workdir


def block_environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = sys.prefix
    return env


def _failure(block: Block, proc) -> str:
    output = (proc.stdout or "")[-2000:] + (proc.stderr or "")[-4000:]
    return f"{block.label} ({block.name}) exited with {proc.returncode}:\n{output}"


def run_block(block: Block, workdir: Path) -> Optional[str]:
    """None when the block ran to exit status 0 in ``workdir``; else why not."""
    env = block_environment()
    try:
        if block.language == "python":
            proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=workdir, env=env,
                                  input=json.dumps([block.label, block.code]),
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        else:
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code],
                                  cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{block.label} ({block.name}) ran over {BLOCK_TIMEOUT} s"
    return _failure(block, proc) if proc.returncode else None


class Server:
    """A server block running in the background in its own process group."""

    def __init__(self, block: Block, workdir: Path, port: int):
        self.log = workdir / f"{block.name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(["bash", "-e", "-c", block.code], cwd=workdir,
                                         env=block_environment(), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", self.proc, self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_all(blocks: List[Block], workdir: Path, skip) -> List[dict]:
    """Runs the blocks in order (``skip(block)``: not run), up to the first
    failure. -> [{"block", "error", "seconds"}] for the blocks run; a server
    block's error is its failure to become healthy, its seconds its start-up's."""
    results, server, path, port = [], None, None, None
    try:
        for block in blocks:
            if block.path != path:
                if server:
                    server.stop()
                server, path, port = None, block.path, None
            if block.name is None or block.kind == "excerpt" or skip(block):
                continue
            if block.kind == "server":
                port = str(free_port())
            if port:
                block = Block(**{**block.__dict__,
                                 "code": re.sub(rf"\b{DOCS_PORT}\b", port, block.code)})
            started = time.monotonic()
            if block.kind == "server":
                try:
                    server = Server(block, workdir, int(port))
                    error = None
                except AssertionError as e:
                    error = f"{block.label} ({block.name}): {e}"
            else:
                error = run_block(block, workdir)
            results.append({"block": block, "error": error,
                            "seconds": time.monotonic() - started})
            if error:
                break
    finally:
        if server:
            server.stop()
    return results


# -------------------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(markdown: str) -> set:
    """GitHub's anchors for the headings of ``markdown`` (outside code blocks):
    lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``, a
    repeated one numbered."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def broken_links(root: Path = REPO) -> List[str]:
    """``file: link`` for each relative link of README.md and docs/*.md whose
    file, or whose anchor in a markdown file, does not exist."""
    broken = []
    for md in doc_files(root):
        text = md.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            name, _, anchor = target.partition("#")
            dest = (md.parent / name).resolve() if name else md
            ok = dest.exists()
            if ok and anchor and dest.suffix == ".md":
                ok = anchor in heading_anchors(dest.read_text(encoding="utf-8"))
            if not ok:
                broken.append(f"{md.relative_to(root)}: {target}")
    return broken
