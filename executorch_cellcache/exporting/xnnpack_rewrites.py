"""Graph rewrites before XNNPACK partitioning: ops XNNPACK refuses, rewritten
into equal ones it takes, and RoPE moved out of the delegate into the cell
cache's own op.

A refused op runs as a portable kernel between two delegate calls, so each
one splits a layer's XNNPACK partition; every call costs a fixed overhead
per step (the 135M bench program made 273 of them a B=1 step, about 1.5 of
its 5.3 ms). With these rewrites a decoder layer's work outside the cell
cache's own ops (o_proj, MLP, the next layer's norm, q/k/v and RoPE) is one
partition (``lowering.delegate_calls``: n_layers + 3 a step for Llama, Qwen3,
Mistral and Gemma3). Each rewrite keeps the values: the same arithmetic in
another form (tests/test_lowering.py checks each against eager torch).

- ``aliases_and_empty_cats``: ``alias(x)`` -> x, ``cat([x, empty])`` -> x (Phi-3's
  RoPE with a full rotary dim: ``q[..., :d]`` of the whole head and a cat with
  the empty pass-through part), so the rewrites below see transformers' usual
  RoPE;
- ``token_major_rope``: q/k/v stay token-major ([1, n_tok, heads, head_dim])
  through RoPE and q/k norms: transformers' transposes to head-major and the
  attention's transposes back cancel (6 transposes a layer, each a copy in
  the delegate);
- ``rope_as_op``: RoPE (``x * cos + rotate_half(x) * sin``, token-major) ->
  one ``cellcache::rope`` op between the delegate and the K/V write / attend,
  which read q and k outside the delegate anyway;
- ``means_as_pooling``: RMSNorm's last-dim mean -> the 4-D mean XNNPACK takes;
- ``views_with_inferred_dim``: a view/reshape/unsqueeze of a dynamic shape
  (transformers' ``view(1, n_tok, -1, head_dim)``) -> a view with one -1;
- ``rotate_half_as_linear``: RoPE's ``rotate_half`` (two slices, a neg and a cat)
  -> one linear with a constant +-1 weight;
- ``tanh_gelu_as_primitives``: Gemma's tanh GELU -> mul/add/tanh (XNNPACK's own
  GELU is the erf one).
"""

import math
from typing import Callable, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

ROTATE_HALF = "cellcache_rotate_half"   # rotate_half_as_linear's weights: their names
Rewrite = Callable[[Graph, Node], Optional[Tuple[Node, List[Node]]]]


def rewrite_for_xnnpack(ep) -> dict:
    """Runs every rewrite on ``ep`` in place; {name: how many it rewrote}."""
    return {f.__name__: f(ep) for f in (aliases_and_empty_cats, token_major_rope, rope_as_op,
                                        means_as_pooling,
                                        views_with_inferred_dim, rotate_half_as_linear,
                                        tanh_gelu_as_primitives)}


def _rewrite_each(ep, rewrite: Rewrite) -> int:
    """Calls ``rewrite(graph, node)`` (inserting before ``node``) on every
    call_function node of ``ep``; where it returns (replacement, inputs), the
    node's uses go to the replacement, the node is erased, and so is each of
    ``inputs`` (in order) left without users. Returns how many it replaced."""
    graph = ep.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        with graph.inserting_before(node):
            done = rewrite(graph, node)
        if done is None:
            continue
        new, inputs = done
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for old in inputs:
            if not old.users:
                graph.erase_node(old)
        count += 1
    ep.graph_module.recompile()
    return count


def _call(graph: Graph, target, *args, **kwargs) -> Node:
    """A new node computing ``target(*args)``, its meta value computed from
    its inputs' (fake) values."""
    node = graph.call_function(target, args, kwargs or None)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, Node) else a for a in args],
                              **kwargs)
    return node


