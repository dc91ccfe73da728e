"""q/k/v and gate/up as one linear each (graph/fused_projections.py): the
same values as transformers' separate projections, the same quantization,
and the parts split inside the layer's XNNPACK partition
(lowering._DynamicSliceConfig). test_quantize's summary test counts four
GEMMs a layer in the emitted programs."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

from executorch_cellcache import ExportOptions
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting import quantize as quantization
from executorch_cellcache.exporting.lowering import delegate_calls, lower_exported
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
    ids = torch.randint(0, model.config.vocab_size, (1, 13),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = model(ids).logits, fused(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("q_out,kv_out,bias", [(96, 32, False), (64, 64, True), (128, 16, True),
                                                (48, 36, False)])
def test_each_part_gives_its_linear_s_output_exactly(q_out, kv_out, bias):
    torch.manual_seed(0)
    attn = _Attention(40, q_out, kv_out, bias)
    want = {n: copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")}
    assert fuse_projections(attn) == 1
    x = torch.randn(2, 5, 40) * 3
    for name, linear in want.items():
        part = getattr(attn, name)
        assert isinstance(part, FusedPart)
        got = part(x)
        assert got.is_contiguous() and torch.equal(got, linear(x)), name
    assert attn.qkv_proj._last is None   # no activations held after a full round
    # A part called alone (another input each time) still gives its own rows.
    for name, linear in want.items():
        y = torch.randn(7, 40)
        assert torch.equal(getattr(attn, name)(y), linear(y)), name


def test_a_part_called_after_its_input_changed_in_place_computes_it_again():
    torch.manual_seed(3)
    attn = _Attention(16, 16, 8)
    k_proj = copy.deepcopy(attn.k_proj)
    fuse_projections(attn)
    x = torch.randn(2, 16)
    attn.q_proj(x)
    x.mul_(2.0)   # the same object, other values: the remembered output is stale
    assert torch.equal(attn.k_proj(x), k_proj(x))


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
    half = _Attention(40, 96, 32)
    half.v_proj = half.v_proj.to(torch.float16)          # another dtype
    done = _Attention(40, 96, 32)
    done.qkv_proj = nn.Linear(40, 160)                    # already fused (Phi-3)
    for module in (attn, mixed, half, done):
        assert fuse_projections(module) == 0
        assert type(module.q_proj) is nn.Linear


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
    want = torch.cat([getattr(parts, n).weight.dequantize() for n in ("q_proj", "k_proj",
                                                                      "v_proj")])
    assert torch.equal(rows, want)
    x = torch.randn(4, 64)
    for name in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(getattr(fused, name)(x), getattr(parts, name)(x),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0])
def test_export_option_is_a_bool_or_none(bad):
    with pytest.raises(InvalidConfigError, match="fuse_projections must be True, False or None"):
        ExportOptions(fuse_projections=bad).checked()


@pytest.mark.parametrize("quantize,want", [("8da4w", True), ("8da8w", False), (None, False)])
def test_projections_are_fused_by_default_for_8da4w_only(quantize, want):
    assert ExportOptions(quantize=quantize).checked().fuse_projections is want
    for given in (True, False):
        assert ExportOptions(quantize=quantize, fuse_projections=given).checked() \
            .fuse_projections is given


class _Split(nn.Module):
    """A linear's output split along its last dim, the parts used apart."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 48)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        y = self.qkv(x)
        a, b, c = (torch.ops.aten.slice_copy.Tensor(y, -1, i, i + 16) for i in (0, 16, 32))
        return self.out(a * torch.sigmoid(b) + c)


def _lower_and_run(module, example, dynamic, inputs):
    """(delegate calls, slices left outside XNNPACK, each input's output)."""
    from executorch.runtime import Runtime

    ep = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
    program = lower_exported(ep, reinplace=False)
    gm = program.exported_program().graph_module
    outside = [n for n in gm.graph.nodes if "slice" in str(n.target)]
    loaded = Runtime.get().load_program(program.buffer)   # the method needs it alive
    method = loaded.load_method("forward")
    return delegate_calls(program.buffer), outside, [method.execute([x])[0] for x in inputs]


