"""The ``cellcache`` command line end to end (SPEC section 4), through
``python -m executorch_cellcache`` in subprocesses.

The embedded default model exported by `cellcache export` once per run
(conftest.default_pte: 512 cells, 32 tokens a step); the error cases run as parallel subprocesses to keep the module fast.
"""

import io
import json
import math
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from executorch_cellcache.cli import build_parser, main

pytestmark = pytest.mark.slow

from conftest import DEFAULT_CELLS as CELLS  # default_pte's
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, twice over.", "a"]
TIMEOUT = 600


def _default_tokenizer():
    from tokenizers import Tokenizer

    from executorch_cellcache.exporting.default_model import CHECKPOINT

    return Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))


def _cmd(*args):
    return [sys.executable, "-m", "executorch_cellcache", *map(str, args)]


def _env():
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _run(*args):
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=TIMEOUT,
                          env=_env(), check=False)


def _start(cases):
    """Starts {name: args} as concurrent subprocesses; -> {name: Popen}."""
    return {name: subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=_env())
            for name, args in cases.items()}


def _finish(procs):
    """-> {name: CompletedProcess} once every process has ended."""
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=TIMEOUT)
        results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return results


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def early_errors(workdir):
    """Error cases that need no exported program: started before the export,
    so they run while it does (argparse rejects --n 0 before opening the file)."""
    return _start({
        "missing-pte": ["generate", workdir / "missing.pte", "--prompt", "hi"],
        "n-0": ["generate", workdir / "default.pte", "--prompt", "hi", "--n", 0],
    })


@pytest.fixture(scope="module")
def pte(default_pte, early_errors):
    """The session's default program, which `cellcache export` wrote (conftest.cli_export
    checks that command's run and output)."""
    return default_pte


def test_export_then_generate_three_prompts_n2(pte):
    args = ["generate", pte, "--n", 2, "--max-new-tokens", 8, "--temperature", 0.8,
            "--seed", 3]
    for p in PROMPTS:  # the second prompt is longer than a step (32 tokens): chunked
        args += ["--prompt", p]
    r = _run(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr

    # Per prompt: a "[prompt i] TEXT" line, then a "[sample j]" line above each sample's
    # text (the text exactly: test_generate_json_...).
    lines = r.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("[prompt ")]
    assert [lines[i] for i in heads] == [f"[prompt {k}] {p}" for k, p in enumerate(PROMPTS)]
    assert all(lines[i + 1] == "[sample 0]" for i in heads), r.stdout
    assert sum(line == "[sample 1]" for line in lines) == 3, r.stdout

    summary = [line for line in r.stderr.splitlines() if line.startswith("prefill ")]
    assert len(summary) == 1, r.stderr
    m = re.search(r"prefill (\d+) tokens at \d+ tok/s, decode (\d+) tokens at \d+ tok/s, "
                  r"(\d+) steps, peak cells (\d+) of (\d+)", summary[0])
    assert m, summary[0]
    prefill, decode, _steps, peak, cap = map(int, m.groups())
    n_prompt = sum(len(e.ids) for e in _default_tokenizer().encode_batch(PROMPTS))  # BOS each
    assert prefill == n_prompt
    assert 3 * 2 <= decode <= 3 * 2 * 7  # fewer only where a sample drew EOS
    assert cap == CELLS and prefill <= peak <= prefill + decode


def test_generate_json_prints_each_samples_prompt_text_token_ids_finish_and_usage(pte):
    """--json: one object a line for each sample; the text output shows the same
    texts, as they are, under their [prompt i] and [sample j] lines."""
    from executorch_cellcache.runtime.runner import Runner

    args = ["generate", pte, "--n", 2, "--max-new-tokens", 8, "--temperature", 0.8, "--seed", 3,
            "--prompt", PROMPTS[0], "--prompt", PROMPTS[2]]
    as_json, as_text = _run(*args, "--json"), _run(*args)
    assert as_json.returncode == as_text.returncode == 0, (as_json.stderr, as_text.stderr)
    samples = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    tok = Runner(pte).tokenizer
    for s in samples:
        prompt, ids = [PROMPTS[0], PROMPTS[2]][s["prompt_index"]], s["token_ids"]
        assert s["prompt"] == prompt and s["prompt_token_ids"] == tok.encode(prompt)
        assert s["finish_reason"] in ("stop", "length") and 1 <= len(ids) <= 8
        stopped = s["finish_reason"] == "stop"
        assert stopped or len(ids) == 8
        assert s["text"] == tok.decode(ids[:-1] if stopped else ids)
        assert s["usage"] == {"prompt_tokens": len(s["prompt_token_ids"]),
                              "cached_tokens": s["usage"]["cached_tokens"],
                              "completion_tokens": len(ids)}
        assert "messages" not in s
    assert as_text.stdout == "\n\n".join(
        (f"[prompt {s['prompt_index']}] {s['prompt']}\n" if s["sample_index"] == 0 else "")
        + f"[sample {s['sample_index']}]\n{s['text']}" for s in samples) + "\n"


