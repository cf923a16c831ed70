"""The reward's scoring for a command that is no service: `rollstream sft`'s held-out score
(trainer/sft_eval.py). What the `Score` RPC does, without a server: ScoreItems in,
ItemScores out, in order, each component in the scoring pool under its time limit
(rollstream.reward.scoring)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from rollstream.core.config import load_settings
from rollstream.reward import recipes
from rollstream.reward.config import RewardSettings
from rollstream.reward.scoring import RPC_DEFAULT_TIMEOUT_S, ScorePool, item_score, score_items
from rollstream.v1 import reward_pb2


class ItemScorer:
    """The reward service's recipes, scoring items in its worker pool. Lazy: the recipes are
    built at the first use and the pool started at the first score (a run whose held-out rows
    have no answers starts neither); leaving its `with` stops the pool."""

    def __init__(self, settings: Callable[[], RewardSettings]):
        self._settings = settings
        self._recipes: recipes.RecipeSource | None = None
        self._kinds: tuple[str, ...] = ()
        self.workers = 0
        self._pool: ScorePool | None = None

    @classmethod
    def from_config(cls, path: Path | None = None) -> ItemScorer:
        """The reward service's recipes as its settings give them: the [reward] table of `path`
        (an `up` profile or config file; none: its defaults), then its ROLLSTREAM_* variables;
        a bad value is a ConfigError, naming it, at the first use."""
        argv, table = (["--config", str(path)], "reward") if path is not None else ([], "")
        return cls(functools.partial(load_settings, RewardSettings, argv, table))

    def _source(self) -> recipes.RecipeSource:
        if self._recipes is None:
            s = self._settings()
            self._recipes, self._kinds, self.workers = s.recipe_source(), s.build_recipes().kinds, s.score_workers
        return self._recipes

    @property
    def kinds(self) -> tuple[str, ...]:
        self._source()
        return self._kinds

    def score(self, items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]:
        if self._pool is None:
            self._pool = ScorePool(self._source(), self.workers)
        return [item_score(s) for s in score_items(items, self._pool, RPC_DEFAULT_TIMEOUT_S)]

    def __enter__(self) -> ItemScorer:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
