"""LoRA training publishes merged weights: the trainer's published bits equal peft's own
merge_and_unload() of the same adapter state (bf16-rounded, bit for bit), the deltas decode
to exactly them from version 0, and only the adapters are trained."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import deltas, modeling
from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import Trainer
from rollstream.v1 import rollout_pb2


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def groups_for(step: int) -> list[rollout_pb2.RolloutGroup]:
    rng = random.Random(step)
    out = []
    for g in range(2):
        completions = []
        for _ in range(4):
            n = rng.randint(1, 6)
            completions.append(rollout_pb2.Completion(
                token_ids=[rng.randrange(5, 200) for _ in range(n)],
                behaviour_logprobs=[-5.5 + rng.gauss(0, 0.2) for _ in range(n)],
                reward=float(rng.random() < 0.5),
            ))
        out.append(rollout_pb2.RolloutGroup(group_id=f"{step}-{g}", prompt_ids=[rng.randrange(5, 200) for _ in range(5)], completions=completions, scored=True))
    return out


def make_trainer(model_dir: Path, **overrides) -> tuple[Trainer, ServiceHost]:
    settings = load_settings(TrainerSettings, [], **{"model": str(model_dir), "lr": 2e-2, "max_new_tokens": 6, **overrides})
    host = ServiceHost("trainer", settings)
    return Trainer(settings, host), host


def peft_merged_bits(model_dir: Path, trainer: Trainer) -> dict[str, np.ndarray]:
    """peft's own path, independent of rollstream.trainer.lora: a fresh fp32 base rounded to
    bf16 (version 0), the trainer's adapter state loaded with peft, merge_and_unload()."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    base, _ = modeling.load_model(model_dir)
    modeling.load_bits_(base, modeling.model_bits(base))
    s = trainer.settings
    targets = "all-linear" if s.lora_target_modules == ["all-linear"] else s.lora_target_modules
    fresh = get_peft_model(base, LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, target_modules=targets, lora_dropout=0.0))
    result = set_peft_model_state_dict(fresh, get_peft_model_state_dict(trainer.model))
    assert not result.unexpected_keys
    merged = fresh.merge_and_unload()
    return modeling.model_bits(merged)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_published_bits_are_peft_merge_and_unload(targets: str, tiny_model_dir: Path) -> None:
    trainer, host = make_trainer(tiny_model_dir, lora_rank=4, lora_alpha=8.0, lora_target_modules=targets)
    plain, plain_host = make_trainer(tiny_model_dir)
    version0 = {n: b.copy() for n, b in trainer.publisher.bits().items()}
    # Version 0 is the same as without LoRA (B = 0): bf16 of the checkpoint, same names.
    assert version0.keys() == plain.publisher.bits().keys()
    assert all(np.array_equal(version0[n], b) for n, b in plain.publisher.bits().items())
    assert trainer.publisher.fingerprint == plain.publisher.fingerprint
    plain_host.close()

    # Only the adapters are trained; the base is frozen.
    assert trainer.params and all(".lora_A." in n or ".lora_B." in n for n in trainer.params)
    assert set(trainer.optimizer.master) == set(trainer.params)
    assert all(not p.requires_grad for p in trainer.lora.base.values())
    touched = set(trainer.lora.layers)
    if targets == "all-linear":
        assert any("mlp" in n for n in touched) and "lm_head.weight" not in touched
    else:
        assert touched and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in touched)

    # Generator side: version 0 plus each pushed delta, decoded exactly as a generator does.
    held, held_version = version0, 0
    for step in range(1, 4):
        _, published, stats = trainer.train_step(groups_for(step))
        info, new = deltas.decode(published.payload, held, held_version, trainer.publisher.fingerprint)
        assert set(new) <= touched  # only merged weights ever change
        held, held_version = {**held, **new}, info.version
    assert stats.changed_tensors > 0

    published_bits = trainer.publisher.bits()
    expected = peft_merged_bits(tiny_model_dir, trainer)
    assert expected.keys() == published_bits.keys() == held.keys()
    for name, bits in expected.items():
        assert np.array_equal(published_bits[name], bits), name
        assert np.array_equal(held[name], bits), name
    # The merge is not the base: training moved the touched weights, and only those.
    moved = {n for n in touched if not np.array_equal(published_bits[n], version0[n])}
    assert moved and moved <= touched
    assert all(np.array_equal(published_bits[n], version0[n]) for n in version0 if n not in touched)
    # The frozen base itself never changed.
    assert all(np.array_equal(modeling.tensor_to_bits(p), version0[n]) for n, p in trainer.lora.base.items())
    host.close()


def test_lora_settings(tiny_model_dir: Path) -> None:
    s = load_settings(TrainerSettings, ["--lora-rank", "8", "--lora-target-modules", "q_proj, k_proj"])
    assert (s.lora_rank, s.lora_target_modules) == (8, ["q_proj", "k_proj"])
    assert load_settings(TrainerSettings, []).lora_target_modules == ["all-linear"]
    with pytest.raises(ValueError, match="no_such_proj"):  # peft names the missing module
        make_trainer(tiny_model_dir, lora_rank=2, lora_target_modules="no_such_proj")
