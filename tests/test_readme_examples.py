"""Every command block of README.md and docs/*.md runs as written, or is listed
in NOT_RUN below with the reason it does not.

The marks, the order and the folder the blocks run in: tests/doc_examples.py.
A command block that is neither marked nor listed fails
test_every_command_block_is_marked_and_every_listed_one_exists, so new docs
cannot rot unseen; a listed block still has its ``cellcache`` command lines
parsed by the CLI's own parser, and an excerpt block is checked against the
file it quotes (which another test builds and runs).
"""

import contextlib
import io
import re
import socket
from collections import Counter

import pytest
from doc_examples import (Block, all_blocks, blocks_of, broken_links, cellcache_command_lines,
                          clone_root, excerpt_problem, run_all)

# The blocks not run, by their mark's name, and why: the one list.
NOT_RUN = {
    # README.md
    "setup": "installs everything and exports SmolLM2-135M (13.5-17 minutes on 2 cores); its "
             "commands run below on the default model",
    "test-all": "runs this suite itself, and the C++ tests before it",
    "real-model-export": "exports a 135M model (about 7 minutes on 2 cores); docs/cli.md and "
                         "tests/test_gguf.py export the default and the real model",
    "real-model-chat": "waits for a person; docs/cli.md's chat-piped runs chat on the default "
                       "model",
    "real-model-serve": "serves until stopped, on the 135M program; docs/serving.md starts serve "
                        "on the default program and asks it",
    "real-model-ask": "asks the real-model server above; docs/serving.md's curl blocks ask the "
                      "default program's",
    "aarch64": "installs with apt as root and downloads the aarch64 wheel; scripts/test.sh "
               "runs `scripts/aarch64.sh test`, tests/test_aarch64.py the runner under qemu",
    # docs/install.md
    "pytest-subsets": "the test suite itself",
    "pip-install": "a fresh venv and a C++ build (minutes); tests/test_wheel.py installs a wheel "
                   "built from the tree the same way",
    # docs/models.md
    "hf-download": "downloads a model from the Hugging Face Hub (the suite downloads nothing)",
    "gguf-export": "needs a GGUF file of your own; tests/test_gguf.py exports the packaged one",
    "retrain-default-model": "trains for about 30 minutes",
    # docs/cli.md
    "export-checkpoint": "needs a checkpoint folder of your own; tests/test_export_models.py "
                         "exports toy ones",
    # docs/features.md
    "export-quantized": "needs a checkpoint folder of your own; tests/test_quantize.py exports "
                        "these modes",
    "export-window-pools": "needs a Gemma3 checkpoint; tests/test_export_pools.py exports "
                           "toy models with pools",
    # docs/cpp-engine.md
    "aarch64-build-run": "as the README's aarch64 block",
    # docs/benchmarks.md
    "bench-smollm2-llama-cpp": "needs a llama.cpp build, and measures for many minutes",
    "bench-model": "exports about ten 135M programs (over an hour cold); tests/test_bench.py "
                   "runs `cellcache bench --quick`",
    "bench-pools": "exports and decodes 8 contexts of 4,096 tokens (minutes)",
    "bench-engine": "needs a 135M program (M.pte: minutes to export) and measures for minutes",
    "bench-speculative": "exports the 135M bench program (up to an hour cold)",
}


def _not_run(block: Block) -> bool:
    return block.name in NOT_RUN


# ------------------------------------------------------------- the docs as they are


def test_every_command_block_is_marked_and_every_listed_one_exists():
    blocks = [b for b in all_blocks() if b.name]
    repeated = [n for n, k in Counter(b.name for b in blocks).items() if k > 1]
    assert not repeated, f"example names used twice: {repeated}"
    names = {b.name for b in blocks}
    assert not set(NOT_RUN) - names, f"NOT_RUN lists blocks no doc has: {set(NOT_RUN) - names}"
    for block in blocks:
        assert not (block.kind != "run" and block.name in NOT_RUN), \
            f"{block.label}: a {block.kind} block is checked or run, not listed"