def test_speculative_generate_says_how_many_tokens_it_proposes_a_step(pte):
    """--draft-max auto (the default) chooses k from measured step costs
    (cpp/engine/draft_length.h); a given k is used as given; the output is
    plain decoding's either way."""
    def run(*flags):
        r = _run("generate", pte, "--prompt", PROMPTS[0], "--max-new-tokens", 24, *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        m = re.search(r"; speculative \(lookup, up to (\d+) a step\): (\d+) of (\d+) proposed",
                      r.stderr)
        return r.stdout, m
    auto, m = run("--speculative", "lookup")  # plain decoding's tokens: test_speculative.py
    assert m and 1 <= int(m[1]) <= 31
    given, m = run("--speculative", "lookup", "--draft-max", "5")
    assert m and int(m[1]) == 5 and given == auto


def test_eval_prints_tokens_scored_and_perplexity(pte, workdir):
    text = workdir / "eval.txt"
    text.write_text("The with statement is used to wrap the execution of a block with "
                    "methods defined by a context manager.\n" * 8)
    r = _run("eval", pte, "--text", text, "--window", 64, "--stride", 32)
    assert r.returncode == 0, r.stderr[-3000:]
    n_tokens = len(_default_tokenizer().encode(text.read_text()).ids)
    m = re.fullmatch(r"(\d+) tokens scored \(window 64, stride 32\): mean NLL (\d+\.\d{4}), "
                     r"perplexity (\d+\.\d{3})\n", r.stdout)
    assert m, r.stdout
    assert int(m[1]) == n_tokens - 1
    assert abs(float(m[3]) - math.exp(float(m[2]))) < 1e-2 * float(m[3])
    assert "evaluating" in r.stderr  # the progress bar


@pytest.mark.parametrize("command", sorted(build_parser()._subparsers._group_actions[0].choices))
def test_help_for_each_command(command, capsys):
    with pytest.raises(SystemExit, match="^0$") as exc:  # the message of SystemExit(0)
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: cellcache " + command)
    expected = {
        "export": ["--model", "--cells", "--max-tokens-per-step", "--out"],
        "generate": ["MODEL.pte", "--prompt", "--prompts-file", "--token-ids",
                     "--max-new-tokens", "--n", "--temperature", "--seed", "--top-k",
                     "--top-p", "--prefix-cache-cells", "--no-prefix-cache"],
        "serve": ["--prefix-cache-cells", "--no-prefix-cache"],
        "eval": ["MODEL.pte", "--text", "--window", "--stride", "held-out"],
    }.get(command, [])
    for option in expected:
        assert option in text, f"{command} --help does not mention {option}"


def test_top_level_help():
    r = _run("--help")
    assert r.returncode == 0
    for command in ("export", "generate", "eval"):
        assert command in r.stdout


def test_generate_reuses_a_finished_prompts_cells_and_reports_it(pte):
    """Two prompts sharing a prefix, each needing over half the cache: the
    second waits for the first, then reuses its cached prefix; the output is
    that of --no-prefix-cache."""
    shared = "You are a terse assistant. Answer in one line. "
    args = ["generate", pte, "--prompt", shared + "Hi", "--prompt", shared + "Yo",
            "--max-new-tokens", CELLS // 2, "--no-stop-on-eos"]
    on, off = _run(*args), _run(*args, "--no-prefix-cache")
    assert on.returncode == off.returncode == 0, (on.stderr[-2000:], off.stderr[-2000:])
    assert on.stdout == off.stdout
    m = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens cached \(per prompt: 0, (\d+)\), "
                  r"hit rate 50%, (\d+) cells held", on.stderr)
    assert m, on.stderr[-2000:]
    cached, total, second, held = map(int, m.groups())
    first_ids, second_ids = (e.ids for e in _default_tokenizer().encode_batch(
        [shared + "Hi", shared + "Yo"]))
    common = next(i for i, (x, y) in enumerate(zip(first_ids, second_ids)) if x != y)
    assert cached == second == common  # the longest common token prefix
    assert total == len(first_ids) + len(second_ids) and 0 < held <= CELLS
    assert "prefix cache" not in off.stderr


@pytest.fixture(scope="module")
def error_runs(pte, workdir, early_errors):
    empty = workdir / "empty.txt"
    empty.write_text("\n  \n\n")
    late = _start({
        "empty-prompts-file": ["generate", pte, "--prompts-file", empty],
        "too-many-new-tokens": ["generate", pte, "--prompt", "hi", "--max-new-tokens", 1000],
    })
    return {**_finish(early_errors), **_finish(late)}


# Tokens of the prompt "hi", BOS included; the capacity error adds 999 fed-back tokens.
HI_TOKENS = len(_default_tokenizer().encode("hi").ids)
ERROR_MESSAGES = {
    "missing-pte": ("generate", "missing.pte does not exist"),
    "n-0": ("generate", "argument --n: must be >= 1, got 0"),
    "empty-prompts-file": ("generate", "prompts file .*empty.txt holds no prompt"),
    "too-many-new-tokens": ("generate", f"needs up to {HI_TOKENS + 999} cells .* but the cache "
                                        f"has {CELLS}"),
}


def _check_error(rc, stdout, stderr, command, pattern):
    assert rc == 2, (rc, stderr[-2000:])
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"cellcache {command}: error: "), errors[0]
    assert re.search(pattern, errors[0]), errors[0]
    assert stdout == ""


