"""torch.export -> ExecuTorch lowering shared by every cell-cache program.

Linear layers and matmuls go to the XNNPACK delegate; the cell-cache ops stay
CPU kernels. K/V writes are ``cellcache::write`` (graph/ops.py), emitted in
place on the mutable cache buffers; ``run_reinplace_pass`` turns any other
functionalized buffer write back into an in-place ``index_put_``. A step never
copies a whole cache (``full_cache_copies`` checks the emitted graph).

Before lowering, ``xnnpack_rewrites.rewrite_for_xnnpack`` rewrites the ops
XNNPACK would refuse (RMSNorm's means, RoPE's slices, views of dynamic
shapes, tanh GELU) into equal ones it takes, so that each layer is one
delegate call (``delegate_calls`` counts them) instead of a dozen split
around portable kernels.

Quantized programs (quantize.py) go to one XNNPACK partitioner for dynamically
quantized and fp32 ops alike (one partition per run of delegable ops, not one
per precision), and are emitted with the quant fusion pass (quantized embeddings -> the runtime's quantized embedding kernels);
``delegated_linears`` and ``torchao_ops`` check the result.
"""

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from executorch_cellcache.exporting.quiet_imports import quiet_third_party_imports
from executorch_cellcache.exporting.xnnpack_rewrites import ROTATE_HALF, rewrite_for_xnnpack

with quiet_third_party_imports():
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    import executorch.backends.xnnpack.operators  # noqa: F401  (fills the visitor table)
    from executorch.backends.xnnpack.operators.node_visitor import (
        NodeVisitor, _node_visitor_dict, register_node_visitor)
    from executorch.backends.xnnpack.partition.config.generic_node_configs import (
        GeluConfig, SliceCopyConfig)
    from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import (
        XNNStaticSlice, XNode)
    from executorch.backends.xnnpack.partition.config.xnnpack_config import (
        ConfigPrecisionType,
    )
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

Progress = Callable[[str], None]


class _ExactGeluConfig(GeluConfig):
    """XNNPACK's GELU is the exact (erf) one: its visitor ignores
    ``approximate``, so a tanh-approximate GELU (Gemma's gelu_pytorch_tanh)
    delegated to it drifts ~3e-4 per activation. Leave those to the portable
    kernel, which honours ``approximate``."""

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        if node.kwargs.get("approximate", "none") != "none":
            return False
        return super().check_constraints(node, ep)


def _same_dim(a, b) -> bool:
    """Two dims of fake tensors equal: the same int, or the same symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b > 0
    return str(a) == str(b)


def _slice_dim(node: torch.fx.Node) -> int:
    return node.args[1] % len(node.args[0].meta["val"].shape) if len(node.args) > 1 else 0


def _slice_offset(node: torch.fx.Node) -> Optional[int]:
    """Where a slice_copy starts along its dim (a negative start counted from
    the end, as torch does); None for a start before the dim's beginning
    (torch clamps it to 0; the serialized offset would be negative) or one
    that is not an int of a static dim."""
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    size = node.args[0].meta["val"].shape[_slice_dim(node)]
    if not isinstance(start, int) or not isinstance(size, int):
        return None
    offset = start + size if start < 0 else start
    return offset if offset >= 0 else None


class _DynamicSliceConfig(SliceCopyConfig):
    """XNNPACK's slice, also of a dynamically shaped tensor (ExecuTorch's
    config refuses any symbolic dim): allowed where the sliced dim is static
    and every other dim whole, the form of the fused projections' parts
    (graph/fused_projections.py) on a [.., tokens, features] tensor. The
    serialized slice (``_DynamicSliceVisitor``) gives those whole dims size
    0, which XNNPACK's static slice reads as "all of the input's": its
    reshape, run on every call, takes the tokens of that call. A static
    slice is ExecuTorch's to judge, as before (any precision it lowers)."""

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        shape_in = node.args[0].meta["val"].shape
        dim = _slice_dim(node)
        if _slice_offset(node) is None:
            return False   # the portable kernel clamps as torch does
        if all(isinstance(d, int) for d in shape_in):
            return super().check_constraints(node, ep)
        if not self.check_common_constraints(node, ep):
            return False
        if len(node.args) > 4 and node.args[4] != 1:
            return False   # strided
        quantized = "quantize" in str(getattr(node.args[0], "target", "")) or any(
            "quantize" in str(user.target) for user in node.users)
        if quantized or "XNN_NHWC_NODE" in node.meta or node.meta["val"].dtype != torch.float32:
            return False   # statically quantized or channels-last: not a form this takes
        shape_out = node.meta["val"].shape
        if not isinstance(shape_in[dim], int) or not isinstance(shape_out[dim], int) \
                or shape_out[dim] <= 0:
            return False
        return all(_same_dim(a, b) for i, (a, b) in enumerate(zip(shape_in, shape_out))
                   if i != dim)


