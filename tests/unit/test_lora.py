"""LoRA training publishes merged weights: the trainer's published bits equal peft's own
merge_and_unload() of the same adapter state (bf16-rounded, bit for bit), the deltas decode
to exactly them from version 0, and only the adapters are trained. With kl_reference =
lora_base the trainer is its own reference: the base under the adapters gives the reference
service's log-probs bit for bit, before and after training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import deltas, modeling
from rollstream.core.config import ConfigError, load_settings
from rollstream.core.service import ServiceHost
from rollstream.reference.scoring import ReferenceModel
from rollstream.trainer import step as trainer_step
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import Trainer
from rollstream.v1 import rollout_pb2
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def groups_for(step: int) -> list[rollout_pb2.RolloutGroup]:
    return scored_groups(step, 2)


def make_trainer(model_dir: Path, **overrides) -> tuple[Trainer, ServiceHost]:
    settings = load_settings(
        TrainerSettings, [], **{"model": str(model_dir), "lr": 2e-2, "max_new_tokens": 6, **overrides}
    )
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
    fresh = get_peft_model(
        base, LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, target_modules=targets, lora_dropout=0.0)
    )
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


def test_lora_base_reference_is_the_reference_service(tiny_model_dir: Path) -> None:
    trainer, host = make_trainer(
        tiny_model_dir,
        lora_rank=4,
        lora_alpha=8.0,
        beta=0.1,
        kl_reference="lora_base",
        chunk_tokens=16,
        token_budget=128,
    )
    assert trainer.ref_from_base
    # The packed path: what the trainer computes, bit for bit (the shared-prompt path, the
    # service's default, agrees to ~1e-6 only, and not on every machine's kernels).
    reference = ReferenceModel.load(tiny_model_dir, token_budget=128, chunk_tokens=16, share_prompts=False)
    groups = groups_for(1)
    seqs = [(list(g.prompt_ids), list(c.token_ids)) for g in groups for c in g.completions]

    def reference_of(batch: modeling.Batch) -> torch.Tensor:
        # What the trainer's step takes as log pi_ref with kl_reference = lora_base.
        return trainer_step.base_logprobs(trainer.model, trainer.lora.model.disable_adapter, batch, trainer.step_config)

    def base_logprobs() -> list[list[float]]:
        # The reference service's packing, so both compute on the very same micro-batches.
        out: list[list[float]] = [[] for _ in seqs]
        for micro in modeling.pack_by_tokens([len(p) + len(c) for p, c in seqs], 128):
            batch = modeling.make_batch([seqs[i] for i in micro], trainer.tokenizer.pad_token_id)
            for i, values in zip(micro, reference_of(batch).split(batch.lengths)):
                out[i] = values.tolist()
        return out

    expected = reference.logprobs(seqs)
    assert base_logprobs() == expected
    # Version 0 is the base itself (B = 0): the first step's KL is exactly zero. The groups
    # carry no ref_logprobs: the trainer does not need them.
    assert not any(c.ref_logprobs for g in groups for c in g.completions)
    metrics, _, _ = trainer.train_step(groups)
    assert metrics.kl == 0.0
    for step in range(2, 4):
        metrics, _, _ = trainer.train_step(groups_for(step))
    # Training moved the policy away from the reference, and the reference stayed put.
    assert metrics.kl > 0.0
    assert base_logprobs() == expected
    batch = modeling.make_batch(seqs, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        policy, _ = modeling.completion_logprobs(trainer.model, batch, chunk_tokens=16)
    assert not torch.equal(policy, reference_of(batch))
    host.close()


def test_lora_base_needs_lora() -> None:
    with pytest.raises(ConfigError, match="kl_reference"):
        load_settings(TrainerSettings, ["--beta", "0.1", "--kl-reference", "lora_base"])
    assert (
        load_settings(TrainerSettings, ["--lora-rank", "4", "--kl-reference", "lora_base"]).kl_reference == "lora_base"
    )