def _swapped(node: Node) -> Optional[Node]:
    """x if ``node`` swaps dims 1 and 2 of a rank-4 x (``transpose(x, 1, 2)``
    or ``permute(x, [0, 2, 1, 3])``), else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    x = node.args[0]
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    if node.target is torch.ops.aten.transpose.int:
        return x if sorted(d % 4 for d in node.args[1:3]) == [1, 2] else None
    if node.target is torch.ops.aten.permute.default:
        return x if [d % 4 for d in node.args[1]] == [0, 2, 1, 3] else None
    return None


# Ops f with f(swap(x)) == swap(f(x)) for a swap of dims 1 and 2:
# elementwise ones, and ones over the last dim only (_last_dim_only).
_ELEMENTWISE = {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor,
                torch.ops.aten.div.Tensor, torch.ops.aten.neg.default, torch.ops.aten.rsqrt.default,
                torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.to.dtype,
                torch.ops.aten._to_copy.default, torch.ops.aten.type_as.default}
_LAST_DIM = {torch.ops.aten.mean.dim, torch.ops.aten.slice.Tensor, torch.ops.aten.cat.default,
             torch.ops.aten.linear.default}
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default,
             torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def _last_dim_only(node: Node) -> bool:
    """Whether ``node`` (of _LAST_DIM) works on the last dim of a rank-4 tensor only."""
    if node.target is torch.ops.aten.linear.default:
        return True
    if node.target in (torch.ops.aten.cat.default, torch.ops.aten.slice.Tensor):
        dims = [node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)]
    else:   # mean.dim
        dims = list(node.args[1]) if len(node.args) > 1 and node.args[1] is not None else [None]
    return all(d is not None and d % 4 == 3 for d in dims)


def _is_dtype_check(node: Node) -> bool:
    """transformers' dtype assertion, which holds whatever the layout."""
    return (node.target is torch.ops.aten._assert_tensor_metadata.default
            and all(a is None for a in node.args[1:3])
            and node.kwargs.get("size") is None and node.kwargs.get("stride") is None)


def _tensor_args(node: Node) -> List[Node]:
    """The tensors ``node`` reads that are laid out like its output (a
    linear's weight and bias are not)."""
    if node.target is torch.ops.aten.linear.default:
        return [node.args[0]]
    found = []
    for a in list(node.args) + list(node.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, Node):
                found.append(x)
    return found


def _region(start: Node) -> Optional[Tuple[List[Node], List[Node], List[Node], List[Node]]]:
    """The ops between head-major swaps and their swaps back that commute
    with the swap, grown from the swap ``start``: (entries, ops, exits,
    outside operands), or None when some op or use does not commute."""
    entries, ops, exits = [start], [], []
    seen = {start}
    stack = [start]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen or _is_dtype_check(user):
                continue
            seen.add(user)
            if _swapped(user) is node:
                exits.append(user)
                continue
            if user.target not in _ELEMENTWISE and not (user.target in _LAST_DIM
                                                          and _last_dim_only(user)):
                return None
            val = user.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() != 4:
                return None   # a dim's number would change meaning (mean without keepdim)
            ops.append(user)
            stack.append(user)
            for a in _tensor_args(user):
                if a not in seen and _swapped(a) is not None:   # q and k in one op
                    seen.add(a)
                    entries.append(a)
                    stack.append(a)
    region = set(entries) | set(ops)
    if not exits or any(_swapped(e) in region for e in entries):
        return None   # a swap of a region's value: an exit, not an entry
    outside = list(dict.fromkeys(a for op in ops for a in _tensor_args(op) if a not in region))
    for a in outside:   # computed from the region: it would see the old layout
        if a in exits or any(x in region for x in a.all_input_nodes):
            return None
    return entries, ops, exits, outside


def _swapped_operands(outside: List[Node]):
    """{operand: (base, shape)} for the operands of a region that broadcast
    over one of dims 1 and 2 (RoPE's cos and sin, [1, 1, n_tok, head_dim]):
    each is read as ``base.view(shape)``, its dims 1 and 2 swapped, where base
    is the operand or, for a view of a contiguous tensor (each layer's
    cos.unsqueeze(1)), that tensor: one view of cos and one of sin for every
    layer. Operands broadcast over both dims (a norm's weight) need none.
    None when an operand broadcasts differently in the two layouts."""
    found = {}
    for a in outside:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if val.dim() > 4:
            return None
        shape = [1] * (4 - val.dim()) + list(val.shape)
        if shape[1] == 1 and shape[2] == 1:
            continue
        swapped = [shape[0], shape[2], shape[1], shape[3]]
        view = [d if isinstance(d, int) else -1 for d in swapped]
        if val.dim() != 4 or 1 not in (shape[1], shape[2]) or view.count(-1) > 1:
            return None
        base = a.args[0] if a.target in _RESHAPES else a
        base_val = base.meta.get("val")
        if base is not a and not (isinstance(base_val, torch.Tensor)
                                  and base_val.is_contiguous()
                                  and base_val.numel() == val.numel()):
            base = a
        try:
            base.meta["val"].view(view)
        except (RuntimeError, ValueError):
            return None
        found[a] = (base, view)
    return found


