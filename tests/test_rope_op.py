"""cellcache::rope (cpp/attention/rope.h, graph/ops.py) and ``rope_as_op``, the
rewrite that puts it in exported graphs (exporting/xnnpack_rewrites.py).

The oracle is transformers' own RoPE: ``apply_rotary_pos_emb`` on the cos/sin
its rotary embedding computes. The op equals it to the bit; the rewrite fires
on transformers' pattern only (token-major, one table row per token) and keeps
every value; a program with the op gives the logits of one without it to the
bit, with as many delegate calls."""

import pytest
import torch
from torch.export import Dim
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding, apply_rotary_pos_emb,
                                                      rotate_half)

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting import xnnpack_rewrites
from executorch_cellcache.exporting.lowering import delegate_calls, lower_exported
from executorch_cellcache.exporting.xnnpack_rewrites import rope_as_op, token_major_rope
from executorch_cellcache.graph import ops
from model_configs import make_model


def _tables(n, head_dim, first=0, theta=10000.0):
    """transformers' cos and sin [1, n, head_dim] for positions first..first+n-1."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_theta=theta)
    positions = torch.arange(first, first + n)[None]
    return LlamaRotaryEmbedding(config)(torch.zeros(1, n, head_dim), positions)


@pytest.mark.parametrize("n, heads, head_dim, first", [
    (1, 1, 8, 0), (7, 3, 64, 100), (64, 4, 128, 4000), (5, 2, 2, 9)])
def test_rope_equals_transformers_to_the_bit(n, heads, head_dim, first):
    cos, sin = _tables(n, head_dim, first)
    q = torch.randn(1, heads, n, head_dim, generator=torch.Generator().manual_seed(n))
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)                  # [1, heads, n, hd]
    token_major = q.transpose(1, 2).contiguous()                    # [1, n, heads, hd]
    got = ops.rope(token_major, cos[:, :, None], sin[:, :, None])
    assert got.shape == token_major.shape
    assert torch.equal(got.transpose(1, 2), want)
    # [n, heads, hd] with [n, hd] tables: the same rows.
    assert torch.equal(ops.rope(token_major[0], cos[0], sin[0]), got[0])


def test_rope_out_fills_a_non_contiguous_out_and_takes_no_tokens():
    cos, sin = _tables(4, 8)
    x = torch.randn(4, 2, 8)
    out = torch.full((2, 4, 8), 9.0).transpose(0, 1)   # [4, 2, 8], not contiguous
    torch.ops.cellcache.rope.out(x, cos[0], sin[0], out=out)
    assert torch.equal(out, ops.rope(x, cos[0], sin[0]))
    empty = ops.rope(torch.empty(0, 2, 8), torch.empty(0, 8), torch.empty(0, 8))
    assert empty.shape == (0, 2, 8)


@pytest.mark.parametrize("x, cos, error", [
    (torch.randn(3, 2, 7), torch.randn(3, 7), InvalidConfigError),   # odd head_dim
    (torch.randn(3, 2, 8), torch.randn(3, 6), InvalidConfigError),   # not x's head_dim
    (torch.randn(3, 2, 8), torch.randn(4, 8), InvalidConfigError),   # a row per token: 3
    (torch.randn(3, 2, 8), torch.randn(2, 8), InvalidConfigError),
    (torch.randn(8), torch.randn(1, 8), InvalidConfigError),         # no heads dim
    (torch.randn(3, 2, 8).half(), torch.randn(3, 8), TypeError),
    (torch.randn(3, 2, 8), torch.randn(3, 8, dtype=torch.float64), TypeError),
])
def test_rope_refuses_bad_input(x, cos, error):
    with pytest.raises(error):
        ops.rope(x, cos, cos.clone())


def test_tables_of_n_tok_rows_in_another_layout_than_x_s_tokens_are_refused():
    """cos/sin must be [*tokens, head_dim] or [*tokens, 1, head_dim] for x [*tokens,
    n_heads, head_dim]. The op checked only the row count, so x [2, 3, 2, 8] with cos
    [3, 2, 8] (6 rows; to eager broadcasting, per-head tables shared by x's first dim)
    was read as 6 token rows: another rotation than `x * cos + rotate_half(x) * sin`,
    without a word."""
    x = torch.randn(2, 3, 2, 8)
    for shape in ((3, 2, 8), (6, 8), (2, 3, 2, 8), (2, 3, 1, 1, 8), (1, 2, 3, 8)):
        table = torch.randn(shape)
        with pytest.raises(InvalidConfigError, match=r"\[\*tokens, 1, head_dim\]"):
            ops.rope(x, table, table.clone())
    # The binding the torch kernel calls refuses them too (the rule is the core's,
    # attention::rope_shape, read by both shims), not only _check_rope before it.
    from executorch_cellcache.cache import _core
    table = torch.randn(3, 2, 8)
    with pytest.raises(InvalidConfigError, match=r"\[\*tokens, 1, head_dim\]"):
        _core.rope_op(x.numpy(), table.numpy(), table.numpy(), torch.empty_like(x).numpy())
    # The two layouts it takes, the second eager's own: the same values as eager.
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    eager = x * cos[:, :, None] + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin[:, :, None]
    torch.testing.assert_close(ops.rope(x, cos[:, :, None], sin[:, :, None]), eager)
    assert torch.equal(ops.rope(x, cos, sin), ops.rope(x, cos[:, :, None], sin[:, :, None]))


def test_the_runtime_kernel_refuses_tables_laid_out_unlike_x_s_tokens(monkeypatch, capfd):
    """A program whose rope got past export's check (here: the check switched off while
    exporting, as a crafted .pte would) fails in the ExecuTorch kernel with a message,
    instead of reading per-head tables as token rows."""
    from executorch.exir import to_edge

    class Rope(torch.nn.Module):
        def forward(self, x, cos, sin):
            return ops.rope(x, cos, sin)
    x, table = torch.randn(2, 3, 2, 8), torch.randn(3, 2, 8)
    monkeypatch.setattr(ops, "_check_rope", lambda *args: None)
    program = to_edge(torch.export.export(Rope(), (x, table, table), strict=False)
                      ).to_executorch()
    monkeypatch.undo()
    capfd.readouterr()
    with pytest.raises(RuntimeError):
        _run(program, x, table, table)
    assert "cos and sin must be [*tokens, head_dim] or [*tokens, 1, head_dim]" in \
        capfd.readouterr().err


def test_an_export_with_a_rope_the_kernel_refuses_fails_at_export():
    class OddHeadDim(torch.nn.Module):
        def forward(self, x, cos):
            return ops.rope(x, cos, cos)
    with pytest.raises(InvalidConfigError, match="head_dim must be even"):
        torch.export.export(OddHeadDim(), (torch.randn(3, 2, 7), torch.randn(3, 7)), strict=False)


class _Attention(torch.nn.Module):
    """q and k projected, RoPE'd as ``rope`` writes it, and returned
    token-major as the cell-cache attention reads them."""

    def __init__(self, rope=apply_rotary_pos_emb, head_dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
        self.rope, self.head_dim = rope, head_dim

    def forward(self, x, cos, sin):
        n = x.shape[1]
        q = self.q(x).view(1, n, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(1, n, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        return tuple(t.transpose(1, 2).flatten(0, 1) for t in (q, k))


def _swapped_operands(q, k, cos, sin):
    """cos * x + sin * rotate_half(x), the add's operands swapped too."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (sin * rotate_half(q)) + (cos * q), (rotate_half(k) * sin) + (k * cos)


