"""The C++ runner, cellcache_runner (SPEC section 4): batched generation from a
.pte and token ids without Python.

Greedy output must equal the Python Runner's token for token (same scheduler
policy and prefix cache, so the same step composition and cell placement; with
--no-prefix-cache, the Python Runner's prefix_cache=False), and bad input must
end in one error line and exit status 2, never a crash.

The default model is exported once per module (512 cells, 32 tokens per step);
the runner is found with `python -m executorch_cellcache runner-path`.
"""

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

import executorch_cellcache as ecc
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

CELLS = 512
STEP = 32
BOS = 0        # the default model's <s>
VOCAB = 1024   # the default model's vocabulary
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived",
]


def _prompts_text(prompts):
    return "".join(" ".join(map(str, p)) + "\n" for p in prompts)


def _parse_output(stdout, n_prompts):
    """'i j: ids...' lines -> [prompt][sample] token lists."""
    results = [[] for _ in range(n_prompts)]
    for line in stdout.splitlines():
        key, ids = line.split(":")
        i, j = map(int, key.split())
        assert j == len(results[i]), f"sample lines out of order: {line!r}"
        results[i].append([int(t) for t in ids.split()])
    return results


@pytest.fixture(scope="module")
def pte(default_pte):
    return default_pte  # CELLS cells, STEP tokens per step (conftest.py)


@pytest.fixture
def run(runner_exe, tmp_path):
    """run(prompts or file text, *flags, model=...) -> CompletedProcess."""

    def _run(prompts, *flags, model=None):
        text = prompts if isinstance(prompts, str) else _prompts_text(prompts)
        prompts_file = tmp_path / "prompts.txt"
        prompts_file.write_text(text)
        args = [runner_exe]
        if model is not None:
            args += ["--model", str(model)]
        args += ["--prompts", str(prompts_file), *flags]
        return subprocess.run(args, capture_output=True, text=True, timeout=300)

    return _run


def _generate(run, pte, prompts, max_new_tokens, n, *flags):
    out = run(prompts, "--n", str(n), "--max-new-tokens", str(max_new_tokens), *flags,
              model=pte)
    assert out.returncode == 0, out.stderr
    return _parse_output(out.stdout, len(prompts)), out.stderr


# ---------------------------------------------------------------- equal to Python


def test_greedy_equals_python_runner_token_for_token(run, pte):
    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    prompts = [tok.encode(t) for t in TEXTS]
    assert all(p[0] == BOS for p in prompts)
    expected = ecc.Runner(pte).generate(prompts, 16, n=2)
    got, _ = _generate(run, pte, prompts, 16, 2)
    assert got == expected


@pytest.fixture(scope="module")
def int8_pte(default_int8_kv_pte):
    """The default model with int8 K/V (issue 24): conftest's, 512 cells."""
    return default_int8_kv_pte


def test_an_int8_kv_program_runs_with_no_flag_and_equals_python(run, runner_exe, int8_pte):
    """The runner reads kv_dtype "int8" from the metadata: greedy samples
    equal Python's token for token, with and without the prefix cache; in
    Python a later request served from a cached int8 prefix equals a cold run."""
    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    prompts = [tok.encode(t) for t in TEXTS]
    python = ecc.Runner(int8_pte)
    expected = python.generate(prompts, 12, n=2)
    got, _ = _generate(run, int8_pte, prompts, 12, 2)
    assert got == expected
    cold_runner = ecc.Runner(int8_pte, prefix_cache=False)
    cold, _ = _generate(run, int8_pte, prompts, 12, 2, "--no-prefix-cache")
    assert cold == cold_runner.generate(prompts, 12, n=2) == expected
    longer = [prompts[1] + [5, 6, 7]]
    assert python.generate(longer, 12, n=2) == cold_runner.generate(longer, 12, n=2)
    assert python.last_stats.cached_tokens[0] >= len(prompts[1]) - 1
    info = json.loads(subprocess.run([runner_exe, "--model", str(int8_pte), "--print-info"],
                                     capture_output=True, text=True, timeout=60).stdout)
    assert info["kv_dtype"] == "int8"


