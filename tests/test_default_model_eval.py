"""The trained default model exported (SPEC section 3's oracle on a model with
structure in its weights) and ``cellcache eval``: held-out perplexity through
the .pte equals transformers eager's within 0.1%, quantized it stays within
issue #10's targets of fp32 (8da4w +5%, 8da8w +1%), greedy text equals
transformers' token for token and reads like the corpus, and bad eval input
ends in one error line.

Programs: the default model as conftest's ``default_pte`` (512 cells, 32 tokens
a step, exported once per run), the runner tests' tiny seeded Llama
(``roomy_pte``) for the no-tokenizer cases, and once per (weights, K/V dtype)
the default model 8da4w and 8da8w with an int8 embedding (shared by the
quality and int8 K/V tests).
"""

import math
import re

import pytest
import torch

import executorch_cellcache as ecc
from executorch_cellcache import InvalidConfigError
from executorch_cellcache.cli import main
from executorch_cellcache.exporting import default_model
from executorch_cellcache.runtime import runner as runner_module
from executorch_cellcache.runtime.tokenizer import HFTokenizer

from conftest import DEFAULT_CELLS as CELLS, DEFAULT_STEP as STEP  # default_pte's

pytestmark = pytest.mark.slow

WINDOW, STRIDE = 256, 128
PROMPT = "The for statement is used to"


@pytest.fixture(scope="module")
def eager():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model.CHECKPOINT, local_files_only=True,
                                                 dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model.CHECKPOINT, local_files_only=True)


@pytest.fixture(scope="module")
def pte(default_pte):
    return default_pte


@pytest.fixture(scope="module")
def runner(pte):
    return ecc.Runner(pte)


def _eager_perplexity(model, ids, window, stride):
    """The Hugging Face fixed-length recipe, written from its description:
    labels -100 outside each window's new tokens, summed cross entropy.
    Windows of equal length run as one batch."""
    ids = torch.tensor(ids)
    windows, labels, prev_end = [], [], 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target = ids[begin:end].clone()
        target[:len(target) - (end - prev_end)] = -100
        windows.append(ids[begin:end])
        labels.append(target)
        prev_end = end
        if end == len(ids):
            break
    nll_sum, n_scored = 0.0, 0
    for length in sorted({len(w) for w in windows}):
        batch = torch.stack([w for w in windows if len(w) == length])
        target = torch.stack([t for t in labels if len(t) == length])
        with torch.no_grad():
            logits = model(batch).logits.double()  # [n_windows, length, vocab]
        nll_sum += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1),
            ignore_index=-100, reduction="sum").item()
        n_scored += int((target[:, 1:] != -100).sum())
    return math.exp(nll_sum / n_scored), n_scored


@pytest.fixture(scope="module")
def heldout_through_pte(runner):
    return ecc.evaluate(runner, default_model.heldout_text(), window=WINDOW, stride=STRIDE)


def test_heldout_perplexity_of_the_pte_equals_transformers_within_0_1_percent(
        runner, eager, hf_tokenizer, heldout_through_pte):
    ids = hf_tokenizer(default_model.heldout_text()).input_ids
    expected, n_scored = _eager_perplexity(eager, ids, WINDOW, STRIDE)
    got = heldout_through_pte
    assert got.tokens == n_scored == len(ids) - 1
    assert abs(got.perplexity / expected - 1) < 1e-3, (got.perplexity, expected)
    # A trained model, far below the 1024-token vocabulary's uniform perplexity.
    assert expected < 100, expected
    assert runner.cache.free_cells == CELLS  # every window's sequence was freed


def test_perplexity_without_overlap_matches_too(runner, eager, hf_tokenizer):
    ids = hf_tokenizer(default_model.heldout_text()[:3000]).input_ids
    expected, n_scored = _eager_perplexity(eager, ids, 100, 100)
    got = ecc.evaluate(runner, ids, window=100, stride=100)
    assert got.tokens == n_scored
    assert abs(got.perplexity / expected - 1) < 1e-3


def test_a_text_shorter_than_the_window_is_one_window(runner, eager, hf_tokenizer):
    ids = hf_tokenizer(default_model.heldout_text()[:200]).input_ids
    assert len(ids) < STRIDE
    expected, n_scored = _eager_perplexity(eager, ids, len(ids), len(ids))
    got = ecc.evaluate(runner, ids, window=WINDOW, stride=STRIDE)
    assert (got.tokens, got.window, got.stride) == (n_scored, len(ids), len(ids))
    assert abs(got.perplexity / expected - 1) < 1e-3


# Issue #10's quality targets (the default model is fine-tuned quantization-aware
# for 8da4w by scripts/train_default_model.py): held-out perplexity through the
# quantized .pte against transformers' fp32 on the same windows.
QUALITY_TARGETS = {"8da4w": 0.05, "8da8w": 0.01}


