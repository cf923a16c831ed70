"""Every loss of rollstream.trainer.grpo against a straightforward per-sequence reference of
its published formula, in float64 (loss value and gradient wrt the trainer log-probs, to
1e-6), with clip-higher, k3 KL and truncated importance sampling; micro-batches add up to
the full batch; dapo's zero-variance filter and dr_grpo's advantages, in the loss and in
the trainer's step."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.trainer import grpo
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import Trainer
from rollstream.v1 import rollout_pb2

TOL = 1e-6
LMAX = 9  # dr_grpo's constant: the sampling budget max_new_tokens
# Clip-higher (eps_high > eps_low) everywhere, so that a swapped bound would show. GSPO's
# sequence-level ratios stay near 1, so it gets ranges small enough to clip some of them.
CLIPS = {"grpo": (0.2, 0.28), "dr_grpo": (0.2, 0.28), "dapo": (0.2, 0.28), "gspo": (0.04, 0.06)}
TIS_CAP = 1.5
GSPO_TIS_CAP = 1.2  # the sequence-level weight is a geometric mean: closer to 1


# --- the reference: the published formulas, one sequence and one token at a time ------------


def _pg_and_slope(r: float, a: float, low: float, high: float) -> tuple[float, float]:
    """pg = -min(r A, clip(r) A) and d pg / d r (zero where the clipped branch is the
    minimum and the ratio is outside the range)."""
    rc = min(max(r, 1 - low), 1 + high)
    unclipped, clipped = r * a, rc * a
    if unclipped <= clipped:
        return -unclipped, -a
    return -clipped, (-a if 1 - low < r < 1 + high else 0.0)


def reference(
    kind: str, seqs: list[dict], low: float, high: float, beta: float, tis_cap: float
) -> tuple[float, list[list[float]]]:
    """(loss, d loss / d logp per sequence and token) in plain Python floats.

    grpo    (1/G) sum_i (1/L_i) sum_t [w pg(r_it, A_i) + beta k3]
    dr_grpo (1/(G Lmax)) sum_i sum_t [...]       dapo (1/T) sum_i sum_t [...]
    gspo    (1/G) sum_i [w_i pg(s_i, A_i) + beta (1/L_i) sum_t k3],  s_i = exp(mean_t(logp - old))
    old = behaviour, w = 1 without TIS; with TIS old = logp (a constant: the trainer's own
    log-probs before the step) and w = min(exp(logp - behaviour), cap), a constant.
    """
    n_seqs = len(seqs)
    n_tokens = sum(len(s["logp"]) for s in seqs)
    denom = {"grpo": n_seqs, "gspo": n_seqs, "dr_grpo": n_seqs * LMAX, "dapo": n_tokens}[kind]
    tis = tis_cap > 0
    loss = 0.0
    grads: list[list[float]] = []
    for s in seqs:
        lps, bs, refs, a = s["logp"], s["behaviour"], s["ref"], s["adv"]
        n = len(lps)
        olds = lps if tis else bs
        k3 = [math.exp(ref - lp) - (ref - lp) - 1 for lp, ref in zip(lps, refs, strict=True)]
        dk3 = [1 - math.exp(ref - lp) for lp, ref in zip(lps, refs, strict=True)]  # d k3 / d logp
        if kind == "gspo":
            ratio = math.exp(sum(lp - o for lp, o in zip(lps, olds, strict=True)) / n)
            w = min(math.exp(sum(lp - b for lp, b in zip(lps, bs, strict=True)) / n), tis_cap) if tis else 1.0
            pg, slope = _pg_and_slope(ratio, a, low, high)
            loss += (w * pg + beta * sum(k3) / n) / denom
            # d ratio / d logp_t = ratio / L
            grads.append([(w * slope * ratio / n + beta * d / n) / denom for d in dk3])
            continue
        seq_loss, g = 0.0, []
        for lp, b, o, kl, dkl in zip(lps, bs, olds, k3, dk3, strict=True):
            r = math.exp(lp - o)
            w = min(math.exp(lp - b), tis_cap) if tis else 1.0
            pg, slope = _pg_and_slope(r, a, low, high)
            seq_loss += w * pg + beta * kl
            g.append(w * slope * r + beta * dkl)  # d r / d logp = r
        scale = 1.0 / (n * denom) if kind == "grpo" else 1.0 / denom
        loss += seq_loss * scale
        grads.append([x * scale for x in g])
    return loss, grads


# --- fixed inputs ---------------------------------------------------------------------------


def make_sequences(seed: int = 0) -> list[dict]:
    """Sequences whose tokens cover every case: per-token ratios below, inside and above the
    clip range, ratios above and below the TIS cap, positive, negative and zero advantages,
    lengths 1 to 7."""
    g = torch.Generator().manual_seed(seed)
    ratios = [0.5, 0.79, 0.95, 1.0, 1.05, 1.19, 1.25, 2.0, 0.7, 1.6, 1.3, 0.85]
    advantages = [1.3, 0.8, 0.0, 2.1, -1.7, 0.6, -0.4]
    lengths = [3, 5, 1, 7, 4, 2, 6]
    seqs, k = [], 0
    for adv, n in zip(advantages, lengths, strict=True):
        logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05).tolist()
        ratio = [ratios[(k + i) % len(ratios)] for i in range(n)]
        k += n + seed
        behaviour = [lp - math.log(r) for lp, r in zip(logp, ratio, strict=True)]
        ref = (
            torch.tensor(logp, dtype=torch.float64) + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
        ).tolist()
        seqs.append({"logp": logp, "behaviour": behaviour, "adv": adv, "ref": ref})
    return seqs


def run_loss(
    kind: str, seqs: list[dict], denom: float, beta: float, tis_cap: float
) -> tuple[grpo.LossParts, list[torch.Tensor]]:
    """policy_loss over `seqs` as one micro-batch; returns (parts, per-sequence logp leaves)."""
    low, high = CLIPS[kind]
    cfg = grpo.LossConfig(kind, low, high, beta, tis_cap, max_completion_tokens=LMAX)
    leaves = [torch.tensor(s["logp"], dtype=torch.float64, requires_grad=True) for s in seqs]
    cat = lambda key: torch.tensor([x for s in seqs for x in s[key]], dtype=torch.float64)  # noqa: E731 - a one-line helper, named where it is used
    seq = torch.tensor([i for i, s in enumerate(seqs) for _ in s["logp"]], dtype=torch.long)
    lengths = torch.tensor([len(s["logp"]) for s in seqs], dtype=torch.long)
    adv = torch.tensor([s["adv"] for s in seqs], dtype=torch.float64)
    parts = grpo.policy_loss(
        cfg, torch.cat(leaves), cat("behaviour"), adv, seq, lengths, denom, cat("ref") if beta > 0 else None
    )
    return parts, leaves


def denom_of(kind: str, seqs: list[dict]) -> float:
    cfg = grpo.LossConfig(kind, max_completion_tokens=LMAX)
    return grpo.normaliser(cfg, [len(s["logp"]) for s in seqs])


KINDS = ["grpo", "dr_grpo", "dapo", "gspo"]


# --- the tests ------------------------------------------------------------------------------


def test_inputs_cover_every_case() -> None:
    seqs = make_sequences()
    low, high = CLIPS["grpo"]
    token_cases, seq_cases = set(), set()
    for s in seqs:
        sign = "pos" if s["adv"] > 0 else "neg" if s["adv"] < 0 else "zero"
        for lp, b in zip(s["logp"], s["behaviour"], strict=True):
            r = math.exp(lp - b)
            token_cases.add(("below" if r < 1 - low else "above" if r > 1 + high else "inside", sign))
            token_cases.add("capped" if r > TIS_CAP else "uncapped")
        glow, ghigh = CLIPS["gspo"]
        sr = math.exp(sum(lp - b for lp, b in zip(s["logp"], s["behaviour"], strict=True)) / len(s["logp"]))
        seq_cases.add(("below" if sr < 1 - glow else "above" if sr > 1 + ghigh else "inside", sign))
        seq_cases.add("capped" if sr > GSPO_TIS_CAP else "uncapped")
    for where in ("below", "above", "inside"):
        for sign in ("pos", "neg"):
            assert (where, sign) in token_cases
    assert {"capped", "uncapped"} <= token_cases
    # gspo: clipped sequences both ways with the sign that makes the clip bite, and unclipped ones.
    assert {("below", "neg"), ("above", "pos"), ("inside", "pos"), "capped", "uncapped"} <= seq_cases
    # A ratio between 1 + eps_low and 1 + eps_high: clip-higher keeps its gradient.
    assert any(
        1 + low < math.exp(lp - b) <= 1 + high for s in seqs for lp, b in zip(s["logp"], s["behaviour"], strict=True)
    )


@pytest.mark.parametrize("tis", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradient_match_the_published_formula(kind: str, beta: float, tis: bool) -> None:
    seqs = make_sequences()
    tis_cap = (GSPO_TIS_CAP if kind == "gspo" else TIS_CAP) if tis else 0.0
    parts, leaves = run_loss(kind, seqs, denom_of(kind, seqs), beta, tis_cap)
    low, high = CLIPS[kind]
    ref_loss, ref_grads = reference(kind, seqs, low, high, beta, tis_cap)
    assert parts.loss.dtype == torch.float64 and parts.loss.dim() == 0
    assert parts.loss.item() == pytest.approx(ref_loss, abs=TOL)
    assert abs(ref_loss) > 1e-3  # not trivially zero
    parts.loss.backward()
    for i, (leaf, expected) in enumerate(zip(leaves, ref_grads, strict=True)):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(expected, abs=TOL), f"sequence {i}"

    # Bookkeeping: clipped tokens (ratio > 1 + eps_high with A > 0, or < 1 - eps_low with
    # A < 0; whole sequences for gspo), truncated tokens, k3 sum.
    clipped = truncated = 0
    for s in seqs:
        pairs = list(zip(s["logp"], s["behaviour"], strict=True))
        a, n = s["adv"], len(pairs)
        if kind == "gspo":
            r = 1.0 if tis else math.exp(sum(lp - b for lp, b in pairs) / n)
            clipped += n if (a > 0 and r > 1 + high) or (a < 0 and r < 1 - low) else 0
            truncated += n if tis and math.exp(sum(lp - b for lp, b in pairs) / n) > tis_cap else 0
        else:
            for lp, b in pairs:
                r = 1.0 if tis else math.exp(lp - b)
                clipped += (a > 0 and r > 1 + high) or (a < 0 and r < 1 - low)
                truncated += tis and math.exp(lp - b) > tis_cap
    assert parts.clipped_tokens == clipped
    assert parts.truncated_tokens == truncated
    if tis:
        assert truncated > 0 and parts.clipped_tokens == 0  # one step per batch: the ratio is 1
    else:
        assert clipped > 0
    assert parts.tokens == sum(len(s["logp"]) for s in seqs)
    k3 = sum(math.exp(r - lp) - (r - lp) - 1 for s in seqs for lp, r in zip(s["logp"], s["ref"], strict=True))
    assert parts.kl_sum == pytest.approx(k3 if beta > 0 else 0.0, abs=TOL)


def test_the_losses_differ_where_their_formulas_do() -> None:
    """Sanity of the reference itself: on the same inputs the four losses are different numbers,
    and on sequences of one token gspo's sequence ratio is grpo's token ratio."""
    seqs = make_sequences()
    values = {k: reference(k, seqs, 0.2, 0.28, 0.0, 0.0)[0] for k in KINDS}
    assert len({round(v, 9) for v in values.values()}) == 4
    one_token = [{**s, "logp": s["logp"][:1], "behaviour": s["behaviour"][:1], "ref": s["ref"][:1]} for s in seqs]
    assert reference("gspo", one_token, 0.2, 0.28, 0.04, 0.0)[0] == pytest.approx(
        reference("grpo", one_token, 0.2, 0.28, 0.04, 0.0)[0], abs=1e-12
    )
    g, _ = run_loss("gspo", one_token, len(one_token), 0.04, 0.0)
    assert g.loss.item() == pytest.approx(reference("gspo", one_token, *CLIPS["gspo"], 0.04, 0.0)[0], abs=TOL)


def test_on_policy_gradients() -> None:
    """At ratio 1 with beta = 0, d loss / d logp_t is -A / (L G) for grpo (REINFORCE with the
    sequence mean), -A / (G Lmax) for dr_grpo, -A / T for dapo and -A / (L G) for gspo."""
    logp = [-1.0, -2.0, -0.5]
    seqs = [
        {"logp": logp, "behaviour": logp, "adv": 0.75, "ref": logp},
        {"logp": [-0.3], "behaviour": [-0.3], "adv": -0.5, "ref": [-0.3]},
    ]
    expected = {
        "grpo": [[-0.75 / 3 / 2] * 3, [0.5 / 1 / 2]],
        "dr_grpo": [[-0.75 / (2 * LMAX)] * 3, [0.5 / (2 * LMAX)]],
        "dapo": [[-0.75 / 4] * 3, [0.5 / 4]],
        "gspo": [[-0.75 / 3 / 2] * 3, [0.5 / 1 / 2]],
    }
    for kind, want in expected.items():
        parts, leaves = run_loss(kind, seqs, denom_of(kind, seqs), 0.0, 0.0)
        parts.loss.backward()
        for leaf, w in zip(leaves, want, strict=True):
            assert leaf.grad.tolist() == pytest.approx(w, abs=1e-12), kind
        assert parts.clipped_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [[0, 2, 4], [1], [0, 1, 2, 3, 6]])
def test_micro_batches_add_up_to_the_full_batch(kind: str, split: list[int]) -> None:
    seqs = make_sequences(seed=3)
    denom = denom_of(kind, seqs)  # the step's constant, from every sequence
    beta, tis = 0.1, {"dapo": TIS_CAP, "gspo": GSPO_TIS_CAP}.get(kind, 0.0)
    full, full_leaves = run_loss(kind, seqs, denom, beta, tis)
    full.loss.backward()
    rest = [i for i in range(len(seqs)) if i not in split]
    a, a_leaves = run_loss(kind, [seqs[i] for i in split], denom, beta, tis)
    b, b_leaves = run_loss(kind, [seqs[i] for i in rest], denom, beta, tis)
    (a.loss + b.loss).backward()
    assert (a.loss + b.loss).item() == pytest.approx(full.loss.item(), abs=1e-12)
    by_index = dict(zip(split, a_leaves, strict=True)) | dict(zip(rest, b_leaves, strict=True))
    for i, leaf in enumerate(full_leaves):
        assert torch.allclose(by_index[i].grad, leaf.grad, rtol=0, atol=1e-12), f"sequence {i}"
    for field in ("tokens", "clipped_tokens", "truncated_tokens"):
        assert getattr(a, field) + getattr(b, field) == getattr(full, field)
    assert a.kl_sum + b.kl_sum == pytest.approx(full.kl_sum, abs=1e-12)


def test_normalisers() -> None:
    lengths = [3, 5, 1, 7]
    assert grpo.normaliser(grpo.LossConfig("grpo"), lengths) == 4
    assert grpo.normaliser(grpo.LossConfig("gspo"), lengths) == 4
    assert grpo.normaliser(grpo.LossConfig("dapo"), lengths) == 16
    assert grpo.normaliser(grpo.LossConfig("dr_grpo", max_completion_tokens=12), lengths) == 48
    with pytest.raises(ValueError, match="max_completion_tokens"):
        grpo.LossConfig("dr_grpo")
    with pytest.raises(ValueError, match="unknown loss"):
        grpo.LossConfig("ppo")  # type: ignore[arg-type]  # an unknown loss on purpose: it must be refused


def test_advantages_and_group_filter() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(rewards) / len(rewards)
    assert grpo.advantages("dr_grpo", rewards) == pytest.approx([r - mean for r in rewards], abs=1e-15)
    for kind in ("grpo", "dapo", "gspo"):
        assert grpo.advantages(kind, rewards) == grpo.group_advantages(rewards)
    assert grpo.keeps_group("dapo", rewards) and not grpo.keeps_group("dapo", [0.5, 0.5, 0.5])
    assert all(grpo.keeps_group(k, [0.5, 0.5]) for k in ("grpo", "dr_grpo", "gspo"))


def test_beta_needs_reference_logprobs() -> None:
    x = torch.zeros(2, dtype=torch.float64)
    for kind in KINDS:
        cfg = grpo.LossConfig(kind, beta=0.1, max_completion_tokens=4)
        with pytest.raises(ValueError, match="reference"):
            grpo.policy_loss(
                cfg, x, x, torch.zeros(1, dtype=torch.float64), torch.zeros(2, dtype=torch.long), torch.tensor([2]), 1.0
            )


# --- in the trainer's step --------------------------------------------------------------------


def _group(rng: random.Random, gid: str, rewards: list[float]) -> rollout_pb2.RolloutGroup:
    completions = []
    for r in rewards:
        n = rng.randint(1, 6)
        completions.append(
            rollout_pb2.Completion(
                token_ids=[rng.randrange(5, 200) for _ in range(n)],
                behaviour_logprobs=[-5.5 + rng.gauss(0, 0.2) for _ in range(n)],
                reward=r,
            )
        )
    prompt = [rng.randrange(5, 200) for _ in range(rng.randint(3, 8))]
    return rollout_pb2.RolloutGroup(group_id=gid, prompt_ids=prompt, completions=completions, scored=True)


def _trainer(model_dir: Path, **overrides) -> tuple[Trainer, ServiceHost]:
    settings = load_settings(
        TrainerSettings, [], **{"model": str(model_dir), "lr": 1e-3, "max_new_tokens": 6, **overrides}
    )
    host = ServiceHost("trainer", settings)
    return Trainer(settings, host), host


def test_dapo_filters_and_counts_zero_variance_groups(tiny_model_dir: Path, one_thread: None) -> None:
    rng = random.Random(7)
    useful = _group(rng, "useful", [1.0, 0.0, 1.0, 0.0])
    flat_one = _group(rng, "all-right", [1.0] * 4)
    flat_zero = _group(rng, "all-wrong", [0.0] * 4)

    # dapo trains on the useful group only: the same weights as a step on it alone.
    with_flat, host_a = _trainer(tiny_model_dir, loss="dapo")
    alone, host_b = _trainer(tiny_model_dir, loss="dapo")
    m, _, _ = with_flat.train_step([flat_one, useful, flat_zero])
    m_alone, _, _ = alone.train_step([useful])
    assert m.zero_variance_groups == 2 and m.groups == 3 and m.completions == 12
    assert m.tokens == m_alone.tokens == sum(len(c.token_ids) for c in useful.completions)
    assert m.loss == m_alone.loss and m.grad_norm == m_alone.grad_norm
    for name, master in with_flat.optimizer.master.items():
        assert torch.equal(master, alone.optimizer.master[name]), name

    # grpo keeps them (they count in G and carry the KL term): a different step.
    grpo_trainer, host_c = _trainer(tiny_model_dir, loss="grpo")
    m_grpo, _, _ = grpo_trainer.train_step([flat_one, useful, flat_zero])
    assert m_grpo.zero_variance_groups == 2
    assert m_grpo.tokens == sum(len(c.token_ids) for g in (flat_one, useful, flat_zero) for c in g.completions)

    # A dapo step with nothing left: no update, the version still advances, the delta is empty.
    before = {n: t.clone() for n, t in with_flat.optimizer.master.items()}
    bits_before = with_flat.publisher.bits()
    m_empty, published, stats = with_flat.train_step([flat_one, flat_zero])
    assert m_empty.tokens == 0 and m_empty.zero_variance_groups == 2 and m_empty.version == 2
    assert all(torch.equal(before[n], t) for n, t in with_flat.optimizer.master.items())
    assert stats.changed_tensors == 0 and stats.changed_values == 0
    assert all(np.array_equal(bits_before[n], b) for n, b in with_flat.publisher.bits().items())
    assert published.info.version == 2
    for h in (host_a, host_b, host_c):
        h.close()


def test_dr_grpo_in_the_trainer_uses_max_new_tokens(tiny_model_dir: Path, one_thread: None) -> None:
    """dr_grpo's loss is the token sum over G * max_new_tokens: doubling max_new_tokens halves it."""
    rng = random.Random(3)
    groups = [_group(rng, "a", [1.0, 0.0, 0.5, 0.0]), _group(rng, "b", [0.0, 0.2, 0.0, 1.0])]
    short, h1 = _trainer(tiny_model_dir, loss="dr_grpo", max_new_tokens=6)
    long, h2 = _trainer(tiny_model_dir, loss="dr_grpo", max_new_tokens=12)
    a, _, _ = short.train_step(groups)
    b, _, _ = long.train_step(groups)
    assert a.loss != 0 and b.loss == pytest.approx(a.loss / 2, rel=1e-6)
    h1.close()
    h2.close()
