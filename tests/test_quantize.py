"""Quantized export (SPEC 7): 8da4w / 8da8w weights and quantized embeddings.

Fast tests: bad options and models are refused before tracing, the
quantization rules (group fallback, tied lm_head) on an eager model, and the
metadata of older / unknown programs.

Exporting tests (slow): each architecture of SPEC section 3 is exported
quantized ONCE per module (2 layers each), each with a different option mix:
  llama    8da4w, group 64, embedding "4,32", tied lm_head, intermediate 96
           (its down_proj, 96 inputs, is the per-channel fallback)
  qwen3    8da8w, embedding "8", fp32 K/V; layers [full, sliding]
  mistral  8da4w, group 32, fp32 embedding, min/max scales, int8 K/V; both layers
           sliding
  gemma3   8da4w, group 32, embedding "8"; layers [sliding, full]
The others store K/V in fp16, the default for weight-quantized programs.
The oracle is the same transformers model quantized EAGERLY with torchao
configs written out here (not taken from the code under test): int8
asymmetric per-token dynamic activations, symmetric int4/int8 weights, HQQ
scale-only scales (min/max where the plan says so); weight-only symmetric
embeddings.

Bound (ATOL): eager torchao dequantizes the int8 activations and runs an fp32
matmul; XNNPACK's qd8 kernels choose their own per-token scale and zero
point, round the activations themselves and accumulate in int32, so an
activation can land one int8 step (max|x|/255) away from the eager one. Over
a 64-wide dot product such steps add up to ~1e-2 per linear output; through
the layers and lm_head the measured worst case (2026-12-01, run with -s: the
module prints MAX_ERRORS) was 0.07-0.15 for 8da4w (llama 0.080 with fp32 K/V
and 0.088 with fp16, mistral 0.086 with HQQ scales and 0.115 with min/max,
0.149 with min/max and int8 K/V (2026-12-02), gemma3 0.09-0.136) and 0.04
for 8da8w (qwen3; its prefill matched to 2e-6), on logits of magnitude ~4. ATOL = 0.25 is ~1.7x the worst measured case and
still 4x below the fp32-vs-8da4w difference of the same models (~1.0; 0.42
for 8da8w, test_oracle_is_discriminating), so a program that left a layer
unquantized or read a wrong cell fails. Greedy tokens must agree wherever the
oracle's top two are more than TIE = 2 * ATOL apart.
"""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from model_configs import WINDOW, make_model

from executorch_cellcache import InvalidConfigError, Runner, export
from executorch_cellcache.cache import metadata
from executorch_cellcache.exporting import lowering
from executorch_cellcache.exporting import quantize as q
from executorch_cellcache.graph.model import UnsupportedModelError

N_CELLS = 128
STEP = 32
ATOL = 0.25
TIE = 2 * ATOL
FAST = 1.0   # seconds: refused before any tracing

PLANS = {  # arch -> (model overrides, export options)
    "llama": ({"tie_word_embeddings": True, "intermediate_size": 96},
              {"quantize": "8da4w", "group_size": 64, "embedding_quantize": "4,32"}),
    "qwen3": ({"num_hidden_layers": 2, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]},
              {"quantize": "8da8w", "embedding_quantize": "8", "kv_dtype": "fp32"}),
    "mistral": ({}, {"quantize": "8da4w", "group_size": 32, "weight_scales": "minmax",
                     "kv_dtype": "int8"}),
    "gemma3": ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
               {"quantize": "8da4w", "group_size": 32, "embedding_quantize": "8"}),
}
MAX_ERRORS = {}