def _partial(q, k, cos, sin):
    """Half the head rotated (Phi's partial_rotary_factor 0.5), the rest passed: left
    alone (_partial_rotary)."""
    half = q.shape[-1] // 2
    rot = apply_rotary_pos_emb(q[..., :half], k[..., :half], cos[..., :half], sin[..., :half])
    return tuple(torch.cat((r, t[..., half:]), -1) for r, t in zip(rot, (q, k)))


def _other_tensor_rotated(q, k, cos, sin):
    """x * cos + rotate_half(y) * sin with y != x: no RoPE."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q * 2) * sin, k * cos + rotate_half(k) * sin


def _per_head_tables(q, k, cos, sin):
    """Tables that differ per head (not one row per token): no RoPE of the op's."""
    heads = torch.arange(1, q.shape[1] + 1, dtype=torch.float32)[None, :, None, None]
    c, s = cos.unsqueeze(1) * heads, sin.unsqueeze(1) * heads
    return q * c + rotate_half(q) * s, k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)


def _export(module, n=5):
    tok = Dim("n", min=1, max=16)
    args = (torch.randn(1, n, 32), *_tables(n, module.head_dim))
    return torch.export.export(module, args, strict=False,
                               dynamic_shapes=({1: tok}, {1: tok}, {1: tok}))


def _ropes(ep):
    return sum(node.target is ops.rope for node in ep.graph.nodes)


@pytest.mark.parametrize("rope, want", [
    (apply_rotary_pos_emb, 2), (_swapped_operands, 2), (_partial, 0),
    (_other_tensor_rotated, 1), (_per_head_tables, 1)])
