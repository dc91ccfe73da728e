"""Outlier input channels of quantized linears computed in fp32
(graph/outlier_channels.py, exporting/outliers.py).

Oracles, written here: the model quantized eagerly with torchao's own 8da4w
config (per-token int8 activations inside torchao's linear), each linear's
forward replaced by the decomposition the docs state, y = q(x * keep) +
x[..., C] W_C^T with W_C the quantized weight's columns; and, for the quality
claim, the same int4 weights with fp32 activations (what activation rounding
is measured against). The model carries planted outliers: four channels of every
RMSNorm weight 60x larger, so the per-token int8 scale of every norm-fed
linear is set by them.
"""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from executorch_cellcache import InvalidConfigError, Runner, export
from executorch_cellcache.exporting import outliers

PLANTED = [5, 18, 33, 60]
K = 4
ATOL = 0.25   # tests/test_quantize.py: one int8 step of an activation, program vs eager torchao


def _model():
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight[PLANTED] *= 60
    model.set_attn_implementation("eager")
    return model


def _torchao_8da4w(model):
    from torchao.quantization import (Int8DynamicActivationIntxWeightConfig, MappingType,
                                      quantize_)
    from torchao.quantization.granularity import PerGroup

    model = copy.deepcopy(model)
    with torch.no_grad():
        quantize_(model, Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32),
            weight_mapping_type=MappingType.SYMMETRIC,
            intx_choose_qparams_algorithm="hqq_scale_only"),
            filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    return model


def _with_outliers(quantized, channels_of):
    """Each quantized linear with channels C (channels_of(name); None: none) computes
    y = q(x * keep) + x[..., C] W_C^T."""
    model = copy.deepcopy(quantized)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        channels = channels_of(name)
        if channels is None:
            continue
        channels = torch.tensor(channels)
        keep = torch.ones(m.in_features)
        keep[channels] = 0
        columns = m.weight.dequantize()[:, channels]

        def forward(x, m=m, keep=keep, channels=channels, columns=columns):
            return F.linear(x * keep, m.weight, m.bias) + x[..., channels] @ columns.T
        m.forward = forward
    return model


def _fp32_activations(quantized):
    """The quantized weights (dequantized) applied to unrounded activations."""
    model = copy.deepcopy(quantized)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.forward = lambda x, m=m: F.linear(x, m.weight.dequantize(), m.bias)
    return model


def _program_name(name):
    """The exported linear computing ``name``'s output (q/k/v and gate/up are fused)."""
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                         (("gate_proj", "up_proj"), "gate_up_proj")):
        parent, _, leaf = name.rpartition(".")
        if leaf in parts:
            return f"{parent}.{fused}"
    return name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _model()
    path = tmp_path_factory.mktemp("outliers") / "p.pte"
    result = export(model, path, n_cells=64, max_tokens_per_step=16, quantize="8da4w",
                    outlier_channels=K)
    return model, result


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _program_logits(path, tokens):
    r = Runner(path)
    s = r.cache.seq_new()
    n = len(tokens)
    return r.step([s] * n, tokens, list(range(n)), list(range(n)))


def test_calibration_finds_the_planted_channels_and_the_summary_says_so(exported):
    _model_, result = exported
    chosen = result.summary.outlier_channels
    norm_fed = [n for n in chosen if n.endswith(("qkv_proj", "gate_up_proj")) or n == "lm_head"]
    assert len(norm_fed) == 2 * 2 + 1
    for name in norm_fed:
        assert chosen[name] == PLANTED, name
    # the other linears (o_proj, down_proj) get K channels where their inputs have marked
    # outliers: a largest mean |x| at least MIN_OUTLIER_RATIO times the median one
    magnitudes = outliers.sample_magnitudes(_model())
    marked = {_program_name(n) for n, v in magnitudes.items()
              if v.max() >= outliers.MIN_OUTLIER_RATIO * v.median()}
    assert set(chosen) == marked
    assert all(len(c) == K for c in chosen.values())
    assert any(l.startswith(f"  outlier channels: {K} input channels of each of "
                            f"{len(marked)} quantized") for l in result.summary.lines())


