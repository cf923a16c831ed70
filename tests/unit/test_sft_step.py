"""rollstream.trainer.sft_step.sft_step, one SFT update, on the tiny model: its loss and
gradient norm against each example run alone through the whole model (no packing, no
chunked LM head), the same update however the rows fall into micro-batches, the clip and
the update applied, and the refusals that apply nothing. Packed rows are built by hand here:
sft_data's tests cover how a dataset becomes them; one test here trains on a dataset's."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_step import LR, load  # the model at version 0 and its optimizer, as the trainer builds them

from rollstream.core import modeling
from rollstream.trainer import sft_data
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep
from rollstream.trainer.sft_data import IGNORE, PackedRow, SftDataConfig
from rollstream.trainer.sft_step import SftStepConfig, sft_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def example(rng: random.Random, vocab: int, prompt: int, completion: int) -> tuple[list[int], list[int]]:
    """Random tokens, the completion's labelled (TRL's completion-only loss), the prompt's not."""
    ids = [rng.randrange(3, vocab) for _ in range(prompt + completion)]
    return ids, [IGNORE] * prompt + ids[prompt:]


def pack(examples: list[tuple[list[int], list[int]]]) -> PackedRow:
    return PackedRow(
        input_ids=[t for ids, _ in examples for t in ids],
        labels=[x for _, labels in examples for x in labels],
        seq_lengths=[len(ids) for ids, _ in examples],
        rows=list(range(len(examples))),
    )


def rows_by_hand(vocab: int, seed: int = 0) -> list[PackedRow]:
    """Three packed rows of different widths: examples of several lengths, one trained on
    every token (its first excepted), one example alone in its row."""
    rng = random.Random(seed)
    return [
        pack([example(rng, vocab, 5, 4), example(rng, vocab, 3, 6), example(rng, vocab, 7, 2)]),
        pack([example(rng, vocab, 0, 9), example(rng, vocab, 4, 3)]),
        pack([example(rng, vocab, 6, 5)]),
    ]


def config(token_budget: int = 4096, max_grad_norm: float = 0.0) -> SftStepConfig:
    return SftStepConfig(token_budget=token_budget, chunk_tokens=8, max_grad_norm=max_grad_norm, device="cpu")


def by_hand(model: torch.nn.Module, rows: list[PackedRow]) -> tuple[float, float, int]:
    """TRL's loss from its definition: every example alone through the model's own forward
    (full logits), -log p of each labelled token but the example's first, summed over the
    step and divided by their count; with the gradient norm of that loss (float64 sums)."""
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for row in rows:
        start = 0
        for length in row.seq_lengths:
            ids = torch.tensor([row.input_ids[start : start + length]])
            labels = row.labels[start : start + length]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            for t in range(1, length):
                if labels[t] != IGNORE:
                    total = total - logp[t - 1, labels[t]]
                    count += 1
            start += length
    loss = total / count
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    model.zero_grad()
    return float(loss.detach()), norm, count


def test_the_loss_is_the_mean_over_the_steps_trained_tokens(tiny_model_dir: Path) -> None:
    model, optimizer, pad_id = load(tiny_model_dir)
    rows = rows_by_hand(model.config.vocab_size)
    loss, norm, count = by_hand(model, rows)
    assert count == sum(row.loss_tokens for row in rows) == 4 + 6 + 2 + 8 + 3 + 5
    before = modeling.model_bits(model)

    r = sft_step(model, optimizer, rows, config(), pad_id=pad_id)

    assert (r.rows, r.examples, r.tokens, r.micro_batches) == (3, 6, count, 1)
    assert r.train_tokens == sum(len(row.input_ids) for row in rows)
    assert r.loss == pytest.approx(loss, rel=1e-5)
    assert r.grad_norm == pytest.approx(norm, rel=1e-4)
    # The update is applied: the model computes with the new bits, and they moved.
    assert optimizer.step_count == 1
    held = modeling.model_bits(model)
    assert all(np.array_equal(held[n], bits) for n, bits in r.trained_bits.items())
    assert any(not np.array_equal(before[n], bits) for n, bits in r.trained_bits.items())


