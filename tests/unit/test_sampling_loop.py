"""The transformers backend's sampling loop: each prompt is prefilled once and its KV cache
copied to the group's rows. What a row samples must not depend on that sharing, on the other
requests in the batch or on their lengths, and its behaviour log-probs must be those of a
plain forward pass over prompt + completion (what the trainer's ratio divides by)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollstream.core import modeling
from rollstream.generator.backends import RowSampler, SampleRequest, TransformersBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread, restored after each test


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model_dir))


def request(prompt: list[int], n: int, seed: int, max_new_tokens: int = 8) -> SampleRequest:
    return SampleRequest(
        prompt_ids=prompt, n=n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=seed
    )


PROMPTS = [[5, 9, 14, 3, 21, 8, 30], [17, 2], [40, 41, 42, 43]]


def test_rows_sample_the_same_in_a_shared_batch_as_alone(backend: TransformersBackend) -> None:
    together = backend.sample([request(p, n=3, seed=100 + i) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        # Row k's generator is seeded by (seed, k): the request alone with n = 3 draws the same rows.
        alone = backend.sample([request(p, n=3, seed=100 + i)])[0]
        assert [s.token_ids for s in together[i]] == [s.token_ids for s in alone]
        for a, b in zip(together[i], alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The rows of a group are different draws, not one draw copied.
    assert len({tuple(s.token_ids) for s in together[0]}) > 1


def test_behaviour_logprobs_are_a_plain_forward_over_the_sequence(backend: TransformersBackend) -> None:
    groups = backend.sample([request(p, n=2, seed=7 + i) for i, p in enumerate(PROMPTS)])
    sequences = [(p, s.token_ids) for p, g in zip(PROMPTS, groups) for s in g]
    expected, _ = modeling.completion_logprobs(backend.model, modeling.make_batch(sequences, backend.pad_id))
    got = torch.tensor([lp for g in groups for s in g for lp in s.logprobs])
    assert got.shape == expected.shape and got.numel() > 0
    torch.testing.assert_close(got, expected.float(), atol=1e-4, rtol=0)


def test_lengths_stop_at_each_rows_own_limit(backend: TransformersBackend) -> None:
    groups = backend.sample(
        [request(PROMPTS[0], n=2, seed=1, max_new_tokens=3), request(PROMPTS[1], n=2, seed=2, max_new_tokens=6)]
    )
    assert all(len(s.token_ids) <= 3 for s in groups[0]) and all(len(s.token_ids) <= 6 for s in groups[1])
    for s in groups[0] + groups[1]:
        assert len(s.logprobs) == len(s.token_ids)
        assert s.finish_reason in ("stop", "length")


PROBS = torch.tensor([0.5, 0.3, 0.2, 0.0])


def draws(rows: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> torch.Tensor:
    """One draw from PROBS for each of `rows` rows with seeds seed, seed + 1, ... (fixed seeds:
    the counts below are the same on every run)."""
    sampler = RowSampler(
        [temperature] * rows, [top_p] * rows, [top_k] * rows, [seed + i for i in range(rows)], torch.device("cpu")
    )
    return sampler.draw(PROBS.log().expand(rows, -1))


def test_the_batched_sampler_draws_each_token_with_its_probability() -> None:
    counts = torch.bincount(draws(20_000), minlength=4).float() / 20_000
    torch.testing.assert_close(counts, PROBS, atol=0.015, rtol=0)  # ~4 standard errors
    assert counts[3] == 0  # a token of zero mass is never drawn


def test_top_k_and_top_p_keep_the_most_probable_tokens() -> None:
    top2 = torch.bincount(draws(20_000, top_k=2), minlength=4).float() / 20_000
    torch.testing.assert_close(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    # top-p 0.6: token 1 starts below 0.6 of mass (0.5 before it), token 2 after it (0.8).
    assert set(draws(2_000, top_p=0.6).tolist()) == {0, 1}
    assert set(draws(2_000, top_p=0.45).tolist()) == {0}
    assert set(draws(100, temperature=0.0).tolist()) == {0}  # greedy


def test_a_rows_draws_depend_on_its_seed_alone() -> None:
    sampler = RowSampler([1.0] * 3, [1.0] * 3, [0] * 3, [7, 8, 9], torch.device("cpu"))
    alone = RowSampler([1.0], [1.0], [0], [8], torch.device("cpu"))
    logp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    for _ in range(5):
        assert sampler.draw(logp)[1] == alone.draw(logp[1:2])[0]