def test_excerpt_blocks_are_the_lines_of_their_files():
    excerpts = [b for b in all_blocks() if b.kind == "excerpt"]
    assert excerpts
    problems = [p for p in map(excerpt_problem, excerpts) if p]
    assert not problems, "\n".join(problems)


def test_links_between_the_docs_resolve():
    assert not broken_links()


def test_cellcache_commands_of_blocks_not_run_parse(capsys):
    from executorch_cellcache.cli.main import build_parser

    checked = 0
    for block in all_blocks():
        if block.name not in NOT_RUN or block.language not in ("bash", "sh"):
            continue
        for argv in cellcache_command_lines(block.code):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    build_parser().parse_args(argv)
                except SystemExit:
                    raise AssertionError(f"{block.label}: cellcache {' '.join(argv)}: "
                                         f"{err.getvalue()}")
            checked += 1
    assert checked >= 10


@pytest.mark.slow
def test_docs_command_blocks_run_as_written(tmp_path):
    blocks = all_blocks()
    results = run_all(blocks, clone_root(tmp_path), _not_run)
    for r in results:  # where the time goes (pytest -s shows it)
        print(f"{r['seconds']:6.1f} s  {r['block'].label} {r['block'].name}")
    failed = [r["error"] for r in results if r["error"]]
    assert not failed, failed[0]
    expected = [b for b in blocks if b.name and b.kind != "excerpt" and not _not_run(b)]
    assert [r["block"].name for r in results] == [b.name for b in expected]


# ------------------------------------------------------------------ the machinery


def _blocks(markdown: str):
    return blocks_of(markdown, "doc.md")


def test_marks_name_command_blocks_and_text_blocks_need_none():
    doc = ("<!-- example: one -->\n```bash\nls\n```\n\n```text\noutput\n```\n"
           "<!-- example: two server -->\n```sh\nserve\n```\n"
           "<!-- example: three excerpt tests/x.cpp -->\n```cpp\nint x;\n```\n")
    blocks = _blocks(doc)
    assert [(b.name, b.kind, b.language, b.line) for b in blocks] == [
        ("one", "run", "bash", 3), (None, "run", "text", 7), ("two", "server", "sh", 11),
        ("three", "excerpt", "cpp", 15)]
    assert blocks[2].code == "serve\n" and blocks[3].excerpt_of == "tests/x.cpp"


@pytest.mark.parametrize("doc, message", [
    ("```python\nx = 1\n```\n", "doc.md:1: a python block without a mark"),
    ("```\nls\n```\n", "doc.md:1: a fence without an info string"),
    ("```console\n$ ls\n```\n", "unknown block language 'console'"),
    ("<!-- example: a -->\n```text\nout\n```\n", "doc.md:1: the mark is not right before"),
    ("<!-- example: A b -->\n```bash\nls\n```\n", "doc.md:1: a malformed mark"),
    ("<!-- example: a -->\n```cpp\nint x;\n```\n", "a cpp block can only be an excerpt"),
    ("<!-- example: a server -->\n```python\nx\n```\n", "a server block is a shell block"),
    ("<!-- example: a -->\n```bash\nls\n", "doc.md:2: the block never closes"),
])
def test_an_unmarked_or_badly_marked_block_is_refused(doc, message):
    with pytest.raises(AssertionError, match=message):
        _blocks(doc)


def test_an_excerpt_is_pieces_of_the_files_lines_in_order(tmp_path):
    (tmp_path / "f.cpp").write_text("a\nb\nc\nd\ne\n")

    def problem(code):
        return excerpt_problem(Block("doc.md", 5, "cpp", code, "x", "excerpt", "f.cpp"),
                               tmp_path)
    assert problem("b\nc\n// ...\ne\n") is None
    assert "doc.md:5: these lines are not f.cpp's" in problem("b\nd\n")
    assert "starting 'b'" in problem("d\n// ...\nb\n")  # out of order
    assert "does not exist" in excerpt_problem(
        Block("doc.md", 5, "cpp", "a\n", "x", "excerpt", "g.cpp"), tmp_path)


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n## A `code` heading: yes\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#a-code-heading-yes) [web](https://x.org/y)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nope) [self](#title)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md", "README.md: docs/a.md#nope",
                                      "README.md: #title"]