def test_greedy_equals_python_when_admission_waits_and_decode_round_robins(run, pte):
    # Worst cases (len + 6 * 11 cells) sum past 512 cells, so some prompts wait;
    # 36 running samples exceed the 32-token step, so decode tokens round-robin;
    # prompts of 40-80 tokens are prefilled in chunks sharing steps with decoding.
    rng = random.Random(0)
    prompts = [[BOS] + [rng.randrange(2, VOCAB) for _ in range(n - 1)]
               for n in (5, 80, 3, 40, 7, 60)]
    runner = ecc.Runner(pte)
    expected = runner.generate(prompts, 12, n=6)
    got, stderr = _generate(run, pte, prompts, 12, 6)
    assert got == expected
    assert f"{runner.last_stats.steps} steps" in stderr
    assert f"peak cells {runner.last_stats.peak_cells} of {CELLS}" in stderr


def test_a_prompt_longer_than_a_step_alone_equals_python(run, pte):
    # Its first chunks end no prompt, so those forwards consume no logits.
    prompt = [BOS] + [65 + i % 26 for i in range(99)]
    expected = ecc.Runner(pte).generate([prompt], 5)
    got, _ = _generate(run, pte, [prompt], 5, 1)
    assert got == expected


def test_summary_line_reports_throughput_and_peak_cells(run, pte):
    _, stderr = _generate(run, pte, [[BOS, 72, 105]], 4, 2)
    (line,) = stderr.splitlines()
    assert line.startswith("prefill 3 tokens at ") and ", decode 6 tokens at " in line
    assert line.endswith(f" of {CELLS}")


def test_blank_lines_are_skipped_and_do_not_count_as_prompts(run, pte):
    plain = run("0 72\n0 79\n", "--max-new-tokens", "3", model=pte)
    spaced = run("\n0 72\n   \n0 79\n\n", "--max-new-tokens", "3", model=pte)
    assert plain.returncode == spaced.returncode == 0
    assert spaced.stdout == plain.stdout
    assert [line.split(":")[0] for line in plain.stdout.splitlines()] == ["0 0", "1 0"]


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(run, pte):
    prompts = [[BOS, 72, 105], [BOS, 79, 107]]
    flags = ("--temperature", "1.0", "--no-stop-on-eos")
    first, _ = _generate(run, pte, prompts, 8, 3, *flags, "--seed", "7")
    again, _ = _generate(run, pte, prompts, 8, 3, *flags, "--seed", "7")
    other, _ = _generate(run, pte, prompts, 8, 3, *flags, "--seed", "8")
    assert first == again
    assert first != other
    assert all(len(s) == 3 for s in first)
    assert len({tuple(s) for s in first[0]}) > 1, "samples of one prompt must differ"
    # A sample's generator is (seed, sample index): a prompt samples the same
    # tokens at any index and beside any other prompts.
    swapped, _ = _generate(run, pte, prompts[::-1] + [[BOS, 65]], 8, 3, *flags, "--seed", "7")
    assert swapped[:2] == first[::-1]


# ---------------------------------------------------------------- bad input


def _write_add_one_program(path, constant_methods=None):
    """A valid .pte of a trivial nn.Module, with the given constant methods."""
    import torch
    from executorch.exir import to_edge

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    exported = torch.export.export(AddOne(), (torch.ones(2),))
    path.write_bytes(to_edge(exported, constant_methods=constant_methods).to_executorch().buffer)
    return path


@pytest.fixture(scope="module")
def trivial_pte(tmp_path_factory):
    """No cell-cache metadata at all."""
    return _write_add_one_program(tmp_path_factory.mktemp("trivial") / "add_one.pte")


