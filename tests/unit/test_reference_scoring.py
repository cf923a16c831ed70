"""rollstream.reference: the frozen reference model's log-probs, on a real (tiny) model.

The packed, chunked computation must equal the obvious one: full logits of one unpadded
sequence at a time -> log_softmax -> the completion tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.core import modeling, validation
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
def test_logprobs_equal_full_logits_computation(
    tiny_model_dir: Path, bf16_rounded_model: torch.nn.Module, temperature: float
) -> None:
    ref = ReferenceModel.load(
        tiny_model_dir, token_budget=TOKEN_BUDGET, chunk_tokens=CHUNK_TOKENS, temperature=temperature
    )
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


@pytest.mark.parametrize("share_prompts", [True, False])
def test_logprobs_below_what_float32_carries_are_floored_not_refused(tiny_model_dir: Path, share_prompts: bool) -> None:
    """At temperature 0.001 the tiny model puts many tokens far below ln(2^-126): the values
    come out at validation.MIN_LOGPROB, where the trainer's intake accepts them (issue 27)."""
    ref = ReferenceModel.load(tiny_model_dir, temperature=0.001, share_prompts=share_prompts)
    sequences = make_sequences(ref.vocab_size)
    sequences += [(sequences[0][0], c) for _, c in sequences[1:4]]  # a shared prompt
    flat = torch.tensor([v for g in ref.logprobs(sequences) for v in g])
    assert (flat == validation.MIN_LOGPROB).sum() > len(flat) // 4, "the setup must reach the floor"
    assert (flat >= validation.MIN_LOGPROB).all() and (flat <= 0).all()


def grouped_sequences(vocab: int) -> list[TokenPair]:
    """What the stage sees: groups of completions sharing a prompt (one group needing two
    micro-batches, one prompt longer than the token budget), a prompt of one token, a lone
    sequence, and empty completions."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    out: list[TokenPair] = []
    for prompt_len, completion_lens in [(24, [3, 20, 1, 9, 0, 14, 6, 2]), (1, [5, 5, 2]), (300, [4, 11]), (6, [8])]:
        prompt = tokens(prompt_len)
        out.extend((prompt, tokens(n)) for n in completion_lens)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prompts_give_the_packed_values_for_fewer_tokens(
    tiny_model_dir: Path, bf16_rounded_model: torch.nn.Module, dtype: str
) -> None:
    budget = 256
    shared = ReferenceModel.load(
        tiny_model_dir, dtype=dtype, token_budget=budget, chunk_tokens=CHUNK_TOKENS, temperature=0.7
    )
    packed = ReferenceModel.load(
        tiny_model_dir,
        dtype=dtype,
        token_budget=budget,
        chunk_tokens=CHUNK_TOKENS,
        temperature=0.7,
        share_prompts=False,
    )
    sequences = grouped_sequences(shared.vocab_size)

    def decoder_tokens(ref: ReferenceModel, seqs: list[TokenPair]) -> tuple[list[list[float]], int]:
        """The log-probs, and how many token positions went through the decoder."""
        seen = [0]
        hook = ref.model.get_decoder().register_forward_pre_hook(
            lambda _m, _a, kw: seen.__setitem__(0, seen[0] + kw["input_ids"].numel()), with_kwargs=True
        )
        try:
            return ref.logprobs(seqs), seen[0]
        finally:
            hook.remove()

    got, _ = decoder_tokens(shared, sequences)
    want, _ = decoder_tokens(packed, sequences)
    assert [len(g) for g in got] == [len(c) for _, c in sequences]
    # Equal up to the float noise of other matrix shapes (as two packings are).
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    for g, w in zip(got, want):
        assert max((abs(a - b) for a, b in zip(g, w)), default=0.0) <= tolerance
    if dtype == "float32":
        scored = [i for i, (_, c) in enumerate(sequences) if c]
        naive = naive_logprobs(bf16_rounded_model, [sequences[i] for i in scored], 0.7)
        for i, w in zip(scored, naive):
            assert torch.allclose(torch.tensor(got[i]), torch.tensor(w), rtol=0, atol=1e-5)

    # 4 completions of 16 tokens under a 48-token prompt, one micro-batch (4 x 64 = budget):
    # the prompt goes through the decoder once (48 + 4 x 16 = 112 positions), not 4 times (256).
    prompt = sequences[0][0][:1] * 48
    group = [(prompt, [7 + k] * 16) for k in range(4)]
    assert decoder_tokens(shared, group)[1] == 48 + 4 * 16
    assert decoder_tokens(packed, group)[1] == 4 * (48 + 16)


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
    s = load_settings(
        ReferenceSettings,
        ["--dtype", "bfloat16", "--token-budget", "512", "--chunk-tokens", "64", "--temperature", "0.8"],
    )
    assert (s.dtype, s.token_budget, s.chunk_tokens, s.temperature) == ("bfloat16", 512, 64, 0.8)
    with pytest.raises(ConfigError, match="field 'dtype'"):
        load_settings(ReferenceSettings, ["--dtype", "float16"])
    with pytest.raises(ConfigError, match="field 'temperature'"):
        load_settings(ReferenceSettings, ["--temperature", "0"])
