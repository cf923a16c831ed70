"""The reference stage's log-probs for a sequence equal the trainer's at version 0.

Version 0 is the bf16 rounding of the checkpoint: the trainer gets it from HostAdamW.sync_model
(the masters rounded to bf16 and written into the model), the reference service from
`round_to_bf16_` at load. If the two disagreed, the KL term would start above zero and
measure rounding instead of drift. Both sides run here exactly as their services run them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollstream.core import modeling
from rollstream.reference.scoring import ReferenceModel, TokenPair
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.step import StepConfig, train_step
from rollstream.v1 import rollout_pb2

TEMPERATURE = 0.8
CHUNK_TOKENS = 16


def sequences(vocab: int) -> list[TokenPair]:
    gen = torch.Generator().manual_seed(3)
    shapes = [(12, 7), (30, 25), (3, 1), (18, 40), (9, 9), (25, 3)]
    return [
        (torch.randint(0, vocab, (p,), generator=gen).tolist(), torch.randint(0, vocab, (c,), generator=gen).tolist())
        for p, c in shapes
    ]


def trainer_logprobs(tiny_model_dir: Path, dtype: str, seqs: list[TokenPair], token_budget: int) -> list[list[float]]:
    """The log-probs the trainer's first step takes its policy ratio of: the model at
    version 0 (HostAdamW.sync_model) through step.train_step itself, one group per sequence."""
    model, tokenizer = modeling.load_model(tiny_model_dir, dtype=dtype)
    model.train()
    optimizer = HostAdamW(
        modeling.named_weights(model), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, moments_dtype="float32"
    )
    optimizer.sync_model()
    groups = [
        rollout_pb2.RolloutGroup(
            prompt_ids=p,
            completions=[rollout_pb2.Completion(token_ids=c, behaviour_logprobs=[0.0] * len(c), reward=0.0)],
        )
        for p, c in seqs
    ]
    cfg = StepConfig(
        LossConfig(), token_budget, CHUNK_TOKENS, TEMPERATURE, max_grad_norm=1.0, device="cpu", share_prompts=False
    )
    result = train_step(model, optimizer, groups, cfg, pad_id=tokenizer.pad_token_id)
    return [values.float().tolist() for values in result.logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_equals_trainer_at_version_0(tiny_model_dir: Path, dtype: str) -> None:
    # share_prompts off: the packed path is the trainer's own computation (with shared
    # prompts the values agree up to float rounding: test_reference_scoring.py).
    ref = ReferenceModel.load(
        tiny_model_dir,
        dtype=dtype,
        token_budget=128,
        chunk_tokens=CHUNK_TOKENS,
        temperature=TEMPERATURE,
        share_prompts=False,
    )
    seqs = sequences(ref.vocab_size)
    got = ref.logprobs(seqs)
    # Same micro-batches as the reference: the very same computation, bit for bit.
    same_packing = trainer_logprobs(tiny_model_dir, dtype, seqs, token_budget=128)
    assert got == same_packing
    # The trainer's own packing differs (another token budget: other padding); equal up to
    # the float noise of other matrix shapes.
    other_packing = trainer_logprobs(tiny_model_dir, dtype, seqs, token_budget=4096)
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    for g, t in zip(got, other_packing, strict=True):
        assert len(g) == len(t)
        assert max(abs(a - b) for a, b in zip(g, t)) <= tolerance


def test_unrounded_weights_would_differ(tiny_model_dir: Path) -> None:
    """The check above has teeth: fp32 weights that skip the bf16 rounding give other values."""
    ref = ReferenceModel.load(tiny_model_dir, token_budget=128, chunk_tokens=CHUNK_TOKENS, temperature=TEMPERATURE)
    seqs = sequences(ref.vocab_size)
    model, tokenizer = modeling.load_model(tiny_model_dir)
    batch = modeling.make_batch(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        raw, _ = modeling.completion_logprobs(model, batch, chunk_tokens=CHUNK_TOKENS, temperature=TEMPERATURE)
    got = torch.tensor([v for s in ref.logprobs(seqs) for v in s])
    assert (raw - got).abs().max() > 1e-4
