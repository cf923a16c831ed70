"""trainer.packed_attention: each example of a packed row attended on its own gives what
transformers' SDPA gives with the block-diagonal mask it builds from the positions (the
log-probs and every gradient); generation switches back to SDPA; a mask or a cache is
refused, not attended across."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_sft_step import example, pack

from rollstream.core import modeling
from rollstream.trainer import packed_attention, sft_data, sft_eval
from rollstream.trainer.sft_data import PackedRow

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rows(vocab: int) -> list[PackedRow]:
    """Rows of different widths (a row's padding is a run of its own), examples of lengths
    1 to 40 (several length groups, a group of one), one row a single example."""
    rng = random.Random(3)
    return [
        pack([example(rng, vocab, 5, 4), example(rng, vocab, 0, 1), example(rng, vocab, 30, 10)]),
        pack(
            [example(rng, vocab, 3, 3), example(rng, vocab, 2, 2), example(rng, vocab, 9, 8), example(rng, vocab, 1, 2)]
        ),
        pack([example(rng, vocab, 12, 5)]),
    ]


def logprobs_and_grads(model: torch.nn.Module, batch: modeling.Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=16)
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("one_example_a_row", [False, True])
def test_each_example_attended_on_its_own_is_sdpa_with_the_block_mask(
    tiny_model_dir: Path, one_example_a_row: bool
) -> None:
    model, tokenizer = modeling.load_model(tiny_model_dir)
    model.train()
    packed = rows(model.config.vocab_size)
    if one_example_a_row:
        packed = [packed[2], packed[2]]  # no restart, no padding: plain causal attention
    batch = sft_data.packed_batch(packed, tokenizer.pad_token_id)
    assert model.config._attn_implementation == "sdpa"
    expected, expected_grads = logprobs_and_grads(model, batch)
    assert packed_attention.use(model)
    got, grads = logprobs_and_grads(model, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert grads.keys() == expected_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_generation_runs_on_sdpa_and_a_mask_is_refused(tiny_model_dir: Path) -> None:
    model, tokenizer = modeling.load_model(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]  # of two lengths: left padding, a padding mask
    before = sft_eval.generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2, device="cpu")
    assert packed_attention.use(model)
    after = sft_eval.generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2, device="cpu")
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert model.config._attn_implementation == packed_attention.NAME  # switched back
    ids = torch.tensor([[5, 6, 7, 0]])
    with pytest.raises(ValueError, match="no padding mask"):
        model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 0]]), use_cache=False)


def test_grouped_query_runs_and_the_refusals() -> None:
    """On tensors: 4 query heads over 2 key/value heads, runs of 1 to 9 positions in two rows,
    against SDPA on each run alone; a run longer than a sliding window, or no positions, is
    refused."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g) for h in (4, 2, 2))
    lengths = [[3, 1, 9, 3], [7, 7, 2]]
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    out, _ = packed_attention.attention(torch.nn.Module(), q, k, v, None, position_ids=positions)
    for b, row in enumerate(lengths):
        at = 0
        for n in row:
            s = slice(at, at + n)
            alone = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1, :, s], k[b : b + 1, :, s], v[b : b + 1, :, s], is_causal=True, enable_gqa=True
            )
            torch.testing.assert_close(out[b, s], alone[0].transpose(0, 1), rtol=0, atol=1e-6)
            at += n
    with pytest.raises(ValueError, match="longer than the sliding window"):
        packed_attention.attention(torch.nn.Module(), q, k, v, None, position_ids=positions, sliding_window=8)
    assert packed_attention.attention(torch.nn.Module(), q, k, v, None, position_ids=positions, sliding_window=9)
    with pytest.raises(ValueError, match="position ids"):
        packed_attention.attention(torch.nn.Module(), q, k, v, None)
