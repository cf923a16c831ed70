"""rollstream.trainer.step.train_step, the trainer's whole GRPO update, on the tiny model:
its loss and metrics against a hand computation of the formulas (and the numbers the
service's step gave before it moved into step.py), what a group with all-equal rewards
contributes, and that micro-batching does not change the update."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import modeling
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep
from rollstream.trainer.step import StepConfig, StepResult, train_step
from rollstream.v1 import rollout_pb2
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LR = 1e-3
CLIP = 0.2
BETA = 0.1
ADV_EPS = 1e-4  # grpo.group_advantages' eps


def load(model_dir: Path, adam_eps: float = 1e-8) -> tuple[torch.nn.Module, HostAdamW, int]:
    """The model at version 0 and its optimizer, as the Trainer builds them."""
    model, tokenizer = modeling.load_model(model_dir)
    model.train()
    optimizer = HostAdamW(
        modeling.named_weights(model),
        lr=LR,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        eps=adam_eps,
        moments_dtype="float32",
    )
    optimizer.sync_model()
    return model, optimizer, tokenizer.pad_token_id


def with_ref(groups: list[rollout_pb2.RolloutGroup], seed: int) -> list[rollout_pb2.RolloutGroup]:
    """Reference log-probs near the behaviour ones, as the reference stage would add them."""
    rng = random.Random(seed)
    for g in groups:
        for c in g.completions:
            c.ref_logprobs.extend([x + rng.gauss(0, 0.1) for x in c.behaviour_logprobs])
    return groups


def step_config(beta: float = 0.0, token_budget: int = 4096, share_prompts: bool = False) -> StepConfig:
    return StepConfig(
        LossConfig("grpo", CLIP, CLIP, beta=beta),
        token_budget,
        chunk_tokens=1024,
        temperature=1.0,
        max_grad_norm=1.0,
        device="cpu",
        share_prompts=share_prompts,
    )


def by_hand(model: torch.nn.Module, groups: list[rollout_pb2.RolloutGroup], beta: float) -> dict[str, float]:
    """The grpo loss and the step's metrics from the formulas, in float64 Python, with each
    sequence's log-probs from its own full forward (no packing, no chunked LM head):
      A_i = (r_i - mean) / (unbiased std + 1e-4) within the group,
      loss = (1/G) sum_i (1/L_i) sum_t [ -min(rho A_i, clip(rho) A_i) + beta k3 ],
      rho = exp(logp - behaviour), k3 = exp(ref - logp) - (ref - logp) - 1."""
    all_rewards = [c.reward for g in groups for c in g.completions]
    loss = kl = entropy = 0.0
    clipped = tokens = 0
    sequences = 0
    for g in groups:
        rewards = [c.reward for c in g.completions]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        for c in g.completions:
            a = (c.reward - mean) / (std + ADV_EPS)
            ids = torch.tensor([list(g.prompt_ids) + list(c.token_ids)])
            with torch.no_grad():
                log_softmax = model(input_ids=ids).logits[0].double().log_softmax(-1)
            seq_sum = 0.0
            for t, token in enumerate(c.token_ids):
                row = log_softmax[len(g.prompt_ids) - 1 + t]  # the position predicting `token`
                lp = float(row[token])
                rho = math.exp(lp - c.behaviour_logprobs[t])
                term = -min(rho * a, min(max(rho, 1 - CLIP), 1 + CLIP) * a)
                clipped += (rho > 1 + CLIP and a > 0) or (rho < 1 - CLIP and a < 0)
                if beta > 0:
                    x = c.ref_logprobs[t] - lp
                    k3 = math.exp(x) - x - 1
                    term += beta * k3
                    kl += k3
                entropy += float(-(row.exp() * row).sum())
                seq_sum += term
                tokens += 1
            loss += seq_sum / len(c.token_ids)
            sequences += 1
    mean_all = statistics.fmean(all_rewards)
    return {
        "loss": loss / sequences,
        "kl": kl / tokens,
        "clip_fraction": clipped / tokens,
        "entropy": entropy / tokens,
        "tokens": tokens,
        "reward_mean": mean_all,
        "reward_std": statistics.pstdev(all_rewards, mean_all),
    }


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_loss_and_metrics_match_a_hand_computation(tiny_model_dir: Path, beta: float, share_prompts: bool) -> None:
    """Each sequence alone (by_hand) against the step's micro-batches: one sequence a row, or
    each group's prompt once with its completions after it under a mask (share_prompts)."""
    groups = scored_groups(1, 2)  # 2 groups x 4 completions, 0/1 rewards
    if beta:
        with_ref(groups, seed=1)
    model, optimizer, pad_id = load(tiny_model_dir)
    expected = by_hand(model, groups, beta)
    r = train_step(model, optimizer, groups, step_config(beta=beta, share_prompts=share_prompts), pad_id=pad_id)

    assert (r.groups, r.completions, r.zero_variance_groups) == (2, 8, 0)
    assert r.tokens == expected["tokens"]
    assert r.train_tokens == sum(len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions)
    assert r.reward_mean == pytest.approx(expected["reward_mean"], abs=1e-12)
    assert r.reward_std == pytest.approx(expected["reward_std"], abs=1e-12)
    assert r.clip_fraction == expected["clip_fraction"] and 0 < r.clip_fraction < 1
    assert r.truncated_fraction == 0.0  # tis_cap = 0
    for name in ("loss", "kl", "entropy"):
        assert getattr(r, name) == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    assert (r.kl > 0) == (beta > 0)
    # An update happened: the optimizer stepped and the model holds the new bf16 weights.
    assert optimizer.step_count == 1 and r.trained_bits is not None and r.grad_norm > 0
    held = modeling.model_bits(model)
    assert all(np.array_equal(held[n], bits) for n, bits in r.trained_bits.items())

    # The numbers Trainer.train_step recorded (as float32 StepMetrics) for this very batch
    # before the step moved into step.py, with settings lr 1e-3, max_new_tokens 6.
    recorded = {
        0.0: {"loss": 0.07633771002292633, "grad_norm": 1.4661965370178223, "kl": 0.0},
        BETA: {"loss": 0.09243689477443695, "grad_norm": 1.5889471769332886, "kl": 0.13395626842975616},
    }[beta]
    for name, value in recorded.items():
        assert getattr(r, name) == pytest.approx(value, rel=1e-5, abs=1e-9), name
    assert r.clip_fraction == pytest.approx(0.3333333432674408, rel=1e-6)
    assert r.entropy == pytest.approx(5.853091716766357, rel=1e-5)


