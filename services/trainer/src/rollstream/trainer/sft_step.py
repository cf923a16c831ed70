"""One SFT step: packed rows in, one optimizer update and its metrics out.

The loss is TRL 1.16 SFTTrainer's (docs/design-notes.md, "SFT (issue 46): what TRL does"):
the mean negative log-likelihood over every trained token of the step, the same however the
rows fall into micro-batches.

  1. check          every row consistent (sft_data's PackedRow: tokens, labels, example
                    lengths), or ValueError naming the row and the field, before any forward
  2. normaliser     the step's count of trained tokens (PackedRow.loss_tokens: labelled,
                    not an example's first): TRL's num_items_in_batch, fixed before the
                    first micro-batch
  3. micro-batches  whole rows packed to `token_budget` padded tokens (modeling.pack_by_tokens,
                    as GRPO's step packs sequences), and for each:
       forward      positions restarting at each example, attention within each example
                    (sft_data.packed_batch: no mask at all for a row of one example), log pi
                    of the trained tokens through the chunked LM head
                    (modeling.completion_logprobs: the logits never whole)
       loss         -sum(log pi) / normaliser
       backward     step.backward_micro_batch: gradients accumulate over the micro-batches
  4. optimizer      one HostAdamW step with the gradient-norm clip, as GRPO's (HostAdamW.step;
                    with `background`, overlapped with the next step's forward)

A non-finite loss or gradient norm applies nothing: the gradients are dropped and
NonFiniteStep is raised. Nothing here reads files or writes logs: the caller (the `sft`
run, tests, benchmarks/sft_vs_trl.py) hands the rows in and records the result.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollstream.core import modeling
from rollstream.trainer.optimizer import HostAdamW, OnPiece
from rollstream.trainer.sft_data import IGNORE, PackedRow, packed_batch
from rollstream.trainer.step import backward_micro_batch


@dataclass(frozen=True)
class SftStepConfig:
    token_budget: int  # padded tokens per micro-batch (a longer row gets one of its own)
    chunk_tokens: int  # LM-head rows at a time (modeling.head_logprobs)
    max_grad_norm: float  # 0: no clipping
    device: str


@dataclass
class SftStepResult:
    rows: int
    examples: int
    loss: float  # mean negative log-likelihood per trained token: TRL's logged loss
    tokens: int  # trained tokens (the normaliser)
    train_tokens: int  # tokens through the model, padding excluded
    micro_batches: int  # forwards run (one without a trained token is skipped)
    grad_norm: float  # before clipping
    trained_bits: dict[str, np.ndarray]  # the new bf16 bits of the optimizer's parameters
    forward_s: float
    backward_s: float
    optimizer_s: float


def check_row(row: PackedRow, index: int) -> None:
    """Raise ValueError naming row `index` and the field where `row` is not a packed row a
    step can train on: tokens and labels of one length, example lengths positive and adding
    up to it, each label IGNORE or its own token (the label at t is what t - 1 predicts)."""
    n = len(row.input_ids)
    if n == 0:
        raise ValueError(f"packed row {index}: input_ids is empty")
    if len(row.labels) != n:
        raise ValueError(f"packed row {index}: labels has {len(row.labels)} entries for {n} input_ids")
    if not row.seq_lengths or min(row.seq_lengths) <= 0 or sum(row.seq_lengths) != n:
        raise ValueError(f"packed row {index}: seq_lengths {row.seq_lengths} are not positive lengths adding up to {n}")
    for t, (token, label) in enumerate(zip(row.input_ids, row.labels)):
        if label != IGNORE and label != token:
            raise ValueError(f"packed row {index}: labels[{t}] is {label}, neither {IGNORE} nor the token {token}")


def micro_batches(
    rows: Sequence[PackedRow], cfg: SftStepConfig, pad_id: int
) -> Iterator[tuple[list[int], modeling.Batch]]:
    """The rows in micro-batches of at most `token_budget` padded tokens (modeling.pack_by_tokens,
    as GRPO's step packs its sequences), each with the Batch its forward takes
    (sft_data.packed_batch): a step's, and a held-out loss's. One without a trained token
    is left out: it has no loss (TRL's adds a zero) and no gradient."""
    for micro in modeling.pack_by_tokens([len(row.input_ids) for row in rows], cfg.token_budget):
        batch = packed_batch([rows[i] for i in micro], pad_id, cfg.device)
        if batch.targets.numel():
            yield micro, batch


def sft_step(
    model: torch.nn.Module,
    optimizer: HostAdamW,
    rows: Sequence[PackedRow],
    cfg: SftStepConfig,
    *,
    pad_id: int,
    on_piece: OnPiece | None = None,
    background: bool = False,
) -> SftStepResult:
    """One update of `model` (through `optimizer`, which holds its trained parameters) on the
    packed `rows` of one step. `on_piece` and `background` are HostAdamW.step's, as in GRPO's
    step.train_step. Raises ValueError, having run nothing, on an inconsistent row or a step
    without a trained token; NonFiniteStep, having applied nothing, on a non-finite loss or
    gradient norm."""
    if not rows:
        raise ValueError("an SFT step needs at least one packed row")
    # 1-2. Every row checked and the normaliser counted before any forward.
    for i, row in enumerate(rows):
        check_row(row, i)
    denom = sum(row.loss_tokens for row in rows)
    if denom == 0:
        raise ValueError(f"none of the step's {len(rows)} packed rows has a trained token")

    # 3. Micro-batches: forward, loss, backward.
    loss = forward_s = backward_s = 0.0
    forwards = 0
    start = time.perf_counter()  # forward_s counts each micro-batch's making too
    for micro, batch in micro_batches(rows, cfg, pad_id):
        logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=cfg.chunk_tokens)
        value, f_s, b_s = backward_micro_batch(
            optimizer, -logp.sum() / denom, start, f"a micro-batch of packed rows {micro}"
        )
        loss += value
        forward_s += f_s
        backward_s += b_s
        forwards += 1
        start = time.perf_counter()

    # 4. The optimizer step (raises NonFiniteStep on a non-finite gradient norm).
    start = time.perf_counter()
    grad_norm, trained_bits = optimizer.step(cfg.max_grad_norm, on_piece, model if background else None)
    optimizer_s = time.perf_counter() - start
    return SftStepResult(
        rows=len(rows),
        examples=sum(len(row.seq_lengths) for row in rows),
        loss=loss,
        tokens=denom,
        train_tokens=sum(len(row.input_ids) for row in rows),
        micro_batches=forwards,
        grad_norm=grad_norm,
        trained_bits=trained_bits,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
    )
