"""Trainer settings (one typed place; TOML, ROLLSTREAM_* env, flags)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from rollstream.core.config import CommonSettings


class TrainerSettings(CommonSettings):
    """rollstream trainer: GRPO on the ready stream, weights pushed to the generators."""

    model: str = Field("smollm2-135m", description="local Hugging Face folder, or smollm2-135m (the demo model)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype of forward/backward")
    device: str = Field("cpu", description="compute device; the optimizer state always lives on the CPU")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")
    steps: int = Field(0, ge=0, description="stop after this many optimizer steps (0: run until stopped)")
    seed: int = Field(0)
    linger: bool = Field(False, description="after the last step keep serving gRPC (weights, state) until stopped")
    # Data
    task: Literal["arithmetic", "jsonl"] = Field("arithmetic", description="built-in synthetic task, or prompts from a JSONL file")
    dataset_path: str = Field("", description="JSONL/Parquet file of prompts (task = jsonl)")
    prompt_field: str = Field("prompt")
    answer_field: str = Field("answer")
    task_kind: str = Field("arithmetic", description="reward recipe name written into each task (jsonl)")
    max_operand: int = Field(9, ge=1, description="arithmetic: operands are 0..max_operand")
    # Sampling (sent with each task)
    group_size: int = Field(8, ge=2)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(12, ge=1)
    # GRPO
    groups_per_step: int = Field(8, ge=1)
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = Field((0.9, 0.999))
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    loss: Literal["grpo"] = Field("grpo")
    clip_eps: float = Field(0.2, gt=0)
    beta: float = Field(0.0, ge=0, description="KL (k3) weight; > 0 needs the reference stage")
    max_staleness: int = Field(1, ge=0, description="drop groups sampled more than this many versions ago")
    prompt_buffer: int = Field(16, ge=1, description="tasks kept waiting in the prompts stream")
    token_budget: int = Field(4096, ge=16, description="padded tokens per micro-batch")
    chunk_tokens: int = Field(1024, ge=1, description="LM-head chunk when computing log-probs")
    # Weight sync
    # NoDecode: the environment gives "a:1,b:2" (or a JSON list), not only JSON.
    generators: Annotated[list[str], NoDecode] = Field(default_factory=list, description="generator gRPC addresses, comma-separated (empty: the Redis registry)")
    anchor_interval: int = Field(20, ge=1, description="publish a full anchor every N versions")
    push_timeout_s: float = Field(120.0, gt=0)
    group: str = Field("trainer", description="consumer group on the ready stream")

    @field_validator("generators", "betas", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        # Flags and env give "a:1,b:2" or "0.9,0.999" (or JSON); TOML gives a list.
        if isinstance(v, str):
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [a.strip() for a in v.split(",") if a.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainerSettings":
        if self.task == "jsonl" and not self.dataset_path:
            raise ValueError("dataset_path is required when task = 'jsonl'")
        return self
