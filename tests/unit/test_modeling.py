"""rollstream.core.modeling on the tiny real Llama: chunked completion log-probs equal the
full-logits computation (values and gradients), micro-batch packing, and exact bf16 bits."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import modeling

# (prompt, completion) token ids: different prompt and completion lengths, so the batch is
# right-padded and completions start at different columns; 14 tokens in all, so chunks of 3
# split sequences in the middle.
SEQUENCES = [
    ([5, 17, 33, 2, 41], [7, 8, 9, 10]),
    ([60, 61], [70, 71, 72, 73, 74, 75]),
    ([100, 101, 102, 103, 104, 105, 106], [7]),
    ([9, 9, 9], [200, 201, 202]),
]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path):
    torch.manual_seed(0)
    model, tok = modeling.load_model(tiny_model_dir, dtype="float32")
    model.eval()  # no dropout; the results must be deterministic
    return model, tok


@pytest.fixture(scope="module")
def reference(model_and_tokenizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    with torch.no_grad():
        return _reference_logprobs(model_and_tokenizer[0])


@torch.no_grad()
def _reference_logprobs(model, temperature: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence, alone (no padding), through the model's full logits."""
    logps, ents = [], []
    for prompt, completion in SEQUENCES:
        ids = torch.tensor([list(prompt) + list(completion)])
        logits = model(input_ids=ids).logits[0].double() / temperature
        start = len(prompt) - 1
        rows = torch.log_softmax(logits[start : start + len(completion)], dim=-1)
        logps.append(rows.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1))
        ents.append(-(rows.exp() * rows).sum(-1))
    return logps, ents


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("chunk_tokens", [3, 1, 1024])
def test_chunked_logprobs_equal_full_logits(model_and_tokenizer, reference, grad: bool, chunk_tokens: int) -> None:
    model, tok = model_and_tokenizer
    batch = modeling.make_batch(SEQUENCES, pad_id=tok.pad_token_id)
    assert batch.input_ids.shape == (4, 9) and batch.lengths == [4, 6, 1, 3]
    with torch.set_grad_enabled(grad):
        logp, entropy = modeling.completion_logprobs(model, batch, chunk_tokens=chunk_tokens, with_entropy=True)
    ref_logp, ref_ent = reference
    assert logp.shape == (14,) and logp.dtype == torch.float32
    assert logp.requires_grad == grad
    got = torch.split(logp.detach().double(), batch.lengths)
    got_ent = torch.split(entropy.detach().double(), batch.lengths)
    for i in range(len(SEQUENCES)):
        torch.testing.assert_close(got[i], ref_logp[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ent[i], ref_ent[i], rtol=0, atol=1e-5)
    assert (logp < 0).all()


def test_temperature_scales_the_logits(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    batch = modeling.make_batch(SEQUENCES, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, entropy = modeling.completion_logprobs(model, batch, chunk_tokens=3, temperature=0.7)
        ref_logp, _ = _reference_logprobs(model, temperature=0.7)
    torch.testing.assert_close(logp.double(), torch.cat(ref_logp), rtol=0, atol=1e-5)
    assert (entropy == 0).all()  # not asked for


def _param_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_gradients_through_chunks_equal_full_logits(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    model.zero_grad(set_to_none=True)
    batch = modeling.make_batch(SEQUENCES, pad_id=tok.pad_token_id)
    # A weighted sum, so each token's gradient is distinct (a plain sum would also do).
    weights = torch.linspace(0.5, 1.5, 14)

    logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=3)
    (logp * weights).sum().backward()
    chunked = _param_grads(model)

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    full = torch.log_softmax(logits[batch.rows, batch.cols].float(), dim=-1)
    full_logp = full.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    (full_logp * weights).sum().backward()
    reference = _param_grads(model)

    assert chunked.keys() == reference.keys()
    assert "lm_head.weight" in chunked and "model.embed_tokens.weight" in chunked
    for name in reference:
        torch.testing.assert_close(chunked[name], reference[name], rtol=0, atol=1e-5, msg=name)
    assert any(g.abs().max() > 1e-4 for g in reference.values())  # not trivially zero


def test_make_batch_layout(model_and_tokenizer) -> None:
    _, tok = model_and_tokenizer
    batch = modeling.make_batch(SEQUENCES, pad_id=tok.pad_token_id)
    for i, (prompt, completion) in enumerate(SEQUENCES):
        n = len(prompt) + len(completion)
        assert batch.input_ids[i, :n].tolist() == list(prompt) + list(completion)
        assert (batch.input_ids[i, n:] == tok.pad_token_id).all()
        assert batch.attention_mask[i].tolist() == [1] * n + [0] * (batch.input_ids.shape[1] - n)
    # Position t-1 predicts token t: the token at cols + 1 of each row is the target.
    assert torch.equal(batch.input_ids[batch.rows, batch.cols + 1], batch.targets)


# --- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_pack_by_tokens_keeps_every_index_once_within_budget(seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.choice([16, 64, 100, 512])
    lengths = [rng.randint(1, budget * 2 if seed % 2 else budget) for _ in range(rng.randint(1, 60))]
    batches = modeling.pack_by_tokens(lengths, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # each index exactly once
    assert all(b for b in batches)
    for b in batches:
        padded = max(lengths[i] for i in b) * len(b)
        if padded > budget:
            assert len(b) == 1 and lengths[b[0]] > budget, (b, [lengths[i] for i in b], budget)


def test_pack_by_tokens_over_long_sequences_are_alone() -> None:
    lengths = [10, 500, 3, 300, 20, 20]
    batches = modeling.pack_by_tokens(lengths, budget=100)
    assert [1] in batches and [3] in batches
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert modeling.pack_by_tokens([], 100) == []
    # Everything fits in one micro-batch when the budget allows.
    assert sorted(modeling.pack_by_tokens([4, 4, 4], budget=12)[0]) == [0, 1, 2]


# --- bits ---------------------------------------------------------------------------------------


def test_model_bits_round_trip_exactly(tiny_model_dir: Path) -> None:
    source, _ = modeling.load_model(tiny_model_dir, dtype="float32")
    target, _ = modeling.load_model(tiny_model_dir, dtype="float32")
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # make source differ from the checkpoint
    bits = modeling.model_bits(source)
    assert bits.keys() == modeling.named_weights(source).keys()
    assert all(b.dtype == np.uint16 for b in bits.values())
    assert modeling.shapes(source) == {k: v.shape for k, v in bits.items()}
    assert any(not np.array_equal(bits[k], v) for k, v in modeling.model_bits(target).items())

    modeling.load_bits_(target, bits)
    back = modeling.model_bits(target)
    for name in bits:
        assert np.array_equal(back[name], bits[name]), name
    # The fp32 model now holds exactly the bf16 values: bf16 -> fp32 is exact.
    for name, p in modeling.named_weights(target).items():
        assert torch.equal(p.detach(), modeling.bits_to_tensor(bits[name]).float()), name
    # tensor_to_bits agrees with torch's own bf16 rounding.
    w = source.lm_head.weight.detach()
    assert np.array_equal(modeling.tensor_to_bits(w), w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_load_bits_subset_and_bf16_model(tiny_model_dir: Path) -> None:
    model, _ = modeling.load_model(tiny_model_dir, dtype="bfloat16")
    before = modeling.model_bits(model)
    name = "model.norm.weight"
    new = {name: (before[name] + np.uint16(1)).astype(np.uint16)}  # +1 ULP everywhere
    modeling.load_bits_(model, new)
    after = modeling.model_bits(model)
    assert np.array_equal(after[name], new[name])
    assert all(np.array_equal(after[k], before[k]) for k in before if k != name)
    assert modeling.named_weights(model)[name].dtype == torch.bfloat16


@pytest.mark.parametrize(("every", "recomputed"), [(1, [True, True]), (2, [True, False]), (3, [True, False])])
def test_checkpoint_every_kth_layer_recomputes_those_with_the_same_gradients(
    tiny_model_dir: Path, every: int, recomputed: list[bool]
) -> None:
    """modeling.checkpoint_layers: the chosen layers run their forward again in backward, the
    others once, and the gradients are those of no checkpointing (the recompute is the same ops)."""
    batch = modeling.make_batch(SEQUENCES, pad_id=0)

    def grads_and_calls(every: int | None) -> tuple[dict[str, torch.Tensor], list[int]]:
        model, _ = modeling.load_model(tiny_model_dir, dtype="float32")
        model.train()
        if every is not None:
            assert modeling.checkpoint_layers(model, every) == sum(recomputed)
        layers = model.get_decoder().layers
        calls = [0] * len(layers)
        for i, layer in enumerate(layers):
            # A pre-hook: the recompute stops once it has what backward needs (torch's early
            # stop), inside the MLP, so a forward hook would not see it.
            layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=3)
        logp.sum().backward()
        return _param_grads(model), calls

    reference, plain_calls = grads_and_calls(None)
    got, calls = grads_and_calls(every)
    assert plain_calls == [1, 1]
    assert calls == [2 if r else 1 for r in recomputed]
    assert got.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=0, atol=1e-6, msg=name)


def test_checkpoint_every_below_one_is_refused(tiny_model_dir: Path) -> None:
    model, _ = modeling.load_model(tiny_model_dir, dtype="float32")
    with pytest.raises(ValueError, match="checkpoint every 0-th layer"):
        modeling.checkpoint_layers(model, 0)
