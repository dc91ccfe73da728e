"""``cellcache bench --model CHECKPOINT``: the rows of the table that apply to
a user's own model.

CHECKPOINT is what ``cellcache export --model`` takes (a Hugging Face
checkpoint folder, a ``.gguf`` file or a folder holding one, a packaged model
such as ``smollm2``) or an exported cell-cache ``.pte``, measured as it is.
A checkpoint is exported once at the bench's sizes (``FULL_SIZES``: 2048
cells, 512-token steps, the cells attention path) and the bench's
quantization, cached with the other programs under a key of the checkpoint's
resolved path, its newest mtime and its size in bytes (a folder: over its
files) and the options, so an edited or replaced checkpoint is exported anew.

Measured, as the main table measures them: decode tokens/s at B=1 and B=8
after 128-token prompts (the batch sizes taking turns step by step) and the
prefill of a 512-token prompt, medians of repeats after a warm-up; with
``--llama-cpp``, llama.cpp's llama-batched-bench on the same weights taking
turns with ours round by round. What llama.cpp runs: a GGUF checkpoint's own
file, as stored; a plain Llama checkpoint folder's weights written to GGUF by
``llama_cpp.write_gguf`` (as the main table does for its model, quantized
like ours); anything else (another architecture, rope scaling, biases, a
.pte) is refused before any work, asking for a .gguf of the model.
"""

import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Tuple

from executorch_cellcache.bench.common import BenchSetup

FULL_SIZES = BenchSetup(
    model={}, prompt_len=128, prefill_len=512, fork_n=0, fork_new_tokens=0, n_cells=2048,
    small_cells=0, used_cells=0, stock_cache_len=0, batch_sizes=[1, 8], decode_steps=8,
    repeats=3, prefix_len=0)
# --quick: the main table's quick sizes (checks the command works on a model)
QUICK_SIZES = replace(FULL_SIZES, prompt_len=16, prefill_len=32, n_cells=512, decode_steps=4,
                      repeats=1)

SKIPPED = ("--model: only decode (B=1, B=8) and prefill are measured; export_llm, the "
           "static-cache export, transformers eager and the long-context rows need the "
           "bench's own random Llama, and fork cells, prefix cache, cache-op share and "
           "used extent are properties of the cache (run `cellcache bench` for them)")


@dataclass(frozen=True)
class UserModel:
    given: str   # what --model said
    path: Path   # the folder, .gguf or .pte it names (a packaged model: its .gguf)
    kind: str    # "checkpoint", "gguf" or "pte"


