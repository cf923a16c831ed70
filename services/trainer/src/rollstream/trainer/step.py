"""One GRPO step, top to bottom: scored groups in, one optimizer update and its metrics out.

  1. advantages     per group (grpo.advantages), one per completion, constant over its
                    tokens; dapo drops the groups whose rewards are all equal
  2. normaliser     the step's constant loss denominator (grpo.normaliser) over every
                    trained completion, so micro-batches add up to the full-batch loss
  3. micro-batches  whole sequences packed to `token_budget` padded tokens (with
                    `share_prompts`, a group's prompt once per micro-batch and its
                    completions after it: modeling.make_shared_batch), and for each:
       log-probs    log pi(token | prefix) and entropy of every completion token, with
                    grad (modeling.completion_logprobs); log pi_ref from the groups, or from
                    the model's own frozen base under its LoRA adapters
       loss         grpo.policy_loss (the formulas are in grpo.py)
       backward     gradients accumulate over the micro-batches
                    (on N ranks, ranks.py: rank r runs the r-th micro-batch of each round of
                    N, and the gradients are summed in micro-batch order, one process's bits)
  4. optimizer      one HostAdamW step: grad-norm clip, AdamW on the fp32 masters, new bf16
                    weights in the model and returned as bits (each bucket's pieces, old and
                    new bits, also handed to `on_piece`: the publisher encodes the delta on
                    the way); with `background`, the buckets are stepped after this returns,
                    while the next step's forward runs (HostAdamW.step with the model)
  5. metrics        the micro-batches' sums, per token

A non-finite loss or gradient norm applies nothing: the gradients are dropped and
NonFiniteStep is raised. `nonfinite_groups` then finds which groups did it (each group's
loss and gradient alone, nothing applied), so the caller refuses those and trains the rest.
Nothing here talks to Redis, gRPC or Prometheus, and nothing is
published: the trainer service publishes the bits, records the metrics and acknowledges
the groups. Benchmarks and tests call this very function, so what they measure and check
is what the trainer does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollstream.core import modeling
from rollstream.trainer import grpo
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep, OnPiece
from rollstream.v1 import rollout_pb2

if TYPE_CHECKING:  # (ranks.py imports torch.distributed's FSDP2: only the trainer on N ranks needs it)
    from rollstream.trainer.ranks import Ranks

# peft's `disable_adapter`: inside it the model computes with its frozen base weights.
AdaptersOff = Callable[[], AbstractContextManager[object]]


@dataclass(frozen=True)
class StepConfig:
    """The settings one step reads. No defaults here: TrainerSettings holds them, and
    `from_settings(TrainerSettings())` gives the trainer's."""

    loss: grpo.LossConfig
    token_budget: int  # padded tokens per micro-batch
    chunk_tokens: int  # LM-head rows at a time (modeling.head_logprobs)
    temperature: float  # the sampling temperature: log-probs of the distribution sampled from
    max_grad_norm: float  # 0: no clipping
    device: str
    share_prompts: bool  # a group's prompt once per micro-batch (modeling.make_shared_batch)

    @classmethod
    def from_settings(cls, s: TrainerSettings) -> StepConfig:
        loss = grpo.LossConfig(
            kind=s.loss,
            clip_eps_low=s.clip_eps_low,
            clip_eps_high=s.clip_eps_high,
            beta=s.beta,
            tis_cap=s.tis_cap,
            max_completion_tokens=s.max_new_tokens,
        )
        return cls(loss, s.token_budget, s.chunk_tokens, s.temperature, s.max_grad_norm, s.device, s.share_prompts)


