"""exporting/xnnpack_rewrites.py's graph rewrites before XNNPACK, each checked to keep
the values (eager torch on the same inputs: the oracle) and to move the ops
into the delegate:

- ``means_as_pooling``: last-dim means (RMSNorm's) into the 4-D form XNNPACK
  takes, transposed inputs too, leaving alone means it cannot rewrite;
- ``rotate_half_as_linear``: RoPE's rotate_half (transformers' own function)
  into one linear with a constant +-1 weight;
- ``views_with_inferred_dim``: views and unsqueezes of a dynamic shape into
  views with one inferred dim;
- ``tanh_gelu_as_primitives``: tanh-approximate GELU into mul/add/tanh;
- ``token_major_rope``: q/k/v kept token-major through RoPE and q/k norms,
  transformers' transposes and the attention's transposes back removed."""

import pytest
import torch

from executorch_cellcache.exporting.lowering import lower_exported
from executorch_cellcache.exporting.xnnpack_rewrites import (
    means_as_pooling, rotate_half_as_linear, rewrite_for_xnnpack, tanh_gelu_as_primitives,
    token_major_rope, views_with_inferred_dim)


class _Means(torch.nn.Module):
    def forward(self, x3, x4):
        a = x3.pow(2).mean(-1, keepdim=True)             # RMSNorm's: [1, n, H] -> [1, n, 1]
        b = x4.mean(dim=3, keepdim=True)                 # q/k norm: [1, n, heads, hd]
        c = x4.transpose(1, 2).mean(-1, keepdim=True)    # transposed (Gemma3's q/k norms)
        d = x3.mean(-1)                                  # no keepdim: not XNNPACK's form
        e = x3.mean(1, keepdim=True)                     # not the last dim
        f = x3.mean(dim=None, keepdim=True)              # over everything
        return a, b, c, d, e, f


def _export():
    n = torch.export.Dim("n", min=1, max=16)
    args = (torch.randn(1, 5, 24), torch.randn(1, 5, 3, 8))
    return torch.export.export(_Means(), args, dynamic_shapes=({1: n}, {1: n}), strict=False)


def _native_means(program):
    plan = program.executorch_program.execution_plan[0]
    names = [plan.operators[i.instr_args.op_index].name for c in plan.chains
             for i in c.instructions if type(i.instr_args).__name__ == "KernelCall"]
    return sum(name == "aten::mean" for name in names)


