"""Qwen2-shaped models with random weights, built from a config (no download), for the
benchmarks that need a model size rather than a particular checkpoint."""

from __future__ import annotations

import torch

# Qwen2 shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings).
SIZES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "0.1b": (512, 1536, 8, 8, 2, 151936, True),
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),  # Qwen2-0.5B
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),  # Qwen2-1.5B
    "7b": (3584, 18944, 28, 28, 4, 152064, False),  # Qwen2-7B
}


def build_model(size: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Qwen2ForCausalLM of `size` with N(0, 0.02) weights in `dtype` on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SIZES[size]
    config = Qwen2Config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to(dtype)  # still on meta: free; then allocate once, in the target dtype
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every module its own tensor: tie the embeddings again
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model
