"""`cellcache bench --llama-cpp`: the bench model in GGUF (read back with gguf's
reader: names, shapes, types, values within each format's rounding, q/k rows
in llama.cpp's RoPE order), llama-batched-bench's output parsed (a fake binary
printing what the real one prints), and every bad input one line naming the
binary while the bench goes on with llama.cpp's rows marked missing. No
llama.cpp build needed."""

import json
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from executorch_cellcache import bench  # noqa: E402
from executorch_cellcache.bench import llama_cpp  # noqa: E402
from executorch_cellcache.bench import ours as ours_bench  # noqa: E402
from executorch_cellcache.bench.common import QUICK, ProgramCache, bench_model  # noqa: E402
from executorch_cellcache.bench.llama_cpp import LlamaCppError  # noqa: E402

# What llama-batched-bench (llama.cpp 0c1e570, ggml 0.25.3, from llama_cpp_python 0.3.36) prints
# for --help (an excerpt) and for a run with --output-format jsonl: its log on
# stderr, the rows on stdout.
REAL_HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation
-c,    --ctx-size N                     size of the prompt context (default: 4096, 0 = loaded from model)

----- example-specific params -----

--output-format {md,jsonl}              output format for batched-bench results (default: md)
-pps                                    is the prompt shared across parallel sequences (default: false)
-npp n0,n1,...                          number of prompt tokens
-ntg n0,n1,...                          number of text generation tokens
-npl n0,n1,...                          number of parallel prompts

example usage:

    llama-batched-bench -m model.gguf -c 2048 -b 2048 -ub 512 -npp 128,256,512 -ntg 128,256 -npl 1,2,4,8,16,32 [-pps]
"""
JSONL = ('{{"n_kv_max": 2304, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, '
         '"is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, '
         '"pp": {pp}, "tg": {tg}, "pl": {pl}, "n_kv": {n_kv}, "t_pp": {t_pp:f}, '
         '"speed_pp": {s_pp:f}, "t_tg": {t_tg:f}, "speed_tg": {s_tg:f}, "t": {t:f}, '
         '"speed": {s:f}}}')
MD_HEADER = """
llama_batched_bench: n_kv_max = 2304, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"""
MD_ROW = "|{pp:6d} | {tg:6d} | {pl:4d} | {n_kv:6d} | {t_pp:8.3f} | {s_pp:8.2f} | {t_tg:8.3f} | " \
         "{s_tg:8.2f} | {t:8.3f} | {s:8.2f} |"

# A fake llama-batched-bench: --help as the real one; a run prints one row per
# -npl value with S_PP = 1000 tok/s and S_TG = 40 * B tok/s and records its
# arguments. Modes: "ok", "md" (the markdown table), "sigill", "fail", "silent"
# (exits 0 having printed nothing, as llama.cpp's logger sometimes does) and
# "flaky" (silent on its first run only).
FAKE = r'''#!{python}
import json, os, signal, sys
args = sys.argv[1:]
if "--help" in args:
    print({help!r})
    sys.exit(0)
mode = {mode!r}
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\n")
runs = sum(1 for _ in open({log!r}))
if mode == "silent" or (mode == "flaky" and runs == 1):
    sys.exit(0)
print("llama_model_loader: loaded meta data with 26 key-value pairs", file=sys.stderr)
if mode == "sigill":
    os.kill(os.getpid(), signal.SIGILL)
if mode == "fail":
    print("llama_model_load: error loading model: missing tensor 'output_norm.weight'",
          file=sys.stderr)
    sys.exit(1)
val = lambda flag: args[args.index(flag) + 1]
pp, tg = int(val("-npp")), int(val("-ntg"))
if mode == "md":
    print({md_header!r})
for pl in map(int, val("-npl").split(",")):
    t_pp, t_tg = pl * pp / 1000, tg / 40
    row = dict(pp=pp, tg=tg, pl=pl, n_kv=pl * (pp + tg), t_pp=t_pp, s_pp=1000.0, t_tg=t_tg,
               s_tg=40.0 * pl, t=t_pp + t_tg, s=pl * (pp + tg) / (t_pp + t_tg))
    print(({md_row!r} if mode == "md" else {jsonl!r}).format(**row))
print("llama_perf_context_print:        load time =      81.72 ms", file=sys.stderr)
'''


def fake_binary(tmp_path: Path, mode: str = "ok", name: str = "llama-batched-bench") -> Path:
    path = tmp_path / name
    path.write_text(FAKE.format(python=sys.executable, help=REAL_HELP, mode=mode,
                                log=str(tmp_path / "argv.log"), md_header=MD_HEADER,
                                md_row=MD_ROW, jsonl=JSONL))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def calls(tmp_path: Path):
    return [json.loads(line) for line in (tmp_path / "argv.log").read_text().splitlines()]


@pytest.fixture(scope="module")
def model():
    return bench_model(QUICK)


# ----------------------------------------------------------------------------- GGUF

def _tensors(path: Path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _values(t) -> np.ndarray:
    """A tensor's values as float32 [rows, cols] (numpy order)."""
    shape = [int(n) for n in reversed(t.shape)]
    if t.tensor_type == T.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def _within_rounding(got: np.ndarray, want: np.ndarray, qtype) -> None:
    """Q8_0: round(x / d), d = amax / 127 per 32 weights; Q4_0: d = -max / 8 with
    4-bit codes, so up to d off (the top code clips); d is stored in fp16."""
    if qtype == T.F32:
        np.testing.assert_array_equal(got, want)
        return
    blocks_got, blocks_want = got.reshape(-1, 32), want.reshape(-1, 32)
    amax = np.abs(blocks_want).max(axis=1, keepdims=True)
    step = amax / (127 if qtype == T.Q8_0 else 8)
    bound = (0.5 if qtype == T.Q8_0 else 1.0) * step + amax * 2e-3 + 1e-7
    assert (np.abs(blocks_got - blocks_want) <= bound).all(), qtype
    assert np.abs(blocks_got - blocks_want).mean() < 0.4 * step.mean()  # not just bounded