def test_micro_batches_give_the_same_update(tiny_model_dir: Path) -> None:
    """One micro-batch of the three rows, or one row each (a budget below every row's width):
    the loss, the gradient norm and the update agree to float rounding. Adam's eps is 1 here,
    so the first update is about lr x gradient (with the default, lr x its sign, which float
    noise flips on near-zero gradients): comparing updates compares the gradients."""
    vocab = modeling.load_model(tiny_model_dir)[0].config.vocab_size
    rows = rows_by_hand(vocab)
    results, updates = [], []
    for budget in (4096, 12):
        model, optimizer, pad_id = load(tiny_model_dir, adam_eps=1.0)
        before = {n: optimizer.master[n].clone() for n in optimizer.params}
        results.append(sft_step(model, optimizer, rows, config(budget, max_grad_norm=1.0), pad_id=pad_id))
        updates.append({n: optimizer.master[n] - before[n] for n in before})
    one, each = results
    assert (one.micro_batches, each.micro_batches) == (1, 3)
    assert each.loss == pytest.approx(one.loss, rel=1e-5)
    assert each.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    scale = max(float(u.abs().max()) for u in updates[0].values())
    assert scale > 0
    for name, u in updates[0].items():
        assert torch.allclose(updates[1][name], u, rtol=0, atol=1e-4 * scale), name


def test_a_micro_batch_without_a_trained_token_is_skipped(tiny_model_dir: Path) -> None:
    """A row labelled nowhere, alone in its micro-batch: no forward for it, and the step's
    loss is that of the other rows."""
    model, optimizer, pad_id = load(tiny_model_dir)
    rows = rows_by_hand(model.config.vocab_size)
    loss, _, _ = by_hand(model, rows)
    unlabelled = PackedRow(list(range(3, 9)), [IGNORE] * 6, [6], [0])
    r = sft_step(model, optimizer, [*rows, unlabelled], config(token_budget=12), pad_id=pad_id)
    assert (r.rows, r.micro_batches, r.train_tokens) == (4, 3, sum(len(row.input_ids) for row in rows) + 6)
    assert r.loss == pytest.approx(loss, rel=1e-5)


def test_examples_do_not_see_each_other(tiny_model_dir: Path) -> None:
    """Packed behind an unlabelled first example of either length, an example's loss is the
    one it has alone: positions restart and the mask is block-diagonal."""
    rng = random.Random(3)
    vocab = modeling.load_model(tiny_model_dir)[0].config.vocab_size
    second = example(rng, vocab, 4, 5)
    alone, _, _ = by_hand(load(tiny_model_dir)[0], [pack([second])])
    for length in (3, 11):
        ids, _ = example(rng, vocab, length, 0)
        model, optimizer, pad_id = load(tiny_model_dir)
        r = sft_step(model, optimizer, [pack([(ids, [IGNORE] * length), second])], config(), pad_id=pad_id)
        assert r.tokens == 5
        assert r.loss == pytest.approx(alone, rel=1e-5)