def aliases_and_empty_cats(ep) -> int:
    """Every ``alias(x)`` -> x, and every ``cat`` of two tensors of one dtype
    where one is empty along the cat's dim (a static 0) -> the other, whose
    shape the cat has: the same values, no op. Phi-3 writes its RoPE so
    (``q[..., :rotary_dim]`` then ``cat([rotated, q[..., rotary_dim:]])``);
    with a full rotary dim the slice is an alias and the pass-through part
    empty, which ``token_major_rope`` and ``rope_as_op`` would not see through.
    Returns how many."""
    def rewrite(graph, node):
        if node.target is torch.ops.aten.alias.default and isinstance(node.args[0], Node):
            return node.args[0], []
        if node.target is not torch.ops.aten.cat.default or len(node.args[0]) != 2:
            return None
        val = node.meta.get("val")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(val, torch.Tensor):
            return None
        for kept, empty in (node.args[0], node.args[0][::-1]):
            kv, ev = kept.meta.get("val"), empty.meta.get("val")
            if not (isinstance(kv, torch.Tensor) and isinstance(ev, torch.Tensor)):
                return None
            size = ev.shape[dim]
            if (isinstance(size, int) and size == 0 and kv.dtype == ev.dtype == val.dtype
                    and [str(d) for d in kv.shape] == [str(d) for d in val.shape]):
                return kept, [empty]
        return None
    return _rewrite_each(ep, rewrite)


def token_major_rope(ep) -> int:
    """Every transpose of q, k or v to transformers' head-major layout ([1,
    heads, n_tok, head_dim]) whose ops until the attention's transpose back
    (RoPE's mul/add/rotate_half, Qwen3's and Gemma3's q/k RMSNorm, dtype
    casts) work elementwise or on the last dim: both transposes removed, the
    ops run token-major, and each rank-4 operand broadcast over the heads
    (RoPE's cos and sin, [1, 1, n_tok, head_dim]) viewed as [1, n_tok, 1,
    head_dim]. The same values (the same arithmetic on every element); each
    transpose was a copy in the delegate, 6 a layer. Operands of rank 1 (a
    norm's weight) and scalars broadcast alike in both layouts. Returns how
    many transposes it removed."""
    graph = ep.graph_module.graph
    removed = 0
    views = {}
    for start in [n for n in graph.nodes if _swapped(n) is not None]:
        if start.graph is not graph or not start.users:
            continue   # erased or emptied by an earlier region
        found = _region(start)
        if found is None:
            continue
        entries, ops, exits, outside = found
        swap_of = _swapped_operands(outside)
        if swap_of is None:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        ops.sort(key=order.__getitem__)
        swapped_operand = {}
        for a, (base, shape) in swap_of.items():
            first = next(op for op in ops if a in op.all_input_nodes)
            key = (base, tuple(shape))   # one base may be viewed in two shapes
            if key not in views:
                with graph.inserting_before(first):
                    views[key] = _call(graph, torch.ops.aten.view.default, base, shape)
                order[views[key]] = order[first] - 0.5
            elif order[views[key]] > order[first]:   # made for a later use
                first.prepend(views[key])
                order[views[key]] = order[first] - 0.5
            swapped_operand[a] = views[key]
        inputs = {e: _swapped(e) for e in entries}
        new = lambda a: inputs.get(a, swapped_operand.get(a, a))  # noqa: E731
        for op in ops:
            op.args = torch.fx.node.map_arg(op.args, new)
            op.kwargs = torch.fx.node.map_arg(op.kwargs, new)
        for a in swapped_operand:
            if not a.users:
                graph.erase_node(a)
        for op in ops:   # graph order: inputs' values first
            args = torch.fx.node.map_arg(op.args, lambda a: a.meta["val"])
            kwargs = torch.fx.node.map_arg(op.kwargs, lambda a: a.meta["val"])
            op.meta["val"] = op.target(*args, **kwargs)
        for e in exits:
            e.replace_all_uses_with(inputs.get(e.args[0], e.args[0]))
            graph.erase_node(e)
            removed += 1
        for e in entries:
            for user in list(e.users):   # dtype checks of the head-major tensor
                user.replace_input_with(e, inputs[e])
            graph.erase_node(e)
            removed += 1
    ep.graph_module.recompile()
    return removed


