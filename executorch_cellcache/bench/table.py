"""The bench's result: figures, ratios against their targets, the printed table,
JSON and the plot."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List


TARGETS = {  # key: (comparison, target, description)
    "b1_vs_stock": (">=", 1.2, "B=1 decode tok/s, ours / stock ExecuTorch"),
    "b8_over_b1": (">=", 6.0, "aggregate decode tok/s, B=8 / B=1"),
    "prefill_vs_stock": (">=", 1.5, "prefill tok/s, ours / stock"),
    "fork_cells_ratio": ("<=", 0.25, "peak cells of n samples / n independent copies"),
    "prefix_ttft_ratio": ("<=", 0.1, "time to first token, system prompt cached / cold"),
    "chat_cells_ratio": ("", None, "cells of 8 chats sharing a system prompt / 8 copies"),
    "cache_ops_share": ("<", 0.02, "place+mask share of a B=8 decode step"),
    "used_extent_ratio": ("<=", 1.2, "decode step, small used extent: big / small cache"),
    "b1_bandwidth_fraction": ("", None, "B=1 decode / memory-bandwidth bound"),
    "export_time_vs_stock": ("<=", 1.0, "export seconds, ours / stock"),
    "long_b8_cells_vs_reference": (">=", 2.5, "B=8 x 2048-token contexts decode tok/s, "
                                   "cells / dense-mask path"),
    "long_b1_cells_vs_reference": ("", None, "B=1 x 2048 decode tok/s, cells / dense-mask"),
    "long_one_among_7_vs_alone": ("<=", 1.3, "one sequence's decode step among 7 others' "
                                  "cells / alone (cells path)"),
    "long_b8_fp16_cells_vs_reference": ("", None, "fp16 K/V: B=8 x 2048 decode tok/s, "
                                        "cells / dense-mask"),
    "long_b8_fp16_vs_fp32_cells": ("", None, "B=8 x 2048 decode tok/s on the cells path, "
                                   "fp16 / fp32 K/V"),
}


@dataclass
class BenchResult:
    figures: Dict[str, float] = field(default_factory=dict)
    ratios: Dict[str, float] = field(default_factory=dict)


def _meets(key: str, value: float) -> str:
    op, target, _ = TARGETS[key]
    if target is None:
        return ""
    ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
    return "yes" if ok else "NO"


def table(result: BenchResult) -> str:
    lines = [f"{'metric':<32} {'value':>10}  {'target':>8}  met  what",
             "-" * 110]
    for key, value in result.ratios.items():
        op, target, what = TARGETS[key]
        tgt = f"{op}{target}" if target is not None else "-"
        lines.append(f"{key:<32} {value:>10.3f}  {tgt:>8}  {_meets(key, value):>3}  {what}")
    lines.append("")
    for key, value in result.figures.items():
        lines.append(f"{key:<32} {value:>14.4g}")
    return "\n".join(lines)


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps({**result.ratios, "figures": result.figures,
                                "targets": {k: [v[0], v[1]] for k, v in TARGETS.items()}},
                               indent=2))


def plot(result: BenchResult, setup_batches: List[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = result.figures
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(setup_batches, [f[f"ours_decode_tok_s_b{x}"] for x in setup_batches], "o-",
           label="cell cache (ExecuTorch)")
    a.plot([1, 8], [f["eager_decode_tok_s_b1"], f["eager_decode_tok_s_b8"]], "s--",
           label="transformers eager")
    a.plot([1], [f["stock_decode_tok_s_b1"]], "^", label="stock ExecuTorch")
    a.set_xlabel("concurrent sequences")
    a.set_ylabel("aggregate decode tokens/s")
    a.legend()
    b.bar(["big cache", "small cache"],
          [f["decode_step_seconds_big_cache"] * 1e3, f["decode_step_seconds_small_cache"] * 1e3])
    b.set_ylabel("decode step ms (same used cells)")
    fig.tight_layout()
    fig.savefig(path)