@pytest.mark.parametrize("quantize,embedding,linear_t,embedding_t", [
    (None, None, T.F32, T.F32), ("8da4w", "8", T.Q4_0, T.Q8_0), ("8da8w", None, T.Q8_0, T.F32)])
def test_gguf_round_trips(tmp_path, model, quantize, embedding, linear_t, embedding_t):
    path = llama_cpp.write_gguf(model, tmp_path / "m.gguf", quantize, embedding)
    cfg = model.config
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == cfg.num_hidden_layers
    assert fields["llama.embedding_length"] == cfg.hidden_size
    assert fields["llama.feed_forward_length"] == cfg.intermediate_size
    assert fields["llama.attention.head_count"] == cfg.num_attention_heads
    assert fields["llama.attention.head_count_kv"] == cfg.num_key_value_heads
    assert fields["llama.rope.dimension_count"] == cfg.hidden_size // cfg.num_attention_heads
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert fields["tokenizer.ggml.model"] == "llama"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.vocab_size and len(set(tokens)) == len(tokens)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 10] == "<0x0A>"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)

    tensors = _tensors(path)
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down"]
    want_names = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.num_hidden_layers) for n in per_layer}
    if quantize:  # a quantized lm_head has its own weight, as in our export
        want_names.add("output.weight")
    assert set(tensors) == want_names
    hf = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for name, t in tensors.items():
        if name.startswith("blk."):
            _, i, short, _ = name.split(".")
            want = sd[f"model.layers.{i}.{hf[short]}.weight"]
        else:
            want = {"token_embd.weight": sd["model.embed_tokens.weight"],
                    "output.weight": sd["model.embed_tokens.weight"],  # tied in the model
                    "output_norm.weight": sd["model.norm.weight"]}[name]
        # GGUF lists ne (innermost first): [in, out] for a [out, in] weight
        assert [int(n) for n in t.shape] == list(reversed(want.shape)), name
        qtype = T.F32 if name.endswith("norm.weight") else \
            embedding_t if name == "token_embd.weight" else linear_t
        assert t.tensor_type == qtype, name
        got = _values(t)
        if name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            assert not np.array_equal(got, want)  # really permuted
            if qtype == T.F32:
                np.testing.assert_array_equal(llama_cpp.unpermute_qk(got, heads), want)
            else:  # blocks of 32 along the rows of the permuted weight
                _within_rounding(got, llama_cpp.permute_qk(want, heads), qtype)
                _within_rounding(llama_cpp.unpermute_qk(got, heads), want, qtype)
            continue
        _within_rounding(got, want, qtype)