def means_as_pooling(ep) -> int:
    """Every fp32 ``mean(x, dim=-1, keepdim=True)`` whose input has at most
    one dynamic dim -> view as [1, N, 1, D] -> ``mean(dims=[2, 3],
    keepdim=True)`` -> view back: the same values (XNNPACK averages the D
    elements of each row), in the one form XNNPACK's partitioner takes (its
    MeanDimConfig: 4-D, dims [2, 3], keepdim). A transposed input (Gemma3's q/k
    norms) is first made contiguous, a copy XNNPACK makes inside the delegate
    (a reshape would decompose into a view of a symbolic size, which XNNPACK
    refuses). RMSNorm computes exactly such a mean. Returns how many."""
    def rewrite(graph, node):
        if node.target is not torch.ops.aten.mean.dim:
            return None
        x = node.args[0]
        val = x.meta.get("val")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = node.args[1] if len(node.args) > 1 else None
        if (not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or not keepdim
                or node.kwargs.get("dtype") is not None or dims is None
                or list(dims) not in ([-1], [val.dim() - 1])):
            return None
        shape = list(val.shape)
        dynamic = [d for d in shape if not isinstance(d, int)]
        if len(dynamic) > 1 or not isinstance(shape[-1], int):
            return None  # XNNPACK's reshape infers at most one dim
        as_4d = [1, -1 if dynamic else math.prod(shape[:-1]), 1, shape[-1]]
        try:
            val.view(as_4d)
        except (RuntimeError, ValueError):
            x = _call(graph, torch.ops.aten.clone.default, x,
                      memory_format=torch.contiguous_format)
        mean = _call(graph, torch.ops.aten.mean.dim,
                     _call(graph, torch.ops.aten.view.default, x, as_4d), [2, 3], True)
        back = [d if isinstance(d, int) else -1 for d in shape[:-1]] + [1]
        return _call(graph, torch.ops.aten.view.default, mean, back), []
    return _rewrite_each(ep, rewrite)


def views_with_inferred_dim(ep) -> int:
    """Every ``view``, ``reshape`` or ``unsqueeze`` whose output has exactly
    one dynamic dim -> ``view`` with the static dims written out and -1 for
    that one (after a contiguous copy where a reshape copies): the same
    tensor, in the form XNNPACK's reshape takes (it refuses
    a shape holding a symbol, such as transformers' ``view(1, n_tok, -1,
    head_dim)`` of q, k and v, and an unsqueeze other than of the last dim).
    Returns how many."""
    targets = _RESHAPES

    def rewrite(graph, node):
        val = node.meta.get("val")
        if node.target not in targets or not isinstance(val, torch.Tensor):
            return None
        dynamic = [d for d in val.shape if not isinstance(d, int)]
        static_args = node.target is not torch.ops.aten.unsqueeze.default and all(
            isinstance(d, int) for d in node.args[1])
        if len(dynamic) != 1 or static_args:
            return None
        shape = [d if isinstance(d, int) else -1 for d in val.shape]
        x = node.args[0]
        try:
            x.meta["val"].view(shape)
        except (RuntimeError, ValueError):   # a reshape that copies: the copy, then a view
            x = _call(graph, torch.ops.aten.clone.default, x,
                      memory_format=torch.contiguous_format)
        view = graph.call_function(torch.ops.aten.view.default, (x, shape))
        view.meta["val"] = val
        return view, []
    return _rewrite_each(ep, rewrite)