@dataclass
class StepResult:
    groups: int
    completions: int  # in every group, dropped ones (dapo) included
    zero_variance_groups: int  # groups whose rewards are all equal (zero advantages)
    reward_mean: float  # over every completion
    reward_std: float  # population std over every completion
    loss: float  # the step's loss: the sum of its micro-batches'
    kl: float  # mean k3 per trained token (0 when beta = 0)
    clip_fraction: float  # trained tokens whose policy gradient the clip removed
    entropy: float  # mean per trained token
    truncated_fraction: float  # trained tokens whose IS weight hit tis_cap
    tokens: int  # completion tokens trained
    train_tokens: int  # prompt + completion tokens through the model
    grad_norm: float  # before clipping; 0 without an update
    # The new bf16 bits of the optimizer's parameters; None when no group was left to train
    # (dapo): no gradient, so no update.
    trained_bits: dict[str, np.ndarray] | None
    # log pi of each trained completion's tokens before the update (detached), in the order
    # the completions come in the groups: what the policy term's ratio was taken of.
    logprobs: list[torch.Tensor]
    # Wall time per phase. On a GPU kernels run asynchronously: each micro-batch's loss is
    # read on the host (the non-finite check), so forward_s waits for its forward, and the
    # optimizer waits for the last backward; forward/backward is then only roughly split.
    forward_s: float
    backward_s: float
    optimizer_s: float


@dataclass(frozen=True)
class _Row:
    """One completion to train on: its sequence, advantage and per-token log-probs."""

    prompt: list[int]
    completion: list[int]
    advantage: float
    behaviour: list[float]
    ref: list[float]  # empty when pi_ref is not read from the groups


def base_logprobs(
    model: torch.nn.Module, adapters_off: AdaptersOff, batch: modeling.Batch, cfg: StepConfig
) -> torch.Tensor:
    """log pi_ref of the batch's completion tokens from the frozen base: the LoRA model with
    its adapters switched off (kl_reference = lora_base). The base holds the bf16 rounding of
    the checkpoint, exactly what the reference service computes with, and version 0 (B = 0)
    is this very model, so the KL starts at exactly zero."""
    with torch.no_grad(), adapters_off():
        logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=cfg.chunk_tokens, temperature=cfg.temperature)
    return logp.float()


@dataclass
class _Sums:
    """What the micro-batches add up: the loss and the metrics' sums."""

    loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: int = 0
    truncated: int = 0
    tokens: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0


def _rows(
    groups: Sequence[rollout_pb2.RolloutGroup], loss_cfg: grpo.LossConfig, ref_from_groups: bool
) -> tuple[list[_Row], list[int]]:
    """The completions to train on, and for each the index of its group in `groups`: the
    group's advantages (dapo drops the groups whose rewards are all equal)."""
    rows: list[_Row] = []
    owner: list[int] = []
    for k, g in enumerate(groups):
        r = [c.reward for c in g.completions]
        if not grpo.keeps_group(loss_cfg.kind, r):
            continue
        for c, a in zip(g.completions, grpo.advantages(loss_cfg.kind, r)):
            ref = list(c.ref_logprobs) if ref_from_groups else []
            rows.append(_Row(list(g.prompt_ids), list(c.token_ids), a, list(c.behaviour_logprobs), ref))
            owner.append(k)
    return rows, owner


@dataclass(frozen=True)
class _Micro:
    """One micro-batch: its rows, in the order their tokens come out, and with
    share_prompts its units (rows of one prompt, one batch row each)."""

    rows: list[int]
    units: list[list[int]] | None = None  # None: one sequence a batch row

    def batch(self, rows: Sequence[_Row], pad_id: int, dtype: torch.dtype, device: str) -> modeling.Batch:
        if self.units is None:
            return modeling.make_batch([(rows[i].prompt, rows[i].completion) for i in self.rows], pad_id, device)
        units = [(rows[u[0]].prompt, [rows[i].completion for i in u]) for u in self.units]
        return modeling.make_shared_batch(units, pad_id, dtype, device)