def test_permuted_rows_make_llama_cpp_rope_equal_transformers_rope():
    """The fact behind permute_qk: transformers' RoPE rotates (x[i], x[i + d/2]),
    llama.cpp's (normal mode) adjacent pairs (x[2i], x[2i+1]); the same rotation
    of permuted rows is the permuted rotation, so q.k (the attention scores) agree."""
    torch.manual_seed(0)
    heads, d, dim, pos = 3, 8, 12, 5
    w = torch.randn(heads * d, dim)
    x = torch.randn(dim)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos * inv

    def hf_rope(v):  # [heads, d]
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        rot = torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1)
        return v * cos + rot * sin

    def ggml_rope(v):  # adjacent pairs
        a, b = v[..., 0::2], v[..., 1::2]
        out = torch.empty_like(v)
        out[..., 0::2] = a * ang.cos() - b * ang.sin()
        out[..., 1::2] = a * ang.sin() + b * ang.cos()
        return out

    want = hf_rope((w @ x).reshape(heads, d))
    permuted = torch.from_numpy(llama_cpp.permute_qk(w.numpy(), heads))
    got = ggml_rope((permuted @ x).reshape(heads, d))
    back = torch.from_numpy(llama_cpp.unpermute_qk(got.reshape(-1, 1).numpy(), heads))
    torch.testing.assert_close(back.reshape(heads, d), want)
    np.testing.assert_array_equal(
        llama_cpp.unpermute_qk(llama_cpp.permute_qk(w.numpy(), heads), heads), w.numpy())


def test_quantizations_without_a_gguf_counterpart_say_so():
    with pytest.raises(LlamaCppError, match="quantize='int4'"):
        llama_cpp.gguf_types("int4")
    with pytest.raises(LlamaCppError, match="embedding_quantize='2'"):
        llama_cpp.gguf_types(None, "2")
    assert llama_cpp.gguf_types("8da4w", "4,32") == (T.Q4_0, T.Q4_0)


# ----------------------------------------------------------------------------- runs

@pytest.mark.parametrize("mode", ["ok", "md"])
def test_run_parses_the_real_output_formats(tmp_path, mode):
    binary = llama_cpp.check_binary(fake_binary(tmp_path, mode))
    rows = llama_cpp.run_batched_bench(binary, tmp_path / "m.gguf", 128, 16, [1, 8], threads=2)
    assert sorted(rows) == [1, 8]
    assert rows[8].decode_tok_s == pytest.approx(320.0)
    assert rows[1].prompt_tok_s == pytest.approx(1000.0)
    assert rows[8].decode_seconds == pytest.approx(16 / 40, abs=1e-3)
    argv = calls(tmp_path)[-1]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["-npp"] == "128" and flags["-ntg"] == "16" and flags["-npl"] == "1,8"
    assert flags["-t"] == flags["-tb"] == "2"
    assert int(flags["-c"]) >= 8 * (128 + 16)  # room for every sequence
    assert flags["-m"] == str(tmp_path / "m.gguf")