def tanh_gelu_as_primitives(ep) -> int:
    """Every fp32 tanh-approximate ``gelu`` (Gemma's gelu_pytorch_tanh) -> the
    formula PyTorch's kernel computes, 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))), in ops XNNPACK runs (mul, add, tanh); lowering keeps the
    tanh form away from XNNPACK's GELU, which is the exact (erf) one
    (``lowering._ExactGeluConfig``). Returns how many."""
    mul, add = torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor

    def rewrite(graph, node):
        if (node.target is not torch.ops.aten.gelu.default
                or node.kwargs.get("approximate", "none") != "tanh"):
            return None
        x = node.args[0]
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            return None
        cube = _call(graph, mul, _call(graph, mul, x, x), x)
        inner = _call(graph, mul, _call(graph, add, x, _call(graph, mul, cube, 0.044715)),
                      math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
        tanh = _call(graph, torch.ops.aten.tanh.default, inner)
        return _call(graph, mul, _call(graph, mul, x, 0.5), _call(graph, add, tanh, 1.0)), []
    return _rewrite_each(ep, rewrite)


def _slice_of(node: Node, start: int, end: int) -> Optional[Node]:
    """The input x of ``node`` if it is ``aten.slice(x, last dim, start,
    end)`` (step 1; an end past the size counts as the size), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return None
    defaults = (None, 0, None, None, 1)   # aten.slice.Tensor(self, dim, start, end, step)
    x, dim, first, last, step = list(node.args) + list(defaults[len(node.args):])
    size = x.meta["val"].shape[-1]
    if dim not in (-1, x.meta["val"].dim() - 1) or (step or 1) != 1 or (first or 0) != start:
        return None
    return x if min(size if last is None else last, size) == end else None


def _add_parameter(ep, name: str, data: torch.Tensor) -> Node:
    """A new parameter placeholder of ``ep`` (before its user inputs, as
    torch.export orders them) holding ``data``; its meta value a fake tensor
    of the graph's own fake mode."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec,
                                              TensorArgument)

    graph = ep.graph_module.graph
    fake_mode = next(n.meta["val"].fake_mode for n in graph.nodes
                     if isinstance(n.meta.get("val"), FakeTensor))
    specs = list(ep.graph_signature.input_specs)
    first_user = next(i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(placeholders[first_user]):
        node = graph.placeholder(name)
    node.meta["val"] = fake_mode.from_tensor(data, static_shapes=True)
    ep.state_dict[node.name] = torch.nn.Parameter(data, requires_grad=False)
    specs.insert(first_user, InputSpec(InputKind.PARAMETER, TensorArgument(node.name),
                                       node.name))
    ep._graph_signature = ExportGraphSignature(specs, ep.graph_signature.output_specs)
    return node


def _rotate_half_input(node: Node) -> Optional[Node]:
    """x if ``node`` is RoPE's ``rotate_half(x)`` as transformers writes it
    (``cat([-x[..., h:], x[..., :h]], -1)``, x fp32 with a static even last
    dim 2h), else None."""
    val = node.meta.get("val")
    if (node.op != "call_function" or node.target is not torch.ops.aten.cat.default
            or not isinstance(val, torch.Tensor)):
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if (len(parts) != 2 or val.dtype != torch.float32 or dim not in (-1, val.dim() - 1)
            or not isinstance(val.shape[-1], int) or val.shape[-1] % 2):
        return None
    neg, low = parts
    half = val.shape[-1] // 2
    if neg.op != "call_function" or neg.target is not torch.ops.aten.neg.default:
        return None
    x = _slice_of(neg.args[0], half, 2 * half)
    return x if x is not None and _slice_of(low, 0, half) is x else None


def _rotate_half_nodes(cat: Node) -> List[Node]:
    """The nodes of ``rotate_half`` ending in ``cat``, users first (to erase)."""
    neg, low = cat.args[0]
    return [cat, neg, neg.args[0], low]


def _mul_operands(node: Node) -> Optional[Tuple[Node, Node]]:
    if (node.op != "call_function" or node.target is not torch.ops.aten.mul.Tensor
            or node.kwargs or len(node.args) != 2
            or not all(isinstance(a, Node) for a in node.args)):
        return None
    return node.args[0], node.args[1]


def _rope_operands(node: Node) -> Optional[Tuple[Node, Node, Node, List[Node]]]:
    """(x, cos, sin, the pattern's other nodes but the add, users first) if
    ``node`` is RoPE as transformers writes it, ``x * cos + rotate_half(x) *
    sin`` (either order of each mul and the add), token-major: x fp32 [...,
    n_tok, n_heads, head_dim], cos and sin [..., n_tok, 1, head_dim]
    (``token_major_rope``'s views), so that each token's table row is the one
    cellcache::rope reads, and x a whole head (not ``_partial_rotary``); else
    None."""
    if (node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.args) != 2
            or not all(isinstance(a, Node) for a in node.args)):
        return None
    for plain, rotated in (node.args, node.args[::-1]):
        ops_plain, ops_rotated = _mul_operands(plain), _mul_operands(rotated)
        if ops_plain is None or ops_rotated is None:
            continue
        for cat, sin in (ops_rotated, ops_rotated[::-1]):
            x = _rotate_half_input(cat)
            if x is None or x not in ops_plain or ops_plain[0] is ops_plain[1]:
                continue
            cos = ops_plain[1] if ops_plain[0] is x else ops_plain[0]
            if _token_major_table(x, cos) and _token_major_table(x, sin) and \
                    not _partial_rotary(x):
                return x, cos, sin, [plain, rotated] + _rotate_half_nodes(cat)
    return None


