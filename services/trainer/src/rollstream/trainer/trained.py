"""What every rank of the trainer holds: the model as it is trained and the host optimizer of
its trained parameters (on N ranks, ranks.py: its FSDP2 shards and this rank's optimizer over
them). Rank 0's Trainer (trainer.py) and the other ranks' followers (follower.py) build it
alike, and restore it from a checkpoint alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollstream.core import cpu_runtime
from rollstream.core.models import resolve_model
from rollstream.trainer import checkpoint, lora
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.ranks import Ranks
from rollstream.trainer.step import StepConfig


@dataclass
class Trained:
    """The model as the trainer trains it and the optimizer of its trained parameters: what
    every rank of a trainer on N ranks holds (its shards), rank 0's Trainer and the others'
    Follower alike."""

    model_dir: str
    model: Any
    tokenizer: Any
    lora: lora.LoraModel | None
    params: dict[str, torch.nn.Parameter]  # N ranks: DTensors, each rank holding its shards
    optimizer: HostAdamW
    step_config: StepConfig

    @classmethod
    def load(cls, s: TrainerSettings, team: Ranks | None) -> Trained:
        # Large freed blocks (activations) back to the OS instead of held by glibc's heaps:
        # far less resident between steps, and less at the peak (core/cpu_runtime.py).
        cpu_runtime.fixed_mmap_threshold()
        if s.threads:
            torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        model_dir = str(resolve_model(s.model))
        spec = lora.LoraSpec(s.lora_rank, s.lora_alpha, tuple(s.lora_target_modules)) if s.lora_rank else None
        # N ranks: loaded into host memory, and each layer moved onto the rank's GPU as FSDP2
        # shards it (Ranks.shard), so that no GPU ever holds more than its shards and a layer.
        device = s.device if team is None else "cpu"
        model, tokenizer, lora_model, params = lora.load(model_dir, s.dtype, device, spec, s.activation_checkpointing)
        model.train()
        if team is not None:
            params = team.shard(model)
        optimizer = s.host_adamw(params, reduce=team.sum_of_squares if team is not None else None)
        return cls(model_dir, model, tokenizer, lora_model, params, optimizer, StepConfig.from_settings(s))

    def restore_optimizer(self, path: Path, state: checkpoint.CheckpointState, team: Ranks | None) -> None:
        """The optimizer state and RNG of checkpoint `path` (every rank: its shards), and the
        served bits written into the model."""
        if team is None:
            self.optimizer.load_state(checkpoint.optimizer_tensors(path), state.optimizer_steps)
        else:
            checkpoint.load_sharded_optimizer(path, self.optimizer, self.params, state.optimizer_steps)
        checkpoint.set_rng_state(checkpoint.rng_tensors(path))