@pytest.fixture(scope="module")
def quantized_pte(tmp_path_factory, request):
    """(mode, kv_dtype) -> the default model exported with those weights (and an
    int8 embedding when quantized) and K/V, once per module: the quality test and
    the int8 K/V test share the 8da4w / fp32 K/V program; fp32 weights with int8
    K/V are conftest's default_int8_kv_pte (made once per run)."""
    made = {}

    def get(mode, kv_dtype):
        if (mode, kv_dtype) == (None, "int8"):
            return request.getfixturevalue("default_int8_kv_pte")
        if (mode, kv_dtype) not in made:
            path = tmp_path_factory.mktemp("quantized") / f"default-{mode}-{kv_dtype}.pte"
            ecc.export(None, path, n_cells=CELLS, max_tokens_per_step=STEP, quantize=mode,
                       embedding_quantize="8" if mode else None, kv_dtype=kv_dtype)
            made[mode, kv_dtype] = path
        return made[mode, kv_dtype]
    return get


@pytest.mark.parametrize("mode", list(QUALITY_TARGETS))
def test_quantized_heldout_perplexity_is_within_its_target_of_fp32(
        mode, eager, hf_tokenizer, quantized_pte):
    path = quantized_pte(mode, "fp32")
    ids = hf_tokenizer(default_model.heldout_text()).input_ids
    fp32, n_scored = _eager_perplexity(eager, ids, WINDOW, STRIDE)
    got = ecc.evaluate(path, ids, window=WINDOW, stride=STRIDE)
    assert got.tokens == n_scored
    increase = got.perplexity / fp32 - 1
    assert increase < QUALITY_TARGETS[mode], (mode, got.perplexity, fp32)
    # and the program is quantized at all: int8/int4 rounding moves every window
    assert got.perplexity != pytest.approx(fp32, rel=1e-4), (mode, got.perplexity, fp32)


# int8 K/V (issue 24): held-out perplexity through the .pte with int8 K/V
# against the same weights with fp32 K/V, target +0.5%. Measured 2026-12-02
# (windows 256, stride 128): fp32 weights 5.2677 vs 5.2704 (-0.051%), 8da4w
# 4.4429 vs 4.4390 (+0.087%), 8da8w 5.1553 vs 5.1525 (+0.053%; not repeated
# here: each quantized pair of exports takes ~4 minutes); 2026-12-03, 8da4w with
# the int8 embedding: 4.4344 vs 4.4395 (-0.115%). The bound is the
# issue's target, ~6x the largest measured change; the change must also be
# nonzero (the program stores int8 at all).
INT8_KV_TARGET = 0.005


@pytest.mark.parametrize("mode", [None, "8da4w"])
def test_int8_kv_heldout_perplexity_is_within_half_a_percent_of_fp32_kv(
        mode, heldout_through_pte, quantized_pte):
    def perplexity(kv_dtype):
        path = quantized_pte(mode, kv_dtype)
        assert ecc.Runner(path).info.kv_dtype == kv_dtype
        return ecc.evaluate(path, default_model.heldout_text(), window=WINDOW, stride=STRIDE)

    fp32 = heldout_through_pte if mode is None else perplexity("fp32")
    int8 = perplexity("int8")
    assert int8.tokens == fp32.tokens
    change = int8.perplexity / fp32.perplexity - 1
    print(f"\n[int8 K/V] weights {mode or 'fp32'}: perplexity {int8.perplexity:.4f} vs "
          f"{fp32.perplexity:.4f} with fp32 K/V ({100 * change:+.3f}%)")
    assert change < INT8_KV_TARGET, (mode, int8.perplexity, fp32.perplexity)
    assert int8.perplexity != pytest.approx(fp32.perplexity, rel=1e-6)