_EXECUTORCH_SLICE_VISITOR = _node_visitor_dict["aten.slice_copy.Tensor"]


@register_node_visitor
class _DynamicSliceVisitor(NodeVisitor):
    """aten.slice_copy (stride 1) of a dynamically shaped tensor as XNNPACK's
    static slice: the symbolic dims (whole, never the sliced one) get size 0,
    the input's, whatever it is on a call (see _DynamicSliceConfig). Static
    shapes go to ExecuTorch's own visitor, which this one replaces in its
    visitor table (the table holds one per op)."""

    target = "aten.slice_copy.Tensor"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._static = _EXECUTORCH_SLICE_VISITOR(*args)

    def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
        shape_in, shape_out = node.args[0].meta["val"].shape, node.meta["val"].shape
        if all(isinstance(d, int) for d in shape_in):
            self._static.define_node(node, xnn_graph, vals_to_ids, debug_handle)
            return
        self.define_nodes_tensor_inputs_outputs(node, xnn_graph, vals_to_ids)
        offsets = [0] * len(shape_in)
        offsets[_slice_dim(node)] = _slice_offset(node)
        sizes = [d if isinstance(d, int) else 0 for d in shape_out]
        xnn_graph.xnodes.append(XNode(
            xnode_union=XNNStaticSlice(num_dims=len(shape_in), offsets=offsets, sizes=sizes,
                                       input_id=vals_to_ids[node.args[0]],
                                       output_id=vals_to_ids[node], flags=0),
            debug_handle=debug_handle))


_PARTITIONER_CONFIGS = [_ExactGeluConfig if c is GeluConfig else
                        _DynamicSliceConfig if c is SliceCopyConfig else c
                        for c in ALL_PARTITIONER_CONFIGS]


def lower(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], dynamic_shapes,
          constant_methods: Optional[Dict[str, object]] = None,
          progress: Optional[Progress] = None, quantized: bool = False):
    """Exports ``module`` (non-strict) and lowers it; returns the
    ExecutorchProgramManager (``.buffer`` holds the .pte bytes). ``progress``
    receives one line per stage; ``quantized``: see lower_exported."""
    say = progress or (lambda _line: None)
    with torch.no_grad():
        t0 = time.perf_counter()
        say("torch.export ...")
        ep = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic_shapes,
                                 strict=False)
        say(f"torch.export done in {time.perf_counter() - t0:.1f} s")
        rewrite_for_xnnpack(ep)
        return lower_exported(ep, constant_methods, progress, quantized=quantized)


def lower_exported(ep, constant_methods: Optional[Dict[str, object]] = None,
                   progress: Optional[Progress] = None, reinplace: bool = True,
                   quantized: bool = False):
    """Lowers an ExportedProgram with XNNPACK and emits it. ``reinplace=False``
    keeps ExecuTorch's default emission (the stock baseline of the benchmark).
    ``quantized``: a graph with torchao-quantized weights; its dynamically
    quantized linears are partitioned with the fp32 ops around them, and the
    quant fusion pass runs at emission."""
    say = progress or (lambda _line: None)
    # One partitioner for both precisions: dynamically quantized linears and the fp32 ops
    # between them (norms, RoPE, residuals, the MLP's activation) share partitions, instead
    # of each precision's run of ops being a delegate call of its own.
    precisions = [ConfigPrecisionType.FP32, ConfigPrecisionType.DYNAMIC_QUANT] \
        if quantized else None
    partitioners = [XnnpackPartitioner(configs=_PARTITIONER_CONFIGS,
                                       config_precisions=precisions)]
    with torch.no_grad():
        t1 = time.perf_counter()
        say("lowering with XNNPACK ...")
        edge = to_edge_transform_and_lower(ep, partitioner=partitioners,
                                           constant_methods=constant_methods)
        t2 = time.perf_counter()
        say(f"lowering done in {t2 - t1:.1f} s; emitting the ExecuTorch program ...")
        program = edge.to_executorch(ExecutorchBackendConfig(
            run_reinplace_pass=reinplace, do_quant_fusion_and_const_prop=quantized))
        say(f"emitted in {time.perf_counter() - t2:.1f} s")
    return program


