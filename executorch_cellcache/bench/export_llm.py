"""ExecuTorch's own LLM flow, the bench's stock anchor: ``export_llm``
(``executorch.extension.llm.export``) on its Llama definition with a KV cache,
``llama::custom_sdpa`` and XNNPACK, at the same quantization as ours.

Its ``params.json`` comes from the bench model's config (same shapes); with no
checkpoint it initializes its own random weights, which do not change its
speed. Its lm_head is a separate weight (no tie), so its fp32 .pte is larger
than ours. The program serves one sequence: ``forward(tokens [1, n],
input_pos [1])`` -> logits of the last token.
"""

import json
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch

from executorch_cellcache.bench.common import BenchSetup
from executorch_cellcache.runtime.execute import execute


def params(setup: BenchSetup) -> dict:
    """export_llm's ModelArgs fields for the bench model (LlamaConfig fields)."""
    m = setup.model
    return {
        "dim": m["hidden_size"], "n_layers": m["num_hidden_layers"],
        "n_heads": m["num_attention_heads"], "n_kv_heads": m["num_key_value_heads"],
        "vocab_size": m["vocab_size"], "hidden_dim": m["intermediate_size"],
        "norm_eps": 1e-6, "rope_theta": 10000.0, "use_scaled_rope": False,
    }


def max_seq_length(setup: BenchSetup) -> int:
    """export_llm's ``max_seq_length`` for a ``setup.prefill_len``-token prefill:
    with dynamic shapes its token dimension is bounded by max_seq_length - 1."""
    return setup.prefill_len + 1


def export_export_llm(setup: BenchSetup, quantize: Optional[str], group_size: int,
                      embedding_quantize: Optional[str], say):
    """A ProgramCache build function: export_llm's .pte at ``path``."""
    def build(path: Path) -> float:
        from executorch.examples.models.llama.export_llama_lib import export_llama
        from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            params_path = Path(tmp) / "params.json"
            params_path.write_text(json.dumps(params(setup)))
            config = LlmConfig()
            config.base.model_class = ModelType.llama3
            config.base.params = str(params_path)
            config.model.use_kv_cache = True
            config.model.use_sdpa_with_kv_cache = True
            config.model.enable_dynamic_shape = True
            config.export.max_seq_length = max_seq_length(setup)
            config.export.max_context_length = setup.stock_cache_len
            config.export.output_dir = tmp
            config.export.output_name = str(Path(tmp) / "export_llm.pte")  # a bare name lands in the cwd
            config.backend.xnnpack.enabled = True
            config.backend.xnnpack.extended_ops = True
            if quantize is not None:
                config.quantization.qmode = quantize
                config.quantization.group_size = group_size if quantize == "8da4w" else 0
            if embedding_quantize is not None:
                bits, _, group = embedding_quantize.partition(",")
                config.quantization.embedding_quantize = f"{bits},{group or 0}"
            say(f"  export_llm ({quantize or 'fp32'}, embedding "
                f"{embedding_quantize or 'fp32'}) ...")
            written = Path(export_llama(config))
            path.write_bytes(written.read_bytes())
        return time.perf_counter() - t0
    return build


class ExportLlmRunner:
    """export_llm's program: forward(tokens [1, n], input_pos [1]) -> logits
    [1, vocab] of the last token."""

    def __init__(self, path: Path):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama:: kernels
        import executorch.kernels.quantized  # noqa: F401  quantized embedding kernels
        from executorch.runtime import Runtime

        self.method = Runtime.get().load_program(str(path)).load_method("forward")

    def forward(self, tokens: List[int], start: int):
        ids = torch.tensor([tokens], dtype=torch.int64)
        return execute(self.method, [ids, torch.tensor([start], dtype=torch.int64)])[0]