def test_a_run_that_loses_its_output_is_repeated(tmp_path):
    binary = llama_cpp.check_binary(fake_binary(tmp_path, "flaky"))
    rows = llama_cpp.run_batched_bench(binary, tmp_path / "m.gguf", 16, 4, [1, 8], threads=2)
    assert sorted(rows) == [1, 8] and len(calls(tmp_path)) == 2
    binary = llama_cpp.check_binary(fake_binary(tmp_path, "silent", name="silent"))
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.run_batched_bench(binary, tmp_path / "m.gguf", 16, 4, [1, 8], threads=2)
    assert _one_line(e.value) == (f"{binary}: its output has no row for -npp 16 -ntg 4 -npl "
                                  f"1,8 (4 runs): empty")


def test_a_build_directory_finds_its_binary(tmp_path):
    (tmp_path / "bin").mkdir()
    binary = fake_binary(tmp_path / "bin")
    assert llama_cpp.check_binary(tmp_path) == binary.resolve()
    assert llama_cpp.check_binary(tmp_path / "bin") == binary.resolve()


def _one_line(e: LlamaCppError) -> str:
    text = str(e)
    assert "\n" not in text and text
    return text


def test_bad_binaries_are_one_line_naming_them(tmp_path):
    missing = tmp_path / "nowhere" / "llama-batched-bench"
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.check_binary(missing)
    assert _one_line(e.value) == f"{missing}: no such file or directory"
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.check_binary(tmp_path)  # a directory without the binary
    assert "no llama-batched-bench in this directory" in _one_line(e.value)
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.check_binary(plain)
    assert _one_line(e.value) == f"{plain}: not executable"
    for other in [Path("/bin/true"), tmp_path / "other"]:
        if other.name == "other":
            other.write_text("#!/bin/sh\necho 'usage: other [--verbose]'\n")
            other.chmod(0o755)
        with pytest.raises(LlamaCppError) as e:
            llama_cpp.check_binary(other)
        assert _one_line(e.value).startswith(f"{other.resolve()}: not llama.cpp's "
                                             f"llama-batched-bench")


def test_a_run_that_dies_or_fails_is_one_line(tmp_path):
    binary = llama_cpp.check_binary(fake_binary(tmp_path, "sigill"))
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.run_batched_bench(binary, tmp_path / "m.gguf", 16, 4, [1, 8], threads=2)
    assert _one_line(e.value).startswith(f"{binary}: was killed by SIGILL (an instruction "
                                         f"this CPU lacks")
    binary = llama_cpp.check_binary(fake_binary(tmp_path, "fail"))
    with pytest.raises(LlamaCppError) as e:
        llama_cpp.run_batched_bench(binary, tmp_path / "m.gguf", 16, 4, [1, 8], threads=2)
    assert _one_line(e.value) == (f"{binary}: exited with status 1: llama_model_load: error "
                                  f"loading model: missing tensor 'output_norm.weight'")


# ----------------------------------------------------------------------------- the bench

class _FakeCache:
    def clear(self):
        pass


class _FakeOurs:
    """Stands in for our Runner: decode steps and prefill that take no time."""
    cache = _FakeCache()


@pytest.fixture
def fake_ours(monkeypatch):
    monkeypatch.setattr(ours_bench, "batch_steppers",
                        lambda runner, batches, setup, prompt_len: {b: lambda: None
                                                                    for b in batches})
    monkeypatch.setattr(ours_bench, "prefiller", lambda runner, setup: lambda: None)
    return _FakeOurs()


def _llama_cpp_rows(tmp_path, binary, fake_ours, lines):
    r = bench.BenchResult()
    f = bench._llama_cpp_figures(r, binary, fake_ours, QUICK, bench.Quantization(),
                                 ProgramCache(tmp_path / "cache", lambda _: None), lines.append)
    return r, f