def test_the_cellcache_lines_of_a_block_are_found():
    code = ("mkdir -p out\ncellcache export --cells 64 \\\n  --out out/m.pte   # note\n"
            "cellcache chat m.pte --system \"Be brief.\" | tee log\n"
            "RUNNER=$(cellcache runner-path)\n")
    assert cellcache_command_lines(code) == [["export", "--cells", "64", "--out", "out/m.pte"],
                                             ["chat", "m.pte", "--system", "Be brief."]]


def _run(tmp_path, *blocks):
    return run_all(list(blocks), tmp_path, lambda b: b.name in ("skipped",))


def test_blocks_share_files_but_nothing_else_and_stop_at_the_first_failure(tmp_path):
    results = _run(
        tmp_path,
        Block("a.md", 3, "bash", "echo hi > made.txt\nX=1\n", "make"),
        Block("a.md", 9, "python", "assert open('made.txt').read() == 'hi\\n'\nx = 1\n", "read"),
        Block("a.md", 12, "python", "raise SystemExit('not run')\n", "skipped"),
        Block("a.md", 15, "python", "print(x)\n", "fresh-namespace"),
        Block("a.md", 20, "bash", "echo never\n", "after"))
    assert [(r["block"].name, r["error"] is None) for r in results] == [
        ("make", True), ("read", True), ("fresh-namespace", False)]
    assert "a.md:15 (fresh-namespace) exited with 1" in results[-1]["error"]
    assert "NameError" in results[-1]["error"]


def test_a_failing_command_in_a_shell_block_fails_it(tmp_path):
    [result] = _run(tmp_path, Block("a.md", 7, "bash", "false | cat\necho after\n", "pipe"))
    assert result["error"].startswith("a.md:7 (pipe) exited with 1")
    assert "after" not in result["error"]


def test_the_blocks_run_in_a_folder_that_stands_for_the_clone_with_the_venv_active(tmp_path):
    root = clone_root(tmp_path)
    assert (root / "scripts" / "setup.sh").is_file() and (root / ".venv" / "bin").is_dir()
    assert not (root / "build").exists() and not (root / "out").exists()
    [result] = _run(root, Block("a.md", 1, "bash",
                                "test -f README.md\ncommand -v cellcache\n. .venv/bin/activate\n",
                                "clone"))
    assert result["error"] is None


def test_a_server_block_serves_its_files_later_blocks_on_a_free_port_then_stops(tmp_path):
    serve = ("mkdir -p site && echo ok > site/health\n"
             "exec python -m http.server 8000 --bind 127.0.0.1 --directory site\n")
    ask = "curl -sS --fail-with-body http://127.0.0.1:8000/health > answer.txt\n"
    results = _run(tmp_path, Block("a.md", 1, "bash", serve, "server", "server"),
                   Block("a.md", 5, "bash", ask, "ask"),
                   Block("b.md", 1, "bash", "test ! -e nothing\n", "next-file"))
    assert [r["error"] for r in results] == [None, None, None]
    port = int(re.search(r"http.server (\d+)", results[0]["block"].code)[1])
    assert port != 8000 and str(port) in results[1]["block"].code
    assert (tmp_path / "answer.txt").read_text() == "ok\n"
    with socket.socket() as s:  # stopped at the end of its file: nothing listens there
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_server_that_exits_before_it_is_healthy_fails_its_block(tmp_path):
    [result] = _run(tmp_path, Block("a.md", 4, "bash", "echo no server; exit 3\n", "dead",
                                    "server"))
    assert "a.md:4 (dead)" in result["error"] and "exited with 3" in result["error"]
    assert "no server" in result["error"]