def _micro_batches(rows: Sequence[_Row], token_budget: int, share_prompts: bool) -> list[_Micro]:
    """The rows in micro-batches of at most `token_budget` padded tokens. Without
    `share_prompts`, one sequence a batch row (modeling.make_batch). With it, consecutive
    rows of one prompt (a group's completions) go in units of the prompt and as many of them
    as fit the budget, one unit a batch row (modeling.make_shared_batch: the prompt through
    the model once per unit, not once per completion); a row that fits no unit with another
    (alone, or longer than the budget) is a sequence of its own, so no unit is wider than the
    budget and its [T, T] mask stays bounded."""
    if not share_prompts:
        lengths = [len(row.prompt) + len(row.completion) for row in rows]
        return [_Micro(micro) for micro in modeling.pack_by_tokens(lengths, token_budget)]
    units: list[list[int]] = []
    width = 0
    for i, row in enumerate(rows):
        if units and rows[units[-1][0]].prompt == row.prompt and width + len(row.completion) <= token_budget:
            units[-1].append(i)
            width += len(row.completion)
        else:
            units.append([i])
            width = len(row.prompt) + len(row.completion)
    many = [u for u in units if len(u) > 1]
    alone = [u[0] for u in units if len(u) == 1]
    widths = [len(rows[u[0]].prompt) + sum(len(rows[i].completion) for i in u) for u in many]
    micros = []
    for packed in modeling.pack_by_tokens(widths, token_budget):
        chosen = [many[k] for k in packed]
        micros.append(_Micro([i for u in chosen for i in u], chosen))
    lengths = [len(rows[i].prompt) + len(rows[i].completion) for i in alone]
    micros += [_Micro([alone[k] for k in micro]) for micro in modeling.pack_by_tokens(lengths, token_budget)]
    return micros


def backward_micro_batch(
    optimizer: HostAdamW,
    loss: torch.Tensor,
    started: float,
    what: str,
    agree: Callable[[bool], bool] | None = None,
) -> tuple[float, float, float]:
    """One micro-batch's loss read on the host and its backward, its gradients added to the
    parameters' (GRPO's _accumulate and sft_step's loop). A non-finite loss drops every
    gradient accumulated so far and raises NonFiniteStep naming `what`. Returns the loss, the
    seconds from `started` (the micro-batch's start) to its read (on a GPU: its forward) and
    the backward's seconds. `agree` (N ranks: Ranks.any_true) turns this rank's "non-finite"
    into every rank's, so that all stop before the backward's collectives or none does."""
    value = float(loss.detach())
    bad = not math.isfinite(value)
    if agree is not None:
        bad = agree(bad)
    if bad:
        # Earlier micro-batches' gradients are in the parameters already: drop them, or
        # they would leak into the next step.
        optimizer.discard_grads()
        raise NonFiniteStep(
            f"loss is {value} in {what}"
            if not math.isfinite(value)
            else f"a loss is not finite in {what} on another rank"
        )
    forward_s = time.perf_counter() - started
    start = time.perf_counter()
    optimizer.wait()  # the previous step's update (step with background): backward writes the gradients it drops
    loss.backward()
    return value, forward_s, time.perf_counter() - start