def test_the_rewrite_fires_on_transformers_rope_only_and_keeps_values(rope, want):
    module = _Attention(rope)
    ep = _export(module)
    token_major_rope(ep)
    assert rope_as_op(ep) == want == _ropes(ep)
    x = torch.randn(1, 9, 32)
    cos, sin = _tables(9, 8, first=300)
    for w, g in zip(module(x, cos, sin), ep.module()(x, cos, sin), strict=True):
        assert torch.equal(g, w)
    if want == 2:   # nothing of RoPE left in the graph but the op
        assert not any(node.target in (torch.ops.aten.cat.default, torch.ops.aten.neg.default)
                       for node in ep.graph.nodes)


def test_a_head_major_rope_is_left_alone():
    # Without token_major_rope the tables broadcast over the tokens' dim: the op's
    # rows would be the heads', so the rewrite must not fire.
    ep = _export(_Attention())
    assert rope_as_op(ep) == 0


def _run(program, *args):
    from executorch.runtime import Runtime

    return Runtime.get().load_program(program.buffer).load_method("forward").execute(list(args))


def _kernels(program):
    plan = program.executorch_program.execution_plan[0]
    return [plan.operators[i.instr_args.op_index].name for c in plan.chains
            for i in c.instructions if type(i.instr_args).__name__ == "KernelCall"]


def test_the_op_runs_between_delegate_calls_with_the_delegate_s_values(monkeypatch):
    ep = _export(_Attention())
    assert xnnpack_rewrites.rewrite_for_xnnpack(ep)["rope_as_op"] == 2
    with_op = lower_exported(ep)
    monkeypatch.setattr(xnnpack_rewrites, "rope_as_op", lambda ep: 0)
    ep = _export(_Attention())
    xnnpack_rewrites.rewrite_for_xnnpack(ep)
    without = lower_exported(ep)
    assert _kernels(with_op).count("cellcache::rope") == 2
    assert "cellcache::rope" not in _kernels(without)
    assert delegate_calls(with_op.buffer) == delegate_calls(without.buffer)
    for n in (1, 4, 16):
        x, (cos, sin) = torch.randn(1, n, 32), _tables(n, 8, first=77)
        for a, b in zip(_run(with_op, x, cos, sin), _run(without, x, cos, sin), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bad", ["x dtype", "rows", "head_dim"])
def test_rope_out_refusing_leaves_out_as_it_was(bad):
    """A refused rope.out writes nothing: not even out's shape changes (out.resize_ ran
    before the checks, so a refused call left out resized to x's shape)."""
    x, cos, sin = torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)
    if bad == "x dtype":
        x = x.double()
    elif bad == "rows":
        cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    else:
        cos, sin = torch.randn(3, 6), torch.randn(3, 6)
    out = torch.full((5,), 9.0)
    with pytest.raises((InvalidConfigError, TypeError)):
        torch.ops.cellcache.rope.out(x, cos, sin, out=out)
    assert out.shape == (5,) and torch.equal(out, torch.full((5,), 9.0))


def test_rope_out_into_its_own_cos_is_refused_with_cos_as_it_was():
    """out=cos, a smaller tensor than x: cos was resized to x's shape before being read,
    so the call failed quoting a row count the caller never passed, and left cos
    resized. Now the rotation is computed first; reading cos shows it to numpy, whose
    view makes its storage non-resizable, so out=cos cannot grow: refused, cos as it
    was."""
    x, cos, sin = torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)
    table = cos.clone()
    with pytest.raises(InvalidConfigError, match="cannot grow"):
        torch.ops.cellcache.rope.out(x, table, sin, out=table)
    assert torch.equal(table, cos)


def test_an_export_with_other_table_rows_than_tokens_fails_at_export():
    """graph/ops.py: "a cos/sin row count other than n_tok: InvalidConfigError (at export
    too)". The fake kernel checked dtypes and head_dim only."""
    class Rope(torch.nn.Module):
        def forward(self, x, cos, sin):
            return ops.rope(x, cos, sin)
    with pytest.raises(InvalidConfigError, match="rows"):
        torch.export.export(Rope(), (torch.randn(3, 2, 8), torch.randn(4, 8), torch.randn(4, 8)),
                            strict=False)