def test_the_bench_alternates_ours_and_llama_cpp_and_writes_its_gguf_once(tmp_path, fake_ours):
    binary = llama_cpp.check_binary(fake_binary(tmp_path))
    lines = []
    r, f = _llama_cpp_rows(tmp_path, binary, fake_ours, lines)
    assert f["llama_cpp_decode_tok_s_b1"] == pytest.approx(40.0)
    assert f["llama_cpp_decode_tok_s_b8"] == pytest.approx(320.0)
    assert f["llama_cpp_prefill_tok_s"] == pytest.approx(1000.0)
    for key in ("decode_tok_s_b1", "decode_tok_s_b8", "prefill_tok_s"):
        assert f[f"ours_alongside_llama_cpp_{key}"] > 0
    runs = calls(tmp_path)
    rounds = max(5, QUICK.repeats)
    assert len(runs) == 2 * (1 + rounds)  # decode and prefill each round, one warm-up
    decode = dict(zip(runs[0][::2], runs[0][1::2]))
    prefill = dict(zip(runs[1][::2], runs[1][1::2]))
    assert (decode["-npp"], decode["-npl"]) == (str(QUICK.prompt_len), "1,8")
    assert (prefill["-npp"], prefill["-ntg"], prefill["-npl"]) == (str(QUICK.prefill_len),
                                                                   "1", "1")
    ggufs = list((tmp_path / "cache").glob("*.gguf"))
    assert len(ggufs) == 1 and decode["-m"] == str(ggufs[0])
    assert not r.missing and any(n.startswith("llama.cpp: ") for n in r.notes)
    r.ratios = bench._llama_cpp_ratios(f)
    assert r.ratios["b8_vs_llama_cpp"] == pytest.approx(
        f["ours_alongside_llama_cpp_decode_tok_s_b8"] / 320.0)
    assert set(r.ratios) == {"b1_vs_llama_cpp", "b8_vs_llama_cpp", "prefill_vs_llama_cpp"}
    text = bench.table(r)
    assert "b1_vs_llama_cpp" in text and "missing" not in text
    # A second run reuses the GGUF.
    mtime = ggufs[0].stat().st_mtime_ns
    _llama_cpp_rows(tmp_path, binary, fake_ours, [])
    assert ggufs[0].stat().st_mtime_ns == mtime


@pytest.mark.parametrize("mode", ["sigill", "fail"])
def test_a_failing_llama_cpp_leaves_its_rows_missing_and_the_bench_goes_on(tmp_path, fake_ours,
                                                                         mode):
    binary = llama_cpp.check_binary(fake_binary(tmp_path, mode))
    lines = []
    r, f = _llama_cpp_rows(tmp_path, binary, fake_ours, lines)
    assert f == {}
    missing = [line for line in lines if line.startswith("llama.cpp rows missing: ")]
    assert len(missing) == 1 and str(binary) in missing[0]
    assert set(r.missing) == {"b1_vs_llama_cpp", "b8_vs_llama_cpp", "prefill_vs_llama_cpp"}
    r.ratios = {"b8_over_b1": 5.0}
    text = bench.table(r)
    assert "b1_vs_llama_cpp" in text and "missing" in text
    assert any(n.startswith("llama.cpp rows missing: ") for n in r.notes)


def test_cli_takes_llama_cpp_only_with_the_main_table(capsys):
    from executorch_cellcache import cli

    assert cli.main(["bench", "--long-context", "--llama-cpp", "/nowhere"]) == 2
    assert "--llama-cpp adds rows to the main table" in capsys.readouterr().err
    assert "llama-batched-bench" in cli.build_parser()._subparsers._group_actions[0] \
        .choices["bench"].format_help()


# ----------------------------------------------------------------------------- --model

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import make_model  # noqa: E402

from executorch_cellcache import cli  # noqa: E402
from executorch_cellcache.bench import user_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A seeded 2-layer Llama as a Q4_1 GGUF with a Q8_0 embedding (the layout of
    the packaged SmolLM2 file)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("user-gguf") / "tiny.gguf"
    return llama_cpp.write_gguf(make_model("llama"), path, "8da4w", "8", linear_type=T.Q4_1)


