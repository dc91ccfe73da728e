"""q/k/v and gate/up as one linear each (graph/fused_projections.py): the
same values as transformers' separate projections, the same quantization, and
fewer GEMMs in the emitted program."""

import copy

import pytest
import torch
from torch import nn

from executorch_cellcache import ExportOptions
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting import quantize as quantization
from executorch_cellcache.graph.fused_projections import (FusedLinear, FusedPart,
                                                          fuse_projections)
from model_configs import ARCHS, make_model


class _Attention(nn.Module):
    def __init__(self, hidden, q_out, kv_out, bias=False):
        super().__init__()
        self.q_proj = nn.Linear(hidden, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=bias)


class _Mlp(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_fused_model_computes_transformers_logits_to_the_bit(arch):
    model = make_model(arch).float().eval()
    fused = copy.deepcopy(model)
    n_layers = model.config.num_hidden_layers
    assert fuse_projections(fused) == 2 * n_layers
    assert sum(isinstance(m, FusedLinear) for m in fused.modules()) == 2 * n_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = model(ids).logits, fused(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("q_out,kv_out,bias", [(96, 32, False), (64, 64, True), (128, 16, True),
                                                (48, 24, False)])
def test_each_part_gives_its_linear_s_output_exactly(q_out, kv_out, bias):
    torch.manual_seed(0)
    attn = _Attention(40, q_out, kv_out, bias)
    want = {n: copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")}
    assert fuse_projections(attn) == 1
    x = torch.randn(2, 5, 40) * 3
    for name, linear in want.items():
        part = getattr(attn, name)
        assert isinstance(part, FusedPart)
        assert torch.equal(part(x), linear(x)), name
    assert attn.qkv_proj._last is None   # no activations held after a full round
    # A part called alone (another input each time) still gives its own rows.
    for name, linear in want.items():
        y = torch.randn(7, 40)
        assert torch.equal(getattr(attn, name)(y), linear(y)), name


def test_gate_and_up_fuse_and_stay_exact():
    torch.manual_seed(1)
    mlp = _Mlp(24, 56)
    gate, up = copy.deepcopy(mlp.gate_proj), copy.deepcopy(mlp.up_proj)
    assert fuse_projections(mlp) == 1
    x = torch.randn(3, 24)
    assert torch.equal(mlp.gate_proj(x), gate(x)) and torch.equal(mlp.up_proj(x), up(x))
    assert mlp.gate_up_proj.out_features == 112


def test_projections_that_cannot_share_a_linear_are_left_alone():
    attn = _Attention(40, 96, 32)
    attn.k_proj = nn.Linear(41, 32, bias=False)          # another input size
    mixed = _Attention(40, 96, 32)
    mixed.v_proj = nn.Linear(40, 32, bias=True)          # bias on one part only
    odd = _Attention(40, 96, 36)                          # 96 is no whole number of 36s
    done = _Attention(40, 96, 32)
    done.qkv_proj = nn.Linear(40, 160)                    # already fused (Phi-3)
    for module in (attn, mixed, odd, done):
        assert fuse_projections(module) == 0
        assert isinstance(module.q_proj, nn.Linear)


@pytest.mark.parametrize("mode,scales", [("8da4w", "minmax"), ("8da4w", "hqq"),
                                         ("8da8w", "minmax")])
def test_quantizing_the_fused_linear_quantizes_each_part_as_alone(mode, scales):
    torch.manual_seed(2)
    parts = _Attention(64, 96, 32)
    fused = copy.deepcopy(parts)
    fuse_projections(fused)
    options = quantization.check_options(mode, 32, weight_scales=scales)
    for m in (parts, fused):
        with torch.no_grad():
            quantization.apply(m, quantization.plan(m, options))
    rows = fused.qkv_proj.weight.dequantize()
    # Fused row i * 5 + j: q rows i * 3 + j (j < 3), then k row i, then v row i.
    q = parts.q_proj.weight.dequantize().reshape(32, 3, 64)
    k = parts.k_proj.weight.dequantize().reshape(32, 1, 64)
    v = parts.v_proj.weight.dequantize().reshape(32, 1, 64)
    assert torch.equal(rows.reshape(32, 5, 64), torch.cat([q, k, v], dim=1))
    x = torch.randn(4, 64)
    for name in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(getattr(fused, name)(x), getattr(parts, name)(x),
                                   rtol=1e-5, atol=1e-5)


def test_export_option_is_a_bool():
    with pytest.raises(InvalidConfigError, match="fuse_projections must be True or False"):
        ExportOptions(fuse_projections="yes").checked()
    assert ExportOptions().checked().fuse_projections is True