def test_opcheck_rope():
    """torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch) on
    rope, as on every op of ours, token-major as the rewrite calls it and [n, heads, hd]."""
    for args in ((torch.randn(1, 5, 4, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)),
                 (torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8))):
        result = torch.library.opcheck(ops.rope, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_rope_out_reused_for_a_larger_x_is_resized_or_refused_never_left_too_large():
    """rope.out showed out to numpy (out.numpy(), which makes its storage non-resizable);
    the next call with a larger x then ran out.resize_, which set out's shape and failed
    to grow its storage: out was left [4, 2, 8] over 48 floats, every later read of it
    out of bounds. Each call must leave out with as much memory as its shape needs."""
    out = torch.empty(0)
    for n in (3, 4):
        x, cos, sin = torch.randn(n, 2, 8), torch.randn(n, 8), torch.randn(n, 8)
        torch.ops.cellcache.rope.out(x, cos, sin, out=out)
        assert torch.equal(out, ops.rope(x, cos, sin))
    fixed = torch.empty(3, 2, 8)
    fixed.numpy()   # the caller's numpy view: this storage can no longer grow
    x, cos, sin = torch.randn(4, 2, 8), torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(InvalidConfigError, match="cannot grow"):
        torch.ops.cellcache.rope.out(x, cos, sin, out=fixed)
    assert fixed.shape == (3, 2, 8)


def _phi(partial_rotary_factor):
    """A toy Phi (hidden 64, 2 layers) rotating a part of each head (partial rotary)."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       partial_rotary_factor=partial_rotary_factor)
    return PhiForCausalLM(config).eval()


def test_a_partial_rotary_rope_as_op_costs_no_delegate_call(tmp_path, monkeypatch):
    """rope_as_op's premise: q and k leave the delegate anyway, so the op splits no
    partition. With partial rotary (Phi, partial_rotary_factor 0.5) the rotated half is
    concatenated back to the passed half before leaving: the cat ran in the delegate
    after the op, one more delegate call a layer (8 against 6 for 2 layers)."""
    from executorch_cellcache import export

    with_op = export(_phi(0.5), tmp_path / "with.pte", n_cells=32, max_tokens_per_step=8)
    monkeypatch.setattr(xnnpack_rewrites, "rope_as_op", lambda ep: 0)
    without = export(_phi(0.5), tmp_path / "without.pte", n_cells=32, max_tokens_per_step=8)
    assert delegate_calls(with_op.path.read_bytes()) == \
        delegate_calls(without.path.read_bytes())


def _phi3():
    """A toy Phi-3 (hidden 64, 2 layers) with the whole head rotated: its RoPE slices
    q[..., :head_dim] (an alias) and concatenates an empty pass-through part."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Phi3ForCausalLM(config).eval()


def test_phi3_s_full_rotary_rope_becomes_the_op_with_transformers_logits(tmp_path, monkeypatch):
    """aliases_and_empty_cats lets token_major_rope and rope_as_op see Phi-3's RoPE:
    2 ops a layer, fewer delegate calls than without it, transformers' logits."""
    from executorch_cellcache import Runner, export

    model = _phi3()
    ids = [5, 77, 31, 200, 9, 140, 66]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    with_op = export(model, tmp_path / "with.pte", n_cells=32, max_tokens_per_step=8)
    runner = Runner(with_op.path)
    s = runner.cache.seq_new()
    got = runner.step([s] * len(ids), ids, list(range(len(ids))), list(range(len(ids))))
    torch.testing.assert_close(torch.as_tensor(got), want, rtol=0, atol=1e-4)
    monkeypatch.setattr(xnnpack_rewrites, "aliases_and_empty_cats", lambda ep: 0)
    without = export(_phi3(), tmp_path / "without.pte", n_cells=32, max_tokens_per_step=8)
    assert _pte_kernels(with_op.path).count("cellcache::rope") == 4
    assert "cellcache::rope" not in _pte_kernels(without.path)
    assert delegate_calls(with_op.path.read_bytes()) <= delegate_calls(without.path.read_bytes())


def _pte_kernels(path):
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(path.read_bytes())
    plan = getattr(program, "program", program).execution_plan[0]
    return [plan.operators[i.instr_args.op_index].name for c in plan.chains
            for i in c.instructions if type(i.instr_args).__name__ == "KernelCall"]


def test_aliases_and_empty_cats_keep_values_and_leave_other_cats():
    class Graph(torch.nn.Module):
        def forward(self, x):
            d = x.shape[-1]
            whole, empty = x[..., :d], x[..., d:]           # an alias and an empty slice
            a = torch.cat([whole * 2, empty], -1)           # -> whole * 2
            b = torch.cat([empty, x + 1], -1)               # -> x + 1
            c = torch.cat([x, x], -1)                       # a real cat: kept
            return a, b, c
    n = Dim("n", min=1, max=16)
    ep = torch.export.export(Graph(), (torch.randn(1, 5, 8),), dynamic_shapes=({1: n},),
                             strict=False)
    assert xnnpack_rewrites.aliases_and_empty_cats(ep) >= 2
    cats = [node for node in ep.graph.nodes if node.target is torch.ops.aten.cat.default]
    assert len(cats) == 1
    x = torch.randn(1, 9, 8)
    for w, g in zip(Graph()(x), ep.module()(x), strict=True):
        assert torch.equal(g, w)
