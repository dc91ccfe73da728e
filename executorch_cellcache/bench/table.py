"""The bench's result: figures, ratios against their targets, the printed table,
JSON and the plot."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from executorch_cellcache.bench.common import machine


TARGETS = {  # key: (comparison, target, description); fp32 run (SPEC 5)
    "b1_vs_export_llm": (">=", 1.0, "B=1 decode tok/s, ours / ExecuTorch export_llm"),
    "prefill_vs_export_llm": (">=", 1.0, "prefill tok/s, ours / export_llm"),
    "b8_vs_export_llm_b1": ("", None, "B=8 aggregate decode, ours / export_llm B=1"),
    "export_time_vs_export_llm": ("<=", 1.0, "export seconds, ours / export_llm"),
    "b1_vs_llama_cpp": ("", None, "B=1 decode tok/s, ours / llama.cpp (same weights, GGUF; "
                        "taking turns)"),
    "b8_vs_llama_cpp": ("", None, "B=8 aggregate decode tok/s, ours / llama.cpp B=8"),
    "prefill_vs_llama_cpp": ("", None, "prefill tok/s, ours / llama.cpp"),
    "b1_vs_stock": (">=", 1.2, "B=1 decode tok/s, ours / static-cache ExecuTorch"),
    "b8_over_b1": (">=", 6.0, "aggregate decode tok/s, B=8 / B=1"),
    "prefill_vs_stock": (">=", 1.5, "prefill tok/s, ours / static-cache"),
    "fork_cells_ratio": ("<=", 0.25, "peak cells of n samples / n independent copies"),
    "prefix_ttft_ratio": ("<=", 0.1, "time to first token, system prompt cached / cold"),
    "chat_cells_ratio": ("", None, "cells of 8 chats sharing a system prompt / 8 copies"),
    "cache_ops_share": ("<", 0.02, "place+mask share of a B=8 decode step"),
    "used_extent_ratio": ("<=", 1.2, "decode step, small used extent: big / small cache"),
    "b1_bandwidth_fraction": ("", None, "B=1 decode / memory-bandwidth bound"),
    "export_time_vs_stock": ("<=", 1.0, "export seconds, ours / static-cache"),
    "long_b8_cells_vs_reference": (">=", 2.5, "B=8 x 2048-token contexts decode tok/s, "
                                   "cells / dense-mask path"),
    "long_b1_cells_vs_reference": ("", None, "B=1 x 2048 decode tok/s, cells / dense-mask"),
    "long_one_among_7_vs_alone": ("<=", 1.3, "one sequence's decode step among 7 others' "
                                  "cells / alone (cells path)"),
    "long_b8_fp16_cells_vs_reference": ("", None, "fp16 K/V: B=8 x 2048 decode tok/s, "
                                        "cells / dense-mask"),
    "long_b8_fp16_vs_fp32_cells": ("", None, "B=8 x 2048 decode tok/s on the cells path, "
                                   "fp16 / fp32 K/V"),
    "long_b8_int8_vs_fp16_cells": (">=", 1.0, "B=8 x 2048 decode tok/s on the cells path, "
                                   "int8 / fp16 K/V"),
    "long_b1_int8_vs_fp16_cells": ("", None, "B=1 x 2048 decode tok/s on the cells path, "
                                   "int8 / fp16 K/V"),
    "kv_bytes_int8_vs_fp16": ("<=", 0.55, "K/V cache bytes per cell (all layers, scales "
                              "included), int8 / fp16"),
}

# llama.cpp's ratios (``cellcache bench --llama-cpp``): key -> (our figure, its figure),
# both measured in the same rounds, taking turns.
LLAMA_CPP_RATIOS = {
    "b1_vs_llama_cpp": ("ours_alongside_llama_cpp_decode_tok_s_b1", "llama_cpp_decode_tok_s_b1"),
    "b8_vs_llama_cpp": ("ours_alongside_llama_cpp_decode_tok_s_b8", "llama_cpp_decode_tok_s_b8"),
    "prefill_vs_llama_cpp": ("ours_alongside_llama_cpp_prefill_tok_s", "llama_cpp_prefill_tok_s"),
}

# The quantized run (SPEC 7, issue 10): ours and export_llm at the same quantization.
QUANTIZED_TARGETS = {
    **TARGETS,
    "b8_vs_export_llm_b1": (">=", 3.0, "B=8 aggregate decode, ours / export_llm B=1"),
    "b8_over_b1": (">=", 4.0, "aggregate decode tok/s, B=8 / B=1"),
    "b1_vs_ours_fp32": (">=", 2.5, "B=1 decode tok/s, ours quantized / ours fp32"),
    "pte_vs_ours_fp32": ("<=", 0.3, ".pte bytes, ours quantized / ours fp32"),
}


@dataclass
class BenchResult:
    figures: Dict[str, float] = field(default_factory=dict)
    ratios: Dict[str, float] = field(default_factory=dict)
    quantized: bool = False
    notes: List[str] = field(default_factory=list)
    missing: Dict[str, str] = field(default_factory=dict)  # ratio key -> why it is missing

    @property
    def targets(self):
        return QUANTIZED_TARGETS if self.quantized else TARGETS


def _meets(targets, key: str, value: float) -> str:
    op, target, _ = targets[key]
    if target is None:
        return ""
    ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
    return "yes" if ok else "NO"


def table(result: BenchResult) -> str:
    lines = [f"{'metric':<32} {'value':>10}  {'target':>8}  met  what",
             "-" * 110]
    targets = result.targets
    for key, value in result.ratios.items():
        op, target, what = targets[key]
        tgt = f"{op}{target}" if target is not None else "-"
        lines.append(f"{key:<32} {value:>10.3f}  {tgt:>8}  {_meets(targets, key, value):>3}  "
                     f"{what}")
    for key in result.missing:
        if key not in result.ratios:
            lines.append(f"{key:<32} {'missing':>10}  {'-':>8}       {targets[key][2]} (see the "
                         f"note)")
    lines.append("")
    for key, value in result.figures.items():
        lines.append(f"{key:<32} {value:>14.4g}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps({"machine": machine(), **result.ratios, "figures": result.figures,
                                "targets": {k: [v[0], v[1]] for k, v in result.targets.items()},
                                **({"missing": result.missing} if result.missing else {}),
                                "notes": result.notes}, indent=2))


def plot(result: BenchResult, setup_batches: List[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = result.figures
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ours = [x for x in setup_batches if f"ours_decode_tok_s_b{x}_batch" in f]
    a.plot(ours, [f[f"ours_decode_tok_s_b{x}_batch"] for x in ours], "o-",
           label="cell cache (ExecuTorch)")
    if "eager_decode_tok_s_b1" in f:  # not with --model
        a.plot([1, 8], [f["eager_decode_tok_s_b1"], f["eager_decode_tok_s_b8"]], "s--",
               label="transformers eager")
    if "stock_decode_tok_s_b1" in f:
        a.plot([1], [f["stock_decode_tok_s_b1"]], "^", label="static-cache ExecuTorch")
    if "export_llm_decode_tok_s_b1" in f:
        a.plot([1], [f["export_llm_decode_tok_s_b1"]], "v", label="ExecuTorch export_llm")
    llama = [b for b in (1, 8) if f"llama_cpp_decode_tok_s_b{b}" in f]
    if llama:
        a.plot(llama, [f[f"llama_cpp_decode_tok_s_b{b}"] for b in llama], "D:",
               label="llama.cpp (taking turns with ours)")
    a.set_xlabel("concurrent sequences")
    a.set_ylabel("aggregate decode tokens/s")
    a.legend()
    if "decode_step_seconds_big_cache" in f:
        b.bar(["big cache", "small cache"], [f["decode_step_seconds_big_cache"] * 1e3,
                                             f["decode_step_seconds_small_cache"] * 1e3])
        b.set_ylabel("decode step ms (same used cells)")
    fig.tight_layout()
    fig.savefig(path)