def resolve(model: str) -> UserModel:
    """What ``--model`` names, checked in milliseconds (before any work):
    FileNotFoundError for a missing path, ValueError for something that is no
    checkpoint, the GGUF reader's one-line errors for a bad .gguf."""
    from executorch_cellcache.exporting import gguf as gguf_files
    from executorch_cellcache.exporting import packaged_models

    if not str(model).strip():
        raise ValueError("--model is empty")
    kinds = (f"a checkpoint folder, a .gguf file, a cell-cache .pte or a packaged model: "
             f"{', '.join(packaged_models.PACKAGED)}")
    path = Path(model).expanduser()
    if not path.exists():
        packaged = packaged_models.resolve(str(model))
        if packaged is None:
            raise FileNotFoundError(f"checkpoint {model} does not exist ({kinds})")
        path = packaged
    if path.is_file() and path.suffix.lower() == ".pte":
        return UserModel(str(model), path, "pte")
    found = gguf_files.find(path)
    if found is not None:
        gguf_files.check(found)
        return UserModel(str(model), found, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return UserModel(str(model), path, "checkpoint")
    raise ValueError(f"{path} is not a model: --model takes {kinds}")


def identity(path: Path) -> dict:
    """The cache key's part for a checkpoint: its resolved path, newest mtime
    and size in bytes (a folder: over every file in it)."""
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [f.stat() for f in files]
    return {"checkpoint": str(path), "mtime_ns": max((s.st_mtime_ns for s in stats), default=0),
            "size": sum(s.st_size for s in stats)}


def program_options(sizes: BenchSetup, quant) -> dict:
    return {"n_cells": sizes.n_cells, "max_tokens": sizes.prefill_len, "attention": "cells",
            **quant.export_options()}


def export_program(model: UserModel, sizes: BenchSetup, quant, programs, say):
    """(path, export seconds) of our program of ``model``, from ``programs``
    (a ProgramCache) or exported."""
    from executorch_cellcache.exporting.exporter import export

    def build(path: Path) -> float:
        return export(model.path, path, n_cells=sizes.n_cells,
                      max_tokens_per_step=sizes.prefill_len,
                      progress=lambda line: say(f"  {line}"), **quant.export_options()).seconds
    return programs.get("ours", replace(sizes, model=identity(model.path)),
                        program_options(sizes, quant), build)


def check_program(runner, sizes: BenchSetup) -> bool:
    """Whether every batch size's sequences fit in ``runner``'s cache at once
    (so the batch sizes take turns step by step; else one after another).
    ValueError when even the largest batch alone (or the prefill) does not fit."""
    info, b = runner.info, max(sizes.batch_sizes)
    together = sum(sizes.batch_sizes) * sizes.prompt_len + b
    alone = max(b * sizes.prompt_len + b, sizes.prefill_len)
    if info.n_cells < alone:
        raise ValueError(f"{runner.path} has {info.n_cells} cells; the bench needs {alone} "
                         f"({b} sequences of {sizes.prompt_len}-token prompts decoding "
                         f"together): export it with --cells {together} or more")
    return info.n_cells >= together


def llama_cpp_refusal(model: UserModel) -> None:
    """ValueError (one line) when llama.cpp cannot run ``model``'s weights:
    a .pte, or a checkpoint folder write_gguf cannot write (not a plain Llama)."""
    if model.kind == "pte":
        raise ValueError(f"--llama-cpp runs the model's weights, and {model.path} is an "
                         f"exported program: pass the checkpoint (a .gguf) it came from")
    if model.kind != "checkpoint":
        return
    try:
        cfg = json.loads((model.path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{model.path / 'config.json'} cannot be read: {e}") from None
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    problem = None
    if cfg.get("model_type") != "llama":
        problem = f"a {cfg.get('model_type')!r} checkpoint"
    elif rope.get("rope_type", rope.get("type", "default")) != "default":
        problem = "a Llama with rope scaling"
    elif cfg.get("attention_bias") or cfg.get("mlp_bias"):
        problem = "a Llama with biases"
    if problem:
        raise ValueError(f"--llama-cpp with a checkpoint folder writes its weights to GGUF, "
                         f"which the bench does for plain Llama checkpoints only, and "
                         f"{model.path} is {problem}: pass a .gguf of the model instead "
                         f"(llama.cpp's convert_hf_to_gguf.py writes one)")


def gguf_source(model: UserModel, sizes: BenchSetup, quant, programs) \
        -> Callable[[], Tuple[Path, str]]:
    """A function giving (the GGUF llama.cpp runs, what it is, for the note):
    a GGUF checkpoint's own file, or a Llama folder's weights written to GGUF
    (cached in ``programs``, keyed like our program of it)."""
    from executorch_cellcache.bench import llama_cpp

    if model.kind == "gguf":
        def own() -> Tuple[Path, str]:
            return model.path, f"{model.path} as stored (tensors {tensor_types(model.path)})"
        return own

    def written() -> Tuple[Path, str]:
        import time

        def build(path: Path) -> float:
            import torch
            from transformers import LlamaForCausalLM

            t0 = time.perf_counter()
            weights = LlamaForCausalLM.from_pretrained(model.path, dtype=torch.float32,
                                                       local_files_only=True)
            llama_cpp.write_gguf(weights.eval(), path, quant.quantize, quant.embedding_quantize)
            return time.perf_counter() - t0
        path, _ = programs.get("llama_cpp_gguf", replace(sizes, model=identity(model.path)),
                               llama_cpp.gguf_options(quant.quantize, quant.embedding_quantize),
                               build, suffix=".gguf")
        types = "/".join(t.name for t in llama_cpp.gguf_types(quant.quantize,
                                                              quant.embedding_quantize))
        return path, (f"{model.path}'s weights in GGUF (linear/embedding {types}; norms F32; "
                      f"cached as {path.name})")
    return written


def tensor_types(path: Path) -> str:
    """The tensor types of a GGUF file and how many of each: "Q4_1 x 210, ..."."""
    from gguf import GGMLQuantizationType, GGUFReader

    counts = Counter(GGMLQuantizationType(int(t.tensor_type)).name
                     for t in GGUFReader(str(path)).tensors)
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())
