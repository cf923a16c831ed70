"""Settings of the reward service (`python -m rollstream.reward --help` lists them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.core.config import CommonSettings


class RewardSettings(CommonSettings):
    """Scores rollout groups from rs:<run>:rollouts with built-in verifiers."""

    output_stage: Literal["scored", "ready"] = Field(
        "scored", description="stream the scored groups go to: 'ready' when the reference stage is skipped (beta = 0)"
    )
    group: str = Field("reward", pattern=r"^[A-Za-z0-9_.-]+$", description="consumer group on the rollouts stream")
    # allow_inf_nan=False: a NaN weight would silently poison every reward downstream.
    answer_weight: float = Field(1.0, allow_inf_nan=False, description="weight of the 'answer' component (correctness)")
    format_weight: float = Field(0.1, allow_inf_nan=False, description="weight of the 'format' component (answer alone)")
    trim_every_s: float = Field(10.0, gt=0, description="trim acknowledged rollouts and log a progress line this often")

    def weights(self) -> dict[str, float]:
        """Component name -> weight, as the verifiers take it."""
        return {"answer": self.answer_weight, "format": self.format_weight}