def test_a_datasets_packed_rows_train(tiny_model_dir: Path) -> None:
    """Conversations through sft_data (the tiny tokenizer's chat template, loss on the
    assistant's turns, packed into rows of 64): the step's loss is TRL's by its definition,
    and a few steps on the same rows bring it down."""
    model, optimizer, pad_id = load(tiny_model_dir)
    tokenizer = modeling.load_model(tiny_model_dir)[1]
    conversations = [
        {"messages": [{"role": "user", "content": f"{a} plus {a}?"}, {"role": "assistant", "content": f"{2 * a}"}]}
        for a in range(12)
    ]
    rows = sft_data.prepare_rows(conversations, tokenizer, SftDataConfig(max_length=64)).rows
    assert len(rows) > 1 and any(len(row.seq_lengths) > 1 for row in rows)
    loss, _, count = by_hand(model, rows)
    losses = [sft_step(model, optimizer, rows, config(max_grad_norm=1.0), pad_id=pad_id).loss for _ in range(4)]
    assert losses[0] == pytest.approx(loss, rel=1e-5)
    assert sum(row.loss_tokens for row in rows) == count
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (lambda r: PackedRow(r.input_ids, r.labels[:-1], r.seq_lengths, r.rows), "packed row 1: labels has"),
        (lambda r: PackedRow(r.input_ids, r.labels, [*r.seq_lengths, 1], r.rows), "packed row 1: seq_lengths"),
        (lambda r: PackedRow(r.input_ids, r.labels, [0, *r.seq_lengths], r.rows), "packed row 1: seq_lengths"),
        (
            lambda r: PackedRow(r.input_ids, [r.input_ids[0] + 1, *r.labels[1:]], r.seq_lengths, r.rows),
            r"packed row 1: labels\[0\] is",
        ),
        (lambda r: PackedRow([], [], [], []), "packed row 1: input_ids is empty"),
    ],
)
def test_a_bad_row_is_refused_before_anything_runs(tiny_model_dir: Path, broken, message: str) -> None:
    model, optimizer, pad_id = load(tiny_model_dir)
    rows = rows_by_hand(model.config.vocab_size)
    rows[1] = broken(rows[1])
    version0 = modeling.model_bits(model)
    with pytest.raises(ValueError, match=message):
        sft_step(model, optimizer, rows, config(), pad_id=pad_id)
    assert optimizer.step_count == 0
    assert all(p.grad is None for p in optimizer.params.values())
    assert all(np.array_equal(version0[n], b) for n, b in modeling.model_bits(model).items())


def test_a_step_without_a_trained_token_is_refused(tiny_model_dir: Path) -> None:
    model, optimizer, pad_id = load(tiny_model_dir)
    # Labelled only on each example's first token: nothing predicts it, so nothing trains.
    row = PackedRow([5, 6, 7, 8, 9], [5, IGNORE, IGNORE, 8, IGNORE], [3, 2], [0, 1])
    assert row.loss_tokens == 0
    with pytest.raises(ValueError, match="none of the step's 1 packed rows has a trained token"):
        sft_step(model, optimizer, [row], config(), pad_id=pad_id)
    with pytest.raises(ValueError, match="at least one packed row"):
        sft_step(model, optimizer, [], config(), pad_id=pad_id)
    assert optimizer.step_count == 0


def test_a_non_finite_loss_applies_nothing(tiny_model_dir: Path) -> None:
    """A NaN in one token's embedding: the micro-batch holding it has a NaN loss, after
    another micro-batch's gradients are in the parameters; all of them go, nothing is applied."""
    model, optimizer, pad_id = load(tiny_model_dir)
    rows = rows_by_hand(model.config.vocab_size)
    poisoned = rows[2].input_ids[3]
    assert all(poisoned not in row.input_ids for row in rows[:2])
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned, 0] = math.nan
    version0 = modeling.model_bits(model)
    # Budget 12: one row a micro-batch, the widest (rows[0]) first, the poisoned one last.
    with pytest.raises(NonFiniteStep, match="loss is nan in a micro-batch of packed rows \\[2\\]"):
        sft_step(model, optimizer, rows, config(token_budget=12), pad_id=pad_id)
    assert optimizer.step_count == 0
    assert all(p.grad is None for p in optimizer.params.values())
    assert all(np.array_equal(version0[n], b, equal_nan=True) for n, b in modeling.model_bits(model).items())


