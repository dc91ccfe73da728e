"""The static-cache ExecuTorch program: transformers' recipe
(``TorchExportableModuleForDecoderOnlyLM``) lowered with XNNPACK (the bench's
second stock row; export_llm.py is the first). ``decode_stepper`` and
``prefiller`` time any one-sequence program with ``forward(tokens, start)``."""

import time
from pathlib import Path
from typing import List

import numpy as np
import torch

from executorch_cellcache.bench.common import BenchSetup, bench_model
from executorch_cellcache.runtime.execute import execute


def export_stock(setup: BenchSetup, say):
    def build(path: Path) -> float:
        from torch.export import Dim
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        from executorch_cellcache.exporting.lowering import lower_exported

        t0 = time.perf_counter()
        model = bench_model(setup)
        model.generation_config.use_cache = True
        model.generation_config.cache_implementation = "static"
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1,
                                                        max_cache_len=setup.stock_cache_len)
        seq = Dim("seq", min=1, max=setup.prefill_len)
        say("  torch.export (transformers' static-cache recipe, strict) ...")
        with torch.no_grad():
            ep = wrapper.export(input_ids=torch.zeros(1, 2, dtype=torch.int64),
                                cache_position=torch.arange(2),
                                dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
        program = lower_exported(ep, progress=lambda line: say(f"  {line}"), reinplace=False)
        path.write_bytes(program.buffer)
        return time.perf_counter() - t0
    return build


class StockRunner:
    """The stock program: forward(input_ids [1, seq], None, cache_position [seq])."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime

        self.method = Runtime.get().load_program(str(path)).load_method("forward")

    def forward(self, tokens: List[int], start: int):
        ids = torch.tensor([tokens], dtype=torch.int64)
        return execute(self.method, [ids, torch.arange(start, start + len(tokens))])[0]


def decode_stepper(program, setup: BenchSetup):
    """One decode step at position prompt_len after a prompt_len-token prompt
    (every call rewrites the same cache slot, so every call sees the same
    context). ``program``: StockRunner or ExportLlmRunner."""
    prompt = np.random.default_rng(5).integers(0, setup.model["vocab_size"],
                                               setup.prompt_len).tolist()
    chunk = setup.prefill_len
    for start in range(0, len(prompt), chunk):
        program.forward(prompt[start:start + chunk], start)
    return lambda: program.forward([1], setup.prompt_len)


def prefiller(program, setup: BenchSetup):
    prompt = np.random.default_rng(5).integers(0, setup.model["vocab_size"],
                                               setup.prefill_len).tolist()
    return lambda: program.forward(prompt, 0)