@pytest.mark.parametrize("case", sorted(ERROR_MESSAGES))
def test_user_errors_exit_2_with_one_error_line(error_runs, case):
    r = error_runs[case]
    _check_error(r.returncode, r.stdout, r.stderr, *ERROR_MESSAGES[case])


# More user errors, in-process (main() is what the subprocesses above run).
@pytest.mark.parametrize("case", ["foreign-pte", "missing-prompts-file",
                                  "prefix-cache-cells-too-big", "no-prompts",
                                  "bad-token-ids", "cells-below-step", "bad-temperature",
                                  "int8-kv-on-the-reference-path", "draft-max-not-a-count",
                                  "draft-max-above-the-step", "window-cells-not-pairs",
                                  "window-cells-twice", "window-cells-on-full-attention",
                                  "window-cells-on-the-reference-path",
                                  "pool-sequences-without-auto", "retained-margin-one-pool"])
def test_more_user_errors_in_process(case, pte, workdir, capsys):
    text = workdir / "notes.pte"
    text.write_text("not a program\n")
    argv, command, pattern = {
        "foreign-pte": (["generate", text, "--prompt", "hi"], "generate",
                        "not a loadable ExecuTorch program"),
        "missing-prompts-file": (["generate", pte, "--prompts-file", workdir / "nope.txt"],
                                 "generate", "nope.txt does not exist"),
        "prefix-cache-cells-too-big": (["generate", pte, "--prompt", "hi",
                                        "--prefix-cache-cells", CELLS + 1], "generate",
                                       rf"prefix_cache_cells must be an integer in \[0, {CELLS}\]"),
        "no-prompts": (["generate", pte], "generate", "no prompts"),
        "bad-token-ids": (["generate", pte, "--token-ids", "--prompt", "1 x 3"], "generate",
                          "--token-ids"),
        "cells-below-step": (["export", "--cells", 8, "--max-tokens-per-step", 32, "--out",
                              workdir / "x.pte"], "export", "n_cells"),
        "bad-temperature": (["generate", pte, "--prompt", "hi", "--temperature", "-1"],
                            "generate", "--temperature"),
        "int8-kv-on-the-reference-path": (["export", "--kv-dtype", "int8", "--attention",
                                           "reference", "--out", workdir / "x.pte"], "export",
                                          "int8 K/V needs the 'cells' attention path, not "
                                          "'reference'"),
        "draft-max-not-a-count": (["generate", pte, "--prompt", "hi", "--speculative", "lookup",
                                   "--draft-max", "many"], "generate",
                                  "--draft-max: expected an integer >= 1 or auto, got 'many'"),
        "window-cells-not-pairs": (["export", "--window-cells", "512", "--out",
                                    workdir / "x.pte"], "export",
                                   r"--window-cells: expected auto, none or WINDOW:CELLS"),
        "window-cells-twice": (["export", "--window-cells", "8:100,8:200", "--out",
                                workdir / "x.pte"], "export", "window 8 is sized twice"),
        # the default model's layers all attend fully: nothing to pool
        "window-cells-on-full-attention": (["export", "--window-cells", "8:100", "--out",
                                            workdir / "x.pte"], "export",
                                           "every layer of this model has full attention"),
        "window-cells-on-the-reference-path": (["export", "--window-cells", "8:100",
                                                "--attention", "reference", "--out",
                                                workdir / "x.pte"], "export",
                                               "needs the 'cells' attention path"),
        "pool-sequences-without-auto": (["export", "--pool-sequences", 4, "--out",
                                         workdir / "x.pte"], "export",
                                        "pool_sequences sizes the pools of window_cells='auto'"),
        "retained-margin-one-pool": (["export", "--retained-margin", 4, "--out",
                                      workdir / "x.pte"], "export",
                                     "with one pool nothing is reclaimed"),
        "draft-max-above-the-step": (["generate", pte, "--prompt", "hi", "--speculative",
                                      "lookup", "--draft-max", "32"], "generate",
                                     r"max_draft \(--draft-max.*\[1, 31\].*got 32"),
    }[case]
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    _check_error(rc, out, err, command, pattern)