def _accumulate(
    model: torch.nn.Module,
    optimizer: HostAdamW,
    rows: Sequence[_Row],
    denom: float,
    cfg: StepConfig,
    pad_id: int,
    adapters_off: AdaptersOff | None,
    logprobs: list[torch.Tensor] | None = None,
    ranks: Ranks | None = None,
) -> _Sums:
    """Forward, loss and backward of `rows` in token-budget micro-batches: the gradients
    accumulate in the parameters. A non-finite micro-batch loss drops every gradient and
    raises NonFiniteStep. `logprobs`, when given, gets each row's detached log pi."""
    loss_cfg = cfg.loss
    sums = _Sums()
    dtype = model.get_input_embeddings().weight.dtype  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method; a shared batch's mask adds to the attention scores
    micros = _micro_batches(rows, cfg.token_budget, cfg.share_prompts)
    # One process runs every micro-batch; rank r of N the r-th of each round of N (ranks.py).
    order = [(k, 1) for k in range(len(micros))] if ranks is None else ranks.rounds(len(micros))
    if ranks is not None:
        ranks.begin_step()
    for k, live in order:
        real = ranks is None or ranks.world.rank < live  # (else a padding copy: its gradient is not added)
        micro = micros[k].rows
        start = time.perf_counter()
        batch = micros[k].batch(rows, pad_id, dtype, cfg.device)
        if ranks is None:
            logp, entropy = modeling.completion_logprobs(
                model, batch, chunk_tokens=cfg.chunk_tokens, temperature=cfg.temperature, with_entropy=True
            )
        else:
            logp, entropy = ranks.logprobs(
                batch, chunk_tokens=cfg.chunk_tokens, temperature=cfg.temperature, with_entropy=True
            )
            ranks.before_backward(live, optimizer.params)
        dev = logp.device
        # The loss works on flat [tokens] vectors; `seq` says which sequence each token is of.
        seq_lengths = torch.tensor(batch.lengths, device=dev)
        seq = torch.repeat_interleave(torch.arange(len(micro), device=dev), seq_lengths)
        adv = torch.tensor([rows[i].advantage for i in micro], dtype=torch.float32, device=dev)
        beh = torch.tensor([x for i in micro for x in rows[i].behaviour], dtype=torch.float32, device=dev)
        if loss_cfg.beta == 0:
            ref = None
        elif adapters_off is not None:
            ref = base_logprobs(model, adapters_off, batch, cfg)
        else:
            ref = torch.tensor([x for i in micro for x in rows[i].ref], dtype=torch.float32, device=dev)
        parts = grpo.policy_loss(loss_cfg, logp, beh, adv, seq, seq_lengths, denom, ref, entropy)
        agree = None if ranks is None else (lambda bad, ranks=ranks, real=real: ranks.any_true(bad and real))
        loss, forward_s, backward_s = backward_micro_batch(
            optimizer, parts.loss, start, f"a micro-batch of {len(micro)} completions", agree
        )
        sums.forward_s += forward_s
        sums.backward_s += backward_s
        if not real:
            continue
        if logprobs is not None:
            for i, values in zip(micro, logp.detach().split(batch.lengths)):
                logprobs[i] = values
        sums.loss += loss
        sums.kl += parts.kl_sum
        sums.entropy += parts.entropy_sum
        sums.clipped += parts.clipped_tokens
        sums.truncated += parts.truncated_tokens
        sums.tokens += parts.tokens
    if ranks is not None:  # every rank's micro-batches' sums (timings: this rank's own)
        total = ranks.sum([sums.loss, sums.kl, sums.entropy, sums.clipped, sums.truncated, sums.tokens])
        sums.loss, sums.kl, sums.entropy = total[:3]
        sums.clipped, sums.truncated, sums.tokens = (round(x) for x in total[3:])
    return sums