def _spy_export(monkeypatch):
    """Counts exporter.export's calls (and the model each got), exporting for real."""
    from executorch_cellcache.exporting import exporter

    real, models = exporter.export, []

    def spy(model, *args, **kwargs):
        models.append(model)
        return real(model, *args, **kwargs)
    monkeypatch.setattr(exporter, "export", spy)
    return models


@pytest.mark.slow
def test_a_gguf_model_is_exported_once_and_llama_cpp_runs_that_very_file(
        tmp_path, tiny_gguf, monkeypatch, capsys):
    binary = fake_binary(tmp_path)
    cache, out = tmp_path / "cache", tmp_path / "b.json"
    models = _spy_export(monkeypatch)
    argv = ["bench", "--model", str(tiny_gguf), "--quick", "--quantize", "8da4w",
            "--embedding-quantize", "8,32", "--llama-cpp", str(binary), "--cache-dir", str(cache),
            "--json", str(out)]
    assert cli.main(argv) == 0
    table, err = capsys.readouterr()
    assert models == [tiny_gguf]  # exported once, from the checkpoint itself
    runs = calls(tmp_path)
    assert runs and all(run[run.index("-m") + 1] == str(tiny_gguf) for run in runs)
    assert not list((cache / "bench").glob("*.gguf"))  # no GGUF of our own
    data = json.loads(out.read_text())
    for key in ("b8_over_b1", "b1_vs_llama_cpp", "b8_vs_llama_cpp", "prefill_vs_llama_cpp"):
        assert key in table and data[key] > 0, key
    for key in ("ours_decode_tok_s_b1_batch", "ours_decode_tok_s_b8_batch", "ours_prefill_tok_s"):
        assert data["figures"][key] > 0, key
    assert data["figures"]["llama_cpp_decode_tok_s_b8"] == pytest.approx(320.0)
    decode = dict(zip(runs[0][::2], runs[0][1::2]))
    assert (decode["-npp"], decode["-npl"]) == (str(user_model.QUICK_SIZES.prompt_len), "1,8")
    # Only the rows that apply to a user's model, and one line saying what is skipped.
    for key in ("b1_vs_stock", "b1_vs_export_llm", "fork_cells_ratio",
                "long_b8_cells_vs_reference"):
        assert key not in data
    assert sum(n.startswith("--model: only decode") for n in data["notes"]) == 1
    assert any(f"on {tiny_gguf} as stored (tensors Q4_1 x 15, F32 x 5, Q8_0 x 1)" in n
               for n in data["notes"])
    assert "measuring decode at B=1/8 after 16-token prompts" in err

    # A second run reuses the program (keyed by the file's path, mtime and size).
    (tmp_path / "argv.log").unlink()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert models == [tiny_gguf] and "using cached ours program" in err
    assert {run[run.index("-m") + 1] for run in calls(tmp_path)} == {str(tiny_gguf)}

    # The program itself as --model: measured as it is, nothing exported.
    (pte,) = (cache / "bench").glob("ours-*.pte")
    assert cli.main(["bench", "--model", str(pte), "--quick", "--cache-dir", str(cache)]) == 0
    table = capsys.readouterr().out
    assert models == [tiny_gguf] and "b8_over_b1" in table and "ours_export_seconds" not in table


