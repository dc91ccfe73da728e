"""Small seeded transformers models for the export tests (no download).

Every architecture SPEC section 3 names, at toy size: hidden 64, GQA (4 query
heads / 2 KV heads), fp32, vocab 320-384, random weights from a fixed seed.
Norm weights are perturbed too, so no RMSNorm is the identity (Gemma-style
norms scale by ``1 + weight`` and start at zero).

Each sliding window (``WINDOW``) is shorter than the test sequences, so the
tests reach positions the window has to hide.

``make_model(arch)`` returns a fresh fp32 eval model with a config of its own:
transformers' ``set_attn_implementation`` mutates ``model.config``, so the
oracle and the exported model must never share one config object.
"""

from collections.abc import Callable

import torch

WINDOW = 6  # sliding window of every sliding layer, in positions
SEED = 1234
ARCHS = ("llama", "qwen3", "mistral", "gemma3")

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=320, num_hidden_layers=2, **_COMMON)
    return LlamaForCausalLM, cfg


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Layers >= max_window_layers slide: [full, full, sliding].
    cfg = Qwen3Config(vocab_size=352, num_hidden_layers=3, head_dim=16,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                      **_COMMON)
    return Qwen3ForCausalLM, cfg


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=384, num_hidden_layers=2, sliding_window=WINDOW, **_COMMON)
    return MistralForCausalLM, cfg


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=336, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, **_COMMON)
    return Gemma3ForCausalLM, cfg


_BUILDERS: dict[str, Callable] = {
    "llama": _llama, "qwen3": _qwen3, "mistral": _mistral, "gemma3": _gemma3}

# What each architecture's layers must export as (None = full causal).
EXPECTED_WINDOWS = {
    "llama": [None, None],
    "qwen3": [None, None, WINDOW],
    "mistral": [WINDOW, WINDOW],
    "gemma3": [WINDOW, None, WINDOW, None],
}


def make_config(arch: str):
    """A fresh config object (never shared between models)."""
    return _BUILDERS[arch]()[1]


def make_model(arch: str, seed: int = SEED, **overrides):
    """A fresh fp32 eval model of ``arch`` with seeded random weights and
    perturbed norm weights; the global RNG state is left as it was.
    ``overrides`` replace config fields (e.g. tie_word_embeddings=True)."""
    cls, cfg = _BUILDERS[arch]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(cfg)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn(p.shape, generator=gen))
                elif p.dim() >= 2:
                    # default init (std 0.02) gives near-uniform attention; make it peaky
                    # enough that a wrong mask or position changes the logits visibly.
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    finally:
        torch.random.set_rng_state(state)
    model.name_or_path = f"tiny-{arch}"
    return model.float().eval()