def test_a_group_with_equal_rewards_contributes_zero_advantage(tiny_model_dir: Path) -> None:
    useful, flat = scored_groups(1, 2)
    for c in flat.completions:
        c.reward = 1.0  # all right: nothing to learn from it
    cfg = step_config()

    # Alone: a zero policy term, so a zero loss and gradient, and AdamW moves nothing.
    model, optimizer, pad_id = load(tiny_model_dir)
    version0 = modeling.model_bits(model)
    r = train_step(model, optimizer, [flat], cfg, pad_id=pad_id)
    assert r.zero_variance_groups == 1 and r.tokens == sum(len(c.token_ids) for c in flat.completions)
    assert r.loss == 0.0 and r.grad_norm == 0.0 and r.clip_fraction == 0.0
    assert r.trained_bits is not None
    assert all(np.array_equal(version0[n], bits) for n, bits in r.trained_bits.items())

    # Beside a useful group it still counts in G (grpo's 1/G): the loss and the gradient are
    # the useful group's alone scaled by 4/8, nothing else.
    model, optimizer, pad_id = load(tiny_model_dir)
    both = train_step(model, optimizer, [useful, flat], cfg, pad_id=pad_id)
    model, optimizer, pad_id = load(tiny_model_dir)
    alone = train_step(model, optimizer, [useful], cfg, pad_id=pad_id)
    assert both.loss == pytest.approx(alone.loss / 2, rel=1e-5)
    assert both.grad_norm == pytest.approx(alone.grad_norm / 2, rel=1e-5)
    assert both.zero_variance_groups == 1 and alone.zero_variance_groups == 0

    # dapo drops it: with nothing left there is no gradient, so no update at all.
    model, optimizer, pad_id = load(tiny_model_dir)
    dapo = dataclasses.replace(cfg, loss=LossConfig("dapo"))
    r = train_step(model, optimizer, [flat], dapo, pad_id=pad_id)
    assert r.trained_bits is None and r.tokens == 0 and r.grad_norm == 0.0 and optimizer.step_count == 0
    assert r.completions == 4 and r.zero_variance_groups == 1