def test_greedy_text_equals_transformers_token_for_token(runner, eager, hf_tokenizer):
    prompt = hf_tokenizer(PROMPT).input_ids
    [[ours]] = runner.generate([prompt], max_new_tokens=48, stop_on_eos=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(48):
            ids.append(int(eager(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):]
    # Corpus-like: most words of the continuation are words of the training text. The share
    # moves with each retrain (2026-12-03: 15 of 19 and 9 of 14 for two checkpoints); the
    # same architecture with random weights writes 48 letter runs, none a corpus word.
    words = re.findall(r"[A-Za-z]+", hf_tokenizer.decode(ours))
    corpus = set(re.findall(r"[A-Za-z]+", " ".join(default_model.split_documents()[0])))
    assert len(words) >= 10 and sum(w in corpus for w in words) >= 0.5 * len(words), words


def test_samples_with_a_temperature_differ(runner, hf_tokenizer):
    prompt = hf_tokenizer(PROMPT).input_ids
    [samples] = runner.generate([prompt], max_new_tokens=24, n=2, temperature=0.8, seed=1)
    assert samples[0] != samples[1]


# ---------------------------------------------------------------- cellcache eval


def _eval(capsys, *argv):
    try:
        rc = main(["eval", *map(str, argv)])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_eval_without_text_scores_the_heldout_slice(pte, capsys, heldout_through_pte):
    rc, out, err = _eval(capsys, pte, "--window", WINDOW, "--stride", STRIDE)
    assert rc == 0, err
    expected = heldout_through_pte
    assert out == (f"{expected.tokens} tokens scored (window {WINDOW}, stride {STRIDE}): "
                   f"mean NLL {expected.mean_nll:.4f}, perplexity {expected.perplexity:.3f}\n")
    assert "held-out" in err and "evaluating" in err  # the progress bar


def test_cli_eval_of_a_text_file_with_default_window_and_stride(pte, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(default_model.heldout_text()[:2000])
    rc, out, err = _eval(capsys, pte, "--text", text)
    assert rc == 0, err
    window = default_model.TRAINING_CONTEXT  # the default model's default (CELLS allow it)
    expected = ecc.evaluate(pte, text.read_text(), window=window, stride=window // 2)
    assert out.startswith(f"{expected.tokens} tokens scored (window {window}, stride "
                          f"{window // 2}): ")
    assert f"perplexity {expected.perplexity:.3f}" in out


@pytest.fixture(scope="module")
def no_tokenizer_pte(roomy_pte):
    """A program exported from a model object: no tokenizer, not the default model."""
    return roomy_pte


def _check_one_error_line(rc, out, err, pattern):
    assert rc == 2, err
    assert out == "" and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith("cellcache eval: error: "), errors[0]
    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("case", ["missing", "empty", "stride-over-window", "window-over-cells",
                                  "no-text-on-another-model", "no-tokenizer", "not-utf8"])
def test_cli_eval_bad_input_is_one_error_line(case, pte, no_tokenizer_pte, tmp_path, capsys):
    good = tmp_path / "good.txt"
    good.write_text("The while statement is used for repeated execution.")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    argv, pattern = {
        "missing": ([pte, "--text", tmp_path / "nope.txt"], "text file .*nope.txt does not exist"),
        "empty": ([pte, "--text", empty], "text file .*empty.txt is empty"),
        "stride-over-window": ([pte, "--text", good, "--window", 8, "--stride", 9],
                               "stride 9 is larger than the window 8"),
        "window-over-cells": ([pte, "--text", good, "--window", CELLS + 1],
                              f"window {CELLS + 1} exceeds the program's cache of {CELLS} cells"),
        "no-text-on-another-model": ([no_tokenizer_pte], "no text: pass --text FILE"),
        "no-tokenizer": ([no_tokenizer_pte, "--text", good], rf"{no_tokenizer_pte.name} carries no tokenizer"),
        "not-utf8": ([pte, "--text", binary], "binary.txt is not UTF-8 text"),
    }[case]
    _check_one_error_line(*_eval(capsys, *argv), pattern)


def test_cli_eval_of_a_text_shorter_than_two_tokens(pte, tmp_path, capsys, monkeypatch):
    # The default tokenizer adds BOS, so any non-empty text has >= 2 tokens; a
    # tokenizer without BOS (the same BPE, no post-processor) makes "a" 1 token.
    spec = (default_model.CHECKPOINT / "tokenizer.json").read_text()
    no_bos = re.sub(r'"post_processor": \{.*?\n  \},', '"post_processor": null,', spec,
                    flags=re.S)
    assert len(HFTokenizer(no_bos).encode("a")) == 1
    monkeypatch.setattr(runner_module, "from_metadata", lambda kind, payload: HFTokenizer(no_bos))
    one = tmp_path / "one.txt"
    one.write_text("a")
    _check_one_error_line(*_eval(capsys, pte, "--text", one),
                          r"the text is 1 token\(s\) long; perplexity needs at least 2 tokens")


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(text=[5]), r"1 token\(s\) long"),
    (dict(text=""), "the text is empty"),
    (dict(text=[1, 2, 3], window=1), "window must hold at least 2 tokens"),
    (dict(text=[1, 2, 3], stride=0), "stride must be a positive integer, got 0"),
    (dict(text=[1, 2, 5000]), r"token ids \[5000\] are outside the vocabulary"),
])
def test_evaluate_refuses_bad_arguments(runner, kwargs, pattern):
    # (earlier tests' prefixes may stay cached: a refusal changes nothing)
    free, ids = runner.cache.free_cells, runner.cache.n_sequences
    with pytest.raises(InvalidConfigError, match=pattern):
        ecc.evaluate(runner, **kwargs)
    assert (runner.cache.free_cells, runner.cache.n_sequences) == (free, ids)
