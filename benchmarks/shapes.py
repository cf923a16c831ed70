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
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
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
    # to_empty leaves the buffers as garbage too: the rotary inv_freq is computed, not loaded,
    # so build those modules again (fp32, as from_pretrained leaves it). Garbage there made a
    # step's loss NaN in 3 of 6 runs.
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq"):
            model.set_submodule(name, type(module)(model.config).to(device))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model


def byte_tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    """A tokenizer that can decode every id of a `vocab_size` vocabulary (a random model
    samples all of them; a small trained BPE would leave most undecodable): ids 0-3 are
    specials, 4-259 the 256 bytes (byte-level, so any text encodes, one token per byte),
    the rest fillers <tN>. Built in-process: no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        model_max_length=4096,
    )


# Small enough for a test, shaped like the real ones where kernels care: head_dim 64, GQA,
# q/k/v biases (fused qkv_proj), gate/up (fused gate_up_proj); a separate lm_head (with a
# tied one a random model only repeats its last token: its own embedding dominates).
SIZES["tiny"] = (256, 512, 2, 4, 2, 4096, False)


def save_model_folder(size: str, path: str, seed: int = 0, head_std: float = 0.2) -> str:
    """A Hugging Face folder (config, bf16-valued fp32 safetensors, tokenizer) of a Qwen2
    shape with random weights; built on the CPU, nothing downloaded. Norm gains are 1; an
    untied lm_head gets std `head_std` so logits are peaked (std ~ head_std * sqrt(hidden)):
    greedy tokens of two engines then agree despite rounding differences, as with a
    trained model."""
    from pathlib import Path

    from transformers import GenerationConfig

    model = build_model(size, torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)  # RMSNorm gains, as a real checkpoint has them (~1)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.normal_(0.0, head_std, generator=gen)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # the values the trainer publishes at version 0
    tokenizer = byte_tokenizer(model.config.vocab_size)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 3
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
