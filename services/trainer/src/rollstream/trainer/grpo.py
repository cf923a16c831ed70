"""GRPO: group-normalised advantages and the clipped surrogate loss with a k3 KL term.

Written against flat per-token tensors (all completion tokens of a micro-batch in one
[N] vector, `seq` saying which sequence each token belongs to), so that micro-batches
of any packing add up to exactly the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """(r - mean) / (std + eps) within one group (unbiased std, as in the GRPO paper's code)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar, already divided by the step's total sequence count
    kl_sum: float
    clipped_tokens: int
    tokens: int
    entropy_sum: float


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq: torch.Tensor,
    seq_lengths: torch.Tensor,
    total_seqs: int,
    clip_eps: float,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossParts:
    """Sequence-mean of token-means of  -min(r A, clip(r, 1-eps, 1+eps) A) + beta * k3.

    logp, behaviour_logp, advantages (per token), ref_logp, entropy: [N];
    seq: [N] index of the token's sequence in this micro-batch; seq_lengths: [S].
    """
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp)
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1.0  # k3: unbiased, always >= 0
        per_token = per_token + beta * kl
    per_seq = torch.zeros(seq_lengths.shape[0], dtype=per_token.dtype, device=per_token.device).index_add(0, seq, per_token)
    loss = (per_seq / seq_lengths.to(per_token.dtype)).sum() / total_seqs
    return LossParts(
        loss=loss,
        kl_sum=float(kl.detach().sum()),
        # Tokens whose gradient the clip removed (TRL's definition): ratio above 1+eps with a
        # positive advantage, or below 1-eps with a negative one.
        clipped_tokens=int((((ratio > 1.0 + clip_eps) & (advantages > 0)) | ((ratio < 1.0 - clip_eps) & (advantages < 0))).sum()),
        tokens=int(logp.numel()),
        entropy_sum=float(entropy.detach().sum()) if entropy is not None else 0.0,
    )