def test_the_clip_is_applied(tiny_model_dir: Path) -> None:
    """AdamW's first step moves each weight by about lr whatever the gradient's scale, unless
    the clipped gradient is far below eps: with max_grad_norm 1e-9 the update nearly vanishes,
    so the step handed the clip to the optimizer; the norm reported is the one before it."""
    moved = []
    for max_grad_norm in (0.0, 1e-9):
        model, optimizer, pad_id = load(tiny_model_dir)
        rows = rows_by_hand(model.config.vocab_size)
        before = {n: optimizer.master[n].clone() for n in optimizer.params}
        r = sft_step(model, optimizer, rows, config(max_grad_norm=max_grad_norm), pad_id=pad_id)
        assert r.grad_norm > 1.0
        moved.append(max(float((optimizer.master[n] - before[n]).abs().max()) for n in before))
    assert moved[0] == pytest.approx(LR, rel=1e-3)
    assert moved[1] < 0.2 * LR


def test_the_overlapped_update_gives_the_same_bits(tiny_model_dir: Path) -> None:
    """With `background`, each step's buckets are stepped while the next step's forward runs
    (HostAdamW.step with the model): two steps give the bits of two sequential ones."""
    bits = []
    for background in (False, True):
        model, optimizer, pad_id = load(tiny_model_dir)
        rows = rows_by_hand(model.config.vocab_size)
        for _ in range(2):
            r = sft_step(model, optimizer, rows, config(max_grad_norm=1.0), pad_id=pad_id, background=background)
        optimizer.wait()
        bits.append({n: b.copy() for n, b in r.trained_bits.items()})
        assert all(np.array_equal(modeling.model_bits(model)[n], b) for n, b in bits[-1].items())
    assert all(np.array_equal(bits[0][n], bits[1][n]) for n in bits[0])


ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


@pytest.mark.skipif(
    not TRL_PYTHON.exists(), reason="no .venv-trl: run `bash scripts/install_trl.sh` to compare with TRL"
)
def test_the_first_steps_loss_is_trls(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL 1.16's SFTTrainer (benchmarks/trl_sft.py: packing, fp32, lr 2e-5 linear, clip 1)
    trains the tiny model three steps and writes its micro-batches down; the step on those
    rows, from the same weights, gives TRL's first loss to 1e-5 and counts TRL's tokens.
    With the model's parameters as the fp32 masters (`rollstream sft`'s float32 run: TRL's
    weights) the next losses follow TRL's too: the normalisation, the clip and AdamW are TRL's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sft_vs_trl  # benchmarks/sft_vs_trl.py

    data, dump = tmp_path / "data.jsonl", tmp_path / "rows.jsonl"
    sft_vs_trl.write_dataset(data, seed=0, examples=48)
    out = subprocess.run(
        [str(TRL_PYTHON), str(ROOT / "benchmarks" / "trl_sft.py"), "--model", str(tiny_model_dir)]
        + ["--data", str(data), "--steps", "3", "--rows", "2", "--max-length", "128", "--threads", "1"]
        + ["--dump", str(dump)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    trl = json.loads(out.stdout.splitlines()[-1])
    steps, counts = sft_vs_trl.dumped_steps(dump)
    assert len(steps) == 3 and all(len(rows) == 2 for rows in steps)

    model, tokenizer = modeling.load_model(tiny_model_dir)  # the checkpoint's weights, as TRL's: no rounding
    model.train()
    params = modeling.named_weights(model)
    optimizer = HostAdamW(
        params,
        lr=2e-5,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        moments_dtype="float32",
        master_layout="fp32",
        in_model=True,
    )
    losses = []
    for k, (rows, count) in enumerate(zip(steps, counts, strict=True)):
        optimizer.lr = 2e-5 * (3 - k) / 3
        r = sft_step(model, optimizer, rows, config(max_grad_norm=1.0), pad_id=tokenizer.pad_token_id)
        assert r.tokens == count
        losses.append(r.loss)
    assert losses[0] == pytest.approx(trl["first_step_loss"], rel=1e-5)
    assert losses == pytest.approx(trl["losses"], rel=1e-4)
