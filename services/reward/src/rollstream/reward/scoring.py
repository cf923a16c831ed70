"""Scoring for the reward stage: groups and Score RPC items in, `Score`s and filled-in
rewards out; the metrics both count with.

Local scoring goes through a `ScoresItems`: in the service the worker pool of
rollstream.reward.limits (each component under its time limit, in a worker process), in
tests a plain `Recipes` (in this process, no limits). With a remote scorer configured the
stream's groups go to it instead (rollstream.reward.remote), while the `Reward/Score` RPC
keeps serving this service's own recipes to anyone else (evaluation scripts, another
reward stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.reward.limits import PoolFailed
from rollstream.reward.recipes import OK, TIMEOUT, ComponentResult, Sample, Score
from rollstream.reward.remote import RemoteScorer, ScorerRejected
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

# A Score RPC without a deadline still gets an answer or an error within this.
RPC_DEFAULT_TIMEOUT_S = 300.0


class ScoresItems(Protocol):
    """limits.ScorePool, or recipes.Recipes: scores of (task_kind, sample) items, in order."""

    @property
    def kinds(self) -> tuple[str, ...]: ...

    def score_many(self, items: Sequence[tuple[str, Sample]], timeout_s: float | None = None) -> list[Score]: ...


@dataclass(frozen=True)
class Metrics:
    """The reward stage's own metrics (dead letters, redeliveries, batch time: ServiceHost.metrics)."""

    groups: Counter
    completions: Counter
    tokens: Counter
    reward: Histogram
    reward_mean: Gauge
    verifier_errors: Counter
    timeouts: Counter
    unknown_kind: Counter
    rpc_items: Counter
    scorer_calls: Counter
    scorer_circuit_open: Gauge
    held_groups: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_reward_"
        return cls(
            groups=Counter(p + "groups", "groups written downstream, by outcome", ["outcome"], registry=registry),
            completions=Counter(p + "completions", "completions scored from the stream", registry=registry),
            tokens=Counter(p + "tokens", "completion tokens of the groups scored from the stream", registry=registry),
            reward=Histogram(
                p + "completion_reward",
                "reward of each scored completion (stream and Score RPC)",
                buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.5, 2, 5),
                registry=registry,
            ),
            reward_mean=Gauge(
                p + "batch_reward_mean", "mean reward of the completions in the last scored batch", registry=registry
            ),
            verifier_errors=Counter(
                p + "verifier_errors", "components whose check failed, by component", ["component"], registry=registry
            ),
            timeouts=Counter(
                p + "timeouts", "components that ran out of time, by component", ["component"], registry=registry
            ),
            unknown_kind=Counter(
                p + "unknown_task_kind", "completions of a task kind no recipe knows", registry=registry
            ),
            rpc_items=Counter(p + "rpc_items", "items scored through the Score RPC", registry=registry),
            scorer_calls=Counter(
                p + "scorer_calls", "calls to the remote scorer, by outcome", ["outcome"], registry=registry
            ),
            scorer_circuit_open=Gauge(
                p + "scorer_circuit_open", "1 while the remote scorer's circuit breaker is open", registry=registry
            ),
            held_groups=Gauge(
                p + "held_groups", "groups held pending while the remote scorer is unavailable", registry=registry
            ),
        )

    def count_scores(self, scores: Sequence[Score]) -> None:
        for s in scores:
            if s.unknown_kind:
                self.unknown_kind.inc()
                continue
            self.reward.observe(s.reward)
            for c in s.components:
                if c.status == TIMEOUT:
                    self.timeouts.labels(component=c.name).inc()
                elif c.failed:
                    self.verifier_errors.labels(component=c.name).inc()


# -- between protobuf and scores ----------------------------------------------------------------


def to_pb(component: ComponentResult) -> rollout_pb2.RewardComponent:
    return rollout_pb2.RewardComponent(
        name=component.name, value=component.value, weight=component.weight, status=component.status
    )


def from_pb(score: reward_pb2.ItemScore) -> Score:
    """A remote scorer's answer in our terms (its statuses are counted like ours)."""
    components = tuple(
        ComponentResult(name=c.name, value=c.value, weight=c.weight, status=c.status or OK) for c in score.components
    )
    return Score(reward=score.reward, components=components)


def apply_scores(groups: dict[int, rollout_pb2.RolloutGroup], scores: Iterable[Score]) -> dict[int, list[Score]]:
    """Fill every completion's reward and breakdown in place from `scores` (one per
    completion, group after group), replacing stale ones; mark the groups scored."""
    remaining = iter(scores)
    out = {}
    for i, group in groups.items():
        out[i] = [next(remaining) for _ in group.completions]
        for completion, s in zip(group.completions, out[i]):
            completion.reward = s.reward
            del completion.reward_components[:]
            completion.reward_components.extend(to_pb(c) for c in s.components)
        group.scored = True
    return out


