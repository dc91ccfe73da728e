"""transformers eager: the same model with a DynamicCache, no export."""

import statistics
import time

import numpy as np
import torch

from executorch_cellcache.bench.common import BenchSetup


def eager_decode_step_time(model, batch: int, setup: BenchSetup) -> float:
    from transformers import DynamicCache

    rng = np.random.default_rng(4)
    ids = torch.tensor(rng.integers(0, setup.model["vocab_size"], (batch, setup.prompt_len)))

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(setup.decode_steps):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - t0) / setup.decode_steps
    run()
    return statistics.median(run() for _ in range(max(1, setup.repeats)))