def _partial_rotary(x: Node) -> bool:
    """Whether x is the rotated part of each head, ``head[..., :r]`` with r less than
    head_dim (Phi's partial_rotary_factor): its RoPE is concatenated back to the passed
    part, a cat the delegate would run after the op, one more delegate call a layer."""
    xv = x.meta.get("val")
    if x.op != "call_function" or x.target is not torch.ops.aten.slice.Tensor or \
            not isinstance(xv, torch.Tensor):
        return False
    head = _slice_of(x, 0, xv.shape[-1])
    return head is not None and head.meta["val"].shape[-1] != xv.shape[-1]


def _token_major_table(x: Node, table: Node) -> bool:
    """Whether ``table`` holds one fp32 row of x's head_dim per token of x
    ([..., n_tok, n_heads, head_dim]), broadcast over the heads: the same
    leading dims (ints or symbols), then 1, then head_dim."""
    xv, tv = x.meta.get("val"), table.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(tv, torch.Tensor)) or \
            xv.dtype != torch.float32 or tv.dtype != torch.float32 or \
            xv.dim() < 2 or tv.dim() != xv.dim():
        return False
    same = [str(a) == str(b) for a, b in zip(xv.shape[:-2], tv.shape[:-2])]
    return (all(same) and isinstance(tv.shape[-2], int) and tv.shape[-2] == 1
            and isinstance(xv.shape[-1], int) and tv.shape[-1] == xv.shape[-1])


def rope_as_op(ep) -> int:
    """Every token-major RoPE (``_rope_operands``: transformers'
    ``x * cos + rotate_half(x) * sin`` after ``token_major_rope``) ->
    ``cellcache::rope(x, cos, sin)`` (graph/ops.py, cpp/attention/rope.h): the
    same values to the bit (each product rounded before the sum, as here), in
    one op outside the delegate where there were six inside it (two muls, an
    add, and rotate_half's slices, neg and cat, or its linear). A layer's q
    and k leave the delegate anyway, for the K/V write and attend, so the
    partition is not split; the 135M bench model decodes 1.07x faster without
    RoPE at B=1 (docs/benchmarks.md). Returns how many."""
    from executorch_cellcache.graph import ops   # registers cellcache::rope

    def rewrite(graph, node):
        found = _rope_operands(node)
        if found is None:
            return None
        x, cos, sin, pattern = found
        return _call(graph, ops.rope, x, cos, sin), pattern
    return _rewrite_each(ep, rewrite)


def rotate_half_as_linear(ep) -> int:
    """Every fp32 ``cat([-x[..., h:], x[..., :h]], -1)`` (RoPE's
    ``rotate_half`` as transformers writes it; x's last dim 2h, static) ->
    ``linear(x, R)`` with a constant R [2h, 2h] holding one -1 or +1 per row:
    the same values (each output is one input times +-1, plus zeros), as one
    op XNNPACK runs where there were four. (Written when XNNPACK's partitioner
    refused slices of a dynamic shape, which split each layer's partition;
    lowering.py now lets them in, and the four-op form decoded the 135M bench
    model 0.99-1.01x as fast as this one: kept. Since ``rope_as_op`` the
    usual RoPE has no rotate_half left in the graph; partial or unusual ones
    may.) R is a parameter named ``ROTATE_HALF``_2h, one per size. Returns how
    many."""
    weights = {}

    def rewrite(graph, node):
        x = _rotate_half_input(node)
        if x is None:
            return None
        val = node.meta["val"]
        half = val.shape[-1] // 2
        if half not in weights:
            r = torch.zeros(2 * half, 2 * half)
            r[torch.arange(half), torch.arange(half) + half] = -1.0
            r[torch.arange(half) + half, torch.arange(half)] = 1.0
            weights[half] = _add_parameter(ep, f"{ROTATE_HALF}_{2 * half}", r)
        linear = graph.call_function(torch.ops.aten.linear.default, (x, weights[half]))
        linear.meta["val"] = val
        return linear, _rotate_half_nodes(node)[1:]
    return _rewrite_each(ep, rewrite)
