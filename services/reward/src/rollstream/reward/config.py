"""Settings of the reward service (`python -m rollstream.reward --help` lists them)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from rollstream.core.config import NAME_PATTERN, CommonSettings
from rollstream.reward.recipes import ComponentSpec, Recipes, RecipeSource, build_recipes, default_specs, recipe_source


class RewardSettings(CommonSettings):
    """Scores rollout groups from rs:{<run>}:rollouts with built-in recipes or a remote scorer."""

    output_stage: Literal["scored", "ready"] = Field(
        "scored", description="stream the scored groups go to: 'ready' when the reference stage is skipped (beta = 0)"
    )
    group: str = Field("reward", pattern=NAME_PATTERN, description="consumer group on the rollouts stream")
    # Off by default: `rollouts` is written by the generator user, so a group that says it is
    # scored may be a stolen generator password rewarding itself (issue 27).
    trust_scored_rollouts: bool = Field(
        False,
        description="forward groups that arrive already scored as they are (a trusted scorer upstream); off: score every group",
    )
    # allow_inf_nan=False: a NaN weight would silently poison every reward downstream.
    answer_weight: float = Field(
        1.0, allow_inf_nan=False, description="weight of the 'answer' component of the built-in recipes"
    )
    format_weight: float = Field(0.1, allow_inf_nan=False, description="weight of the 'format' component (arithmetic)")
    # NoDecode: a flag or environment value is JSON text, parsed by the validator below.
    recipes: Annotated[dict[str, list[ComponentSpec]], NoDecode] = Field(
        default_factory=dict,
        description="task_kind -> [{component, weight, name, timeout_s, params}], replacing/adding to the built-in recipes (TOML table, or JSON)",
    )
    component_timeout_s: float = Field(
        5.0, gt=0, description="time limit of one component on one completion (per component: timeout_s)"
    )
    score_workers: int = Field(
        2,
        ge=1,
        description="worker processes that run the components (a worker past a component's time limit is killed and replaced)",
    )
    trim_every_s: float = Field(1.0, gt=0, description="trim acknowledged rollouts this often")
    # Remote scorer: when set, every group is scored by this Reward/Score server instead.
    scorer_address: str = Field(
        "", description="host:port of a rollstream.v1.Reward server to score with (empty: built-in recipes)"
    )
    scorer_batch_size: int = Field(64, ge=1, description="completions per Score call")
    scorer_deadline_s: float = Field(30.0, gt=0, description="deadline of one Score call")
    # gRPC retries the call itself (the channel's retryPolicy); gRPC caps attempts at 5.
    scorer_retries: int = Field(
        3, ge=0, le=4, description="retries of a call that failed for a transient reason (gRPC allows at most 4)"
    )
    scorer_backoff_s: float = Field(
        0.5, gt=0, description="first retry delay (gRPC picks each delay at random up to this); doubles per retry"
    )
    scorer_backoff_max_s: float = Field(10.0, gt=0, description="longest retry delay")
    scorer_breaker_failures: int = Field(5, ge=1, description="consecutive failed calls that open the circuit")
    scorer_breaker_cooldown_s: float = Field(
        15.0, gt=0, description="how long an open circuit refuses calls before trying one"
    )

    @field_validator("recipes", mode="before")
    @classmethod
    def _json_text(cls, v: object) -> object:
        if isinstance(v, str):
            return json.loads(v) if v.strip() else {}
        return v

    @model_validator(mode="after")
    def _recipes_build(self) -> "RewardSettings":
        self.build_recipes()  # a bad component or parameter stops the service at start, named
        return self

    def recipe_specs(self) -> dict[str, list[ComponentSpec]]:
        """The built-in recipes (with this service's weights), then the configured ones over them."""
        return {**default_specs(self.answer_weight, self.format_weight), **self.recipes}

    def build_recipes(self) -> Recipes:
        return build_recipes(self.recipe_specs(), self.component_timeout_s)

    def recipe_source(self) -> RecipeSource:
        """How the scoring workers build the same recipes (plain data; rollstream.reward.scoring)."""
        return recipe_source(self.recipe_specs(), self.component_timeout_s)

    def weights(self) -> dict[str, float]:
        """Weights of the built-in components, for the start-up log line."""
        return {"answer": self.answer_weight, "format": self.format_weight}
