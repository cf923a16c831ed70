"""The overlapped optimizer step (train_step with background: HostAdamW.step with the model):
the buckets stepped on a thread of their own while the next step's forward runs, each module
waiting for its own weights, gives the sequential step's bits exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import deltas, modeling
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW, MasterLayout, MomentsDtype, NonFiniteStep
from rollstream.trainer.step import StepConfig, train_step
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STEPS = 20
# Small enough that the step clips now and then: the clip factor is part of what must match.
MAX_GRAD_NORM = 0.5
# Buckets of 1,024 fp32 values: many buckets, most cutting through a parameter.
BUCKET_MB = 4096 / 2**20


def config() -> StepConfig:
    # Micro-batches of 40 tokens: several a step, so gradients accumulate.
    return StepConfig(
        LossConfig("grpo", 0.2, 0.2),
        40,
        chunk_tokens=16,
        temperature=1.0,
        max_grad_norm=MAX_GRAD_NORM,
        device="cpu",
        share_prompts=False,
    )


def run(model_dir: Path, layout: MasterLayout, moments: MomentsDtype, background: bool) -> dict[str, list]:
    """STEPS steps; what each one made: served bits, delta payload, log-probs, norms, and
    the masters and moments at the end."""
    model, tokenizer = modeling.load_model(model_dir)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.01,
        bucket_mb=BUCKET_MB,
        moments_dtype=moments,
        master_layout=layout,
    )
    bits = opt.sync_model()
    base = {name: b.copy() for name, b in bits.items()}
    out: dict[str, list] = {"bits": [], "payload": [], "logprobs": [], "norm": []}
    for step in range(STEPS):
        encoder = deltas.DeltaEncoder(base, step, step + 1, "fp")
        r = train_step(
            model,
            opt,
            scored_groups(step, 3),
            config(),
            pad_id=tokenizer.pad_token_id,
            on_piece=encoder.add_piece,
            background=background,
        )
        assert r.trained_bits is not None
        opt.wait()
        payload, _ = encoder.finish()
        base = {name: b.copy() for name, b in r.trained_bits.items()}
        out["bits"].append(base)
        out["payload"].append(payload)
        out["logprobs"].append(torch.cat(r.logprobs))
        out["norm"].append(r.grad_norm)
    out["state"] = [{k: v.clone() for k, v in opt.state_tensors().items()}]
    return out


@pytest.mark.parametrize(
    ("layout", "moments"), [("split", "bfloat16"), ("split", "float32"), ("fp32", "bfloat16"), ("fp32", "float32")]
)
def test_overlapped_steps_give_the_sequential_bits(
    tiny_model_dir: Path, layout: MasterLayout, moments: MomentsDtype
) -> None:
    sequential = run(tiny_model_dir, layout, moments, background=False)
    overlapped = run(tiny_model_dir, layout, moments, background=True)
    assert any(norm > MAX_GRAD_NORM for norm in sequential["norm"]) and any(
        norm < MAX_GRAD_NORM for norm in sequential["norm"]
    )
    assert overlapped["norm"] == sequential["norm"]
    for step in range(STEPS):
        # The log-probs come from each step's forward, which overlapped the previous update.
        assert torch.equal(overlapped["logprobs"][step], sequential["logprobs"][step]), step
        assert overlapped["payload"][step] == sequential["payload"][step], step
        for name, b in sequential["bits"][step].items():
            assert np.array_equal(overlapped["bits"][step][name], b), (step, name)
    for key, t in sequential["state"][0].items():
        assert torch.equal(
            overlapped["state"][0][key].view(torch.int16 if t.element_size() == 2 else torch.int32),
            t.view(torch.int16 if t.element_size() == 2 else torch.int32),
        ), key


def test_the_next_forward_runs_while_the_update_goes_on(tiny_model_dir: Path) -> None:
    """The update holds back every bucket after the embedding's until the next forward has
    run the embedding: that forward used the new embedding while the rest was still being
    stepped, and the step's results are still the sequential ones."""
    model, tokenizer = modeling.load_model(tiny_model_dir)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=BUCKET_MB,
        moments_dtype="float32",
    )
    opt.sync_model()
    embedding = model.get_input_embeddings()
    embedding_buckets = set(opt._buckets_of[next(n for n, p in opt.params.items() if p is embedding.weight)])
    assert len(opt.buckets) > max(embedding_buckets) + 1
    embedded = threading.Event()
    held_back: list[int] = []

    def on_piece(name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        at = opt.layout[name][0] + start
        k = next(i for i, b in enumerate(opt.buckets) if b.start <= at < b.end)
        if k not in embedding_buckets:  # (already set: the forward ran the embedding before bucket k was out)
            held_back.append(k)
            assert embedded.wait(timeout=600), "the next forward never reached the embedding"

    armed = threading.Event()  # from the third step's forward on
    embedding.register_forward_hook(lambda *_: embedded.set() if armed.is_set() else None)
    cfg = config()
    train_step(model, opt, scored_groups(0, 3), cfg, pad_id=tokenizer.pad_token_id)
    train_step(model, opt, scored_groups(1, 3), cfg, pad_id=tokenizer.pad_token_id, on_piece=on_piece, background=True)
    armed.set()
    second = train_step(model, opt, scored_groups(2, 3), cfg, pad_id=tokenizer.pad_token_id)
    assert held_back, "no bucket was held back: the update finished before the forward began"

    reference, _ = modeling.load_model(tiny_model_dir)
    reference.train()
    ref_opt = HostAdamW(
        modeling.named_weights(reference),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=BUCKET_MB,
        moments_dtype="float32",
    )
    ref_opt.sync_model()
    for step in range(2):
        train_step(reference, ref_opt, scored_groups(step, 3), cfg, pad_id=tokenizer.pad_token_id)
    expected = train_step(reference, ref_opt, scored_groups(2, 3), cfg, pad_id=tokenizer.pad_token_id)
    assert all(torch.equal(a, b) for a, b in zip(second.logprobs, expected.logprobs, strict=True))
    assert second.trained_bits is not None and expected.trained_bits is not None
    assert all(np.array_equal(second.trained_bits[n], b) for n, b in expected.trained_bits.items())


def test_a_failed_update_surfaces_and_no_forward_waits_forever(tiny_model_dir: Path) -> None:
    model, tokenizer = modeling.load_model(tiny_model_dir)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=BUCKET_MB,
        moments_dtype="float32",
    )
    opt.sync_model()

    def broken(name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        raise OSError("the encoder's disk is full")

    train_step(
        model, opt, scored_groups(0, 3), config(), pad_id=tokenizer.pad_token_id, on_piece=broken, background=True
    )
    with pytest.raises(OSError, match="disk is full"):
        train_step(model, opt, scored_groups(1, 3), config(), pad_id=tokenizer.pad_token_id)
    with pytest.raises(OSError, match="disk is full"):
        opt.state_tensors()  # nothing reads a half-stepped state as if it were whole


def test_a_refused_step_after_an_overlapped_one_applies_nothing(tiny_model_dir: Path) -> None:
    model, tokenizer = modeling.load_model(tiny_model_dir)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=BUCKET_MB,
        moments_dtype="float32",
    )
    opt.sync_model()
    train_step(model, opt, scored_groups(0, 3), config(), pad_id=tokenizer.pad_token_id, background=True)
    opt.wait()
    after_one = {k: v.clone() for k, v in opt.state_tensors().items()}
    poisoned = scored_groups(1, 3)
    poisoned[0].completions[0].behaviour_logprobs[0] = float("nan")
    with pytest.raises(NonFiniteStep):
        train_step(model, opt, poisoned, config(), pad_id=tokenizer.pad_token_id, background=True)
    assert opt.step_count == 1
    assert all(torch.equal(v, after_one[k]) for k, v in opt.state_tensors().items())


def test_each_device_gradient_goes_once_its_last_piece_is_down(tiny_model_dir: Path) -> None:
    """The next forward of an overlapped step needs device room: a parameter's gradient is
    dropped as soon as the bucket holding its last piece has come down, not at the update's end."""
    model, tokenizer = modeling.load_model(tiny_model_dir)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=3e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=BUCKET_MB,
        moments_dtype="float32",
    )
    opt.sync_model()
    seen: dict[str, bool] = {}

    def on_piece(name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        last = start + new.size == opt.layout[name][1]
        seen[name] = seen.get(name, False) or last
        assert (opt.params[name].grad is None) == last, (name, start)

    train_step(
        model, opt, scored_groups(0, 3), config(), pad_id=tokenizer.pad_token_id, on_piece=on_piece, background=True
    )
    opt.wait()
    assert set(seen) == set(opt.params) and all(seen.values())
    assert any(len(held) > 1 for held in opt._buckets_of.values())  # a parameter cut by buckets was in it
