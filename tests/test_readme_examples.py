"""The README's Python examples run as written.

Every fenced ```python block that the line before marks with ``<!-- runnable
-->`` is run, in README order, in one fresh directory, each as its own script
(a Python process of this environment; nothing carries over but files), as a
reader would paste it. The first runnable block exports the default model to
``m.pte``; a block that uses a file no earlier block created fails, as does
one that raises or asserts. The failure names the block's README line.
"""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- runnable -->"
TIMEOUT = 1200
MIN_BLOCKS = 6  # the README's runnable examples today (a lost marker fails the count)

# Runs one block, given as JSON [line, code] on stdin, as a script named after its line.
DRIVER = textwrap.dedent("""
    import json, sys
    line, code = json.load(sys.stdin)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
""")


def runnable_blocks(markdown: str):
    """[(line number of the block's first code line, code)] of the blocks
    marked runnable. A marker not followed by a ```python block is an error."""
    lines = markdown.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            raise AssertionError(f"README.md:{i + 1}: {MARKER} is not followed by a ```python "
                                 f"block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"README.md:{i + 2}: the runnable block never closes")
        blocks.append((i + 3, "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


def run_blocks(blocks, workdir: Path):
    """-> [{"line", "error"}] for the blocks run in order, up to the first
    failure (error: its stderr's end, the traceback)."""
    results = []
    for line, code in blocks:
        proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([line, code]),
                              cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT)
        failed = proc.returncode != 0
        results.append({"line": line, "error": f"exit status {proc.returncode}:\n"
                                               f"{proc.stderr[-4000:]}" if failed else None})
        if failed:
            break
    return results


def test_the_marker_finds_python_blocks_only_after_it():
    text = "```python\nskipped = 1\n```\n\n<!-- runnable -->\n```python\nx = 1\ny = 2\n```\n"
    assert runnable_blocks(text) == [(7, "x = 1\ny = 2\n")]
    with pytest.raises(AssertionError, match="is not followed by a ```python block"):
        runnable_blocks("<!-- runnable -->\n```bash\nls\n```\n")


def test_an_example_that_uses_a_file_it_does_not_create_fails(tmp_path):
    """The check fails for the right reason: the block's line and the missing file."""
    blocks = [(10, "open('made.txt', 'w').write('hi')\n"),
              (20, "assert open('made.txt').read() == 'hi'\n"),
              (30, "open('never-made.txt')\n"),
              (40, "raise SystemExit('not reached')\n")]
    results = run_blocks(blocks, tmp_path)
    assert [r["line"] for r in results] == [10, 20, 30]
    assert results[0]["error"] is None and results[1]["error"] is None
    assert "README.md:30" in results[2]["error"]
    assert "FileNotFoundError" in results[2]["error"] and "never-made.txt" in results[2]["error"]


def test_each_block_starts_from_a_fresh_namespace(tmp_path):
    results = run_blocks([(1, "x = 1\n"), (2, "print(x)\n")], tmp_path)
    assert results[0]["error"] is None and "NameError" in results[1]["error"]


@pytest.mark.slow
def test_readme_python_examples_run_as_written(tmp_path):
    blocks = runnable_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= MIN_BLOCKS, f"only {len(blocks)} runnable blocks in README.md"
    assert re.search(r"export\(None, \"m\.pte\"", blocks[0][1]), \
        "the first runnable block must export m.pte (the later ones use it)"
    results = run_blocks(blocks, tmp_path)
    failed = [r for r in results if r["error"]]
    assert not failed, f"README.md:{failed[0]['line']} failed:\n{failed[0]['error']}"
    assert len(results) == len(blocks)
