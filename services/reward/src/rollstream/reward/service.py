"""The reward stage: rs:{<run>}:rollouts -> recipes (or a remote scorer) -> rs:{<run>}:scored (or :ready).

Read it top to bottom: `main` loads settings and starts the servers, `run` starts the
scoring pool and runs the stream loop on the main thread, `stream_loop` is the loop,
`process_batch` is one read's worth of work. Every group written downstream is
acknowledged in the same transaction (StreamStage.commit), so a crash at any point loses
nothing; entries a dead consumer left pending are claimed after `claim_idle_ms`.

Scoring (rollstream.reward.scoring) runs every component in the worker processes of a
rollstream.reward.limits.ScorePool, which kills a worker that runs past the component's
time limit; the `Reward/Score` RPC, on the gRPC server's threads, uses the same pool.

With `scorer_address` set, groups are scored by that remote `Reward/Score` server instead
(rollstream.reward.remote); while it is unavailable the batch is held, pending, and tried
again (never acknowledged with made-up zeros).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rollstream.core import codec, grpc_utils, logs, redis_policy, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.service import ServiceHost
from rollstream.core.streams import Entry, StreamStage
from rollstream.reward.config import RewardSettings
from rollstream.reward.limits import ScorePool
from rollstream.reward.remote import RemoteScorer, ScorerUnavailable
from rollstream.reward.scoring import Metrics, RewardServicer, Scored, Scorer
from rollstream.v1 import reward_pb2_grpc, rollout_pb2

SERVICE_NAME = "rollstream.v1.Reward"
SOURCE_STAGE = "rollouts"
PROGRESS_EVERY_S = 30.0  # the periodic progress line
# Groups read: the structure every stage checks (finite log-probs, lengths that match, the
# completion count the task asked for). Vocabulary bounds are the trainer's and
# generator's business: this service has no model (and no torch).
INPUT_LIMITS = validation.Limits()
# Groups written: rewards finite and bounded, whatever a remote scorer answered.
OUTPUT_LIMITS = validation.Limits()


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_or_exit(RewardSettings, list(argv) if argv is not None else sys.argv[1:])
    with ServiceHost("reward", settings) as host:
        host.install_signal_handlers()
        run(host, settings)
    return 0


# -- readiness and totals ------------------------------------------------------------------


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
    timeouts: int = 0
    unknown_kind: int = 0
    trimmed: int = 0


# -- the stage ----------------------------------------------------------------------------


def parse_group(entry: Entry) -> rollout_pb2.RolloutGroup:
    """Decode and check one rollouts entry (raises codec.EntryError with the reason)."""
    group = codec.decode(entry.fields, rollout_pb2.RolloutGroup)
    validation.check_group(group, INPUT_LIMITS, stage="rollouts")
    return group


def read_batch(stage: StreamStage, settings: RewardSettings, metrics: Metrics, totals: Totals, log: logging.Logger) -> list[tuple[Entry, rollout_pb2.RolloutGroup]]:
    """One read's worth of valid groups; what does not parse or check goes to the dead
    letters alone (rollstream.core.streams.StreamStage.read_valid)."""
    def on_dead(entry: Entry, reason: str) -> None:
        count_dead_letter(entry, reason, metrics, totals, log)

    batch = stage.read_valid(settings.read_count, settings.block_ms, parse_group, on_dead=on_dead)
    redelivered = sum(1 for e, _ in batch if e.deliveries > 1)
    if redelivered:
        # Left pending by a consumer that died (or by us before a restart): worth seeing.
        metrics.redelivered.inc(redelivered)
        logs.event(log, "redelivered", entries=redelivered, max_deliveries_seen=max(e.deliveries for e, _ in batch))
    return batch


def dead_letter(stage: StreamStage, entry: Entry, reason: str, metrics: Metrics, totals: Totals, log: logging.Logger) -> None:
    stage.dead_letter(entry, reason)
    count_dead_letter(entry, reason, metrics, totals, log)


def count_dead_letter(entry: Entry, reason: str, metrics: Metrics, totals: Totals, log: logging.Logger) -> None:
    """The metrics, totals and log line of an entry the stage has dead-lettered."""
    metrics.dead_lettered.inc()
    totals.dead_lettered += 1
    logs.event(log, "dead_lettered", logging.WARNING, entry=entry.id.decode(), reason=reason)


def process_batch(
    stage: StreamStage,
    batch: Sequence[tuple[Entry, rollout_pb2.RolloutGroup]],
    settings: RewardSettings,
    scorer: Scorer,
    metrics: Metrics,
    totals: Totals,
    log: logging.Logger,
) -> None:
    """Score the decoded groups and commit them (output + ack) in one transaction.

    Raises ScorerUnavailable before anything is written: the caller holds the batch."""
    # A group already scored upstream (by a custom scorer) is forwarded as it is.
    to_score = {i: group for i, (_, group) in enumerate(batch) if not group.scored}
    scored = scorer.score_groups(to_score) if to_score else Scored(scores={}, rejected={})
    done: list[Entry] = []
    outputs: list[tuple[str, rollout_pb2.RolloutGroup]] = []
    for i, (entry, group) in enumerate(batch):
        if i in scored.rejected:
            dead_letter(stage, entry, scored.rejected[i], metrics, totals, log)
            continue
        try:
            # A scorer (a remote one above all) may answer NaN or 1e30: refused here, alone.
            validation.check_group(group, OUTPUT_LIMITS, stage="scored")
        except codec.EntryError as e:
            dead_letter(stage, entry, f"scoring gave an unusable group: {e}", metrics, totals, log)
            continue
        done.append(entry)
        outputs.append((settings.output_stage, group))
    if not done:
        return

    scores = [s for group_scores in scored.scores.values() for s in group_scores]
    newly_scored = len(scored.scores)
    passed_through = len(done) - newly_scored
    errors = sum(s.errors for s in scores)
    timeouts = sum(s.timeouts for s in scores)
    unknown = sum(1 for s in scores if s.unknown_kind)
    stats = {
        "scored": newly_scored,
        "reward_passthrough": passed_through,
        "reward_verifier_errors": errors,
        "reward_timeouts": timeouts,
        "reward_unknown_kind": unknown,
    }
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
    totals.timeouts += timeouts
    totals.unknown_kind += unknown
    logs.event(log, "batch", logging.DEBUG, groups=len(done), scored=newly_scored, completions=len(scores), verifier_errors=errors, timeouts=timeouts)


def run(host: ServiceHost, settings: RewardSettings) -> None:
    """Start the scoring pool and the servers; run the stream loop on this (the main) thread until stopped."""
    metrics = Metrics.register(host.registry)
    readiness = Readiness()
    pool = ScorePool(settings.recipe_source(), settings.score_workers)
    remote = None
    try:
        host.start([grpc_utils.Service(SERVICE_NAME, RewardServicer(pool, metrics), reward_pb2_grpc.add_RewardServicer_to_server)], ready=readiness.get)
        pool.warm_up()
        if settings.scorer_address:
            remote = RemoteScorer.from_settings(settings, on_call=lambda outcome: metrics.scorer_calls.labels(outcome=outcome).inc())
        stream_loop(host, settings, Scorer(local=pool, remote=remote), metrics, readiness)
    finally:
        if remote is not None:
            remote.close()
        pool.close()


def stream_loop(host: ServiceHost, settings: RewardSettings, scorer: Scorer, metrics: Metrics, readiness: Readiness) -> None:
    client = host.connect_redis()
    try:
        stage = host.open_stage(client, SOURCE_STAGE, settings.group)
        readiness.ok, readiness.detail = True, f"reading {stage.stream}"
        host.set_ready(True)
        logs.event(
            host.log,
            "started",
            source=stage.stream,
            output=stage.keys.stream(settings.output_stage),
            group=stage.group,
            consumer=stage.consumer,
            task_kinds=",".join(scorer.local.kinds),
            weights=settings.weights(),
            remote_scorer=settings.scorer_address or "none",
        )

        totals = Totals()
        last_logged = asdict(totals)
        next_housekeeping = time.monotonic() + settings.trim_every_s
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        # Groups read but not yet committed because the remote scorer is unavailable: they
        # stay pending on us (touched, so nobody takes them over) and are tried again first.
        held: list[tuple[Entry, rollout_pb2.RolloutGroup]] = []
        while not host.stop.is_set():
            try:
                if not held:
                    held = read_batch(stage, settings, metrics, totals, host.log)
                if held:
                    with metrics.batch_seconds.time():
                        process_batch(stage, held, settings, scorer, metrics, totals, host.log)
                    held = []
                    metrics.held_groups.set(0)
                if scorer.remote is not None:
                    metrics.scorer_circuit_open.set(1 if scorer.remote.breaker.state == "open" else 0)
                if time.monotonic() >= next_housekeeping:
                    totals.trimmed += stage.trim()
                    next_housekeeping = time.monotonic() + settings.trim_every_s
                if time.monotonic() >= next_progress and asdict(totals) != last_logged:  # quiet while idle
                    last_logged = asdict(totals)
                    next_progress = time.monotonic() + PROGRESS_EVERY_S
                    logs.event(host.log, "progress", **last_logged)
            except ScorerUnavailable as e:
                remote = scorer.remote
                assert remote is not None
                metrics.held_groups.set(len(held))
                metrics.scorer_circuit_open.set(1 if remote.breaker.state == "open" else 0)
                if readiness.ok:
                    logs.event(host.log, "scorer_unavailable", logging.WARNING, held=len(held), error=str(e))
                readiness.ok, readiness.detail = False, f"remote scorer unavailable, holding {len(held)} groups: {e}"
                host.set_ready(False)
                try:
                    stage.touch([entry for entry, _ in held])
                except redis_policy.ERRORS:
                    pass  # Redis trouble is handled on the next turn
                host.stop.wait(max(remote.breaker.retry_in_s(), settings.scorer_backoff_s))
                continue
            except redis_policy.ERRORS as e:
                # Whatever was read and not committed stays pending on us and is read again.
                held = []
                stage.reread_own_pending()
                host.redis.failed(e, "reward loop")
                continue
            host.redis.recovered()
            if not readiness.ok:
                readiness.ok, readiness.detail = True, f"reading {stage.stream}"
                host.set_ready(True)
                logs.event(host.log, "scorer_recovered")
    finally:
        client.close()