def test_program_computes_the_decomposition_and_rounds_activations_less(exported):
    model, result = exported
    chosen = result.summary.outlier_channels
    quantized = _torchao_8da4w(model)
    oracle = _with_outliers(quantized, lambda name: chosen.get(_program_name(name)))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 256, (16,), generator=g).tolist()
    got = _program_logits(result.path, tokens)
    want = _logits(oracle, tokens)
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"program vs eager decomposition: max abs error {err:.3g}"
    per_token = _logits(quantized, tokens)
    unrounded = _logits(_fp32_activations(quantized), tokens)

    def gap(a, b):
        return (a - b).abs().mean().item()
    print(f"mean |logits error|: program vs decomposition {gap(got, want):.4f}, vs per-token "
          f"only {gap(got, per_token):.4f}; vs unrounded activations: program "
          f"{gap(got, unrounded):.4f}, decomposition {gap(want, unrounded):.4f}, per-token "
          f"only {gap(per_token, unrounded):.4f}")
    assert gap(got, want) < 0.5 * gap(got, per_token)
    assert gap(want, unrounded) < 0.5 * gap(per_token, unrounded)
    assert gap(got, unrounded) < 0.5 * gap(per_token, unrounded)


def test_sampled_magnitudes_are_mean_absolute_inputs():
    model = _model()
    seen = {}

    def record(name):
        def hook(_m, args):
            seen.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))
        return hook
    got = outliers.sample_magnitudes(model, sequences=2, tokens=5)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(record(name))
    outliers.sample_magnitudes(model, sequences=2, tokens=5)
    assert set(got) == set(seen)
    for name, xs in seen.items():
        rows = torch.cat(xs)
        assert rows.shape[0] == 2 * 5
        torch.testing.assert_close(got[name], rows.abs().mean(0))


@pytest.mark.parametrize("value", [-1, 65, True, 2.0, "8"])
def test_bad_outlier_channels_are_refused_by_name(value, tmp_path):
    with pytest.raises(InvalidConfigError, match=f"outlier_channels must be an integer in "
                                                 f"0..64, got {value!r}"):
        export(_model(), tmp_path / "x.pte", n_cells=64, quantize="8da4w",
               outlier_channels=value)
    assert not (tmp_path / "x.pte").exists()


def test_outlier_channels_without_quantize_are_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="outlier_channels=8 keeps input channels of "
                                                 "quantized linears in fp32; pass quantize"):
        export(_model(), tmp_path / "x.pte", n_cells=64, outlier_channels=8)
    assert not (tmp_path / "x.pte").exists()


def test_cli_refuses_a_negative_count(tmp_path):
    run = subprocess.run([sys.executable, "-m", "executorch_cellcache", "export",
                          "--quantize", "8da4w", "--outlier-channels", "-1",
                          "--out", str(tmp_path / "x.pte")], capture_output=True, text=True)
    assert run.returncode == 2
    assert "--outlier-channels" in run.stderr
    assert not (tmp_path / "x.pte").exists()


def test_block_offsets_and_outlier_channels_share_one_side_path():
    # Oracle written from the two decompositions' formulas: the block sums
    # times the offsets, and the chosen channels times the given columns.
    from executorch_cellcache.graph.block_offsets import add_block_offsets, has_block_offsets
    from executorch_cellcache.graph.outlier_channels import add_outlier_channels

    torch.manual_seed(4)
    linear = nn.Linear(64, 6)
    offsets, channels, columns = torch.randn(6, 2), torch.tensor([3, 40]), torch.randn(6, 2)
    x = torch.randn(5, 64)
    kept = x.clone()
    kept[:, channels] = 0
    want = F.linear(kept, linear.weight, linear.bias) + \
        torch.stack([x[:, :32].sum(-1), x[:, 32:].sum(-1)], -1) @ offsets.T + \
        x[:, channels] @ columns.T
    reverse = copy.deepcopy(linear)
    add_block_offsets(linear, offsets)
    add_outlier_channels(linear, channels, columns, 64)
    add_outlier_channels(reverse, channels, columns, 64)
    add_block_offsets(reverse, offsets)
    assert has_block_offsets(linear) and has_block_offsets(reverse)
    torch.testing.assert_close(linear(x), want)
    torch.testing.assert_close(reverse(x), want)
    with pytest.raises(ValueError, match="outlier channels already"):
        add_outlier_channels(linear, channels, columns, 64)
    with pytest.raises(ValueError, match="block offsets already"):
        add_block_offsets(linear, offsets)
    from executorch_cellcache.graph import side_path
    with pytest.raises(ValueError, match="does not fit the module's"):
        side_path.append(linear, torch.zeros(1, 32), torch.zeros(6, 1))
    torch.testing.assert_close(linear(x), want)   # nothing changed by the refusals
    other = nn.Linear(64, 6)
    add_block_offsets(other, offsets)
    with pytest.raises(ValueError, match="does not fit the module's side path"):
        add_outlier_channels(other, channels, torch.randn(5, 2), 64)   # 5 outputs, not 6
    assert not hasattr(other, "outlier_keep")   # refused whole: no mask left behind