def score_groups(groups: dict[int, rollout_pb2.RolloutGroup], scorer: ScoresItems) -> dict[int, list[Score]]:
    """Score every completion of every group with its task kind's recipe, in place; all of
    them in one go, so that the pool's workers share the whole batch."""
    items = [
        (
            g.task_kind,
            Sample(completion=c.text, answer=g.answer, metadata_json=g.metadata_json, num_tokens=len(c.token_ids)),
        )
        for g in groups.values()
        for c in g.completions
    ]
    return apply_scores(groups, scorer.score_many(items))


def score_items(
    items: Sequence[reward_pb2.ScoreItem], scorer: ScoresItems, timeout_s: float | None = None
) -> list[Score]:
    return scorer.score_many(
        [
            (
                item.task_kind,
                Sample(
                    completion=item.completion,
                    answer=item.answer,
                    metadata_json=item.metadata_json,
                    num_tokens=item.num_tokens if item.HasField("num_tokens") else None,
                ),
            )  # fmt: skip
            for item in items
        ],
        timeout_s=timeout_s,
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """`Score`: the recipes over gRPC, item by item, in request order. Runs on the gRPC
    server's threads; the checks run in the scoring pool, like the stream loop's."""

    def __init__(self, scorer: ScoresItems, metrics: Metrics):
        self.scorer = scorer
        self.metrics = metrics

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        remaining = context.time_remaining()
        timeout = RPC_DEFAULT_TIMEOUT_S if remaining is None else max(0.0, remaining)
        try:
            scores = score_items(request.items, self.scorer, timeout)
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "scoring did not finish before the deadline")
        except PoolFailed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.rpc_items.inc(len(scores))
        self.metrics.count_scores(scores)
        return reward_pb2.ScoreResponse(
            scores=[reward_pb2.ItemScore(reward=s.reward, components=[to_pb(c) for c in s.components]) for s in scores]
        )


# -- what the stream loop scores with -------------------------------------------------------------


@dataclass
class Scored:
    """What scoring a batch gave: the scores of each group scored (by position in the
    batch), and the reason for each group a remote scorer rejected."""

    scores: dict[int, list[Score]]
    rejected: dict[int, str]


@dataclass
class Scorer:
    """How the stream loop scores: the local recipes (through the pool), or a remote scorer."""

    local: ScoresItems
    remote: RemoteScorer | None

    def score_groups(self, groups: dict[int, rollout_pb2.RolloutGroup]) -> Scored:
        """Score `groups` (position in the batch -> group) in place. Raises
        ScorerUnavailable when they must be held: nothing has been written then (a group
        already scored in place is simply scored again on the retry)."""
        if self.remote is None:
            # A kind no recipe knows has no verifier: its group is refused (dead letter), not
            # scored 0 and trained on as if every completion were wrong. A remote scorer
            # knows its own kinds and rejects what it cannot score.
            known = self.local.kinds
            rejected = {
                i: f"task_kind {g.task_kind!r} has no verifier in this reward service (known: {', '.join(known)})"
                for i, g in groups.items()
                if g.task_kind not in known
            }
            todo = {i: g for i, g in groups.items() if i not in rejected}
            return Scored(scores=score_groups(todo, self.local) if todo else {}, rejected=rejected)
        try:
            return Scored(scores=self._score_remotely(groups), rejected={})
        except ScorerRejected as e:
            if len(groups) == 1:
                return Scored(scores={}, rejected={i: f"remote scorer rejected the group: {e}" for i in groups})
        # Which group does the scorer object to? Ask group by group.
        result = Scored(scores={}, rejected={})
        for i, g in groups.items():
            try:
                result.scores.update(self._score_remotely({i: g}))
            except ScorerRejected as e:
                result.rejected[i] = f"remote scorer rejected the group: {e}"
        return result

    def _score_remotely(self, groups: dict[int, rollout_pb2.RolloutGroup]) -> dict[int, list[Score]]:
        assert self.remote is not None
        items = [
            reward_pb2.ScoreItem(
                group_id=g.group_id,
                completion_index=k,
                task_kind=g.task_kind,
                completion=c.text,
                answer=g.answer,
                metadata_json=g.metadata_json,
                num_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
            )
            for g in groups.values()
            for k, c in enumerate(g.completions)
        ]
        replies = self.remote.score(items)  # raises before any group is changed
        return apply_scores(groups, map(from_pb, replies))