def _assert_user_error(out, *fragments):
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("cellcache_runner: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    for crash in ("Abort", "Segmentation", "terminate called", "core dumped"):
        assert crash not in out.stderr
    assert out.stdout == ""


def test_missing_model_file_is_a_user_error(run, tmp_path):
    _assert_user_error(run([[BOS, 1]], model=tmp_path / "nope.pte"), "does not exist")


def test_missing_prompts_file_is_a_user_error(runner_exe, pte, tmp_path):
    out = subprocess.run([runner_exe, "--model", str(pte), "--prompts",
                          str(tmp_path / "nope.txt")], capture_output=True, text=True)
    _assert_user_error(out, "prompts file", "does not exist")


def test_a_folder_as_model_is_a_user_error(run, tmp_path):
    _assert_user_error(run([[BOS, 1]], model=tmp_path), "is a folder")


def test_a_file_that_is_not_a_program_is_a_user_error(run, tmp_path, pte):
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program at all")
    _assert_user_error(run([[BOS, 1]], model=junk), "not a loadable ExecuTorch program")
    truncated = tmp_path / "truncated.pte"
    truncated.write_bytes(pte.read_bytes()[:4096])
    _assert_user_error(run([[BOS, 1]], model=truncated), "not a loadable ExecuTorch program")


def test_a_program_without_cell_cache_metadata_is_a_user_error(run, trivial_pte):
    _assert_user_error(run([[BOS, 1]], model=trivial_pte), "has no cell-cache metadata")


@pytest.mark.parametrize("metadata, fragment", [
    ({"cellcache_format": 2}, "cell-cache format 2 is not supported (expects 1)"),
    ({"cellcache_format": 1}, "cannot run the metadata method 'n_cells'"),
    ({"cellcache_format": 1, "n_cells": 0}, "metadata n_cells = 0 is out of range"),
])
def test_bad_cell_cache_metadata_is_a_user_error(run, tmp_path, metadata, fragment):
    path = _write_add_one_program(tmp_path / "bad_metadata.pte", metadata)
    _assert_user_error(run([[BOS, 1]], model=path), fragment)


def test_an_unsupported_kv_dtype_is_a_user_error(run, tmp_path):
    from executorch_cellcache.cache import metadata

    info = metadata.ProgramInfo(
        n_cells=16, n_layers=1, windows=[None], vocab_size=300, bos_id=None, eos_ids=[],
        max_tokens_per_step=4, model_type="toy", model_name="toy",
        tokenizer_kind=metadata.TOKENIZER_NONE, tokenizer_json=None, kv_dtype="bf16")
    path = _write_add_one_program(tmp_path / "bf16.pte", metadata.constant_methods(info))
    _assert_user_error(run([[256, 1]], model=path),
                       "K/V dtype 'bf16' is not supported by this runner (supported: fp32, "
                       "fp16, int8)")


@pytest.mark.parametrize("text, fragment", [
    ("0 72 x\n", "line 1: 'x' is not an integer token id"),
    ("0 72\n1.5 3\n", "line 2: '1.5' is not an integer token id"),
    ("0 99999999999999999999999\n", "is not an integer token id"),
    ("\n  \n", "holds no prompt"),
])
def test_a_malformed_prompts_file_is_a_user_error(run, pte, text, fragment):
    _assert_user_error(run(text, model=pte), fragment)


@pytest.mark.parametrize("token", [VOCAB, 100000, -1])
def test_a_token_outside_the_vocabulary_is_a_user_error(run, pte, token):
    out = run(f"0 72\n0 {token} 3\n", model=pte)
    _assert_user_error(out, f"prompt 1 has token id {token} outside the vocabulary "
                            f"[0, {VOCAB})")


def test_a_prompt_the_cache_can_never_hold_is_a_user_error(run, pte):
    out = run([[BOS] + [65] * CELLS], "--max-new-tokens", "4", model=pte)
    _assert_user_error(out, f"prompt 0's prompt alone is {CELLS + 1} tokens",
                       f"the cache has {CELLS} cells; shorten it")


def test_samples_that_can_never_fit_are_a_user_error(run, pte):
    out = run([[BOS, 65]], "--n", "8", "--max-new-tokens", "100", model=pte)
    _assert_user_error(out, "n=8 samples x 99 generated tokens fed back")


@pytest.mark.parametrize("flags, fragment", [
    (["--n", "0"], "--n expects a positive integer, got '0'"),
    (["--n", "two"], "--n expects a positive integer"),
    (["--max-new-tokens", "-3"], "--max-new-tokens expects a positive integer"),
    (["--temperature", "-1"], "--temperature expects a number >= 0"),
    (["--temperature", "nan"], "--temperature expects a number >= 0"),
    (["--seed", "x"], "--seed expects a non-negative integer"),
    (["--n"], "--n expects a value"),
    (["--bogus"], "unknown option '--bogus'"),
    (["--n", "300", "--max-new-tokens", "1"], "exceed the 256 sequence ids"),
])
def test_bad_option_values_are_user_errors(run, pte, flags, fragment):
    _assert_user_error(run([[BOS, 72]], *flags, model=pte), fragment)


def test_a_missing_model_option_is_a_user_error(run):
    _assert_user_error(run([[BOS, 72]]), "--model M.pte is required")


def test_help_prints_usage(runner_exe):
    out = subprocess.run([runner_exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.startswith("usage: cellcache_runner --model M.pte --prompts FILE")


# ---------------------------------------------------------------- speculative decoding

COPY_TEXTS = [  # text that repeats itself, so prompt lookup has something to propose
    "The cat sat on the mat. The cat sat on the mat. The cat sat",
    "Once upon a time there was a little girl named Lily. Once upon a time there was",
    "one two three four five, one two three four five, one two",
]


def _speculation(stderr):
    """(proposed, accepted, tokens per forward) from the summary line."""
    m = re.search(r"speculative \((\w+), up to (\d+) a step\): proposed (\d+) tokens, "
                  r"accepted (\d+) \(\d+%\), ([\d.]+) tokens per forward", stderr)
    assert m, stderr
    return int(m.group(3)), int(m.group(4)), float(m.group(5))


def test_speculative_decoding_gives_plain_greedy_tokens_and_pythons_counts(run, pte):
    """Prompt lookup and a draft model (the program itself as its own draft)
    change no greedy token, here or in the Python runtime; proposed and
    accepted counts equal the Python Runner's, step rules being the same."""
    from spec.speculative import Speculative

    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    prompts = [tok.encode(t) for t in COPY_TEXTS + TEXTS[:2]]
    runner = ecc.Runner(pte)
    plain, _ = _generate(run, pte, prompts, 24, 2)
    assert plain == runner.generate(prompts, 24, n=2)
    for spec, flags in [
            (Speculative("lookup", max_draft=6, min_ngram=1),
             ["--speculative", "lookup", "--draft-max", "6", "--lookup-min-ngram", "1"]),
            (Speculative("lookup", max_draft=3, min_ngram=1, max_ngram=2),
             ["--speculative", "lookup", "--draft-max", "3", "--lookup-min-ngram", "1",
              "--lookup-max-ngram", "2"]),
            (Speculative("draft", max_draft=4, draft_model=str(pte)),
             ["--speculative", "draft", "--draft-model", str(pte), "--draft-max", "4"])]:
        runner.clear()
        assert runner.generate(prompts, 24, n=2, speculative=spec) == plain
        got, stderr = _generate(run, pte, prompts, 24, 2, *flags)
        assert got == plain, flags
        proposed, accepted, per_forward = _speculation(stderr)
        assert f"(lookup, up to {spec.max_draft} a step)" in stderr or \
            f"(draft, up to {spec.max_draft} a step)" in stderr
        stats = runner.last_stats
        assert (proposed, accepted) == (stats.proposed_tokens, stats.accepted_tokens), flags
        assert proposed > 0 and f"{stats.tokens_per_forward:.2f} tokens per forward" in stderr
        if spec.method == "draft":  # its own draft: every proposal accepted
            assert accepted == proposed and per_forward > 2


def test_speculative_sampling_with_lookup_keeps_the_seeded_tokens(run, pte):
    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    prompts = [tok.encode(t) for t in COPY_TEXTS]
    flags = ("--temperature", "0.7", "--seed", "5")
    plain, _ = _generate(run, pte, prompts, 20, 2, *flags)
    got, stderr = _generate(run, pte, prompts, 20, 2, *flags, "--speculative", "lookup",
                            "--lookup-min-ngram", "1")
    assert got == plain
    assert _speculation(stderr)[0] > 0


@pytest.mark.parametrize("flags, fragment", [
    (["--speculative", "ngram"], "speculative method must be one of lookup, draft, got 'ngram'"),
    (["--draft-max", "3"], "--draft-max sets up speculative decoding; give --speculative"),
    (["--speculative", "lookup", "--draft-max", "32"],
     "max_draft (--draft-max, tokens proposed per step) must be an integer in [1, 31] (the "
     "program's max_tokens_per_step 32 minus the decode token), got 32"),
    (["--speculative", "lookup", "--draft-max", "0"], "--draft-max expects a positive integer"),
    (["--speculative", "lookup", "--lookup-min-ngram", "4"],
     "min_ngram (4) must not exceed max_ngram (3)"),
    (["--speculative", "draft"], "speculative method 'draft' needs a draft model (--draft-model"),
    (["--speculative", "lookup", "--draft-model", "d.pte"],
     "a draft model is used by speculative method 'draft', not 'lookup'"),
    (["--speculative", "draft", "--draft-model", "/nonexistent/d.pte"],
     "draft model: model file '/nonexistent/d.pte' does not exist"),
])
def test_bad_speculative_options_are_user_errors(run, pte, flags, fragment):
    _assert_user_error(run([[BOS, 72]], *flags, model=pte), fragment)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_a_user_error(run, pte, tmp_path,
                                                                     trivial_pte):
    from executorch_cellcache.cache import metadata

    small = _write_cell_cache_shaped_program(tmp_path / "small.pte",
                                             metadata.constant_methods(_toy_info()))
    other = _write_cell_cache_shaped_program(
        tmp_path / "other.pte", metadata.constant_methods(_toy_info(vocab_size=VOCAB)))
    for draft, fragments in [
            (small, [f"the draft model {small} has a vocabulary of 300 tokens, the target "
                     f"{VOCAB}: speculative decoding needs the same vocabulary"]),
            (other, [f"the draft model {other} embeds another tokenizer than the target"]),
            (trivial_pte, ["draft model: ", "has no cell-cache metadata"])]:
        out = run([[BOS, 72]], "--speculative", "draft", "--draft-model", str(draft), model=pte)
        _assert_user_error(out, *fragments)


def test_speculation_on_a_program_without_room_for_a_proposal_is_a_user_error(run, tmp_path):
    from executorch_cellcache.cache import metadata

    path = _write_cell_cache_shaped_program(
        tmp_path / "one.pte", metadata.constant_methods(_toy_info(max_tokens_per_step=1)))
    _assert_user_error(run([[1, 2]], "--speculative", "lookup", model=path),
                       "needs a program whose max_tokens_per_step holds a decode token and a "
                       "proposal (>= 2); this one's is 1")


# ---------------------------------------------------------------- --print-info


def _print_info(runner_exe, model):
    out = subprocess.run([runner_exe, "--model", str(model), "--print-info"],
                         capture_output=True, text=True, encoding="utf-8", timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _python_info(path):
    from executorch.runtime import Runtime

    from executorch_cellcache.cache import metadata

    return metadata.read(Runtime.get().load_program(str(path)))


def test_print_info_gives_the_tokenizer_python_reads(runner_exe, pte):
    """An app builds its tokenizer from the .pte alone: C++ reads the same
    tokenizer.json (and chat template) Python reads, which is the checkpoint's."""
    got = _print_info(runner_exe, pte)
    info = _python_info(pte)
    assert got["tokenizer_kind"] == "hf" == info.tokenizer_kind
    assert got["tokenizer_json"] == info.tokenizer_json
    assert got["tokenizer_json"] == (CHECKPOINT / "tokenizer.json").read_text(encoding="utf-8")
    assert got["chat_template"] == (info.chat_template or "")
    assert (got["n_cells"], got["max_tokens_per_step"], got["vocab_size"], got["bos_id"]) == \
        (CELLS, STEP, VOCAB, BOS)
    assert got["eos_ids"] == info.eos_ids and got["windows"] == info.windows
    assert (got["model_type"], got["model_name"]) == (info.model_type, info.model_name)
    assert (got["kv_dtype"], got["quantize"], got["group_size"], got["embedding_quantize"]) == \
        ("fp32", "", 0, "")


def _write_cell_cache_shaped_program(path, constant_methods):
    """A .pte whose forward takes the 5 cell-cache inputs (and computes nothing
    useful), with the given constant methods: loadable by the C++ runner."""
    import torch
    from executorch.exir import to_edge

    class Inputs5(torch.nn.Module):
        def forward(self, tokens, positions, logits_for, handle, extent):
            return tokens.float()[None]

    examples = tuple(torch.zeros(2, dtype=torch.int64) for _ in range(5))
    exported = torch.export.export(Inputs5(), examples)
    path.write_bytes(to_edge(exported, constant_methods=constant_methods).to_executorch().buffer)
    return path


def _toy_info(**kw):
    from executorch_cellcache.cache import metadata

    fields = dict(n_cells=16, n_layers=2, windows=[None, 8], vocab_size=300, bos_id=None,
                  eos_ids=[7, 9], max_tokens_per_step=4, model_type="toy", model_name="tøy",
                  tokenizer_kind=metadata.TOKENIZER_HF,
                  tokenizer_json='{"model": {"vocab": {"\u00e9": 0, "\\"q\\"": 1}}}\n',
                  chat_template='{{ "ü ✓" }}\t\x01 \\ "quoted"\r\n', kv_dtype="fp16",
                  quantize="8da4w", group_size=32, embedding_quantize="4,32",
                  window_cells={8: 12}, retained_margin=2, attention="cells")
    fields.update(kw)
    return metadata.ProgramInfo(**fields)


def test_print_info_carries_every_text_exactly(runner_exe, tmp_path):
    """Non-ASCII, quotes, backslashes and control characters survive the
    uint8 tensor and the JSON escaping; every field equals Python's reading."""
    from executorch_cellcache.cache import metadata

    info = _toy_info()
    path = _write_cell_cache_shaped_program(tmp_path / "toy.pte", metadata.constant_methods(info))
    got = _print_info(runner_exe, path)
    assert _python_info(path) == info
    assert got == {
        "n_cells": 16, "n_layers": 2, "windows": [None, 8], "vocab_size": 300, "bos_id": None,
        "eos_ids": [7, 9], "max_tokens_per_step": 4, "window_cells": {"8": 12},
        "retained_margin": 2, "kv_dtype": "fp16", "attention": "cells", "quantize": "8da4w",
        "group_size": 32, "embedding_quantize": "4,32", "model_type": "toy",
        "model_name": "tøy", "tokenizer_kind": "hf", "tokenizer_json": info.tokenizer_json,
        "chat_template": info.chat_template}


def test_print_info_of_an_older_program_reads_the_declared_defaults(runner_exe, tmp_path):
    """A program written before the optional methods (ops/program_metadata.yaml
    gives their defaults) loads in both readers with the same values."""
    from executorch_cellcache.cache import metadata

    methods = metadata.constant_methods(_toy_info())
    for name in metadata.OPTIONAL:
        del methods[name]
    path = _write_cell_cache_shaped_program(tmp_path / "old.pte", methods)
    got = _print_info(runner_exe, path)
    info = _python_info(path)
    assert (got["chat_template"], got["kv_dtype"], got["quantize"], got["group_size"],
            got["embedding_quantize"], got["window_cells"], got["retained_margin"],
            got["attention"]) == ("", "fp32", "", 0, "", None, 32, "reference")
    assert (info.chat_template, info.kv_dtype, info.quantize, info.group_size,
            info.embedding_quantize, info.attention) == (None, "fp32", None, 0, None, "reference")
    assert got["tokenizer_json"] == info.tokenizer_json


@pytest.mark.parametrize("pairs, fragments", [
    ([8], ["metadata window_cells must hold (window, cells) pairs of positive integers, got [8]"]),
    ([8, 0], ["got [8, 0]"]),
    ([4, 12], ["window_cells for window 4: no layer has that window"]),
    ([8, 10], ["window_cells for window 8 must lie in [11, ", "got 10"]),
    ([8, 12, "reference"], ["a program with a cell pool per window policy needs the 'cells' "
                            "attention path, this one names 'reference'; re-export it"]),
])
def test_a_program_whose_pools_do_not_fit_its_layers_is_refused_by_name(runner_exe, tmp_path,
                                                                        pairs, fragments):
    """window_cells (issue #25) that are not (window, cells) pairs, name a window no
    layer has, or size a pool below W + retained_margin + 1, or pools with the
    dense-mask attention path (it reads one pool): one error line."""
    from executorch_cellcache.cache import metadata

    attention = "cells"
    if isinstance(pairs[-1], str):
        pairs, attention = pairs[:-1], pairs[-1]
    methods = metadata.constant_methods(_toy_info(attention=attention))
    methods["window_cells"] = pairs
    path = _write_cell_cache_shaped_program(tmp_path / "pools.pte", methods)
    out = subprocess.run([runner_exe, "--model", str(path), "--print-info"],
                         capture_output=True, text=True)
    _assert_user_error(out, *fragments)


@pytest.mark.parametrize("flag", [["--n", "2"], ["--speculative", "lookup"]])
def test_print_info_takes_only_the_model(runner_exe, pte, flag):
    out = subprocess.run([runner_exe, "--model", str(pte), "--print-info", *flag],
                         capture_output=True, text=True)
    _assert_user_error(out, "--print-info takes only --model")


# ---------------------------------------------------------------- CLI


def test_runner_path_prints_an_existing_executable(runner_exe):
    path = Path(runner_exe)
    assert path.is_absolute()
    assert path.is_file() and os.access(path, os.X_OK)
    assert path.name == "cellcache_runner"


def test_runner_path_without_a_built_runner_exits_2_with_a_clear_message(
        monkeypatch, tmp_path, capsys):
    from executorch_cellcache import cli
    from executorch_cellcache.cli import paths

    package = tmp_path / "executorch_cellcache"
    package.mkdir()
    monkeypatch.setattr(paths, "__file__", str(package / "cli" / "paths.py"))
    assert cli.main(["runner-path"]) == 2
    err = capsys.readouterr().err
    assert "cellcache runner-path: error: the C++ runner cellcache_runner was not built" in err
    assert len(err.splitlines()) == 1