def _refused(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cellcache bench: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def plain_pte(tmp_path_factory):
    """An ExecuTorch program without cell-cache metadata."""
    from executorch.exir import to_edge

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    path = tmp_path_factory.mktemp("plain") / "plain.pte"
    path.write_bytes(to_edge(torch.export.export(Plain(), (torch.ones(3),))).to_executorch()
                     .buffer)
    return path


def test_bad_models_are_one_line_before_any_work(tmp_path, plain_pte, capsys):
    cache = tmp_path / "cache"
    bench_args = ["--quick", "--cache-dir", str(cache)]
    missing = tmp_path / "nowhere"
    assert _refused(["bench", "--model", str(missing), *bench_args], capsys) == (
        f"cellcache bench: error: checkpoint {missing} does not exist (a checkpoint folder, a "
        f".gguf file, a cell-cache .pte or a packaged model: smollm2)")
    assert "no cell-cache metadata" in _refused(["bench", "--model", str(plain_pte),
                                                 *bench_args], capsys)
    text = tmp_path / "notes.pte"
    text.write_text("not a program\n")
    assert "not a loadable ExecuTorch program" in _refused(["bench", "--model", str(text),
                                                            *bench_args], capsys)
    (tmp_path / "empty").mkdir()
    assert "is not a model: --model takes" in _refused(
        ["bench", "--model", str(tmp_path / "empty"), *bench_args], capsys)
    assert "--long-context and --speculative measure the bench's own model" in _refused(
        ["bench", "--model", str(text), "--long-context"], capsys)
    # --llama-cpp needs weights it can run: not a program, not a folder it cannot write.
    binary = fake_binary(tmp_path)
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert "plain Llama checkpoints only, and " f"{qwen} is a 'qwen3' checkpoint: pass a .gguf" \
        in _refused(["bench", "--model", str(qwen), "--llama-cpp", str(binary), *bench_args],
                    capsys)
    assert not cache.exists()  # refused before any export
    assert not (tmp_path / "argv.log").exists()  # llama.cpp never ran


def test_a_pte_with_llama_cpp_or_quantization_is_refused(tmp_path, capsys, monkeypatch):
    """A .pte carries no weights llama.cpp runs, and is measured as exported."""
    from types import SimpleNamespace

    from executorch_cellcache.runtime import runner

    pte = tmp_path / "m.pte"
    pte.write_bytes(b"")
    info = SimpleNamespace(n_cells=2048, quantize=None, embedding_quantize=None)
    monkeypatch.setattr(runner, "Runner", lambda path: SimpleNamespace(info=info, path=path))
    assert f"{pte} is an exported program: pass the checkpoint (a .gguf)" in _refused(
        ["bench", "--model", str(pte), "--llama-cpp", str(fake_binary(tmp_path))], capsys)
    assert "leave them out" in _refused(["bench", "--model", str(pte), "--quantize", "8da4w"],
                                        capsys)
    info.n_cells = 1000  # 8 x 128-token prompts do not fit
    assert "has 1000 cells; the bench needs 1032" in _refused(
        ["bench", "--model", str(pte), "--cache-dir", str(tmp_path)], capsys)


def test_cells_for_one_batch_at_a_time_measure_the_batches_in_turn():
    from types import SimpleNamespace

    sizes = user_model.FULL_SIZES
    fits = lambda n: user_model.check_program(  # noqa: E731
        SimpleNamespace(info=SimpleNamespace(n_cells=n), path="p.pte"), sizes)
    assert fits(9 * 128 + 8) and not fits(9 * 128 + 7) and not fits(1032)


def test_a_llama_folder_is_written_to_gguf_once_for_llama_cpp(tmp_path):
    folder = tmp_path / "llama"
    torch.manual_seed(0)
    make_model("llama").save_pretrained(folder)
    m = user_model.resolve(str(folder))
    assert m.kind == "checkpoint"
    user_model.llama_cpp_refusal(m)  # a plain Llama: accepted
    programs = ProgramCache(tmp_path / "cache", lambda _: None)
    quant = bench.Quantization("8da4w", 32, "8")
    path, what = user_model.gguf_source(m, user_model.QUICK_SIZES, quant, programs)()
    assert path.parent == tmp_path / "cache" and path.suffix == ".gguf"
    assert "weights in GGUF (linear/embedding Q4_0/Q8_0" in what
    assert _tensors(path)["blk.0.attn_q.weight"].tensor_type == T.Q4_0
    mtime = path.stat().st_mtime_ns
    assert user_model.gguf_source(m, user_model.QUICK_SIZES, quant, programs)()[0] == path
    assert path.stat().st_mtime_ns == mtime  # reused
    # An edited checkpoint is another key.
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")
    assert user_model.gguf_source(m, user_model.QUICK_SIZES, quant, programs)()[0] != path
