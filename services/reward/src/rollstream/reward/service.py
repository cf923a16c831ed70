"""The reward stage: rs:<run>:rollouts -> built-in verifiers -> rs:<run>:scored (or :ready).

Read it top to bottom: `main` loads settings and starts the servers, `run` is the loop,
`process_batch` is one read's worth of work. Every group written downstream is
acknowledged in the same transaction (StreamStage.commit), so a crash at any point loses
nothing; entries a dead consumer left pending are claimed after `claim_idle_ms`.

The same verifiers back the `rollstream.v1.Reward/Score` RPC, so this service is also a
remote scorer for anyone else (evaluation scripts, another reward stage).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import grpc
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.core import codec, grpc_utils, logs, streams
from rollstream.core.config import ConfigError, load_settings
from rollstream.core.service import ServiceHost
from rollstream.core.streams import Entry, StreamStage
from rollstream.reward import verifiers
from rollstream.reward.config import RewardSettings
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

SERVICE_NAME = "rollstream.v1.Reward"
SOURCE_STAGE = "rollouts"
# Back-off while Redis is unreachable: start small (a blip), cap it (a restart).
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(RewardSettings, list(argv) if argv is not None else sys.argv[1:])
    except ConfigError as e:
        print(f"rollstream.reward: {e}", file=sys.stderr)
        return 2
    with ServiceHost("reward", settings) as host:
        host.install_signal_handlers()
        run(host, settings)
    return 0


# -- metrics and readiness ----------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    groups: Counter
    completions: Counter
    reward_mean: Gauge
    verifier_errors: Counter
    unknown_kind: Counter
    dead_lettered: Counter
    batch_seconds: Histogram
    redelivered: Counter
    rpc_items: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_reward_"
        return cls(
            groups=Counter(p + "groups", "groups written downstream, by outcome", ["outcome"], registry=registry),
            completions=Counter(p + "completions", "completions scored from the stream", registry=registry),
            reward_mean=Gauge(p + "batch_reward_mean", "mean reward of the completions in the last scored batch", registry=registry),
            verifier_errors=Counter(p + "verifier_errors", "components whose verifier raised, by component", ["component"], registry=registry),
            unknown_kind=Counter(p + "unknown_task_kind", "completions of a task kind no recipe knows", registry=registry),
            dead_lettered=Counter(p + "dead_lettered", "malformed entries moved to the dead-letter stream", registry=registry),
            batch_seconds=Histogram(p + "batch_seconds", "time to score and commit one read's batch", registry=registry),
            redelivered=Counter(
                p + "redelivered", "entries read again: claimed from a dead consumer, or our own after a restart", registry=registry
            ),
            rpc_items=Counter(p + "rpc_items", "items scored through the Score RPC", registry=registry),
        )

    def count_scores(self, scores: Sequence[verifiers.Score]) -> None:
        for s in scores:
            if s.unknown_kind:
                self.unknown_kind.inc()
            for c in s.components:
                if c.failed and not s.unknown_kind:
                    self.verifier_errors.labels(component=c.name).inc()


@dataclass
class Readiness:
    """What /readyz reports; written by the loop, read by the HTTP thread."""

    ok: bool = False
    detail: str = "starting"

    def get(self) -> tuple[bool, str]:
        return self.ok, self.detail


@dataclass
class Totals:
    """Running counts for the periodic progress log line."""

    scored: int = 0
    passed_through: int = 0
    dead_lettered: int = 0
    verifier_errors: int = 0
    unknown_kind: int = 0
    trimmed: int = 0


# -- scoring ------------------------------------------------------------------------------


def to_pb(component: verifiers.Component) -> rollout_pb2.RewardComponent:
    return rollout_pb2.RewardComponent(name=component.name, value=component.value, weight=component.weight, status=component.status)


def score_group(group: rollout_pb2.RolloutGroup, weights: Mapping[str, float]) -> list[verifiers.Score]:
    """Fill every completion's reward and components in place; mark the group scored."""
    scores = []
    for completion in group.completions:
        s = verifiers.score(group.task_kind, completion.text, group.answer, weights)
        completion.reward = s.reward
        del completion.reward_components[:]
        completion.reward_components.extend(to_pb(c) for c in s.components)
        scores.append(s)
    group.scored = True
    return scores


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """`Score`: the built-in verifiers over gRPC, item by item, in request order."""

    def __init__(self, weights: Mapping[str, float], metrics: Metrics):
        self.weights = dict(weights)
        self.metrics = metrics

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        scores = [verifiers.score(item.task_kind, item.completion, item.answer, self.weights) for item in request.items]
        self.metrics.rpc_items.inc(len(scores))
        self.metrics.count_scores(scores)
        return reward_pb2.ScoreResponse(
            scores=[reward_pb2.ItemScore(reward=s.reward, components=[to_pb(c) for c in s.components]) for s in scores]
        )


# -- the stage ----------------------------------------------------------------------------