def run_packed(
    model_dir: Path, groups: list[rollout_pb2.RolloutGroup], token_budget: int, share_prompts: bool = False
) -> tuple[StepResult, HostAdamW, dict[str, torch.Tensor]]:
    # A large Adam eps makes the update nearly linear in the gradient: the float noise of
    # another packing then stays float noise in the weights (with eps 1e-8 the first step is
    # ~lr * sign(g), and a gradient that is zero up to noise could flip sign).
    model, optimizer, pad_id = load(model_dir, adam_eps=1e-2)
    before = {n: m.clone() for n, m in optimizer.master.items()}
    r = train_step(
        model,
        optimizer,
        groups,
        step_config(beta=BETA, token_budget=token_budget, share_prompts=share_prompts),
        pad_id=pad_id,
    )
    return r, optimizer, {n: optimizer.master[n] - before[n] for n in before}


@pytest.mark.parametrize(
    ("token_budget", "share_prompts"),
    [
        (44, False),  # two micro-batches of whole sequences
        (4096, True),  # each group's prompt once, its 4 completions after it: one micro-batch
        (12, True),  # units cut to the budget: a prompt with 1-2 of its completions, some sequences alone
    ],
)
def test_micro_batches_give_the_same_update(tiny_model_dir: Path, token_budget: int, share_prompts: bool) -> None:
    groups = with_ref(scored_groups(2, 2), seed=2)
    lengths = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    assert len(modeling.pack_by_tokens(lengths, 44)) == 2 and len(modeling.pack_by_tokens(lengths, 4096)) == 1

    one, _, update_one = run_packed(tiny_model_dir, groups, 4096)
    two, _, update_two = run_packed(tiny_model_dir, groups, token_budget, share_prompts)
    for name in ("loss", "kl", "entropy", "grad_norm"):
        assert getattr(two, name) == pytest.approx(getattr(one, name), rel=1e-5), name
    assert (two.tokens, two.clip_fraction) == (one.tokens, one.clip_fraction)
    for a, b in zip(one.logprobs, two.logprobs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    scale = max(float(u.abs().max()) for u in update_one.values())
    assert scale > 0
    for name, u in update_one.items():
        assert torch.allclose(update_two[name], u, rtol=0, atol=1e-4 * scale), name


def test_a_non_finite_loss_applies_nothing(tiny_model_dir: Path) -> None:
    groups = scored_groups(1, 2)
    groups[1].completions[3].behaviour_logprobs[0] = math.nan  # completion 7 of the step
    # Micro-batches of 2 sequences, the poisoned one not first: the gradients of those
    # before it are in the parameters already and must go too.
    lengths = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    packs = modeling.pack_by_tokens(lengths, 22)
    assert len(packs) > 1 and 7 not in packs[0]
    model, optimizer, pad_id = load(tiny_model_dir)
    version0 = modeling.model_bits(model)
    with pytest.raises(NonFiniteStep, match="loss is nan"):
        train_step(model, optimizer, groups, step_config(token_budget=22), pad_id=pad_id)
    assert optimizer.step_count == 0
    assert all(p.grad is None for p in optimizer.params.values())
    assert all(np.array_equal(version0[n], b) for n, b in modeling.model_bits(model).items())


def test_shared_prompt_units_are_cut_to_the_budget() -> None:
    """The units of share_prompts: consecutive completions of one prompt, no unit wider than
    the budget, a completion that fits with no other in a micro-batch of sequences, and
    every completion exactly once."""
    from rollstream.trainer.step import _micro_batches, _Row

    def row(prompt: list[int], n: int) -> _Row:
        return _Row(prompt, [7] * n, 0.0, [0.0] * n, [])

    rows = [row([1, 2, 3], 2), row([1, 2, 3], 3), row([1, 2, 3], 4), row([4, 5], 9), row([6], 1), row([6], 1)]
    micros = _micro_batches(rows, token_budget=10, share_prompts=True)
    assert sorted(i for m in micros for i in m.rows) == list(range(6))
    shapes = []
    for m in micros:
        batch = m.batch(rows, 0, torch.float32, "cpu")
        assert batch.lengths == [len(rows[i].completion) for i in m.rows]
        shapes.append((batch.attention_mask.dim(), batch.input_ids.shape[1]))
    # [1,2,3]+2+3 (width 8) and [6]+1+1 (3) share (two rows of 8 would pass 10: two micro-batches);
    # [1,2,3]+4 does not fit beside the 8 and [4,5]+9 (11) not in any: sequences alone.
    assert sorted(shapes) == [(2, 7), (2, 11), (4, 3), (4, 8)]
    assert sorted(i for m in micros if m.units is not None for i in m.rows) == [0, 1, 4, 5]
