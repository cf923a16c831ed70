"""The reward stage: rs:{<run>}:rollouts -> recipes (or a remote scorer) -> rs:{<run>}:scored (or :ready).

Read it top to bottom: `main` loads settings and starts the servers, `run` starts the
stream loop and then serves scoring work on the main thread, `stream_loop` is the loop,
`process_batch` is one read's worth of work. Every group written downstream is
acknowledged in the same transaction (StreamStage.commit), so a crash at any point loses
nothing; entries a dead consumer left pending are claimed after `claim_idle_ms`.

Threads: component time limits are SIGALRM, which only the main thread receives
(rollstream.reward.limits), so the main thread does all local scoring; the stream loop
runs in its own thread and hands scoring to it, and so does the `Reward/Score` RPC, which
serves the same recipes to anyone else (evaluation scripts, another reward stage).

With `scorer_address` set, groups are scored by that remote `Reward/Score` server instead
(rollstream.reward.remote); while it is unavailable the batch is held, pending, and tried
again (never acknowledged with made-up zeros).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.core import codec, grpc_utils, logs, redis_policy, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.service import ServiceHost, StageMetrics
from rollstream.core.streams import Entry, StreamStage
from rollstream.reward.config import RewardSettings
from rollstream.reward.limits import MainThreadRunner
from rollstream.reward.recipes import OK, TIMEOUT, ComponentResult, Recipes, Sample, Score
from rollstream.reward.remote import CircuitBreaker, RemoteScorer, ScorerRejected, ScorerUnavailable
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

SERVICE_NAME = "rollstream.v1.Reward"
SOURCE_STAGE = "rollouts"
PROGRESS_EVERY_S = 30.0  # the periodic progress line
# Groups read: the structure every stage checks (finite log-probs, lengths that match, the
# completion count the task asked for). Vocabulary bounds are the trainer's and
# generator's business: this service has no model (and no torch).
INPUT_LIMITS = validation.Limits()
# Groups written: rewards finite and bounded, whatever a remote scorer answered.
OUTPUT_LIMITS = validation.Limits()
# A Score RPC without a deadline still gets an answer or an error within this.
RPC_DEFAULT_TIMEOUT_S = 300.0


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_or_exit(RewardSettings, list(argv) if argv is not None else sys.argv[1:])
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
    timeouts: Counter
    unknown_kind: Counter
    dead_lettered: Counter
    batch_seconds: Histogram
    redelivered: Counter
    rpc_items: Counter
    scorer_calls: Counter
    scorer_circuit_open: Gauge
    held_groups: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry, stage: StageMetrics) -> "Metrics":
        p = "rollstream_reward_"
        return cls(
            groups=Counter(p + "groups", "groups written downstream, by outcome", ["outcome"], registry=registry),
            completions=Counter(p + "completions", "completions scored from the stream", registry=registry),
            reward_mean=Gauge(p + "batch_reward_mean", "mean reward of the completions in the last scored batch", registry=registry),
            verifier_errors=Counter(p + "verifier_errors", "components whose check failed, by component", ["component"], registry=registry),
            timeouts=Counter(p + "timeouts", "components that ran out of time, by component", ["component"], registry=registry),
            unknown_kind=Counter(p + "unknown_task_kind", "completions of a task kind no recipe knows", registry=registry),
            dead_lettered=stage.dead_lettered,
            batch_seconds=stage.batch_seconds,
            redelivered=stage.redelivered,
            rpc_items=Counter(p + "rpc_items", "items scored through the Score RPC", registry=registry),
            scorer_calls=Counter(p + "scorer_calls", "calls to the remote scorer, by outcome", ["outcome"], registry=registry),
            scorer_circuit_open=Gauge(p + "scorer_circuit_open", "1 while the remote scorer's circuit breaker is open", registry=registry),
            held_groups=Gauge(p + "held_groups", "groups held pending while the remote scorer is unavailable", registry=registry),
        )

    def count_scores(self, scores: Sequence[Score]) -> None:
        for s in scores:
            if s.unknown_kind:
                self.unknown_kind.inc()
                continue
            for c in s.components:
                if c.status == TIMEOUT:
                    self.timeouts.labels(component=c.name).inc()
                elif c.failed:
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
    timeouts: int = 0
    unknown_kind: int = 0
    trimmed: int = 0


# -- scoring ------------------------------------------------------------------------------


def to_pb(component: ComponentResult) -> rollout_pb2.RewardComponent:
    return rollout_pb2.RewardComponent(name=component.name, value=component.value, weight=component.weight, status=component.status)


def from_pb(score: reward_pb2.ItemScore) -> Score:
    """A remote scorer's answer in our terms (its statuses are counted like ours)."""
    components = tuple(ComponentResult(name=c.name, value=c.value, weight=c.weight, status=c.status or OK) for c in score.components)
    return Score(reward=score.reward, components=components)


def samples(group: rollout_pb2.RolloutGroup) -> list[Sample]:
    return [
        Sample(completion=c.text, answer=group.answer, metadata_json=group.metadata_json, num_tokens=len(c.token_ids))
        for c in group.completions
    ]


def apply_scores(group: rollout_pb2.RolloutGroup, scores: Sequence[Score]) -> None:
    """Fill every completion's reward and breakdown in place (replacing stale ones); mark the group scored."""
    for completion, s in zip(group.completions, scores, strict=True):
        completion.reward = s.reward
        del completion.reward_components[:]
        completion.reward_components.extend(to_pb(c) for c in s.components)
    group.scored = True


