"""rollstream.trainer.grpo's `grpo` loss, called as trainer.step calls it (advantages per
group, normaliser over the step, policy_loss per micro-batch), against a straightforward
per-sequence reference of the published formula, in float64: advantages, loss value,
gradient, and micro-batch additivity. The other losses: tests/unit/test_losses.py."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rollstream.trainer.grpo import LossConfig, advantages, group_advantages, keeps_group, normaliser, policy_loss

CLIP = 0.2
TOL = 1e-6


# --- advantages -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rewards",
    [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0], [3.0, -1.0, 2.5, 0.25, 0.0, 7.0, 1.0, 1.0], [1.0, 0.0]],
)
def test_group_advantages_by_hand(rewards: list[float]) -> None:
    eps = 1e-4
    mean = sum(rewards) / len(rewards)
    std = statistics.stdev(rewards)  # unbiased (n - 1)
    expected = [(r - mean) / (std + eps) for r in rewards]
    got = advantages("grpo", rewards)  # what trainer.step asks for
    assert got == pytest.approx(expected, abs=1e-12)
    assert got == group_advantages(rewards)
    assert sum(got) == pytest.approx(0.0, abs=1e-12)


def test_group_advantages_eps_argument() -> None:
    rewards = [0.0, 2.0]
    std = statistics.stdev(rewards)  # sqrt(2)
    assert group_advantages(rewards, eps=0.5) == pytest.approx([-1 / (std + 0.5), 1 / (std + 0.5)], abs=1e-12)


@pytest.mark.parametrize("rewards", [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0], [0.7] * 8, [5.0]])
def test_zero_variance_group_gives_zero_advantages(rewards: list[float]) -> None:
    assert advantages("grpo", rewards) == [0.0] * len(rewards)
    assert keeps_group("grpo", rewards)  # grpo keeps it: it still counts in G (and carries the KL term)


# --- the reference implementation -------------------------------------------------------------


def reference_loss_and_grad(
    seqs: list[dict], total_seqs: int, clip_eps: float, beta: float
) -> tuple[float, list[list[float]]]:
    """Per sequence, per token, in plain Python floats:
    loss = (1/total_seqs) * sum_s mean_t [ -min(r A, clip(r, 1-eps, 1+eps) A) + beta * k3 ],
    r = exp(logp - behaviour), k3 = exp(ref - logp) - (ref - logp) - 1;
    and d loss / d logp_t worked out by hand."""
    loss = 0.0
    grads: list[list[float]] = []
    for s in seqs:
        n = len(s["logp"])
        seq_sum = 0.0
        g_seq = []
        for lp, b, a, ref in zip(s["logp"], s["behaviour"], s["adv"], s["ref"], strict=True):
            r = math.exp(lp - b)
            rc = min(max(r, 1 - clip_eps), 1 + clip_eps)
            unclipped, clipped = r * a, rc * a
            term = -min(unclipped, clipped)
            # d(-min)/dlp: the unclipped branch moves with r (dr/dlp = r); the clipped
            # branch only while r is inside the clip range.
            if unclipped <= clipped:
                d = -a * r
            else:
                d = -a * r if 1 - clip_eps < r < 1 + clip_eps else 0.0
            if beta > 0:
                x = ref - lp
                term += beta * (math.exp(x) - x - 1)
                d += beta * (1 - math.exp(x))
            seq_sum += term
            g_seq.append(d / n / total_seqs)
        loss += seq_sum / n / total_seqs
        grads.append(g_seq)
    return loss, grads


def make_sequences(seed: int = 0) -> list[dict]:
    """Sequences whose tokens cover every clip case: ratio below, inside and above the range,
    with positive, negative and zero advantages (advantage is per sequence, as in GRPO)."""
    g = torch.Generator().manual_seed(seed)
    ratios = [0.5, 0.79, 0.95, 1.0, 1.05, 1.19, 1.25, 2.0, 0.7, 1.6]
    advantages = [1.3, -0.8, 0.0, 2.1, -1.7]
    lengths = [3, 5, 1, 7, 4]
    seqs = []
    k = 0
    for adv, n in zip(advantages, lengths, strict=True):
        logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05).tolist()
        ratio = [ratios[(k + i) % len(ratios)] for i in range(n)]
        k += n
        behaviour = [lp - math.log(r) for lp, r in zip(logp, ratio, strict=True)]
        ref = (
            torch.tensor(logp, dtype=torch.float64) + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
        ).tolist()
        seqs.append({"logp": logp, "behaviour": behaviour, "adv": [adv] * n, "ref": ref})
    return seqs


def grpo_config(clip_eps: float, beta: float) -> LossConfig:
    return LossConfig("grpo", clip_eps_low=clip_eps, clip_eps_high=clip_eps, beta=beta)


def run_grpo(seqs: list[dict], denom: float, clip_eps: float, beta: float):
    """policy_loss (kind grpo, symmetric clip) over `seqs` as one flat micro-batch, with the
    step's normaliser `denom`, laid out as trainer.step lays it out: flat [tokens] vectors,
    `seq` the sequence of each token, one advantage per sequence. Returns (parts, per-sequence
    logp leaves)."""
    leaves = [torch.tensor(s["logp"], dtype=torch.float64, requires_grad=True) for s in seqs]
    logp = torch.cat(leaves)
    cat = lambda key: torch.tensor([x for s in seqs for x in s[key]], dtype=torch.float64)  # noqa: E731 - a one-line helper, named where it is used
    lengths = torch.tensor([len(s["logp"]) for s in seqs], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    seq_adv = torch.tensor([s["adv"][0] for s in seqs], dtype=torch.float64)
    parts = policy_loss(
        grpo_config(clip_eps, beta),
        logp,
        cat("behaviour"),
        seq_adv,
        seq,
        lengths,
        denom,
        cat("ref") if beta > 0 else None,
    )
    return parts, leaves


def step_normaliser(seqs: list[dict]) -> float:
    """The step's denominator as trainer.step computes it: over every sequence of the step."""
    return normaliser(LossConfig("grpo"), [len(s["logp"]) for s in seqs])


