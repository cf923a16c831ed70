"""Trainer checkpoints, in process on the tiny model: a run resumed from step k continues
exactly like the uninterrupted run (losses, gradient norms, masters, published bits, bit for
bit), for full fine-tuning, LoRA, bf16 moments and gradient offload; the files are
safetensors + JSON; writes are atomic; mismatched checkpoints are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollstream.core.config import ConfigError, load_settings
from rollstream.core.service import ServiceHost
from rollstream.trainer import checkpoint
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import Trainer
from rollstream.v1 import rollout_pb2
from synthetic import scored_groups  # tests/synthetic.py

STEPS = 5
SAVE_AT = 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def groups_for(step: int, n_groups: int = 2, size: int = 4) -> list[rollout_pb2.RolloutGroup]:
    """Fixed synthetic scored groups for one step (the same for every run)."""
    return scored_groups(1000 + step, n_groups, group_size=size)


def make_trainer(model_dir: Path, **overrides) -> tuple[Trainer, ServiceHost]:
    values = {"model": str(model_dir), "lr": 1e-3, "max_new_tokens": 6, **overrides}
    settings = load_settings(TrainerSettings, [], **values)
    host = ServiceHost("trainer", settings)
    return Trainer(settings, host), host


VARIANTS = {
    "full-grpo": {},
    "lora-gspo": {"lora_rank": 4, "lora_alpha": 8.0, "loss": "gspo", "clip_eps_low": 0.02, "clip_eps_high": 0.03},
    "fp32-layout-fp32-moments": {"master_layout": "fp32", "moments_dtype": "float32"},
    "bf16-moments-dapo-tis-offload": {
        "moments_dtype": "bfloat16",
        "loss": "dapo",
        "clip_eps_high": 0.28,
        "tis_cap": 2.0,
        "grad_offload": True,
        "bucket_mb": 0.01,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_continues_bit_for_bit(variant: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    overrides = VARIANTS[variant]
    # The uninterrupted run, checkpointing after step SAVE_AT.
    a, host_a = make_trainer(tiny_model_dir, **overrides)
    metrics_a = []
    for step in range(1, STEPS + 1):
        m, _, _ = a.train_step(groups_for(step))
        metrics_a.append(m)
        if step == SAVE_AT:
            torch.rand(7)  # move the generator, so that restoring it is visible
            rng_at_save = torch.get_rng_state().clone()
            bits_at_save = {n: b.copy() for n, b in a.publisher.bits().items()}
            path = a.save_checkpoint(tmp_path / "ckpt", prompts_fed=17, consumer="trainer-7")
    host_a.close()

    # The resumed run.
    torch.manual_seed(999)
    b, host_b = make_trainer(tiny_model_dir, **overrides, resume=str(path))
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert (b.step, b.version) == (SAVE_AT, SAVE_AT)
    assert b.restored is not None and (b.restored.prompts_fed, b.restored.consumer) == (17, "trainer-7")
    assert b.publisher.bits().keys() == bits_at_save.keys()
    for name, bits in b.publisher.bits().items():
        assert np.array_equal(bits, bits_at_save[name]), name
    metrics_b = [b.train_step(groups_for(step))[0] for step in range(SAVE_AT + 1, STEPS + 1)]
    host_b.close()

    for ma, mb in zip(metrics_a[SAVE_AT:], metrics_b, strict=True):
        assert (mb.step, mb.version) == (ma.step, ma.version)
        assert mb.loss == ma.loss and mb.grad_norm == ma.grad_norm, f"step {ma.step}"
        assert (mb.tokens, mb.clip_fraction, mb.kl, mb.entropy) == (ma.tokens, ma.clip_fraction, ma.kl, ma.entropy)
        assert mb.delta_bytes == ma.delta_bytes
    assert any(m.loss != 0 for m in metrics_b)
    for name, master in a.optimizer.master.items():
        assert torch.equal(b.optimizer.master[name], master), name
    for key, value in a.optimizer.state_tensors().items():
        assert torch.equal(b.optimizer.state_tensors()[key], value), key
    for name, bits in a.publisher.bits().items():
        assert np.array_equal(b.publisher.bits()[name], bits), name
    # And training moved the published weights (the comparison is not of two idle runs).
    assert any(not np.array_equal(bits_at_save[n], x) for n, x in a.publisher.bits().items())


def test_checkpoint_files_are_safetensors_and_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    t, host = make_trainer(tiny_model_dir, moments_dtype="bfloat16", redis_url="redis://:secret@127.0.0.1:6379/0")
    t.train_step(groups_for(1))
    path = t.save_checkpoint(tmp_path / "c1", prompts_fed=3, consumer="me")
    host.close()
    assert sorted(p.name for p in path.iterdir()) == ["optimizer.safetensors", "rng.safetensors", "state.json"]
    state = json.loads((path / "state.json").read_text())
    assert state["format"] == checkpoint.FORMAT and state["format_version"] == checkpoint.FORMAT_VERSION
    assert (state["version"], state["step"], state["optimizer_steps"], state["prompts_fed"], state["consumer"]) == (
        1,
        1,
        1,
        3,
        "me",
    )
    assert state["model_fingerprint"] == t.publisher.fingerprint
    assert state["settings"]["lr"] == 1e-3 and "redis_url" not in state["settings"]
    assert "secret" not in (path / "state.json").read_text()
    assert "held_groups" not in state  # retired: nothing read it back
    tensors = load_file(str(path / "optimizer.safetensors"))  # safetensors' own reader
    names = set(t.params)
    # The default split layout: each fp32 master as its served bf16 bits and the int16 low half.
    assert state["master_layout"] == "split"
    assert set(tensors) == {
        f"{kind}/{n}" for kind in ("master_hi", "master_lo", "exp_avg", "exp_avg_sq") for n in names
    }
    for n in names:
        assert tensors[f"master_hi/{n}"].dtype == torch.bfloat16 and tensors[f"master_lo/{n}"].dtype == torch.int16
        joined = (tensors[f"master_hi/{n}"].view(torch.int16).int() << 16) + tensors[f"master_lo/{n}"].int()
        assert torch.equal(joined.view(torch.float32), t.optimizer.master[n])
        assert torch.equal(tensors[f"master_hi/{n}"], t.params[n].detach().to(torch.bfloat16))  # the served weights
        assert tensors[f"exp_avg/{n}"].dtype == torch.bfloat16
        assert tuple(tensors[f"exp_avg_sq/{n}"].shape) == tuple(t.params[n].shape)
    rng = load_file(str(path / "rng.safetensors"))
    assert rng["torch_cpu"].dtype == torch.uint8


def test_save_is_atomic_and_latest_sees_only_complete_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    t, host = make_trainer(tiny_model_dir)
    root = tmp_path / "ckpts"
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.resolve("latest", str(root))
    first = t.save_checkpoint(root / checkpoint.step_dir_name(0))
    t.train_step(groups_for(1))
    second = t.save_checkpoint(root / checkpoint.step_dir_name(1))
    # Neither a crashed write (hidden temp folder) nor a folder without state.json counts.
    (root / ".step-00000009.tmp-1234").mkdir()
    (root / "step-00000008").mkdir()
    assert checkpoint.latest(root) == second
    assert checkpoint.resolve("latest", str(root)) == second
    assert checkpoint.resolve(str(first), "") == first
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.resolve(str(root / "step-00000008"), "")

    # An existing checkpoint is never overwritten, unless asked to (a step's default folder
    # after a resume from an earlier step); then the new one is complete before it replaces it.
    before = (second / "optimizer.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        t.save_checkpoint(second)
    assert (second / "optimizer.safetensors").read_bytes() == before
    t.train_step(groups_for(2))
    t.save_checkpoint(second, replace=True)
    assert checkpoint.load_state(second).step == 2
    assert (second / "optimizer.safetensors").read_bytes() != before
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [".step-00000009.tmp-1234"]

    # A write that fails half-way leaves nothing behind under any name.
    bad = {"x": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(checkpoint.CheckpointError, match="cannot be stored"):
        checkpoint.save(
            root / "step-00000005",
            checkpoint.CheckpointState(version=5, step=5, optimizer_steps=5),
            bad,
            checkpoint.rng_state(),
        )
    assert not (root / "step-00000005").exists()
    assert not any(p.name.startswith(".step-00000005") for p in root.iterdir())
    host.close()


def test_mismatched_checkpoints_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    lora, host = make_trainer(tiny_model_dir, lora_rank=4)
    path = lora.save_checkpoint(tmp_path / "lora")
    host.close()
    with pytest.raises(checkpoint.CheckpointError, match="LoRA"):
        make_trainer(tiny_model_dir, resume=str(path))
    with pytest.raises(checkpoint.CheckpointError, match="LoRA"):
        make_trainer(tiny_model_dir, resume=str(path), lora_rank=8)
    full, host = make_trainer(tiny_model_dir)
    full_path = full.save_checkpoint(tmp_path / "full")
    host.close()
    with pytest.raises(checkpoint.CheckpointError, match="moments_dtype"):
        make_trainer(tiny_model_dir, resume=str(full_path), moments_dtype="float32")


# state.json as trainers before the pydantic model wrote it (json.dumps(sort_keys=True) of the
# dataclass), held_groups included.
OLD_STATE = {
    "base_weights_sha256": "",
    "consumer": "trainer-7",
    "consumer_group": "trainer",
    "format": "rollstream-trainer-checkpoint",
    "format_version": 1,
    "groups_stale": 1,
    "groups_trained": 8,
    "held_groups": ["g-1", "g-2"],
    "lora": {"alpha": 8.0, "rank": 4, "target_modules": ["q_proj", "v_proj"]},
    "model_fingerprint": "abc123",
    "moments_dtype": "bfloat16",
    "optimizer_steps": 4,
    "prompts_fed": 17,
    "run": "demo",
    "settings": {"lr": 0.001, "steps": 0},
    "step": 4,
    "version": 4,
}


def write_state(path: Path, state: dict | str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / checkpoint.STATE_FILE).write_text(
        state if isinstance(state, str) else json.dumps(state, indent=2, sort_keys=True)
    )
    return path


def test_an_old_state_file_still_loads(tmp_path: Path) -> None:
    state = checkpoint.load_state(write_state(tmp_path / "old", OLD_STATE))
    assert (state.version, state.step, state.optimizer_steps, state.groups_trained, state.groups_stale) == (
        4,
        4,
        4,
        8,
        1,
    )
    assert (state.prompts_fed, state.run, state.consumer, state.consumer_group) == (17, "demo", "trainer-7", "trainer")
    assert (
        state.lora == OLD_STATE["lora"]
        and state.settings == OLD_STATE["settings"]
        and state.moments_dtype == "bfloat16"
    )
    assert not hasattr(state, "held_groups")
    # Written back: the same keys, less the retired one, plus the newer one at its default;
    # and it loads again to the same state.
    again = json.loads(state.to_json())
    assert again == {
        **{k: v for k, v in OLD_STATE.items() if k != "held_groups"},
        "trained_log_id": "",
        "master_layout": "fp32",
    }
    assert checkpoint.CheckpointState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"step": "4"},
            r"state.json: state file does not match this trainer: step: Input should be a valid integer \(got '4'\)",
        ),
        ({"version": -1}, r"version: Input should be greater than or equal to 0"),
        ({"lora": 5}, r"lora: Input should be (a valid dictionary|an object)"),
        ({"settings": None}, r"settings: Input should be (a valid dictionary|an object)"),
        ({"a_newer_field": 1}, r"a_newer_field: Extra inputs are not permitted"),
        (
            {"format_version": 2},
            r"not a rollstream-trainer-checkpoint v1 state file: format_version: Input should be 1",
        ),
        ({"format": "something-else"}, r"not a rollstream-trainer-checkpoint v1 state file: format:"),
        ({"format": None, "step": None}, r"format: Field required.*step: Field required"),
    ],
)
def test_a_corrupt_state_file_is_refused_naming_the_field(tmp_path: Path, change: dict, message: str) -> None:
    state = {k: v for k, v in {**OLD_STATE, **change}.items() if v is not None or k == "settings"}
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load_state(write_state(tmp_path / "bad", state))


@pytest.mark.parametrize(
    "text", ["", "{", "[]", "null", '{"format": "rollstream-trainer-checkpoint", "format_version": 1, "version": 1}']
)
def test_a_state_file_that_is_not_one_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.json: "):
        checkpoint.load_state(write_state(tmp_path / "bad", text))


def test_held_groups_is_accepted_and_dropped() -> None:
    state = checkpoint.CheckpointState(version=1, step=1, optimizer_steps=1, held_groups=["g"])
    assert "held_groups" not in json.loads(state.to_json())
    with pytest.raises(ValueError, match="not_a_field"):
        checkpoint.CheckpointState(version=1, step=1, optimizer_steps=1, not_a_field=1)


def test_checkpoint_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        load_settings(TrainerSettings, ["--checkpoint-every", "5"])
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        load_settings(TrainerSettings, ["--resume", "latest"])
    s = load_settings(
        TrainerSettings, ["--checkpoint-every", "5", "--checkpoint-dir", str(tmp_path), "--resume", "latest"]
    )
    assert (s.checkpoint_every, s.resume) == (5, "latest")


def test_memory_options_do_not_change_the_step(tiny_model_dir: Path) -> None:
    """Activation checkpointing, gradient offload and the bucket size trade memory and time,
    not results: the same masters, bit for bit, as the defaults. (Both runs split each step
    into several micro-batches: the split itself changes the order of the fp32 gradient sums.)"""
    runs = {}
    for name, overrides in {
        "default": {},
        "checkpointing+offload+small-buckets": {
            "activation_checkpointing": True,
            "grad_offload": True,
            "bucket_mb": 0.01,
        },
    }.items():
        t, host = make_trainer(tiny_model_dir, token_budget=40, **overrides)
        metrics = [t.train_step(groups_for(step)) for step in (1, 2)]
        runs[name] = (
            [(m.loss, m.grad_norm) for m, _, _ in metrics],
            {n: m.clone() for n, m in t.optimizer.master.items()},
            t,
        )
        host.close()
    (losses_a, masters_a, default), (losses_b, masters_b, other) = runs.values()
    assert other.model.is_gradient_checkpointing and not default.model.is_gradient_checkpointing
    assert len(other.optimizer.buckets) > 1 and other.optimizer.host_grad is not None
    assert losses_a == losses_b
    for n, m in masters_a.items():
        assert torch.equal(masters_b[n], m), n