def process_batch(
    stage: StreamStage, entries: Sequence[Entry], settings: RewardSettings, metrics: Metrics, totals: Totals, log: logging.Logger
) -> None:
    """Dead-letter what does not parse; score the rest and commit them in one transaction."""
    weights = settings.weights()
    redelivered = sum(1 for e in entries if e.deliveries > 1)
    if redelivered:
        # Left pending by a consumer that died (or by us before a restart): worth seeing.
        metrics.redelivered.inc(redelivered)
        logs.event(log, "redelivered", entries=redelivered, max_deliveries_seen=max(e.deliveries for e in entries))
    done: list[Entry] = []
    outputs: list[tuple[str, rollout_pb2.RolloutGroup]] = []
    scores: list[verifiers.Score] = []
    passed_through = 0
    for entry in entries:
        try:
            group = codec.decode(entry.fields, rollout_pb2.RolloutGroup)
            codec.validate_group(group)
        except codec.EntryError as e:
            # Its own transaction (dead-letter + ack): a bad entry must not hold up the good ones.
            stage.dead_letter(entry, str(e))
            metrics.dead_lettered.inc()
            totals.dead_lettered += 1
            logs.event(log, "dead_lettered", logging.WARNING, entry=entry.id.decode(), reason=str(e))
            continue
        if group.scored:
            # Someone upstream (a custom scorer) already scored it: forward it as it is.
            passed_through += 1
        else:
            scores.extend(score_group(group, weights))
        done.append(entry)
        outputs.append((settings.output_stage, group))
    if not done:
        return

    newly_scored = len(done) - passed_through
    errors = sum(s.errors for s in scores)
    unknown = sum(1 for s in scores if s.unknown_kind)
    stats = {"scored": newly_scored, "reward_passthrough": passed_through, "reward_verifier_errors": errors, "reward_unknown_kind": unknown}
    stats_key = stage.keys.stats

    def count_in_redis(ops: streams.Ops) -> None:
        for name, n in stats.items():
            if n:
                ops.hincrby(stats_key, name, n)

    stage.commit(done, outputs=outputs, extra=count_in_redis)

    # Counted only once committed, so the metrics agree with what reached the stream.
    metrics.groups.labels(outcome="scored").inc(newly_scored)
    metrics.groups.labels(outcome="passed_through").inc(passed_through)
    metrics.completions.inc(len(scores))
    metrics.count_scores(scores)
    if scores:
        metrics.reward_mean.set(sum(s.reward for s in scores) / len(scores))
    totals.scored += newly_scored
    totals.passed_through += passed_through
    totals.verifier_errors += errors
    totals.unknown_kind += unknown
    logs.event(log, "batch", logging.DEBUG, groups=len(done), scored=newly_scored, completions=len(scores), verifier_errors=errors)


def open_stage(host: ServiceHost, settings: RewardSettings, client: redis.Redis, readiness: Readiness) -> StreamStage | None:
    """Join the consumer group, waiting for Redis if it is not up yet (None: stopped meanwhile)."""
    delay = RETRY_FIRST_S
    while not host.stop.is_set():
        try:
            return StreamStage.for_service(client, settings, SOURCE_STAGE, settings.group)
        except redis.RedisError as e:
            readiness.detail = f"waiting for redis: {e}"
            logs.event(host.log, "redis_unavailable", logging.WARNING, error=str(e), retry_s=delay)
            host.stop.wait(delay)
            delay = min(delay * 2, RETRY_MAX_S)
    return None


def run(host: ServiceHost, settings: RewardSettings) -> None:
    metrics = Metrics.register(host.registry)
    readiness = Readiness()
    servicer = RewardServicer(settings.weights(), metrics)
    host.start([grpc_utils.Service(SERVICE_NAME, servicer, reward_pb2_grpc.add_RewardServicer_to_server)], ready=readiness.get)

    client = streams.connect(settings.redis_url)
    try:
        stage = open_stage(host, settings, client, readiness)
        if stage is None:
            return
        readiness.ok, readiness.detail = True, f"reading {stage.stream}"
        host.set_ready(True)
        logs.event(
            host.log,
            "started",
            source=stage.stream,
            output=stage.keys.stream(settings.output_stage),
            group=stage.group,
            consumer=stage.consumer,
            weights=settings.weights(),
        )

        totals = Totals()
        last_logged = asdict(totals)
        next_housekeeping = time.monotonic() + settings.trim_every_s
        delay = RETRY_FIRST_S
        while not host.stop.is_set():
            try:
                entries = stage.read(settings.read_count, settings.block_ms)
                if entries:
                    with metrics.batch_seconds.time():
                        process_batch(stage, entries, settings, metrics, totals, host.log)
                if time.monotonic() >= next_housekeeping:
                    totals.trimmed += stage.trim()
                    next_housekeeping = time.monotonic() + settings.trim_every_s
                    if asdict(totals) != last_logged:  # quiet while idle
                        last_logged = asdict(totals)
                        logs.event(host.log, "progress", **last_logged)
            except redis.RedisError as e:
                # Whatever was read and not committed stays pending and is read again.
                readiness.ok, readiness.detail = False, f"redis error: {e}"
                host.set_ready(False)
                logs.event(host.log, "redis_error", logging.WARNING, error=str(e), retry_s=delay)
                host.stop.wait(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if not readiness.ok:
                readiness.ok, readiness.detail = True, f"reading {stage.stream}"
                host.set_ready(True)
                logs.event(host.log, "redis_recovered")
            delay = RETRY_FIRST_S
    finally:
        client.close()