@pytest.mark.parametrize("argv", [["export", "--cells", "0"], ["export", "--kv-dtype", "int4"],
                                  ["export", "--attention", "dense"],
                                  ["generate", "m.pte", "--n", "0"],
                                  ["generate", "m.pte", "--temperature", "-1"], ["nope"],
                                  ["generate", "m.pte", "--prefix-cache-cells", "-1"],
                                  ["serve", "m.pte", "--no-prefix-cache",
                                   "--prefix-cache-cells", "8"]])
def test_option_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit, match="^2$") as info:  # argparse's usage-error exit
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "--help" in err[0], err
    if "--kv-dtype" in argv:  # names the value and the choices
        assert "'int4'" in err[0] and "'fp32', 'fp16', 'int8'" in err[0], err


@pytest.mark.parametrize("model, quantize, embedding, expected", [
    (None, None, None, "cellcache-default.pte"),
    (None, "8da4w", "8", "cellcache-default-8da4w-emb8.pte"),
    ("ckpts/SmolLM-135M/", "8da8w", None, "SmolLM-135M-8da8w.pte"),
    ("ckpts/qwen3", None, "4,32", "qwen3-emb4g32.pte"),
])
def test_export_default_out_names_the_model_and_quantization(model, quantize, embedding,
                                                             expected):
    from executorch_cellcache.cli.export import default_out_name

    assert default_out_name(model, quantize, embedding) == expected


def test_generate_stop_token_ids_end_the_sample_before_that_token(pte):
    from executorch_cellcache.runtime.runner import Runner

    runner = Runner(pte)
    tok = runner.tokenizer
    ids = runner.generate([tok.encode("Hello")], 16)[0][0]
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k] and
             ids[k] not in runner.info.eos_ids)
    r = _run("generate", pte, "--prompt", "Hello", "--max-new-tokens", 16, "--prompt", "a",
             "--stop-token-ids", ids[k], 1023, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout.splitlines()[0])
    assert (first["text"], first["token_ids"], first["finish_reason"]) == \
        (tok.decode(ids[:k]), ids[:k + 1], "stop")
    bad = _run("generate", pte, "--prompt", "Hello", "--stop-token-ids", 4096)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "4096" in bad.stderr and "stop_token_ids" in bad.stderr, bad.stderr


def test_generate_prompts_file_dash_reads_the_prompts_from_standard_input(pte, monkeypatch,
                                                                         capsys):
    args = ["generate", str(pte), "--max-new-tokens", "4"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello\n\n  \na\n")))
    assert main(args + ["--prompts-file", "-"]) == 0
    piped = capsys.readouterr().out
    assert main(args + ["--prompt", "Hello", "--prompt", "a"]) == 0
    assert piped == capsys.readouterr().out and piped.count("[prompt ") == 2, piped


def test_serve_lists_and_answers_to_the_served_model_names(pte, workdir):
    from serve_support import serving

    names = ["--served-model-name", "smol", "--served-model-name", "chat"]
    with serving(pte, workdir / "serve.log", *names) as base:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as r:
            models = json.load(r)
    assert [m["id"] for m in models["data"]] == ["smol", "chat"]


@pytest.mark.parametrize("flag, quantize, fused", [
    ([], "8da4w", True), ([], "8da8w", False), ([], None, False),
    (["--fuse-projections", "off"], "8da4w", False), (["--fuse-projections", "on"], None, True),
    (["--fuse-projections", "auto"], "8da8w", False)])
def test_export_fuse_projections_reaches_the_export_options(flag, quantize, fused, monkeypatch,
                                                            tmp_path):
    from executorch_cellcache.exporting import exporter

    seen = []

    def stop(model, out, options, progress=None):
        seen.append(options)
        raise RuntimeError("stopped before exporting")

    monkeypatch.setattr(exporter, "export", stop)
    argv = ["export", "--out", str(tmp_path / "m.pte")] + flag
    argv += ["--quantize", quantize] if quantize else []
    assert main(argv) == 2
    [options] = seen
    assert options.fuse_projections is fused