def test_slices_of_a_dynamically_shaped_tensor_run_in_xnnpack_for_every_length():
    # ExecuTorch's own config leaves such a slice to a portable kernel between two
    # delegate calls; ours serializes the token dim as "the input's", whatever a call has.
    torch.manual_seed(4)
    m = _Split().eval()
    xs = [torch.randn(n, 32) for n in (1, 3, 64, 2, 17, 1)]
    calls, outside, got = _lower_and_run(m, (torch.randn(5, 32),),
                                         ({0: Dim("T", min=1, max=64)},), xs)
    assert calls == 1
    assert not outside
    for x, y in zip(xs, got, strict=True):
        with torch.no_grad():
            want = m(x)
        assert y.shape == want.shape
        np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_a_slice_not_of_the_whole_token_dim_stays_outside_xnnpack():
    # Rows [1:] of a dynamic dim: the serialized size would have to follow the
    # input, which XNNPACK's static slice cannot express: left to the portable kernel.
    class Rows(nn.Module):
        def forward(self, x):
            return torch.ops.aten.slice_copy.Tensor(x * 2.0, 0, 1, 9223372036854775807) + 1.0

    x = torch.randn(7, 16)
    _, outside, (got,) = _lower_and_run(Rows(), (torch.randn(5, 16),),
                                        ({0: Dim("T", min=3, max=64)},), [x])
    assert outside
    assert torch.equal(got, x[1:] * 2.0 + 1.0)


def test_a_slice_of_a_static_shape_still_serializes_as_executorch_s():
    torch.manual_seed(5)
    m = _Split().eval()
    x = torch.randn(4, 32)
    calls, _, (got,) = _lower_and_run(m, (torch.randn(4, 32),), None, [x])
    assert calls == 1
    with torch.no_grad():
        np.testing.assert_allclose(got.numpy(), m(x).numpy(), rtol=1e-5, atol=1e-5)


class _SliceOf(nn.Module):
    def __init__(self, start, end):
        super().__init__()
        self.start, self.end = start, end

    def forward(self, x):
        return torch.ops.aten.slice_copy.Tensor(x * 2.0, -1, self.start, self.end) + 1.0


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_start_before_the_dim_s_beginning_runs_as_torch_clamps_it(dynamic):
    # torch clamps start -100 of a 48-wide dim to 0; start + 48 would be a negative
    # offset, which the serialized XNNPACK slice cannot hold (flatc refused it).
    m = _SliceOf(-100, 8)
    shapes = ({0: Dim("T", min=1, max=64)},) if dynamic else None
    xs = [torch.randn(n, 48) for n in ((1, 7) if dynamic else (5,))]
    _, _, got = _lower_and_run(m, (torch.randn(5, 48),), shapes, xs)
    for x, y in zip(xs, got, strict=True):
        assert torch.equal(y, m(x))


def test_a_static_fp16_slice_is_still_xnnpack_s():
    # ExecuTorch's config takes a static slice in any precision it lowers; ours only
    # adds dynamic shapes to what it takes.
    m = _SliceOf(8, 24)
    x = torch.randn(5, 48, dtype=torch.float16)
    calls, outside, (got,) = _lower_and_run(m, (x,), None, [x])
    assert calls == 1 and not outside
    assert torch.equal(got, m(x))


@pytest.mark.slow
def test_fused_and_unfused_programs_give_the_same_logits_to_the_bit(tmp_path):
    # The option reaches the graph (the unfused program has seven linears a layer)
    # and the parts' slices change no value: prefill, then decode steps.
    from executorch_cellcache import Runner, export

    model = make_model("llama")
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(3, 300, (14,), generator=torch.Generator().manual_seed(6)).tolist()
    logits, summaries = {}, {}
    for fuse in (True, False):
        result = export(model, tmp_path / f"{fuse}.pte", n_cells=32, max_tokens_per_step=8,
                        quantize="8da4w", fuse_projections=fuse)
        summaries[fuse] = result.summary
        runner = Runner(result.path)
        s = runner.cache.seq_new()
        rows = [runner.step([s] * 6, ids[:6], list(range(6)), list(range(6)))]
        rows += [runner.step([s], [ids[p]], [p], [0]) for p in range(6, len(ids))]
        logits[fuse] = torch.cat([torch.as_tensor(r) for r in rows])
    assert summaries[True].fused_projections == 2 * n_layers
    assert summaries[False].fused_projections == 0
    assert summaries[False].linears - summaries[True].linears == 3 * n_layers
    assert not any("fused" in line for line in summaries[False].lines())
    assert torch.equal(logits[True], logits[False])
