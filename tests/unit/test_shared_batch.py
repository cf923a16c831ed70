"""modeling.make_shared_batch: a prompt once, its completions after it under a mask, gives
every completion token the log-prob that one sequence per completion gives (make_batch), up
to float rounding, in fp32 and bf16, with padded rows in the batch, and a gradient free of
NaN (padding positions attend to themselves, never to nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollstream.core import modeling


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_shared_prompts_give_the_log_probs_of_whole_sequences(tiny_model_dir: Path, dtype: str, atol: float) -> None:
    model, tokenizer = modeling.load_model(tiny_model_dir, dtype=dtype)
    model.train()
    gen = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    units = [
        (tokens(9), [tokens(3), tokens(7), tokens(1)]),
        (tokens(2), [tokens(5), tokens(5)]),
        (tokens(14), [tokens(2)]),
    ]
    pad = tokenizer.pad_token_id
    whole = modeling.make_batch([(p, c) for p, cs in units for c in cs], pad)
    shared = modeling.make_shared_batch(units, pad, model.get_input_embeddings().weight.dtype)
    assert shared.lengths == whole.lengths and torch.equal(shared.targets, whole.targets)
    assert shared.input_ids.shape == (3, 9 + 3 + 7 + 1)  # the widest unit; the others padded
    expected, _ = modeling.completion_logprobs(model, whole)
    got, entropy = modeling.completion_logprobs(model, shared, with_entropy=True)
    assert torch.allclose(got.float(), expected.float(), rtol=0, atol=atol), (got - expected).abs().max()
    (got.sum() + entropy.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        modeling.make_shared_batch([([], [[1, 2]])], 0, torch.float32)
