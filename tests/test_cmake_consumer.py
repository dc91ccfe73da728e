"""The installed C++ engine as an app links it: tests/cmake_consumer/, a separate CMake
project, finds the package with find_package(executorch_cellcache) (the folder from
`cellcache cmake-dir`), links executorch_cellcache::runner, and runs one greedy
request through Engine over CellCacheProgram on the default model; a second program
takes text (the program's own tokenizer) and a JSON schema (GrammarHooks).

Oracles: the Python Runner's greedy tokens for the same prompt (and their text by the
Python tokenizer); ``jsonschema`` and `cellcache_runner --stdio` for the schema. The forward only runs
if the package brought the cellcache:: kernels linked whole (else ExecuTorch stops on
"Missing operator").
"""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import executorch_cellcache as ecc
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

CONSUMER = Path(__file__).resolve().parent / "cmake_consumer"
PROMPT = "The for statement"
NEW_TOKENS = 24


def _tool(name):
    """pip's cmake / ninja beside this interpreter (requirements.txt)."""
    path = Path(sys.executable).parent / name
    assert path.is_file(), f"{name} is not installed beside {sys.executable}"
    return str(path)


@pytest.fixture(scope="module")
def cmake_dir():
    out = subprocess.run([sys.executable, "-m", "executorch_cellcache", "cmake-dir"],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"cmake-dir failed: {out.stderr}"
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def consumer_exe(cmake_dir, tmp_path_factory):
    build = tmp_path_factory.mktemp("cmake_consumer")
    configure = subprocess.run(
        [_tool("cmake"), "-S", str(CONSUMER), "-B", str(build), "-G", "Ninja",
         f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}", "-DCMAKE_BUILD_TYPE=Release",
         f"-Dexecutorch_cellcache_DIR={cmake_dir}"],
        capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    built = subprocess.run([_tool("cmake"), "--build", str(build)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    return build / "cellcache_consumer"


def test_text_consumer_speaks_text_and_follows_a_schema(consumer_exe, default_pte, runner_exe):
    import json

    import jsonschema
    from stdio_support import Session
    from test_structured_output import SCHEMAS

    from executorch_cellcache.runtime.tokenizer import StreamDecoder
    exe = consumer_exe.parent / "cellcache_text_consumer"
    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    [[expected]] = ecc.Runner(default_pte).generate([tok.encode(PROMPT)], NEW_TOKENS)
    stream = StreamDecoder(tok)
    want = "".join(stream.push(t) for t in expected) + stream.flush()
    out = subprocess.run([str(exe), str(default_pte), str(NEW_TOKENS), PROMPT],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"

    schema = SCHEMAS["nested"]
    out = subprocess.run([str(exe), str(default_pte), "128", "Data:", json.dumps(schema)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)
    s = Session(runner_exe, default_pte)
    s.send({"id": 1, "text": "Data:", "json_schema": schema, "max_new_tokens": 128})
    s.wait_finished(1)
    s.close()
    assert out.stdout == "".join(a.get("text", "") for a in s.seen) + "\n"

    bad = subprocess.run([str(exe), str(default_pte), "8", "Data:", "{\"type\": 5}"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == \
        "error: the json_schema does not compile: Type should be a string"


def test_the_package_holds_the_config_its_version_and_every_included_header(cmake_dir):
    assert (cmake_dir / "executorch_cellcache-config.cmake").is_file()
    version = (cmake_dir / "executorch_cellcache-config-version.cmake").read_text()
    assert f'set(PACKAGE_VERSION "{importlib.metadata.version("executorch-cellcache")}")' \
        in version
    # lib/cmake/executorch_cellcache -> the package's include/: each quoted include of an
    # installed header resolves beside it or under include/, as the compiler looks.
    include = cmake_dir.parents[2] / "include"
    headers = sorted(include.rglob("*.h"))
    assert {h.name for h in (include / "cellcache" / "runner").glob("*.h")} >= {
        "engine.h", "batch_runner.h", "program.h", "program_info.h", "forward.h",
        "sampling.h", "scheduler.h", "prefix_cache.h", "run_status.h", "tokenizer.h",
        "stream_decoder.h", "chat_template.h", "tool_calls.h", "grammar.h", "grammar_hooks.h", "program_text.h"}
    for header in headers:
        for name in re.findall(r'^#include "([^"]+)"', header.read_text(), re.M):
            assert (header.parent / name).is_file() or (include / name).is_file(), \
                f"{header.relative_to(include)} includes {name}, which is not installed"


def test_consumer_greedy_tokens_equal_the_python_runner(consumer_exe, default_pte):
    prompt = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text()).encode(PROMPT)
    [[expected]] = ecc.Runner(default_pte).generate([prompt], NEW_TOKENS)
    out = subprocess.run([str(consumer_exe), str(default_pte), str(NEW_TOKENS),
                          *map(str, prompt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [int(t) for t in out.stdout.split()] == expected
    assert len(expected) == NEW_TOKENS  # the prompt does not stop early: all steps compared
    # executorch_cellcache::pool_executor made the runtime's pool (its pthreadpool_create
    # came first: exported from the executable), as it does for cellcache_runner. On one
    # CPU the runtime's pool has one thread, which is pthreadpool's own (nothing to
    # schedule: pool_executor.cpp), as test_pool_executor.py allows.
    pools = 1 if (os.cpu_count() or 1) > 1 else 0
    assert f"pool executor pools: {pools}" in out.stderr.splitlines()


def test_consumer_refuses_a_bad_pool_spin_setting_in_one_line(consumer_exe, default_pte):
    out = subprocess.run([str(consumer_exe), str(default_pte), "4", "0", "1"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CELLCACHE_POOL_SPIN_US": "fast"})
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "CELLCACHE_POOL_SPIN_US" in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_consumer_reports_a_missing_program_as_a_user_error(consumer_exe, tmp_path):
    out = subprocess.run([str(consumer_exe), str(tmp_path / "nope.pte"), "4", "0", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "does not exist" in out.stderr


def test_cmake_dir_without_an_installed_package_exits_2_with_a_clear_message(
        monkeypatch, tmp_path, capsys):
    from executorch_cellcache import cli
    from executorch_cellcache.cli import paths

    package = tmp_path / "executorch_cellcache"
    package.mkdir()
    monkeypatch.setattr(paths, "__file__", str(package / "cli" / "paths.py"))
    assert cli.main(["cmake-dir"]) == 2
    err = capsys.readouterr().err
    assert "cellcache cmake-dir: error: the C++ engine's CMake package was not installed" in err
    assert len(err.splitlines()) == 1
