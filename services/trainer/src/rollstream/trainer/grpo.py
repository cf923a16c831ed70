"""The GRPO family of policy losses: grpo, dr_grpo, dapo, gspo; k3 KL; truncated IS.

Written against flat per-token tensors (all completion tokens of a micro-batch in one [N]
vector, `seq` saying which sequence each token belongs to). Every micro-batch holds whole
sequences and the loss is divided by a constant of the whole step (`normaliser`), so
micro-batches of any packing add up to exactly the full-batch loss and gradient.

Notation: sequence i of the step has L_i completion tokens, advantage A_i, trainer log-probs
logp_it (with grad), behaviour log-probs b_it (the generator's, recorded when sampling),
reference log-probs ref_it. G is the number of sequences in the step, T their total number
of completion tokens. clip(x) = clamp(x, 1 - eps_low, 1 + eps_high) ("clip-higher" when
eps_high > eps_low). pg(r, A) = -min(r A, clip(r) A). k3_it = exp(ref - logp) - (ref - logp) - 1.

  grpo    (DeepSeekMath):  (1/G) sum_i (1/L_i) sum_t [ w_it pg(r_it, A_i) + beta k3_it ]
  dr_grpo (Dr. GRPO):      (1/(G Lmax)) sum_i sum_t [ w_it pg(r_it, A_i) + beta k3_it ],
                           Lmax = max_completion_tokens (the sampling budget `max_new_tokens`),
                           a constant, so no length bias; advantages without std: r - mean
  dapo    (DAPO):          (1/T) sum_i sum_t [ w_it pg(r_it, A_i) + beta k3_it ] (token-level
                           mean), and groups whose rewards are all equal are dropped
  gspo    (GSPO):          (1/G) sum_i [ w_i pg(s_i, A_i) + beta (1/L_i) sum_t k3_it ],
                           s_i = exp((1/L_i) sum_t (logp_it - old_it)), a sequence-level ratio
                           (it stays near 1: GSPO uses clip ranges of a few 1e-4)

The ratio r_it = exp(logp_it - old_it). Without truncated importance sampling (tis_cap = 0)
the old policy is the behaviour policy, old = b, and w = 1: the clip bounds the update on
samples from a stale or different sampler. With tis_cap > 0 the objective is the truncated-IS
one of Yao et al. ("Your efficient RL framework secretly brings you off-policy RL
training", 2025), as verl implements it: the PPO ratio is taken against the trainer's own
log-probs at the start of the step, and the trainer/behaviour mismatch (engine numerics,
staleness) is corrected by the weight w_it = min(exp(sg(logp_it) - b_it), tis_cap), a
constant under differentiation that multiplies the policy term (not the KL term). This
trainer makes exactly one optimizer step per batch, so "the trainer's log-probs at the start
of the step" is sg(logp) itself: r = 1 in value, its gradient is that of logp, and the clip
is inactive (clip fraction 0); the cap is what bounds the update. For gspo the weight is per
sequence, w_i = min(exp((1/L_i) sum_t (sg(logp_it) - b_it)), tis_cap), GSPO's own
geometric mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossKind = Literal["grpo", "dr_grpo", "dapo", "gspo"]
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)


@dataclass(frozen=True)
class LossConfig:
    kind: LossKind = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    beta: float = 0.0
    tis_cap: float = 0.0  # 0: no truncated importance sampling (old policy = behaviour)
    max_completion_tokens: int = 0  # dr_grpo's constant Lmax

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r} (one of {LOSS_KINDS})")
        if self.kind == "dr_grpo" and self.max_completion_tokens < 1:
            raise ValueError("dr_grpo normalises by max_completion_tokens, which must be >= 1")


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """(r - mean) / (std + eps) within one group (unbiased std, as in the GRPO paper's code)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


def advantages(kind: LossKind, rewards: Sequence[float]) -> list[float]:
    """The group's advantages for `kind`: r - mean for dr_grpo (no std scaling, which
    Dr. GRPO shows biases towards easy and hard questions), group-normalised otherwise."""
    if kind == "dr_grpo":
        r = torch.tensor(rewards, dtype=torch.float64)
        return (r - r.mean()).tolist()
    return group_advantages(rewards)


def keeps_group(kind: LossKind, rewards: Sequence[float]) -> bool:
    """dapo drops groups whose rewards are all equal (all advantages zero: no signal, but they
    would still dilute the token mean). The other losses keep them: they carry the KL term
    and count in G."""
    return kind != "dapo" or max(rewards) != min(rewards)


def normaliser(cfg: LossConfig, completion_lengths: Sequence[int]) -> float:
    """The step's constant denominator, from the lengths of every sequence trained in the step."""
    if cfg.kind == "dapo":
        return float(sum(completion_lengths))
    if cfg.kind == "dr_grpo":
        return float(len(completion_lengths) * cfg.max_completion_tokens)
    return float(len(completion_lengths))  # grpo, gspo


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar, already divided by the step's normaliser
    kl_sum: float  # sum of k3 over tokens
    clipped_tokens: int  # tokens whose policy gradient the clip removed
    truncated_tokens: int  # tokens whose IS weight hit tis_cap (all tokens of a sequence for gspo)
    tokens: int
    entropy_sum: float


def policy_loss(
    cfg: LossConfig,
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    seq_advantages: torch.Tensor,
    seq: torch.Tensor,
    seq_lengths: torch.Tensor,
    denom: float,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossParts:
    """The loss of one micro-batch (see the module docstring for the formulas).

    logp, behaviour_logp, ref_logp, entropy: [N] per token; seq: [N] index of each token's
    sequence in this micro-batch; seq_advantages, seq_lengths: [S]; denom: normaliser(...).
    """
    dtype, dev = logp.dtype, logp.device
    n_seqs = seq_lengths.shape[0]
    lengths = seq_lengths.to(dtype)
    adv_seq = seq_advantages.to(dtype)
    behaviour_logp = behaviour_logp.to(dtype)
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    use_tis = cfg.tis_cap > 0
    old = logp.detach() if use_tis else behaviour_logp

    def per_seq_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_seqs, dtype=x.dtype, device=dev).index_add(0, seq, x)

    kl = torch.zeros_like(logp)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        log_ratio = ref_logp.to(dtype) - logp
        kl = torch.exp(log_ratio) - log_ratio - 1.0  # k3: unbiased, always >= 0

    if cfg.kind == "gspo":
        ratio = torch.exp(per_seq_sum(logp - old) / lengths)  # [S]
        pg = -torch.minimum(ratio * adv_seq, torch.clamp(ratio, low, high) * adv_seq)
        truncated = torch.zeros(n_seqs, dtype=torch.bool, device=dev)
        if use_tis:
            raw = torch.exp(per_seq_sum(logp.detach() - behaviour_logp) / lengths)
            truncated = raw > cfg.tis_cap
            pg = pg * torch.clamp(raw, max=cfg.tis_cap)
        per_seq = pg + cfg.beta * per_seq_sum(kl) / lengths if cfg.beta > 0 else pg
        loss = per_seq.sum() / denom
        clipped_seq = ((ratio > high) & (adv_seq > 0)) | ((ratio < low) & (adv_seq < 0))
        clipped_tokens = int(seq_lengths[clipped_seq.detach()].sum())
        truncated_tokens = int(seq_lengths[truncated].sum())
    else:
        adv = adv_seq[seq]
        ratio = torch.exp(logp - old)
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
        truncated = torch.zeros_like(logp, dtype=torch.bool)
        if use_tis:
            raw = torch.exp(logp.detach() - behaviour_logp)
            truncated = raw > cfg.tis_cap
            pg = pg * torch.clamp(raw, max=cfg.tis_cap)
        per_token = pg + cfg.beta * kl if cfg.beta > 0 else pg
        if cfg.kind == "grpo":
            loss = (per_seq_sum(per_token) / lengths).sum() / denom
        else:  # dr_grpo, dapo: a plain token sum over a constant
            loss = per_token.sum() / denom
        # Tokens whose gradient the clip removed (TRL's definition): ratio above 1 + eps_high
        # with a positive advantage, or below 1 - eps_low with a negative one.
        clipped_tokens = int((((ratio > high) & (adv > 0)) | ((ratio < low) & (adv < 0))).sum())
        truncated_tokens = int(truncated.sum())
    return LossParts(
        loss=loss,
        kl_sum=float(kl.detach().sum()),
        clipped_tokens=clipped_tokens,
        truncated_tokens=truncated_tokens,
        tokens=int(logp.numel()),
        entropy_sum=float(entropy.detach().sum()) if entropy is not None else 0.0,
    )