def train_step(
    model: torch.nn.Module,
    optimizer: HostAdamW,
    groups: Sequence[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    *,
    pad_id: int,
    adapters_off: AdaptersOff | None = None,
    on_piece: OnPiece | None = None,
    background: bool = False,
    ranks: Ranks | None = None,
) -> StepResult:
    """One update of `model` (through `optimizer`, which holds its trained parameters) on
    validated, scored `groups`. With beta > 0, log pi_ref is the groups' ref_logprobs, or,
    given `adapters_off` (LoRA, kl_reference = lora_base), the model's base under it.
    `on_piece(name, start, old, new)` gets each piece of each trained parameter, its bf16 bits
    before and after, during the optimizer step (HostAdamW.step); it is not called when
    nothing is applied. With `background`, the optimizer's buckets are stepped on a thread of
    their own after this returns (HostAdamW.step with the model): trained_bits and the model's
    weights are final once optimizer.wait() returns, and the next step's forward overlaps the
    update, each module waiting only for its own weights.
    With `ranks` (the trainer as N ranks, ranks.py: every rank calls this with the same groups),
    this rank runs its share of the micro-batches on the sharded model and steps its shards;
    the loss and the metrics are every rank's, `logprobs` holds this rank's rows only (the
    others' stay empty) and trained_bits are this rank's shards (Ranks.full_bits joins them).
    Raises NonFiniteStep, having applied nothing, on a non-finite loss or gradient norm."""
    if not groups:
        raise ValueError("a step needs at least one group")
    loss_cfg = cfg.loss
    ref_from_groups = loss_cfg.beta > 0 and adapters_off is None

    # 1. Advantages, group by group.
    rows, _ = _rows(groups, loss_cfg, ref_from_groups)
    rewards = [c.reward for g in groups for c in g.completions]
    # All its advantages are 0: no policy signal (dapo drops it).
    zero_variance = sum(1 for g in groups if len({c.reward for c in g.completions}) == 1)

    # 2. The loss denominator of the whole step.
    denom = grpo.normaliser(loss_cfg, [len(row.completion) for row in rows])

    # 3. Micro-batches: forward, loss, backward; the metrics' sums on the way.
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rows)  # every row is in one micro-batch
    sums = _accumulate(model, optimizer, rows, denom, cfg, pad_id, adapters_off, logprobs, ranks)

    # 4. The optimizer step (raises NonFiniteStep on a non-finite gradient norm).
    start = time.perf_counter()
    grad_norm, trained_bits = (
        optimizer.step(cfg.max_grad_norm, on_piece, model if background else None) if rows else (0.0, None)
    )
    optimizer_s = time.perf_counter() - start

    # 5. Metrics.
    mean = sum(rewards) / len(rewards)
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
    per_token = max(sums.tokens, 1)
    return StepResult(
        groups=len(groups),
        completions=len(rewards),
        zero_variance_groups=zero_variance,
        reward_mean=mean,
        reward_std=std,
        loss=sums.loss,
        kl=sums.kl / per_token,
        clip_fraction=sums.clipped / per_token,
        entropy=sums.entropy / per_token,
        truncated_fraction=sums.truncated / per_token,
        tokens=sums.tokens,
        train_tokens=sum(len(row.prompt) + len(row.completion) for row in rows),
        grad_norm=grad_norm,
        trained_bits=trained_bits,
        logprobs=logprobs,
        forward_s=sums.forward_s,
        backward_s=sums.backward_s,
        optimizer_s=optimizer_s,
    )


def nonfinite_groups(
    model: torch.nn.Module,
    optimizer: HostAdamW,
    groups: Sequence[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    *,
    pad_id: int,
    adapters_off: AdaptersOff | None = None,
    ranks: Ranks | None = None,
) -> dict[int, str]:
    """After a refused step: which of its groups make the loss or the gradient norm
    non-finite on their own, index in `groups` -> why. Each group's completions run alone
    (forward, loss over the whole step's denominator, backward), their gradient norm is
    read and the gradients dropped: nothing is applied. Empty when none does alone (only
    together: the caller decides). One extra forward and backward of the step, paid only
    when a step was refused."""
    loss_cfg = cfg.loss
    rows, owner = _rows(groups, loss_cfg, loss_cfg.beta > 0 and adapters_off is None)
    denom = grpo.normaliser(loss_cfg, [len(row.completion) for row in rows])
    found: dict[int, str] = {}
    for k in sorted(set(owner)):
        mine = [row for row, o in zip(rows, owner) if o == k]
        try:
            _accumulate(model, optimizer, mine, denom, cfg, pad_id, adapters_off, ranks=ranks)
        except NonFiniteStep as e:
            found[k] = str(e)
            continue
        norm = optimizer.grad_norm()
        optimizer.discard_grads()
        if not math.isfinite(norm):
            found[k] = f"gradient norm is {norm}"
    return found