def _tokens(n, seed, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------- the eager oracle


def _eager_quantized(model, options):
    """``model`` quantized with torchao the way SPEC 7 says, written out
    independently of executorch_cellcache.exporting.quantize."""
    from torchao.quantization import (Int8DynamicActivationIntxWeightConfig,
                                      IntxWeightOnlyConfig, MappingType, quantize_)
    from torchao.quantization.granularity import PerAxis, PerGroup

    model = copy.deepcopy(model)
    mode, group = options.get("quantize"), options.get("group_size", 32)
    bits = {"8da4w": 4, "8da8w": 8}[mode]
    algorithm = {"minmax": "affine"}.get(options.get("weight_scales"), "hqq_scale_only")
    if mode == "8da8w":
        group = 0

    def linear(granularity):
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=getattr(torch, f"int{bits}"), weight_granularity=granularity,
            weight_mapping_type=MappingType.SYMMETRIC,
            intx_choose_qparams_algorithm=algorithm)

    emb = options.get("embedding_quantize")
    with torch.no_grad():
        if emb:
            e_bits, _, e_group = emb.partition(",")
            quantize_(model, IntxWeightOnlyConfig(
                weight_dtype=getattr(torch, f"int{e_bits}"),
                granularity=PerGroup(int(e_group)) if e_group else PerAxis(0),
                mapping_type=MappingType.SYMMETRIC,
                intx_choose_qparams_algorithm=algorithm),
                filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
        grouped = lambda m, fqn: isinstance(m, nn.Linear) and group and \
            m.in_features % group == 0  # noqa: E731
        quantize_(model, linear(PerGroup(group) if group else PerAxis(0)), filter_fn=grouped)
        quantize_(model, linear(PerAxis(0)),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not grouped(m, fqn))
    return model


class Quantized:
    def __init__(self, arch, fp32, oracle, result, options):
        self.arch, self.fp32, self.oracle = arch, fp32, oracle
        self.result, self.path, self.options = result, result.path, options

    def reference(self, tokens):
        with torch.no_grad():
            return self.oracle(torch.tensor([list(tokens)])).logits[0].float()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("quantized")
    cache = {}

    def get(arch):
        if arch not in cache:
            overrides, options = PLANS[arch]
            fp32 = make_model(arch, **overrides)
            fp32.set_attn_implementation("eager")
            oracle = _eager_quantized(fp32, options)
            result = export(fp32, out_dir / f"{arch}.pte", n_cells=N_CELLS,
                            max_tokens_per_step=STEP, **options)
            print(f"\n[export] {arch} {options}: {result.seconds:.1f} s\n  " +
                  "\n  ".join(result.summary.lines()))
            cache[arch] = Quantized(arch, fp32, oracle, result, options)
        return cache[arch]

    yield get
    if MAX_ERRORS:
        print("\n[max abs logits error vs the eagerly quantized model]")
        for (arch, what), err in sorted(MAX_ERRORS.items()):
            print(f"  {arch:8s} {what:12s} {err:.3g}")


def _check(arch, what, got, want):
    err = (got - want).abs().max().item()
    MAX_ERRORS[(arch, what)] = max(MAX_ERRORS.get((arch, what), 0.0), err)
    assert err <= ATOL, f"{arch} {what}: max abs error {err:.3g} > {ATOL}"


def _check_greedy(arch, got, want):
    top2 = torch.topk(want, 2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > TIE
    agree = got.argmax(-1) == want.argmax(-1)
    assert bool(clear.any()), f"{arch}: every row is a near-tie, the check is vacuous"
    assert bool((agree | ~clear).all()), f"{arch}: greedy tokens differ at a clear argmax"


# ---------------------------------------------------------------- bad input (fast)


def _refused(exc, match, tmp_path, **options):
    out = tmp_path / "never-written.pte"
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match):
        export(make_model("llama"), out, n_cells=64, **options)
    assert time.perf_counter() - t0 < FAST, "refused only after tracing"
    assert not out.exists()


@pytest.mark.parametrize("mode", ["int4", "8DA4W", "", "8da4w "])
def test_unknown_quantize_mode_is_refused_by_name(mode, tmp_path):
    _refused(InvalidConfigError, f"unknown quantize mode {mode!r}", tmp_path, quantize=mode)


@pytest.mark.parametrize("group", [0, -32, 48, 16, 33, True, 32.0, "32"])
def test_group_size_must_be_a_positive_multiple_of_32(group, tmp_path):
    _refused(InvalidConfigError, f"multiple of 32, got {group!r}", tmp_path, quantize="8da4w",
             group_size=group)


def test_group_size_with_8da8w_is_refused_not_ignored(tmp_path):
    _refused(InvalidConfigError, "8da8w quantizes weights per channel; group_size \\(64\\)",
             tmp_path, quantize="8da8w", group_size=64)


@pytest.mark.parametrize("spec", ["3", "16", "8,48", "4,x", "8,32,1", "int8", ""])
def test_bad_embedding_quantize_is_refused_by_name(spec, tmp_path):
    _refused(InvalidConfigError, f"embedding quantization {spec!r}", tmp_path,
             embedding_quantize=spec)


@pytest.mark.parametrize("scales", ["HQQ", "max", "", "affine"])
def test_bad_weight_scales_are_refused_by_name(scales, tmp_path):
    _refused(InvalidConfigError, f"weight_scales must be one of hqq, minmax, got {scales!r}",
             tmp_path, quantize="8da4w", weight_scales=scales)


def test_weight_scales_without_quantization_is_refused_not_ignored(tmp_path):
    _refused(InvalidConfigError, "weight_scales='minmax' applies to quantized weights", tmp_path,
             weight_scales="minmax")


@pytest.mark.parametrize("qat, match", [
    ({"quantize": "8da4w", "weight_scales": "lsq"},
     "quantization_aware_training\\['weight_scales'\\] must be one of hqq, minmax, got 'lsq'"),
    ({"weight_scales": ["minmax"]}, "must be one of hqq, minmax, got \\['minmax'\\]"),
    ("minmax", "quantization_aware_training must be a mapping with a 'weight_scales' entry"),
    ({"quantize": "8da4w"}, "must be a mapping with a 'weight_scales' entry.*--weight-scales"),
])
def test_a_checkpoint_naming_no_known_qat_scales_is_refused_before_tracing(qat, match,
                                                                         tmp_path):
    model = make_model("llama")
    model.config.quantization_aware_training = qat
    t0 = time.perf_counter()
    with pytest.raises(InvalidConfigError, match=match):
        export(model, tmp_path / "never-written.pte", n_cells=64, quantize="8da4w")
    assert time.perf_counter() - t0 < FAST
    # and the caller's own choice needs no config entry
    assert q.resolve_scales(q.check_options("8da4w", 32, None, "hqq"), model).weight_scales \
        == "hqq"


@pytest.mark.parametrize("scales", [["hqq"], {"a": 1}, 1, True])
def test_weight_scales_of_another_type_are_refused_by_name(scales):
    with pytest.raises(InvalidConfigError, match="weight_scales must be one of hqq, minmax"):
        q.check_options("8da4w", 32, None, scales)


def test_model_without_quantizable_linear_is_refused(tmp_path):
    """GPT-2's blocks use transformers' Conv1D, not nn.Linear: only lm_head
    would be quantized, which is not what 8da4w promises."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128))
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="no nn.Linear layer besides lm_head for "
                       "quantize='8da4w'.*Conv1D"):
        export(model, tmp_path / "never-written.pte", n_cells=64, quantize="8da4w")
    assert time.perf_counter() - t0 < FAST


def test_cli_refuses_bad_quantize_before_exporting(capsys, tmp_path):
    from executorch_cellcache import cli

    out = tmp_path / "never.pte"
    assert cli.main(["export", "--quantize", "q4_0", "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "unknown quantize mode 'q4_0'" in err and "exporting" not in err


def test_cli_refuses_bad_weight_scales(capsys):
    from executorch_cellcache import cli

    with pytest.raises(SystemExit, match="^2$") as e:  # argparse's usage-error exit
        cli.main(["export", "--quantize", "8da4w", "--weight-scales", "max"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--weight-scales: invalid choice: 'max'" in err and "exporting" not in err


# ---------------------------------------------------------------- rules (fast, eager)


def test_rules_group_fallback_and_tied_lm_head():
    """8da4w with group 64 on a tied Llama with intermediate 96: down_proj (96
    inputs) is quantized per channel and listed; lm_head gets its own int4
    weight (the tie is broken and reported); the embedding stays fp32."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    model = make_model("llama", tie_word_embeddings=True, intermediate_size=96)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embed_before = model.model.embed_tokens.weight.detach().clone()
    report = q.quantize_model(model, q.check_options("8da4w", 64, None))
    assert report.per_channel == ["model.layers.0.mlp.down_proj",
                                  "model.layers.1.mlp.down_proj"]
    assert len(report.linears) == 2 * 7 + 1 and "lm_head" in report.linears
    assert report.untied_lm_head and report.embedding == "fp32"
    head = model.lm_head.weight
    assert isinstance(head, IntxUnpackedToInt8Tensor) and head.block_size == (1, 64)
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.block_size == (1, 96)  # one group = the whole row: per channel
    assert int(head.qdata.min()) >= -8 and int(head.qdata.max()) <= 7
    assert torch.equal(model.model.embed_tokens.weight, embed_before)


def _group_amax(weight, group):
    return weight.detach().reshape(weight.shape[0], -1, group).abs().amax(-1)


def test_minmax_scales_are_a_groups_max_abs_over_half_the_int_range():
    """torchao's symmetric min/max rule (its choose_qparams_affine docs): scale =
    max|w| / ((qmax - qmin) / 2), i.e. /7.5 for int4 and /127.5 for int8 rows;
    HQQ's scale-only search lands elsewhere."""
    model = make_model("llama")
    w = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    emb = model.model.embed_tokens.weight.detach().clone()
    hqq = copy.deepcopy(model)
    report = q.quantize_model(model, q.check_options("8da4w", 32, "8", "minmax"))
    assert report.weight_scales == "min/max"
    got = model.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(got.scale.reshape(w.shape[0], -1), _group_amax(w, 32) / 7.5)
    emb_scale = model.model.embed_tokens.weight.scale.reshape(-1)
    torch.testing.assert_close(emb_scale, emb.abs().amax(-1) / 127.5)
    q.quantize_model(hqq, q.check_options("8da4w", 32, "8"))
    hqq_scale = hqq.model.layers[0].self_attn.q_proj.weight.scale.reshape(w.shape[0], -1)
    assert not torch.allclose(hqq_scale, _group_amax(w, 32) / 7.5, rtol=1e-3)


def test_weight_scales_default_to_what_a_qat_checkpoint_names_else_hqq():
    model = make_model("llama")
    unset = q.check_options("8da4w", 32, None)
    assert q.resolve_scales(unset, model).weight_scales == "hqq"
    model.config.quantization_aware_training = {"quantize": "8da4w", "weight_scales": "minmax"}
    assert q.resolve_scales(unset, model).weight_scales == "minmax"
    given = q.check_options("8da4w", 32, None, "hqq")
    assert q.resolve_scales(given, model).weight_scales == "hqq"  # the caller's choice wins
    assert "fine-tuned quantization-aware" in q.describe_scales(
        q.resolve_scales(unset, model), model)
    # plan and quantize_model resolve the same way: min/max scales applied, and reported
    assert {step.config.intx_choose_qparams_algorithm for step in q.plan(model, unset)} == \
        {"affine"}
    w = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    report = q.quantize_model(model, unset)
    scale = model.model.layers[0].self_attn.q_proj.weight.scale.reshape(w.shape[0], -1)
    torch.testing.assert_close(scale, _group_amax(w, 32) / 7.5)
    assert report.weight_scales.startswith("min/max")


def test_rules_embedding_width_not_divisible_falls_back_per_row():
    model = make_model("llama")  # hidden 64
    report = q.quantize_model(model, q.check_options(None, 32, "4,128"))
    assert report.embedding == "int4 per row (width 64 is not a multiple of 128)"
    assert report.linears == []


# ---------------------------------------------------------------- metadata (fast)


class _FakeProgram:
    """metadata.read's view of a loaded program: constant methods only."""

    def __init__(self, methods):
        self.methods = dict(methods)
        self.method_names = set(self.methods) | {"forward"}

    def load_method(self, name):
        value = self.methods[name]
        out = value if isinstance(value, list) else [value]

        class _M:
            def execute(self, _inputs):
                return out
        return _M()


def _info(**kw):
    return metadata.ProgramInfo(n_cells=8, n_layers=1, windows=[None], vocab_size=10,
                                bos_id=None, eos_ids=[], max_tokens_per_step=4,
                                model_type="llama", model_name="m", tokenizer_kind="none",
                                tokenizer_json=None, **kw)


def test_metadata_round_trips_quantization():
    info = _info(quantize="8da4w", group_size=64, embedding_quantize="4,32")
    back = metadata.read(_FakeProgram(metadata.constant_methods(info)))
    assert (back.quantize, back.group_size, back.embedding_quantize) == ("8da4w", 64, "4,32")


def test_metadata_of_an_older_program_means_fp32():
    methods = metadata.constant_methods(_info())
    for name in ("quantize", "group_size", "embedding_quantize"):
        del methods[name]
    back = metadata.read(_FakeProgram(methods))
    assert (back.quantize, back.group_size, back.embedding_quantize) == (None, 0, None)


@pytest.mark.parametrize("field,value,match", [
    ("quantize", "int2", "quantized as 'int2', which this version cannot run"),
    ("embedding_quantize", "2,32", "embedding quantization '2,32' is not one this version"),
])
def test_metadata_unknown_quantization_is_refused_by_name(field, value, match):
    info = _info(**{field: value})
    with pytest.raises(ValueError, match=match):
        metadata.read(_FakeProgram(metadata.constant_methods(info)))


def test_runner_registers_the_quantized_embedding_kernels():
    """The runtime's Python module lacks the quantized kernels until
    executorch.kernels.quantized is imported; require_kernels does it."""
    from executorch.runtime import Runtime

    from executorch_cellcache.runtime.kernels import require_kernels

    for spec, op in (("8", "embedding_byte.out"), ("4,32", "embedding_4bit.out")):
        require_kernels(_info(quantize="8da4w", embedding_quantize=spec))
        assert f"quantized_decomposed::{op}" in Runtime.get().operator_registry.operator_names


def test_runner_names_a_kernel_the_runtime_cannot_provide(monkeypatch):
    from executorch_cellcache.runtime.kernels import require_kernels

    monkeypatch.setitem(metadata.EMBEDDING_KERNELS, 8, "quantized_decomposed::no_such.out")
    with pytest.raises(InvalidConfigError, match="quantized \\(8\\) but the runtime has no "
                       "kernel quantized_decomposed::no_such.out"):
        require_kernels(_info(embedding_quantize="8"))


@pytest.fixture(scope="module")
def unknown_mode_pte(tmp_path_factory):
    """A real .pte whose metadata names a quantize mode no version knows
    (export refuses to write one, so it is lowered by hand)."""
    from executorch.exir import to_edge

    class Tiny(nn.Module):
        def forward(self, tokens, positions, logits_for, handle, extent):
            return tokens.float()[None]

    ep = torch.export.export(Tiny(), tuple(torch.zeros(2, dtype=torch.int64) for _ in range(5)))
    methods = metadata.constant_methods(_info(quantize="int2"))
    path = tmp_path_factory.mktemp("unknown") / "int2.pte"
    path.write_bytes(to_edge(ep, constant_methods=methods).to_executorch().buffer)
    return path


def test_runner_refuses_an_unknown_quantize_mode(unknown_mode_pte):
    with pytest.raises(InvalidConfigError, match="quantized as 'int2', which this version"):
        Runner(unknown_mode_pte)


@pytest.mark.slow  # builds nothing, but needs the C++ runner built with the package
def test_cpp_runner_refuses_an_unknown_quantize_mode(unknown_mode_pte, tmp_path):
    from executorch_cellcache.cli.paths import runner_executable

    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2\n")
    out = subprocess.run([str(runner_executable()), "--model", str(unknown_mode_pte),
                          "--prompts", str(prompts)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "quantized as 'int2', which this runner cannot run" in out.stderr


# ---------------------------------------------------------------- exported (slow)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(PLANS))
def test_prefill_and_decode_past_window_match_eager_quantized(programs, arch):
    """A 12-token prompt (twice the window) in one prefill, then 20 decode
    steps teacher-forced with the oracle's greedy tokens."""
    p = programs(arch)
    prompt = _tokens(2 * WINDOW, seed=11)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(p.reference(seq)[-1].argmax()))
    want = p.reference(seq)
    r = Runner(p.path)
    s = r.cache.seq_new()
    n = len(prompt)
    got = [r.step([s] * n, prompt, list(range(n)), list(range(n)))]
    for pos in range(n, len(seq)):
        got.append(r.step([s], [seq[pos]], [pos], [0]))
    got = torch.cat(got)
    _check(arch, "prefill", got[:n], want[:n])
    _check(arch, "decode", got[n:], want[n:])
    _check_greedy(arch, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(PLANS))
def test_summary_metadata_and_delegation(programs, arch):
    p = programs(arch)
    s, options = p.result.summary, p.options
    # 8da4w: q/k/v and gate/up are one linear each (graph/fused_projections.py), four
    # GEMMs a layer where the model has seven, and lm_head; 8da8w keeps them apart.
    n_layers = p.fp32.config.num_hidden_layers
    fused = options["quantize"] == "8da4w"
    n_linear = sum(isinstance(m, nn.Linear) for m in p.fp32.modules()) - 3 * n_layers * fused
    assert n_linear == (4 if fused else 7) * n_layers + 1
    assert s.linears == s.linears_quantized == s.delegated_quantized == n_linear
    assert s.fused_projections == 2 * n_layers * fused
    line = f"  fused projections: {2 * n_layers} groups (q/k/v or gate/up), one linear each " \
        f"(counted as one above)"
    assert (line in s.lines()) is fused
    assert s.delegated_fp32 == 0
    assert s.size_bytes == p.path.stat().st_size
    # Quantized linears share partitions with the fp32 ops between them: one delegate
    # call per layer plus three, as fp32 programs (test_export_models).
    assert lowering.delegate_calls(p.path.read_bytes()) == p.fp32.config.num_hidden_layers + 3
    info = Runner(p.path).info
    assert info.quantize == options["quantize"]
    assert info.group_size == (options.get("group_size", 32)
                               if options["quantize"] == "8da4w" else 0)
    assert info.embedding_quantize == options.get("embedding_quantize")
    assert info.kv_dtype == options.get("kv_dtype", "fp16")  # fp16: the quantized default
    scales = {"minmax": "min/max"}.get(options.get("weight_scales"), "HQQ scale-only")
    assert f"weight scales: {scales}" in s.lines()
    if arch == "llama":
        assert s.per_channel == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
        assert s.untied_lm_head and s.embedding == "int4 groups of 32"
        assert any("untied" in line for line in s.lines())
    else:
        assert s.per_channel == [] and not s.untied_lm_head


@pytest.mark.slow
def test_quantized_program_is_smaller_than_its_weights_in_fp32(programs):
    """mistral: fp32 embedding (384 x 64) + int4 linears. Its fp32 weights
    are ~300 KB; int4 linears with fp32 group scales are ~5/32 of theirs."""
    p = programs("mistral")
    fp32_bytes = sum(t.numel() * 4 for t in p.fp32.state_dict().values())
    embedding = p.fp32.model.embed_tokens.weight.numel() * 4
    assert p.result.size_bytes < embedding + 0.45 * (fp32_bytes - embedding)


@pytest.mark.slow
def test_oracle_is_discriminating(programs):
    """The fp32 model differs from the quantized oracle by more than ATOL:
    a program that silently left its weights fp32 would fail the comparison."""
    p = programs("mistral")
    seq = _tokens(2 * WINDOW, seed=3)
    with torch.no_grad():
        fp32 = p.fp32(torch.tensor([seq])).logits[0]
    assert (fp32 - p.reference(seq)).abs().max().item() > ATOL


# ---------------------------------------------------------------- runner features (slow)


@pytest.mark.slow
def test_forks_share_the_prompt_and_follow_the_oracle(programs):
    """n=3 greedy samples of one prompt share its cells (tied llama, 4-bit
    embedding, per-channel fallback) and equal the single-sample output."""
    p = programs("llama")
    prompt = _tokens(10, seed=4)
    r = Runner(p.path)
    [samples] = r.generate([prompt], 8, n=3, stop_on_eos=False)
    assert samples[0] == samples[1] == samples[2]
    assert r.last_stats.peak_cells == len(prompt) + 3 * 7
    [[alone]] = Runner(p.path).generate([prompt], 8, stop_on_eos=False)
    assert alone == samples[0]


@pytest.mark.slow
def test_continuous_batching_equals_one_prompt_at_a_time(programs):
    """Three prompts in one batch (prefill chunks sharing forwards with other
    prompts' decode steps, gemma3's sliding and global layers) give each
    prompt's tokens alone; per-token activation scales make batching exact
    up to float rounding."""
    p = programs("gemma3")
    prompts = [_tokens(n, seed=20 + n) for n in (5, 13, 40)]
    batched = Runner(p.path).generate(prompts, 10, stop_on_eos=False)
    for prompt, got in zip(prompts, batched, strict=True):
        assert Runner(p.path).generate([prompt], 10, stop_on_eos=False)[0] == got


@pytest.mark.slow
def test_rollback_then_redo_gives_the_same_logits(programs):
    p = programs("qwen3")
    r = Runner(p.path)
    s = r.cache.seq_new()
    prompt = _tokens(9, seed=6)
    r.step([s] * 9, prompt, list(range(9)), [8])
    first = r.step([s, s, s], [5, 6, 7], [9, 10, 11], [0, 1, 2])
    r.rollback(s, 3)
    assert r.cache.next_pos(s) == 9
    again = r.step([s, s, s], [5, 6, 7], [9, 10, 11], [0, 1, 2])
    assert torch.allclose(first, again, atol=1e-5)
    want = p.reference(prompt + [5, 6, 7])[9:]
    _check("qwen3", "rollback", again, want)


@pytest.mark.slow
def test_cpp_runner_runs_quantized_program_like_the_python_runner(programs, tmp_path):
    """The C++ runner loads a quantized program (XNNPACK dynamically quantized
    linears, the 4-bit embedding kernel) with no flag and its greedy tokens
    equal the Python runner's."""
    from executorch_cellcache.cli.paths import runner_executable

    p = programs("llama")
    prompts = [_tokens(n, seed=30 + n) for n in (3, 17)]
    want = Runner(p.path).generate(prompts, 6, n=2, stop_on_eos=False)
    file = tmp_path / "prompts.txt"
    file.write_text("".join(" ".join(map(str, x)) + "\n" for x in prompts))
    out = subprocess.run([str(runner_executable()), "--model", str(p.path), "--prompts",
                          str(file), "--n", "2", "--max-new-tokens", "6", "--no-stop-on-eos"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = [[[], []] for _ in prompts]
    for line in out.stdout.splitlines():
        key, ids = line.split(":")
        i, j = map(int, key.split())
        got[i][j] = [int(t) for t in ids.split()]
    assert got == want
