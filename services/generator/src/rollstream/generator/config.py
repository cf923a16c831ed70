"""Generator settings (one typed place; TOML, ROLLSTREAM_* env, flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.core.config import CommonSettings


class GeneratorSettings(CommonSettings):
    """rollstream generator: PromptTask -> RolloutGroup with behaviour log-probs."""

    model: str = Field("smollm2-135m", description="local Hugging Face folder, or smollm2-135m (the demo model)")
    backend: Literal["transformers"] = Field("transformers", description="sampling engine")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (weights are always bf16 values)")
    device: str = Field("cpu")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")
    group: str = Field("generator", description="consumer group on the prompts stream")
    generator_id: str = Field("", description="name in the registry and in RolloutGroups (default: consumer name)")
    advertise_address: str = Field("", description="address the trainer pushes weights to (default host:grpc_port)")
    trainer_address: str = Field("", description="trainer gRPC address for catch-up (FetchWeights); empty: none")
    tasks_per_batch: int = Field(4, ge=1, description="prompt tasks sampled together in one batch")
    max_inflight_groups: int = Field(32, ge=1, description="take no task while this many groups wait downstream")
    max_staleness: int = Field(1, ge=0, description="take no task while this many versions behind the trainer")
    sync_interval_s: float = Field(2.0, gt=0, description="how often to compare versions with the trainer")
    seed: int = Field(0, description="sampling seed (mixed with each task's own)")
