"""Qwen2-shaped models with random weights, built from a config (no download), for the
benchmarks that need a model size rather than a particular checkpoint."""

from __future__ import annotations

import torch

# Qwen2 shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings).
SIZES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "0.1b": (512, 1536, 8, 8, 2, 151936, True),
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),  # Qwen2-0.5B
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),  # Qwen2-1.5B
    "3b": (2048, 11008, 36, 16, 2, 151936, True),  # Qwen2.5-3B
    "7b": (3584, 18944, 28, 28, 4, 152064, False),  # Qwen2-7B
    "14b": (5120, 13824, 48, 40, 8, 152064, False),  # Qwen2.5-14B
}


def config(size: str):
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv, vocab, tied = SIZES[size]
    return Qwen2Config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
    )


def parameter_count(size: str) -> int:
    """Parameters of `size` (tied embeddings once), without allocating any."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config(size))
    return sum(p.numel() for p in model.parameters())


def build_model(size: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Qwen2ForCausalLM of `size` with N(0, 0.02) weights in `dtype` on `device`."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config(size))
    model.to(dtype)  # still on meta: free; then allocate once, in the target dtype
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every module its own tensor: tie the embeddings again
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model