def test_rewrites_exactly_the_viewable_last_dim_means_and_keeps_values():
    ep = _export()
    x3, x4 = torch.randn(1, 7, 24), torch.randn(1, 7, 3, 8)
    want = _Means()(x3, x4)
    assert means_as_pooling(ep) == 3
    got = ep.module()(x3, x4)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_rewritten_means_run_inside_xnnpack():
    baseline = lower_exported(_export())
    ep = _export()
    means_as_pooling(ep)
    program = lower_exported(ep)
    # The three means it leaves stay portable; the three it rewrites are delegated.
    assert _native_means(baseline) == 6
    assert _native_means(program) == 3
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(program.buffer).load_method("forward")
    x3, x4 = torch.randn(1, 9, 24), torch.randn(1, 9, 3, 8)
    for w, g in zip(_Means()(x3, x4), method.execute([x3, x4]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def _kernels(program):
    plan = program.executorch_program.execution_plan[0]
    return [plan.operators[i.instr_args.op_index].name for c in plan.chains
            for i in c.instructions if type(i.instr_args).__name__ == "KernelCall"]


def _run(program, *args):
    from executorch.runtime import Runtime

    return Runtime.get().load_program(program.buffer).load_method("forward").execute(list(args))


class _Rope(torch.nn.Module):
    """transformers' RoPE on q and k as Llama applies it, plus a cat of two
    halves that is no rotate_half (the rewrite must leave it)."""

    def forward(self, q, k, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
        other = torch.cat((-q[..., :4], q[..., 4:]), dim=-1)   # halves not swapped
        return q_out, k_out, other


def test_rotate_half_becomes_one_linear_with_the_same_values():
    n = torch.export.Dim("n", min=1, max=16)
    shapes = [(1, 4, 5, 16), (1, 2, 5, 16), (1, 5, 16), (1, 5, 16)]
    ep = torch.export.export(_Rope(), tuple(torch.randn(s) for s in shapes), strict=False,
                             dynamic_shapes=({2: n}, {2: n}, {1: n}, {1: n}))
    baseline = lower_exported(torch.export.export(
        _Rope(), tuple(torch.randn(s) for s in shapes), strict=False,
        dynamic_shapes=({2: n}, {2: n}, {1: n}, {1: n})))
    assert rotate_half_as_linear(ep) == 2           # q's and k's, not the other cat
    args = [torch.randn(s[:-2] + (9,) + s[-1:]) if len(s) == 4 else torch.randn(1, 9, 16)
            for s in shapes]
    for w, g in zip(_Rope()(*args), ep.module()(*args), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    program = lower_exported(ep)
    # Two slices per rotate_half, two for the other cat; the rewrite leaves the other
    # cat's. Slices of a dynamic shape run in XNNPACK either way (lowering's
    # _DynamicSliceConfig): none is left to a portable kernel.
    slices = lambda g: sum("slice" in str(node.target) for node in g.nodes)
    assert slices(ep.graph) == 2
    assert _kernels(baseline).count("aten::slice_copy") == 0
    assert _kernels(program).count("aten::slice_copy") == 0
    for w, g in zip(_Rope()(*args), _run(program, *args), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


class _Views(torch.nn.Module):
    def forward(self, x, c):
        n = x.shape[1]
        q = x.view(1, n, -1, 8).transpose(1, 2)       # transformers' view(hidden_shape)
        return (q * 2, c.unsqueeze(1) + 1,            # Llama's cos.unsqueeze(1)
                q.transpose(1, 2).reshape(1, n, -1) - 1)


def test_views_of_a_dynamic_shape_get_one_inferred_dim_and_run_in_xnnpack():
    n = torch.export.Dim("n", min=1, max=16)
    make = lambda: torch.export.export(_Views(), (torch.randn(1, 5, 32), torch.randn(1, 5, 8)),
                                       dynamic_shapes=({1: n}, {1: n}), strict=False)
    ep = make()
    assert views_with_inferred_dim(ep) == 3
    x, c = torch.randn(1, 7, 32), torch.randn(1, 7, 8)
    for w, g in zip(_Views()(x, c), ep.module()(x, c), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    portable = [k for k in _kernels(lower_exported(ep)) if "view" in k or "unsqueeze" in k]
    assert len(portable) < len([k for k in _kernels(lower_exported(make()))
                                if "view" in k or "unsqueeze" in k])
    for w, g in zip(_Views()(x, c), _run(lower_exported(ep), x, c), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


class _Gelu(torch.nn.Module):
    def forward(self, x):
        return (torch.nn.functional.gelu(x, approximate="tanh"),
                torch.nn.functional.gelu(x))               # exact: left as it is


def test_tanh_gelu_becomes_xnnpack_ops_within_float_rounding():
    n = torch.export.Dim("n", min=1, max=64)
    ep = torch.export.export(_Gelu(), (torch.randn(1, 5, 16),), dynamic_shapes=({1: n},),
                             strict=False)
    assert tanh_gelu_as_primitives(ep) == 1
    x = torch.linspace(-12, 12, 64 * 16).reshape(1, 64, 16)
    for w, g in zip(_Gelu()(x), ep.module()(x), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)
    program = lower_exported(ep)
    baseline = lower_exported(torch.export.export(
        _Gelu(), (torch.randn(1, 5, 16),), dynamic_shapes=({1: n},), strict=False))
    assert "aten::gelu" in _kernels(baseline) and "aten::gelu" not in _kernels(program)
    for w, g in zip(_Gelu()(x), _run(program, x), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


class _CopyingReshape(torch.nn.Module):
    def forward(self, x):
        q = x.view(1, x.shape[1], -1, 8).transpose(1, 2)
        return q.reshape(1, 4 * x.shape[1], 8) + 3   # not viewable: this reshape copies


def test_a_reshape_that_copies_keeps_its_copy():
    n = torch.export.Dim("n", min=1, max=16)
    ep = torch.export.export(_CopyingReshape(), (torch.randn(1, 5, 32),),
                             dynamic_shapes=({1: n},), strict=False)
    assert views_with_inferred_dim(ep) == 2
    x = torch.randn(1, 7, 32)
    torch.testing.assert_close(ep.module()(x), _CopyingReshape()(x), rtol=0, atol=0)


class _AttentionInputs(torch.nn.Module):
    """q, k, v as transformers' attention layers make them for the attention
    function (graph/model.py): projections viewed [1, n, heads, hd] and
    transposed head-major, Qwen3's q norm (before the transpose) or Gemma3's
    k norm (after it), RoPE (apply_rotary_pos_emb: cos/sin unsqueezed to [1,
    1, n, hd]); then the attention's transposes back to token-major. With
    ``leak``, q's head-major value is also summed over its heads: a use that
    does not commute with the transposes, which must then stay."""

    def __init__(self, leak: bool = False):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(32, 32), torch.nn.Linear(32, 16),
                                  torch.nn.Linear(32, 16))
        self.q_norm, self.k_norm = Qwen3RMSNorm(8), Qwen3RMSNorm(8)
        for norm in (self.q_norm, self.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
        self.leak = leak

    def forward(self, x, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        n = x.shape[1]
        q = self.q_norm(self.q(x).view(1, n, -1, 8)).transpose(1, 2)   # Qwen3
        k = self.k_norm(self.k(x).view(1, n, -1, 8).transpose(1, 2))   # Gemma3
        v = self.v(x).view(1, n, -1, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = tuple(t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))   # _token_major
        return out + ((q.sum(1),) if self.leak else ())


def _attention_inputs(leak=False):
    n = torch.export.Dim("n", min=1, max=16)
    args = (torch.randn(1, 5, 32), torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    return torch.export.export(_AttentionInputs(leak), args, strict=False,
                               dynamic_shapes=({1: n}, {1: n}, {1: n}))


def _transposes(graph_module):
    return sum(node.target in (torch.ops.aten.transpose.int, torch.ops.aten.permute.default)
               for node in graph_module.graph.nodes)


def _delegated_permutes(program):
    """permute_copy nodes inside the XNNPACK delegates (each a copy there)."""
    gm = program.exported_program().graph_module
    lowered = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"
               and getattr(getattr(gm, n.target, None), "backend_id", None) == "XnnpackBackend"]
    return sum("permute_copy" in str(node.target) for lm in lowered
               for node in lm.original_module.graph.nodes)


@pytest.mark.parametrize("leak", [False, True])
def test_token_major_rope_removes_the_transposes_around_rope_with_the_same_values(leak):
    ep = _attention_inputs(leak)
    assert _transposes(ep.graph_module) == 6
    # q, k and v each lose both transposes, unless q's head-major value has another use.
    assert token_major_rope(ep) == (4 if leak else 6)
    assert _transposes(ep.graph_module) == (2 if leak else 0)
    x, cos, sin = torch.randn(1, 9, 32), torch.randn(1, 9, 8), torch.randn(1, 9, 8)
    want = _AttentionInputs(leak)(x, cos, sin)
    got = ep.module()(x, cos, sin)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # cos and sin: one view each ([1, n, 1, hd]) in place of their unsqueezes
    # (q's RoPE keeps its unsqueeze where q stays head-major).
    for name in ("cos", "sin"):
        users = next(n for n in ep.graph.nodes if n.name == name).users
        assert sorted(str(u.target) for u in users) == \
            ["aten.unsqueeze.default"] * leak + ["aten.view.default"]


def test_token_major_rope_leaves_no_copy_of_a_transpose_in_the_delegate():
    baseline, ep = _attention_inputs(), _attention_inputs()
    for rewrite in (means_as_pooling, views_with_inferred_dim, rotate_half_as_linear):
        rewrite(baseline)   # every rewrite but this one
    assert rewrite_for_xnnpack(ep)["token_major_rope"] == 6
    before = lower_exported(baseline)
    after = lower_exported(ep)
    assert _delegated_permutes(before) == 6
    assert _delegated_permutes(after) == 0 and "aten::permute_copy" not in _kernels(after)
    x, cos, sin = torch.randn(1, 9, 32), torch.randn(1, 9, 8), torch.randn(1, 9, 8)
    for w, g in zip(_AttentionInputs()(x, cos, sin), _run(after, x, cos, sin), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def _k_rope_first(q, k, cos):
    """k's RoPE before q's: q's region makes cos's view, k's region reads it."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k * cos.unsqueeze(1)
    q = q * cos.unsqueeze(1)
    return q.transpose(1, 2) + 0, k.transpose(1, 2) + 0


def _one_base_two_views(q, k, cos):
    """cos unsqueezed at dim 1 and at dim 2: two views of one base ([1, 1, n, hd]
    swaps to [1, n, 1, hd], [1, n, 1, hd] to [1, 1, n, hd]); one head."""
    y = q[:, :, :1].transpose(1, 2) * cos.unsqueeze(1) * cos.unsqueeze(2)
    return y.transpose(1, 2) + 0, k + 0


def _swap_of_a_region_value(q, k, cos):
    """A swap of a value computed in the region (n == heads): an exit, not an entry."""
    a = q.transpose(1, 2)
    return ((a + (a * 2).transpose(1, 2)).transpose(1, 2) + k + cos,)


def _mean_without_keepdim(q, k, cos):
    """Rank 4 -> 2 over the last dims; its last dim is then n, not head_dim
    (n == heads == head_dim)."""
    a = q.transpose(1, 2)
    return ((a * a.mean(-1).mean(-1)).transpose(1, 2) + k + cos,)


@pytest.mark.parametrize("f, dynamic", [(_k_rope_first, True), (_one_base_two_views, True),
                                        (_swap_of_a_region_value, False),
                                        (_mean_without_keepdim, False)])
def test_token_major_rope_keeps_graphs_valid_and_values_where_regions_are_unusual(f, dynamic):
    class M(torch.nn.Module):
        def forward(self, q, k, cos):
            return f(q, k, cos)

    n = torch.export.Dim("n", min=1, max=16)
    shape = (1, 5, 4, 8) if dynamic else (1, 4, 4, 4)
    args = (torch.randn(shape), torch.randn(shape), torch.randn(1, shape[1], shape[3]))
    ep = torch.export.export(M(), args, strict=False,
                             dynamic_shapes=({1: n}, {1: n}, {1: n}) if dynamic else None)
    token_major_rope(ep)
    ep.graph_module.graph.lint()
    if dynamic:
        args = (torch.randn(1, 9, 4, 8), torch.randn(1, 9, 4, 8), torch.randn(1, 9, 8))
    for w, g in zip(M()(*args), ep.module()(*args), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