def score_group(group: rollout_pb2.RolloutGroup, recipes: Recipes) -> list[Score]:
    """Score every completion of `group` with its task kind's recipe, in place."""
    scores = [recipes.score(group.task_kind, s) for s in samples(group)]
    apply_scores(group, scores)
    return scores


def score_items(items: Sequence[reward_pb2.ScoreItem], recipes: Recipes) -> list[Score]:
    return [
        recipes.score(
            item.task_kind,
            Sample(
                completion=item.completion, answer=item.answer, metadata_json=item.metadata_json,
                num_tokens=item.num_tokens if item.HasField("num_tokens") else None,
            ),
        )
        for item in items
    ]


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """`Score`: the recipes over gRPC, item by item, in request order (run on the main thread)."""

    def __init__(self, recipes: Recipes, runner: MainThreadRunner, metrics: Metrics):
        self.recipes = recipes
        self.runner = runner
        self.metrics = metrics

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        remaining = context.time_remaining()
        timeout = RPC_DEFAULT_TIMEOUT_S if remaining is None else max(0.0, remaining)
        try:
            scores = self.runner.call(lambda: score_items(request.items, self.recipes), timeout_s=timeout)
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "scoring did not finish before the deadline")
        self.metrics.rpc_items.inc(len(scores))
        self.metrics.count_scores(scores)
        return reward_pb2.ScoreResponse(
            scores=[reward_pb2.ItemScore(reward=s.reward, components=[to_pb(c) for c in s.components]) for s in scores]
        )


@dataclass
class Scored:
    """What scoring a batch gave: the scores of each group scored (by position in the
    batch), and the reason for each group a remote scorer rejected."""

    scores: dict[int, list[Score]]
    rejected: dict[int, str]


@dataclass
class Scorer:
    """How the stream loop scores: the recipes on the main thread, or a remote scorer."""

    recipes: Recipes
    runner: MainThreadRunner
    remote: RemoteScorer | None

    def score_groups(self, groups: dict[int, rollout_pb2.RolloutGroup]) -> Scored:
        """Score `groups` (position in the batch -> group) in place. Raises
        ScorerUnavailable when they must be held: nothing has been written then (a group
        already scored in place is simply scored again on the retry)."""
        if self.remote is None:
            scores = self.runner.call(lambda: {i: score_group(g, self.recipes) for i, g in groups.items()})
            return Scored(scores=scores, rejected={})
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
                group_id=g.group_id, completion_index=k, task_kind=g.task_kind, completion=c.text, answer=g.answer,
                metadata_json=g.metadata_json, num_tokens=len(c.token_ids), finish_reason=c.finish_reason,
            )
            for g in groups.values()
            for k, c in enumerate(g.completions)
        ]
        replies = iter(self.remote.score(items))  # raises before any group is changed
        out = {}
        for i, g in groups.items():
            out[i] = [from_pb(next(replies)) for _ in g.completions]
            apply_scores(g, out[i])
        return out


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


def make_remote(settings: RewardSettings, stop: threading.Event, metrics: Metrics) -> RemoteScorer | None:
    if not settings.scorer_address:
        return None
    return RemoteScorer(
        settings.scorer_address,
        batch_size=settings.scorer_batch_size,
        deadline_s=settings.scorer_deadline_s,
        retries=settings.scorer_retries,
        backoff_s=settings.scorer_backoff_s,
        backoff_max_s=settings.scorer_backoff_max_s,
        breaker=CircuitBreaker(settings.scorer_breaker_failures, settings.scorer_breaker_cooldown_s),
        wait=stop.wait,
        on_call=lambda outcome: metrics.scorer_calls.labels(outcome=outcome).inc(),
        creds=ClientCredentials.from_settings(settings),
    )


def run(host: ServiceHost, settings: RewardSettings) -> None:
    """Start the servers and the stream loop; serve scoring on this (the main) thread until the loop ends."""
    metrics = Metrics.register(host.registry, host.metrics)
    readiness = Readiness()
    runner = MainThreadRunner()
    recipes = settings.build_recipes()
    servicer = RewardServicer(recipes, runner, metrics)
    host.start([grpc_utils.Service(SERVICE_NAME, servicer, reward_pb2_grpc.add_RewardServicer_to_server)])
    scorer = Scorer(recipes=recipes, runner=runner, remote=make_remote(settings, host.stop, metrics))
    failure: list[BaseException] = []

    def loop_thread() -> None:
        try:
            stream_loop(host, settings, scorer, metrics, readiness)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread below
            failure.append(e)
            host.stop.set()

    thread = threading.Thread(target=loop_thread, name="stream-loop", daemon=True)
    thread.start()
    try:
        runner.serve(until=lambda: not thread.is_alive())
    finally:
        host.stop.set()
        thread.join()
        if scorer.remote is not None:
            scorer.remote.close()
    if failure:
        raise failure[0]


def stream_loop(host: ServiceHost, settings: RewardSettings, scorer: Scorer, metrics: Metrics, readiness: Readiness) -> None:
    client = host.connect_redis()
    try:
        stage = host.open_stage(client, SOURCE_STAGE, settings.group)
        readiness.ok, readiness.detail = True, f"reading {stage.stream}"
        host.set_ready(True, readiness.detail)
        logs.event(
            host.log,
            "started",
            source=stage.stream,
            output=stage.keys.stream(settings.output_stage),
            group=stage.group,
            consumer=stage.consumer,
            task_kinds=",".join(scorer.recipes.kinds),
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
                host.set_ready(False, readiness.detail)
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
                host.set_ready(True, readiness.detail)
                logs.event(host.log, "scorer_recovered")
    finally:
        client.close()