def test_reference_covers_every_clip_case() -> None:
    seqs = make_sequences()
    cases = set()
    for s in seqs:
        for lp, b, a in zip(s["logp"], s["behaviour"], s["adv"], strict=True):
            r = math.exp(lp - b)
            where = "below" if r < 1 - CLIP else "above" if r > 1 + CLIP else "inside"
            cases.add((where, "pos" if a > 0 else "neg" if a < 0 else "zero"))
    assert {
        ("below", "pos"),
        ("below", "neg"),
        ("above", "pos"),
        ("above", "neg"),
        ("inside", "pos"),
        ("inside", "neg"),
    } <= cases


@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
def test_loss_and_gradient_match_the_reference(beta: float) -> None:
    seqs = make_sequences()
    total = len(seqs)
    assert step_normaliser(seqs) == total  # grpo: G, the number of sequences
    parts, leaves = run_grpo(seqs, step_normaliser(seqs), CLIP, beta)
    ref_loss, ref_grads = reference_loss_and_grad(seqs, total, CLIP, beta)
    assert parts.loss.dtype == torch.float64 and parts.loss.dim() == 0
    assert parts.loss.item() == pytest.approx(ref_loss, abs=TOL)
    parts.loss.backward()
    for i, (leaf, expected) in enumerate(zip(leaves, ref_grads, strict=True)):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(expected, abs=TOL), f"sequence {i}"
    flat = torch.cat([leaf.grad for leaf in leaves])
    if beta == 0:
        # Clipped tokens (and zero-advantage ones) get exactly no gradient; the others do.
        assert (flat == 0).any() and (flat != 0).any()

    # The bookkeeping.
    n_tokens = sum(len(s["logp"]) for s in seqs)
    assert parts.tokens == n_tokens
    # clipped_tokens counts tokens whose gradient the clip removed (TRL's clip fraction):
    # ratio above 1+eps with A > 0, or below 1-eps with A < 0.
    outside = sum(
        1
        for s in seqs
        for lp, b, a in zip(s["logp"], s["behaviour"], s["adv"], strict=True)
        if (a > 0 and math.exp(lp - b) > 1 + CLIP) or (a < 0 and math.exp(lp - b) < 1 - CLIP)
    )
    assert parts.clipped_tokens == outside
    if beta > 0:
        k3 = sum(math.exp(ref - lp) - (ref - lp) - 1 for s in seqs for lp, ref in zip(s["logp"], s["ref"], strict=True))
        assert parts.kl_sum == pytest.approx(k3, abs=TOL)
        assert parts.kl_sum > 0
    else:
        assert parts.kl_sum == 0.0


def test_on_policy_gradient_is_the_policy_gradient() -> None:
    """At ratio 1 with beta = 0 the gradient wrt logp_t is -A / (len * total): REINFORCE."""
    logp = [-1.0, -2.0, -0.5]
    seqs = [{"logp": logp, "behaviour": logp, "adv": [0.75] * 3, "ref": logp}]
    parts, leaves = run_grpo(seqs, denom=4.0, clip_eps=CLIP, beta=0.0)
    parts.loss.backward()
    assert parts.loss.item() == pytest.approx(-0.75 / 4, abs=1e-12)
    assert leaves[0].grad.tolist() == pytest.approx([-0.75 / 3 / 4] * 3, abs=1e-12)
    assert parts.clipped_tokens == 0


def test_beta_needs_reference_logprobs() -> None:
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            grpo_config(CLIP, 0.1),
            x,
            x,
            torch.zeros(1, dtype=torch.float64),
            torch.zeros(2, dtype=torch.long),
            torch.tensor([2]),
            1.0,
            ref_logp=None,
        )


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("split", [[0, 2, 4], [1], [0, 1, 2, 3]])
def test_micro_batches_add_up_to_the_full_batch(beta: float, split: list[int]) -> None:
    seqs = make_sequences(seed=3)
    total = len(seqs)
    denom = step_normaliser(seqs)  # of the whole step, whatever the packing
    full, full_leaves = run_grpo(seqs, denom, CLIP, beta)
    full.loss.backward()

    first = [seqs[i] for i in split]
    second = [s for i, s in enumerate(seqs) if i not in split]
    a, a_leaves = run_grpo(first, denom, CLIP, beta)
    b, b_leaves = run_grpo(second, denom, CLIP, beta)
    (a.loss + b.loss).backward()

    assert (a.loss + b.loss).item() == pytest.approx(full.loss.item(), abs=1e-12)
    by_index = dict(zip(split, a_leaves, strict=True)) | dict(
        zip([i for i in range(total) if i not in split], b_leaves, strict=True)
    )
    for i, leaf in enumerate(full_leaves):
        assert torch.allclose(by_index[i].grad, leaf.grad, rtol=0, atol=1e-12), f"sequence {i}"
    assert a.tokens + b.tokens == full.tokens
    assert a.clipped_tokens + b.clipped_tokens == full.clipped_tokens
    assert a.kl_sum + b.kl_sum == pytest.approx(full.kl_sum, abs=1e-12)
