"""torch.export -> ExecuTorch lowering shared by every cell-cache program.

Linear layers and matmuls go to the XNNPACK delegate; the cell-cache ops stay
CPU kernels. K/V writes are ``cellcache::write`` (graph/ops.py), emitted in
place on the mutable cache buffers; ``run_reinplace_pass`` turns any other
functionalized buffer write back into an in-place ``index_put_``. A step never
copies a whole cache (``full_cache_copies`` checks the emitted graph).

Before lowering, ``means_as_pooling`` rewrites each last-dim mean (RMSNorm's)
into the 4-D form XNNPACK runs, so norms stay inside the delegate instead of
splitting it around a portable ``mean`` (fewer delegate calls a step).

Quantized programs (quantize.py) go to XNNPACK's dynamically quantized
partitioner first, then the plain one, and are emitted with the quant fusion
pass (quantized embeddings -> the runtime's quantized embedding kernels);
``delegated_linears`` and ``torchao_ops`` check the result.
"""

import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from executorch_cellcache.exporting.quiet_imports import quiet_third_party_imports

with quiet_third_party_imports():
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import GeluConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )
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


_PARTITIONER_CONFIGS = [_ExactGeluConfig if c is GeluConfig else c
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
        means_as_pooling(ep)
        return lower_exported(ep, constant_methods, progress, quantized=quantized)


def means_as_pooling(ep) -> int:
    """Rewrites, in place, every fp32 ``mean(x, dim=-1, keepdim=True)`` of
    ``ep`` whose input views as [1, N, 1, D] (contiguous, at most one
    dynamic dim) into view -> ``mean(dims=[2, 3], keepdim=True)`` -> view:
    the same values (XNNPACK averages the D elements of each row), in the one
    form XNNPACK's partitioner takes (its MeanDimConfig: 4-D, dims [2, 3],
    keepdim). RMSNorm computes exactly such a mean; left portable it costs a
    kernel call and splits the XNNPACK partition around it, twice a layer.
    Returns how many means it rewrote."""
    graph = ep.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.mean.dim:
            continue
        x = node.args[0]
        val = x.meta.get("val")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = node.args[1] if len(node.args) > 1 else None
        if (not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or not keepdim
                or node.kwargs.get("dtype") is not None or dims is None
                or list(dims) not in ([-1], [val.dim() - 1])):
            continue
        shape = list(val.shape)
        dynamic = [d for d in shape if not isinstance(d, int)]
        if len(dynamic) > 1 or not isinstance(shape[-1], int):
            continue  # XNNPACK's reshape infers at most one dim
        rows = -1 if dynamic else math.prod(shape[:-1])
        as_4d = [1, rows, 1, shape[-1]]
        back = [d if isinstance(d, int) else -1 for d in shape[:-1]] + [1]
        try:
            val_4d = val.view(as_4d)
        except (RuntimeError, ValueError):
            continue  # not viewable (a transposed input): leave it portable
        with graph.inserting_before(node):
            view = graph.call_function(torch.ops.aten.view.default, (x, as_4d))
            view.meta["val"] = val_4d
            mean = graph.call_function(torch.ops.aten.mean.dim, (view, [2, 3], True))
            mean.meta["val"] = val_4d.mean([2, 3], keepdim=True)
            out = graph.call_function(torch.ops.aten.view.default, (mean, back))
            out.meta["val"] = mean.meta["val"].view(back)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    ep.graph_module.recompile()
    return rewritten


def lower_exported(ep, constant_methods: Optional[Dict[str, object]] = None,
                   progress: Optional[Progress] = None, reinplace: bool = True,
                   quantized: bool = False):
    """Lowers an ExportedProgram with XNNPACK and emits it. ``reinplace=False``
    keeps ExecuTorch's default emission (the stock baseline of the benchmark).
    ``quantized``: a graph with torchao-quantized weights; the dynamically
    quantized partitioner runs first and the quant fusion pass at emission."""
    say = progress or (lambda _line: None)
    partitioners = [XnnpackPartitioner(configs=_PARTITIONER_CONFIGS)]
    if quantized:
        partitioners.insert(0, XnnpackDynamicallyQuantizedPartitioner())
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

def _is_linear(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "aten.linear" in str(node.target)


def _is_torchao(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "torchao" in str(node.target)


def delegated_linears(program) -> Dict[str, int]:
    """Linear layers inside the emitted program's XNNPACK delegates:
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
                kind = "quantized" if isinstance(weight, torch.fx.Node) and \
                    _is_torchao(weight) else "fp32"
                counts[kind] += 1
    return counts


def torchao_ops(program) -> List[str]:
    """torchao:: ops left in the emitted program outside any delegate: the
    runtime has no kernel for them, so the program would not load."""
    return [f"{n.name}: {n.target}" for n in program.exported_program().graph.nodes
            if _is_torchao(n)]
