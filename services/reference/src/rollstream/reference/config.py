"""Reference settings (one typed place; TOML, ROLLSTREAM_* env, flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.core.config import CommonSettings


class ReferenceSettings(CommonSettings):
    """rollstream reference: scored RolloutGroup -> the same group with ref_logprobs."""

    model: str = Field("smollm2-135m", description="local Hugging Face folder, or smollm2-135m (the demo model)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (weights are always bf16 values)")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0")
    # The trainer's KL term compares log pi_ref with its own log pi, both of logits/temperature;
    # a different value here would make the KL measure the temperature, not the policy drift.
    temperature: float = Field(1.0, gt=0, description="log-probs are of logits/temperature (must match the trainer's)")
    token_budget: int = Field(8192, ge=1, description="padded tokens per micro-batch (bounds activation memory)")
    chunk_tokens: int = Field(1024, ge=1, description="completion tokens per LM-head chunk (bounds logits memory)")
    share_prompts: bool = Field(
        True,
        description="run a group's shared prompt through the model once (KV cache) instead of once per completion; "
        "off: exactly the trainer's computation for the same micro-batches",
    )
    group: str = Field("reference", description="consumer group on the scored stream")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")
    trim_interval_s: float = Field(1.0, gt=0, description="how often to trim acknowledged entries from the scored stream")
