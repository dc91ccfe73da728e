"""The embedded default model: a small Llama-architecture config with seeded
random weights and a byte-level tokenizer (no download needed).

Its output is random text: it exists so that export, generation and the
benchmarks run anywhere. Point ``--model`` at a local Hugging Face checkpoint
folder for a real model.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from executorch_cellcache.cache import metadata

SEED = 0
NAME = "cellcache-default-llama"


def default_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=metadata.BYTES_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=metadata.BYTES_BOS_ID,
        eos_token_id=metadata.BYTES_EOS_ID,
        tie_word_embeddings=False,
    )


def default_model() -> LlamaForCausalLM:
    """The default model in fp32, weights from torch.manual_seed(SEED)."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(default_config())
    finally:
        torch.random.set_rng_state(generator_state)
    model.name_or_path = NAME
    return model.eval()
