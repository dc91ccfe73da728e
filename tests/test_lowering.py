"""exporting/lowering.py's graph rewrite before XNNPACK: ``means_as_pooling``
turns last-dim means (RMSNorm's) into the 4-D form XNNPACK takes, keeps the
values, and leaves alone the means it cannot view that way."""

import pytest
import torch

from executorch_cellcache.exporting.lowering import lower_exported, means_as_pooling


class _Means(torch.nn.Module):
    def forward(self, x3, x4):
        a = x3.pow(2).mean(-1, keepdim=True)             # RMSNorm's: [1, n, H] -> [1, n, 1]
        b = x4.mean(dim=3, keepdim=True)                 # q/k norm: [1, n, heads, hd]
        c = x4.transpose(1, 2).mean(-1, keepdim=True)    # transposed: not viewable
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
    assert means_as_pooling(ep) == 2
    got = ep.module()(x3, x4)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_rewritten_means_run_inside_xnnpack():
    baseline = lower_exported(_export())
    ep = _export()
    means_as_pooling(ep)
    program = lower_exported(ep)
    # The four means it leaves stay portable; the two it rewrites are delegated.
    assert _native_means(baseline) == 6
    assert _native_means(program) == 4
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(program.buffer).load_method("forward")
    x3, x4 = torch.randn(1, 9, 24), torch.randn(1, 9, 3, 8)
    for w, g in zip(_Means()(x3, x4), method.execute([x3, x4]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
