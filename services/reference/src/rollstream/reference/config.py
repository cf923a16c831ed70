"""Reference settings (one typed place; TOML, ROLLSTREAM_* env, flags: rollstream.core.config)."""

from __future__ import annotations

from pydantic import Field

from rollstream.core.config import TorchSettings


class ReferenceSettings(TorchSettings):
    """rollstream reference: scored RolloutGroup -> the same group with ref_logprobs."""

    # model, dtype, device, threads: TorchSettings (the reference says nothing more about them).
    # The trainer's KL term compares log pi_ref with its own log pi, both of logits/temperature;
    # a different value here would make the KL measure the temperature, not the policy drift.
    temperature: float = Field(
        1.0, gt=0, description="log-probs are of logits/temperature: the trainer's temperature (`up` sets it)"
    )
    token_budget: int = Field(8192, ge=1, description="padded tokens per micro-batch (bounds activation memory)")
    chunk_tokens: int = Field(1024, ge=1, description="completion tokens per LM-head chunk (bounds logits memory)")
    share_prompts: bool = Field(
        True,
        description="run a group's shared prompt through the model once (KV cache) instead of once per completion; "
        "off: exactly the trainer's computation for the same micro-batches",
    )
    group: str = Field("reference", description="consumer group on the scored stream")
    trim_every_s: float = Field(1.0, gt=0, description="how often to trim acknowledged entries from the scored stream")