def is_in_place_write(node: torch.fx.Node) -> bool:
    """An emitted in-place buffer write: ``cellcache::write`` or ``index_put_``."""
    target = str(node.target)
    return "cellcache.write" in target or "index_put_" in target


def full_cache_copies(program, cache_shapes) -> list:
    """Nodes of the emitted graph that copy a whole cache buffer: any op other
    than an in-place write (``is_in_place_write``) whose output has a cache
    buffer's shape [n_cells, n_kv_heads, head_dim]. Empty when every K/V
    write is in place."""
    shapes = {tuple(s) for s in cache_shapes}
    found = []
    for node in program.exported_program().graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            continue  # dynamic shapes follow n_tok / extent, never n_cells
        if tuple(val.shape) in shapes and not is_in_place_write(node):
            found.append(f"{node.name}: {node.target}")
    return found


def is_model_cache_buffer(name: str) -> bool:
    """The K/V buffers CellCacheLM registers (graph/model.py)."""
    return name.endswith(("cellcache_k", "cellcache_v"))


def cache_reads(program, is_cache_buffer: Callable[[str], bool] = is_model_cache_buffer) -> list:
    """Nodes of the emitted graph that read a K/V cache buffer other than its
    in-place write (``is_in_place_write``) and ``cellcache::attend``: on the cells
    attention path any such node is a per-layer copy of (part of) the cache,
    such as the reference path's ``cache[:extent]`` slice. Empty when
    attention reads the caches only through ``cellcache::attend``.
    is_cache_buffer: True for the buffer names (state-dict keys) of caches."""
    ep = program.exported_program()
    buffers = ep.graph_signature.inputs_to_buffers
    cache = {n for n in ep.graph.nodes
             if n.op == "placeholder" and is_cache_buffer(buffers.get(n.name, ""))}
    found = []
    for node in ep.graph.nodes:  # topological order: a write is seen before its readers
        if node.op != "call_function" or not any(a in cache for a in node.all_input_nodes):
            continue
        target = str(node.target)
        if "index_put_" in target:
            cache.add(node)  # its output is the same buffer
        elif not is_in_place_write(node) and "cellcache.attend" not in target:
            found.append(f"{node.name}: {node.target}")
    return found

def delegate_calls(program_bytes: bytes, method: str = "forward") -> int:
    """How many delegate calls (XNNPACK partitions run) one call of
    ``method`` of an emitted program makes: each costs a fixed overhead per
    step (~5 us on a 2-core Xeon), so fewer, larger partitions decode faster."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(program_bytes)
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == method)
    return sum(type(i.instr_args).__name__ == "DelegateCall"
               for chain in plan.chains for i in chain.instructions)


def _is_linear(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "aten.linear" in str(node.target)


def _is_torchao(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "torchao" in str(node.target)


def delegated_linears(program) -> Dict[str, int]:
    """Linear layers of the model inside the emitted program's XNNPACK
    delegates (``rotate_half_as_linear``'s are not counted):
    {"quantized": those whose weight is a torchao dequantize (the dynamically
    quantized kernels), "fp32": the others}."""
    gm = program.exported_program().graph_module
    counts = {"quantized": 0, "fp32": 0}
    for node in gm.graph.nodes:
        lowered = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if getattr(lowered, "backend_id", None) != "XnnpackBackend":
            continue
        for inner in lowered.original_module.graph.nodes:
            if _is_linear(inner):
                weight = inner.args[1]
                if isinstance(weight, torch.fx.Node) and ROTATE_HALF in weight.name:
                    continue   # rotate_half_as_linear's, not a layer of the model
                kind = "quantized" if isinstance(weight, torch.fx.Node) and \
                    _is_torchao(weight) else "fp32"
                counts[kind] += 1
    return counts


def torchao_ops(program) -> List[str]:
    """torchao:: ops left in the emitted program outside any delegate: the
    runtime has no kernel for them, so the program would not load."""
    return [f"{n.name}: {n.target}" for n in program.exported_program().graph.nodes
            if _is_torchao(n)]
