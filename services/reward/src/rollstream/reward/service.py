"""The reward stage: rs:{<run>}:rollouts -> recipes (or a remote scorer) -> rs:{<run>}:scored (or :ready).

Read it top to bottom: `main` loads settings, `run` builds the ServiceHost, starts the scoring
pool and the servers and runs the loop on the main thread (rollstream.core.service), `RewardLoop.turn`
is one turn of it and `RewardLoop.process_batch` one read's worth of work. Every group written downstream is
acknowledged in the same transaction (StreamStage.commit), so a crash at any point loses
nothing; entries a dead consumer left pending are claimed after `claim_idle_ms`.

Scoring (rollstream.reward.scoring) runs every component in the worker processes of a
ScorePool, which kills a worker that runs past the component's time limit; the
`Reward/Score` RPC, on the gRPC server's threads, uses the same pool.

Every group is scored with the answer, metadata and kind of its task as the trainer fed it
(rs:{<run>}:tasks, validation.fetch_tasks), never with what the group says; a group of a
task the trainer did not feed is dead-lettered (RewardLoop.of_known_tasks).

With `scorer_address` set, groups are scored by that remote `Reward/Score` server instead
(rollstream.reward.remote); while it is unavailable the batch is held, pending, and tried
again (never acknowledged with made-up zeros).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass, field

from rollstream.core import grpc_utils, logs, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.service import Every, ServiceHost
from rollstream.core.streams import Entry, StreamStage
from rollstream.reward.config import RewardSettings
from rollstream.reward.recipes import Score
from rollstream.reward.remote import RemoteScorer, ScorerUnavailable
from rollstream.reward.scoring import Metrics, RewardServicer, Scored, ScorePool, Scorer
from rollstream.v1 import reward_pb2_grpc, rollout_pb2

SERVICE_NAME = "rollstream.v1.Reward"
SOURCE_STAGE = "rollouts"
PROGRESS_EVERY_S = 30.0  # the periodic progress line
# Groups read: the structure every stage checks (finite log-probs, lengths that match, the
# completion count the task asked for); written: also rewards finite and bounded, whatever a remote
# scorer answered. Vocabulary bounds are the trainer's and generator's: this service has no model.
LIMITS = validation.Limits()


def main(argv: list[str] | None = None) -> int:
    return run(load_or_exit(RewardSettings, sys.argv[1:] if argv is None else argv))


def run(settings: RewardSettings) -> int:
    with ServiceHost("reward", settings) as host:
        host.install_signal_handlers()
        metrics = Metrics.register(host.registry)
        pool = ScorePool(settings.recipe_source(), settings.score_workers)
        remote = None
        try:
            host.start(
                [
                    grpc_utils.Service(
                        SERVICE_NAME, RewardServicer(pool, metrics), reward_pb2_grpc.add_RewardServicer_to_server
                    )
                ]
            )
            host.set_ready(False, "starting the scoring workers")
            pool.warm_up()
            if settings.scorer_address:
                remote = RemoteScorer.from_settings(
                    settings, on_call=lambda outcome: metrics.scorer_calls.labels(outcome=outcome).inc()
                )
            else:
                pool.check_sandboxes(settings.recipe_specs(), lambda found: say_sandbox_problems(found, host.log))
            client = host.connect_redis()
            try:
                stage = host.open_stage(client, SOURCE_STAGE, settings.group)
                loop = RewardLoop(host, settings, stage, Scorer(local=pool, remote=remote), metrics)
                host.set_ready(True, f"reading {stage.stream}")
                logs.event(
                    host.log,
                    "started",
                    source=stage.stream,
                    output=stage.keys.stream(settings.output_stage),
                    group=stage.group,
                    consumer=stage.consumer,
                    task_kinds=",".join(pool.kinds),
                    weights=settings.weights(),
                    remote_scorer=settings.scorer_address or "none",
                )
                # After Redis trouble the held batch is dropped: its entries are still pending on
                # us and are read again first.
                host.run_loop(stage, loop.turn, "reward loop", on_redis_error=loop.held.clear)
            finally:
                client.close()
        finally:
            if remote is not None:
                remote.close()
            pool.close()
    return 0


def say_sandbox_problems(problems: dict[str, str], log: logging.Logger) -> None:
    """A WARNING for each code task kind whose sandbox cannot run here (k8s/ runs this pod with
    the runtime's default seccomp profile; code tasks need k8s-code-sandbox/, docs/deploy.md)."""
    for kind, why in problems.items():
        logs.event(
            log,
            "code_sandbox_unavailable",
            logging.WARNING,
            task_kind=kind,
            error=why,
            consequence="its completions score 0 (status error)",
        )


@dataclass
class Totals:
    """Running counts for the periodic progress log line."""

    scored: int = 0
    passed_through: int = 0
    verifier_errors: int = 0
    timeouts: int = 0
    trimmed: int = 0


@dataclass
class RewardLoop:
    """What the loop holds between turns. `held`: groups read but not committed because the
    remote scorer is unavailable; they stay pending on us (touched, so nobody takes them
    over) and are tried again first."""

    host: ServiceHost
    settings: RewardSettings
    stage: StreamStage
    scorer: Scorer
    metrics: Metrics
    held: validation.Groups = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)
    scorer_ok: bool = True
    trim: Every = field(init=False)
    progress: Every = field(default_factory=lambda: Every(PROGRESS_EVERY_S))
    # What the last progress line said; it starts at the zero totals so an idle stage stays quiet.
    last_logged: dict[str, int] = field(default_factory=lambda: asdict(Totals()))

    def __post_init__(self) -> None:
        self.trim = Every(self.settings.trim_every_s)

    def turn(self) -> None:
        host = self.host
        recovered = False
        if not self.held:
            self.held.extend(
                self.of_known_tasks(
                    host.read(self.stage, lambda e: validation.parse_group(e, LIMITS, stage="rollouts"))
                )
            )
        if self.held:
            try:
                with host.metrics.batch_seconds.time():
                    self.process_batch(self.held)
            except ScorerUnavailable as e:
                self.hold(e)
                return
            self.held.clear()
            self.metrics.held_groups.set(0)
            recovered = not self.scorer_ok
        if self.scorer.remote is not None:
            self.metrics.scorer_circuit_open.set(1 if self.scorer.remote.breaker.state == "open" else 0)
        # After the gauges: whoever sees /readyz say ready again sees the circuit closed too.
        if recovered:
            self.scorer_ok = True
            host.set_ready(True, f"reading {self.stage.stream}")
            logs.event(host.log, "scorer_recovered")
        if self.trim.due():
            self.totals.trimmed += self.stage.trim()
        if self.progress.due() and asdict(self.totals) != self.last_logged:  # quiet while idle
            self.last_logged = asdict(self.totals)
            logs.event(host.log, "progress", **self.last_logged)

    def of_known_tasks(self, batch: validation.Groups) -> validation.Groups:
        """The groups of `batch` whose task the trainer fed (rs:{<run>}:tasks), each given the
        task's answer, metadata and kind, whatever it said itself: a group is scored against
        what the trainer asked, never against what its writer claims. A group of a task the
        map does not hold is dead-lettered, never scored (docs/security.md, "Forged answers")."""
        if not batch:
            return []
        key = self.stage.keys.tasks
        tasks = validation.fetch_tasks(self.stage.client, key, [g.task_id for _, g in batch])
        known: validation.Groups = []
        for entry, group in batch:
            task = tasks.get(group.task_id)
            if task is None:
                self.stage.dead_letter(entry, validation.unknown_task(group, key))
                continue
            validation.take_task_fields(group, task)
            known.append((entry, group))
        return known

    def hold(self, error: ScorerUnavailable) -> None:
        """The remote scorer is unavailable: not ready, the batch kept pending on us, and a
        wait until the circuit breaker lets a call through again."""
        remote = self.scorer.remote
        assert remote is not None
        self.metrics.held_groups.set(len(self.held))
        self.metrics.scorer_circuit_open.set(1 if remote.breaker.state == "open" else 0)
        if self.scorer_ok:
            logs.event(self.host.log, "scorer_unavailable", logging.WARNING, held=len(self.held), error=str(error))
        self.scorer_ok = False
        self.host.set_ready(False, f"remote scorer unavailable, holding {len(self.held)} groups: {error}")
        self.stage.touch([entry for entry, _ in self.held])
        self.host.stop.wait(max(remote.breaker.retry_in_s(), self.settings.scorer_backoff_s))

    def process_batch(self, batch: validation.Groups) -> None:
        """Score the decoded groups and commit them (output + ack) in one transaction.

        Raises ScorerUnavailable before anything is written: the caller holds the batch."""
        host, stage, metrics, totals = self.host, self.stage, self.metrics, self.totals
        # A group already scored upstream is forwarded as it is only where the operator trusts
        # what writes `rollouts` (trust_scored_rollouts); else its rewards are replaced.
        trusted = self.settings.trust_scored_rollouts
        to_score = {i: group for i, (_, group) in enumerate(batch) if not (group.scored and trusted)}
        scored = self.scorer.score_groups(to_score) if to_score else Scored(scores={}, rejected={})
        done: list[Entry] = []
        outputs: list[tuple[str, rollout_pb2.RolloutGroup]] = []
        tokens = 0  # completion tokens of the groups scored here
        committed_scores: list[list[Score]] = []  # of the groups scored here and committed
        for i, (entry, group) in enumerate(batch):
            if i in scored.rejected:
                stage.dead_letter(entry, scored.rejected[i])
                continue
            try:
                # A scorer (a remote one above all) may answer NaN or 1e30: refused here, alone.
                validation.check_group(group, LIMITS, stage="scored")
            except validation.EntryError as e:
                stage.dead_letter(entry, f"scoring gave an unusable group: {e}")
                continue
            done.append(entry)
            outputs.append((self.settings.output_stage, group))
            if i in scored.scores:
                tokens += sum(len(c.token_ids) for c in group.completions)
                committed_scores.append(scored.scores[i])
        if not done:
            return

        # Counted over what is committed: a group scored here, then dead-lettered for what its
        # scores hold, is neither scored nor passed through.
        scores = [s for group_scores in committed_scores for s in group_scores]
        newly_scored = len(committed_scores)
        passed_through = len(done) - newly_scored
        errors = sum(s.errors for s in scores)
        timeouts = sum(s.timeouts for s in scores)
        # No unknown_kind here: the Scorer dead-letters a kind no recipe knows (a remote scorer rejects it).
        stats = {
            "scored": newly_scored,
            "reward_passthrough": passed_through,
            "reward_verifier_errors": errors,
            "reward_timeouts": timeouts,
        }

        def count_in_redis(ops: streams.Ops) -> None:
            for name, n in stats.items():
                if n:
                    ops.hincrby(stage.counters, name, n)

        stage.commit(done, outputs=outputs, extra=count_in_redis)

        # Counted only once committed, so the metrics agree with what reached the stream.
        metrics.groups.labels(outcome="scored").inc(newly_scored)
        metrics.groups.labels(outcome="passed_through").inc(passed_through)
        metrics.completions.inc(len(scores))
        metrics.tokens.inc(tokens)
        metrics.count_scores(scores)
        if scores:
            metrics.reward_mean.set(sum(s.reward for s in scores) / len(scores))
        totals.scored += newly_scored
        totals.passed_through += passed_through
        totals.verifier_errors += errors
        totals.timeouts += timeouts
        groups = [g for _, g in outputs]
        logs.event(
            host.log,
            "groups_scored",
            n=len(done),
            scored=newly_scored,
            completions=len(scores),
            verifier_errors=errors,
            timeouts=timeouts,
            reward=round(sum(s.reward for s in scores) / len(scores), 4) if scores else None,
            versions=",".join(sorted({str(g.policy_version) for g in groups})),
            groups=logs.group_ids(groups),
        )
