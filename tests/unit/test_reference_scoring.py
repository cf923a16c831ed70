"""rollstream.reference: the frozen reference model's log-probs, on a real (tiny) model.

The packed, chunked computation must equal the obvious one: full logits of one unpadded
sequence at a time -> log_softmax -> the completion tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.core import modeling
from rollstream.core.config import ConfigError, load_settings
from rollstream.reference.config import ReferenceSettings
from rollstream.reference.scoring import ReferenceModel, TokenPair

TOKEN_BUDGET = 64  # padded tokens per micro-batch: forces several micro-batches below
CHUNK_TOKENS = 7  # LM-head chunk, smaller than the completion tokens of any micro-batch


def make_sequences(vocab: int, seed: int = 0) -> list[TokenPair]:
    """Prompts of 1..31 tokens and completions of 1..20, in no particular order."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (31, 20), (1, 1), (12, 9), (8, 17), (20, 2), (3, 12), (16, 16), (27, 5)]
    return [
        (torch.randint(0, vocab, (p,), generator=gen).tolist(), torch.randint(0, vocab, (c,), generator=gen).tolist())
        for p, c in shapes
    ]


def naive_logprobs(model: torch.nn.Module, sequences: list[TokenPair], temperature: float) -> list[list[float]]:
    """One sequence at a time, no padding, full [T, vocab] logits."""
    out = []
    with torch.no_grad():
        for prompt, completion in sequences:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            # Position t predicts token t + 1: completion token j sits at len(prompt) + j.
            rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
            out.append(logp[rows, torch.tensor(completion)].tolist())
    return out


@pytest.fixture(scope="module")
def bf16_rounded_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The checkpoint with every weight rounded to bf16 by hand (what version 0 is)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_logits_computation(tiny_model_dir: Path, bf16_rounded_model: torch.nn.Module, temperature: float) -> None:
    ref = ReferenceModel.load(tiny_model_dir, token_budget=TOKEN_BUDGET, chunk_tokens=CHUNK_TOKENS, temperature=temperature)
    sequences = make_sequences(ref.vocab_size)
    lengths = [len(p) + len(c) for p, c in sequences]
    # The setup really exercises packing and chunking.
    packed = modeling.pack_by_tokens(lengths, TOKEN_BUDGET)
    assert len(packed) >= 4
    assert any(len(b) > 1 for b in packed), "some micro-batch must mix lengths (padding)"
    assert all(sum(len(sequences[i][1]) for i in b) > CHUNK_TOKENS for b in packed if len(b) > 1)

    got = ref.logprobs(sequences)
    want = naive_logprobs(bf16_rounded_model, sequences, temperature)

    assert [len(g) for g in got] == [len(c) for _, c in sequences]
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-5), (g, w)
    # Log-probs of a few-hundred-token vocabulary under random weights: negative and not degenerate.
    flat = torch.tensor([v for g in got for v in g])
    assert (flat < 0).all() and flat.std() > 0


def test_temperature_changes_the_values(tiny_model_dir: Path) -> None:
    at_1_model = ReferenceModel.load(tiny_model_dir, temperature=1.0)
    sequences = make_sequences(at_1_model.vocab_size)[:3]
    at_1 = at_1_model.logprobs(sequences)
    at_07 = ReferenceModel.load(tiny_model_dir, temperature=0.7).logprobs(sequences)
    assert not torch.allclose(torch.tensor(at_1[1]), torch.tensor(at_07[1]), atol=1e-3)


def test_weights_are_rounded_to_bf16_and_frozen(tiny_model_dir: Path) -> None:
    raw = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = ReferenceModel.load(tiny_model_dir)
    raw_params = dict(raw.named_parameters())
    changed = 0
    for name, p in ref.model.named_parameters():
        assert p.dtype == torch.float32
        assert not p.requires_grad
        # Every value is exactly representable in bf16, and is the rounding of the checkpoint's.
        assert torch.equal(p, p.bfloat16().float()), name
        assert torch.equal(p, raw_params[name].bfloat16().float()), name
        changed += int(not torch.equal(p, raw_params[name]))
    # Random fp32 init is not bf16-representable, so the rounding visibly happened.
    assert changed > 0
    assert not ref.model.training


def test_bfloat16_compute_is_close_to_float32(tiny_model_dir: Path) -> None:
    f32_model = ReferenceModel.load(tiny_model_dir, dtype="float32")
    sequences = make_sequences(f32_model.vocab_size, seed=1)
    f32 = f32_model.logprobs(sequences)
    b16 = ReferenceModel.load(tiny_model_dir, dtype="bfloat16").logprobs(sequences)
    diff = (torch.tensor([v for s in f32 for v in s]) - torch.tensor([v for s in b16 for v in s])).abs()
    # bf16 activations carry ~3 significant digits; log-probs here are around -6.
    assert diff.max() < 0.02, diff.max()


def test_check_names_what_is_wrong(tiny_model_dir: Path) -> None:
    ref = ReferenceModel.load(tiny_model_dir)
    ref.check([1, 2], [3])  # fine
    with pytest.raises(ValueError, match="empty prompt"):
        ref.check([], [3, 4])
    with pytest.raises(ValueError, match=f"token id {ref.vocab_size} is outside"):
        ref.check([1, 2], [3, ref.vocab_size])
    with pytest.raises(ValueError, match="longer than the model's context of 2048"):
        ref.check([1] * 2000, [2] * 49)


def test_empty_inputs(tiny_model_dir: Path) -> None:
    ref = ReferenceModel.load(tiny_model_dir, token_budget=TOKEN_BUDGET, chunk_tokens=CHUNK_TOKENS)
    assert ref.logprobs([]) == []
    got = ref.logprobs([([1, 2, 3], []), ([4, 5], [6, 7])])
    assert got[0] == [] and len(got[1]) == 2


def test_settings_defaults_flags_and_errors() -> None:
    s = load_settings(ReferenceSettings, [])
    assert (s.model, s.dtype, s.device, s.temperature, s.group) == ("smollm2-135m", "float32", "cpu", 1.0, "reference")
    s = load_settings(ReferenceSettings, ["--dtype", "bfloat16", "--token-budget", "512", "--chunk-tokens", "64", "--temperature", "0.8"])
    assert (s.dtype, s.token_budget, s.chunk_tokens, s.temperature) == ("bfloat16", 512, 64, 0.8)
    with pytest.raises(ConfigError, match="field 'dtype'"):
        load_settings(ReferenceSettings, ["--dtype", "float16"])
    with pytest.raises(ConfigError, match="field 'temperature'"):
        load_settings(ReferenceSettings, ["--temperature", "0"])
