"""The trainer service: feed prompts, collect scored groups, GRPO step, publish, push.

One loop, top to bottom:
  1. top up rs:{<run>}:prompts to `prompt_buffer` tasks;
  2. read rs:{<run>}:ready; drop duplicates (group_id already trained) and groups more than
     `max_staleness` versions old (counted, acknowledged); dead-letter groups that do not
     answer a task of the trainer's task map as they say, or whose text is not their tokens;
  3. with `groups_per_step` groups: one GRPO step (step.py: advantages, the policy loss
     over token-budget micro-batches, backward, AdamW on the host masters) -> new bf16
     weights (version + 1); with LoRA the published weights are the merged ones (lora.py),
     and with kl_reference = lora_base the KL's pi_ref is the same model with its adapters off;
  4. encode the exact delta, then in one transaction: ack the groups, record them as trained,
     set the version, append the step's metrics; then push it to every generator in the
     background (the next step trains meanwhile; its commit waits for this push first);
  5. every `checkpoint_every` steps, and on SaveCheckpoint, a checkpoint (checkpoint.py);
  6. held-out evaluation (evaluation.py): a round fed before the first step, every `eval_every`
     steps (in the step's commit) and after the last; its groups, which the task map says are
     evaluation groups, are recorded and acknowledged, never trained; a run ends once its last
     round is reported.
`--resume` restores one, trains again the groups logged as trained after it (replay.py: so a crash
loses no trained work), moves the run's version to it and pushes its anchor.
Redis trouble never ends the loop: it waits (rollstream.core.redis_policy), and from the
step on it only retries, since the update exists and its groups must be acknowledged.
A non-finite loss or gradient norm applies and publishes nothing; the groups that make it
non-finite on their own go to the dead letters with the reason, and the step's other groups
stay in the batch for the next step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.core import logs, redis_policy, run_keys, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.grpc_utils import Service
from rollstream.core.service import ServiceHost
from rollstream.trainer import checkpoint, export, follower, pipeline_view, ranks, replay, servicer
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.evaluation import Evaluator
from rollstream.trainer.fleet import GeneratorDirectory
from rollstream.trainer.optimizer import NonFiniteStep
from rollstream.trainer.prompts import PromptFeeder, chat_encoder, check_answers
from rollstream.trainer.push import PushOutcome
from rollstream.trainer.servicer import CheckpointRequests
from rollstream.trainer.trackers import Reports, Trackers, run_config
from rollstream.trainer.trainer import Trainer
from rollstream.v1 import rollout_pb2, trainer_pb2_grpc


class StepNotRecorded(RuntimeError):
    """A step applied in memory whose commit Redis refused for good: the process ends (not a
    Redis error, so no loop catches it)."""


def main(argv: list[str] | None = None) -> int:
    return run(load_or_exit(TrainerSettings, sys.argv[1:] if argv is None else argv))


def run(settings: TrainerSettings) -> int:
    """The trainer: one process, or under torchrun N ranks (ranks.py), rank 0 this service and
    the others its followers (follower.py)."""
    team = ranks.Ranks.from_env(settings)
    if team is None:
        with ServiceHost("trainer", settings) as host:
            host.install_signal_handlers()
            serve(settings, host, Trainer(settings, host))
        return 0
    if not team.lead_rank:
        return follower.run(settings, team)
    try:
        with ServiceHost("trainer", settings) as host:
            host.install_signal_handlers()
            serve(settings, host, Trainer(settings, host, team))
    except BaseException:  # noqa: BLE001 - printed, then this rank exits 1 and torchrun ends the others
        traceback.print_exc()
        ranks.leave(1, together=False)
    team.lead("stop")
    ranks.leave(0)
    return 0


def serve(settings: TrainerSettings, host: ServiceHost, trainer: Trainer) -> None:
    """Serve gRPC and train until done or stopped (launcher/colocated.py builds the trainer first)."""
    restored = trainer.restored
    if restored is not None and restored.consumer and not settings.consumer and restored.run == settings.run:
        # Resume as the same consumer: the entries it held come back to it first.
        settings = settings.model_copy(update={"consumer": restored.consumer})
    directory = GeneratorDirectory(settings.generators, dns_name=settings.generators_dns)
    checkpoints = CheckpointRequests()
    view = pipeline_view.install(settings, host) if settings.dashboard else None
    host.start(
        [
            Service(
                "rollstream.v1.Trainer",
                servicer.TrainerServicer(trainer, directory, checkpoints),
                trainer_pb2_grpc.add_TrainerServicer_to_server,
            )
        ]
    )
    client = host.connect_redis()
    # report_to; a tracker that fails is turned off, never raised
    reports = Reports(settings.run, settings.metrics_file, host.log, Trackers.from_settings(settings, settings.run))
    try:
        reports.trackers.log_config(run_config(settings))
        keys = run_keys.RunKeys(settings.run)
        stage = host.open_stage(client, "ready", settings.group)
        fed = host.redis.call(
            lambda: PromptFeeder.position(client, keys, restored.prompts_fed if restored else 0),
            "reading the feeder's position",
        )
        encode = chat_encoder(trainer.tokenizer)
        feeder = PromptFeeder(settings, client, stage, fed, encode)
        evaluator = host.redis.call(lambda: Evaluator(settings, client, stage, encode), "reading the evaluation rounds")
        loop = TrainerLoop(trainer, host, client, keys, stage, feeder, evaluator, directory, checkpoints, reports)
        # Who reads a delta, before the first step (replayed ones too): with none, none is encoded.
        trainer.publisher.readers.saw(loop.push_targets(), directory.from_registry)
        # Also without a checkpoint: a trainer killed before its first one starts from the
        # model again, and the steps it trained are replayed from there.
        replay.replay_trained_log(trainer, host, client, stage)
        # After a resume this moves the version back; generators ahead of it get the anchor.
        host.redis.call(lambda: client.set(keys.version, trainer.version), "setting the version")
        # For `rollstream status`: this many groups pending on the trainer is a step in progress.
        recorded = streams.Ops()
        recorded.hset(stage.counters, "groups_per_step", settings.groups_per_step)
        stage.apply(recorded)
        host.set_ready(True, f"training from {stage.stream}")
        if restored is not None:
            trainer.push_anchor(loop.push_targets(), directory.from_registry)
        # After Redis trouble the batch is kept: its entries are still pending on us, and
        # when they are read again `turn` skips them.
        # Stopped in the middle of a turn (a stopping service's Redis calls raise Stopped) is
        # a stop like any other: the run still ends with finish (the export).
        with contextlib.suppress(redis_policy.Stopped):
            host.run_loop(stage, loop.turn, "trainer loop", until=loop.finished)
        loop.finish()
    finally:
        reports.trackers.close()
        checkpoints.close()
        trainer.close()
        client.close()
        if view is not None:
            view.close()


@dataclass
class TrainerLoop:
    """What the loop holds between turns: the trainer, its Redis side, and the groups read
    and not yet trained (`batch`: ours, pending, until committed)."""

    trainer: Trainer
    host: ServiceHost
    client: redis_policy.Client
    keys: run_keys.RunKeys
    stage: streams.StreamStage
    feeder: PromptFeeder
    evaluator: Evaluator
    directory: GeneratorDirectory
    checkpoints: CheckpointRequests
    reports: Reports  # steps.jsonl and the trackers: each step's figures, each evaluation round's
    batch: validation.Groups = field(default_factory=list)

    def turn(self) -> None:
        """Serve checkpoint requests, feed prompts, read ready groups into the batch, and train
        once it holds a step's worth."""
        trainer, s, keys = self.trainer, self.trainer.settings, self.keys
        self.checkpoints.serve(self.save)
        if self.evaluator.due(trainer.step):  # before the first step (the others are fed with their step's commit)
            ops = streams.Ops()
            self.evaluator.feed(ops, trainer.step, trainer.version)
            self.stage.apply(ops)
        if not self.trained_enough():
            self.feeder.top_up(trainer.version)
        held_ids = {e.id for e, _ in self.batch}
        new: validation.Groups = []
        for entry, group in self.host.read(
            self.stage, lambda e: validation.parse_group(e, trainer.limits, stage="ready", need_ref=trainer.need_ref)
        ):
            if entry.id in held_ids:
                continue  # already held (re-read after a failed call): not a duplicate group
            seen = group.group_id in {g.group_id for _, g in self.batch} or group.group_id in {
                g.group_id for _, g in new
            }
            # Evaluated too: a copy arriving after its round was reported (its task gone from the map) is no dead letter.
            finished = any(
                self.client.sismember(keys.groups(outcome), group.group_id)
                for outcome in ("trained", "stale", "evaluated")
            )
            if seen or finished:
                self.stage.commit([entry], extra=lambda ops: ops.hincrby(self.stage.counters, "duplicates", 1))
                trainer.count_dropped("duplicate", 1)
                continue
            new.append((entry, group))
        kept, evals = check_answers(self.client, self.stage, keys, new, trainer.version, self.stale, self.decode)
        self.evaluator.take(evals)
        self.batch.extend(kept)
        self.report_evals()
        self.drop_stale()
        if len(self.batch) < s.groups_per_step or self.trained_enough():
            self.stage.touch([e for e, _ in self.batch])  # still ours: keep other consumers off them
            return
        taken = self.batch[: s.groups_per_step]
        with self.host.metrics.batch_seconds.time():
            trained = self.train_and_commit(taken)
        if not trained:
            return  # refused: its culprits left the batch; the others wait for the next step
        del self.batch[: s.groups_per_step]
        if s.checkpoint_every and self.trainer.step % s.checkpoint_every == 0:
            self.save_periodic()

    def trained_enough(self) -> bool:
        """The last step trained (eval_only: nothing to train)."""
        s = self.trainer.settings
        return s.eval_only or (s.steps > 0 and self.trainer.step >= s.steps)

    def finished(self) -> bool:
        """The last step trained and the last evaluation round fed and reported."""
        return self.trained_enough() and not self.evaluator.due(self.trainer.step) and not self.evaluator.waiting()

    def finish(self) -> None:
        """After the loop: the final checkpoint of a finished run; with linger, checkpoints still served."""
        s = self.trainer.settings
        self.count_pushes(
            self.trainer.publisher.pushes.wait()
        )  # the last step's push, counted as the others are at the next commit
        logs.event(self.host.log, "training_finished", steps=self.trainer.step, version=self.trainer.version)
        if self.trained_enough() and s.checkpoint_dir and not s.eval_only:
            # A finished run keeps its final state as a checkpoint, not only in the trained log.
            newest = checkpoint.scan(Path(s.checkpoint_dir)).latest
            if newest is None or newest.state.step != self.trainer.step:
                self.save_periodic()
        export.export_at_end(self.trainer, self.host.log)
        if s.linger:
            while not self.host.stop.wait(0.2):
                self.checkpoints.serve(self.save)

    def count_pushes(self, outcomes: list[PushOutcome]) -> None:
        """A push's outcomes in the ledger where no step's commit carries them (the last one)."""
        if not outcomes:
            return
        applied = sum(o.applied for o in outcomes)

        def ledger(ops: streams.Ops) -> None:
            ops.hincrby(self.stage.counters, "pushes_applied", applied)
            ops.hincrby(self.stage.counters, "pushes_not_applied", len(outcomes) - applied)

        with contextlib.suppress(
            *redis_policy.ERRORS, redis_policy.Stopped
        ):  # counts, not the run's state: never worth the export after them
            self.stage.commit([], extra=ledger)

    def drop_stale(self) -> None:
        """Acknowledge and count groups sampled more than max_staleness versions ago, and groups
        from a version this trainer has not published (sampled before it resumed from an
        earlier checkpoint: that lineage was abandoned)."""
        trainer, keys = self.trainer, self.keys
        stale = [(e, g) for e, g in self.batch if self.stale(g)]
        if not stale:
            return

        def ledger(ops: streams.Ops) -> None:
            ops.sadd(keys.groups("stale"), *[g.group_id for _, g in stale])
            ops.hincrby(self.stage.counters, "stale", len(stale))

        self.stage.commit([e for e, _ in stale], extra=ledger)
        dropped = {e.id for e, _ in stale}
        self.batch[:] = [(e, g) for e, g in self.batch if e.id not in dropped]
        trainer.count_dropped("stale", len(stale))

    def stale(self, group: rollout_pb2.RolloutGroup) -> bool:
        """Sampled more than max_staleness versions ago, or by a version this trainer has not
        published (before it resumed from an earlier checkpoint: that lineage was abandoned)."""
        return not 0 <= self.trainer.version - group.policy_version <= self.trainer.settings.max_staleness

    def decode(self, ids: Sequence[int]) -> str:
        """A group's tokens as the text the reward scored (check_answers compares them)."""
        return str(self.trainer.tokenizer.decode(list(ids), skip_special_tokens=True))

    def report_evals(self) -> None:
        """Report the evaluation rounds that are complete or waited eval_timeout_s: in the evals
        stream (evaluator), then the step log, Prometheus, the trackers and the log."""
        for m in self.evaluator.report_ready():
            self.reports.evaluated(m, self.trainer.metrics)

    def train_and_commit(self, taken: validation.Groups) -> bool:
        """One step on `taken`, pushed to the generators, then acknowledged with the ledger in one script;
        True once committed, False when the step was refused (refuse_step). From the step on, Redis trouble
        is waited out (host.redis.call, commit's own retries), never raised: the update exists, so its groups must be acknowledged."""
        trainer, keys, counters = self.trainer, self.keys, self.stage.counters
        groups = [g for _, g in taken]
        log_trained = bool(trainer.settings.checkpoint_dir)  # replayed on resume; without checkpoints nothing resumes

        def record(metrics: rollout_pb2.StepMetrics, outcomes: list[PushOutcome]) -> None:
            applied = sum(o.applied for o in outcomes)

            def ledger(ops: streams.Ops) -> None:
                ops.sadd(keys.groups("trained"), *[g.group_id for g in groups])
                ops.hincrby(counters, "trained", len(groups))
                ops.hincrby(counters, "pushes_applied", applied)
                ops.hincrby(counters, "pushes_not_applied", len(outcomes) - applied)
                ops.hset(counters, "step", trainer.step)
                ops.set(keys.version, trainer.version)
                ops.xadd(keys.metrics, validation.encode(metrics), maxlen=100_000, approximate=True)
                if self.evaluator.due(trainer.step):  # with the version it evaluates: generators see both at once
                    self.evaluator.feed(ops, trainer.step, trainer.version)
                if log_trained:
                    for entry, _ in taken:
                        ops.xadd(
                            keys.trained_log, {"step": trainer.step, **{k.decode(): v for k, v in entry.fields.items()}}
                        )

            try:
                self.stage.commit([e for e, _ in taken], extra=ledger)
            except redis_policy.ERRORS as e:
                # Neither transient nor a refusal of the script's checks (a key of the wrong type,
                # a counter that is not an integer: both waited out inside commit, nothing
                # written): Redis failed the record itself. The update must not live on without it, or its
                # groups, still pending, would be trained a second time: end the process; the
                # restart resumes from the checkpoint and trains them once.
                raise StepNotRecorded(f"step {trainer.step}: Redis refused its commit ({redis_policy.short(e)})") from e

        try:
            metrics, stats, _ = trainer.train_and_push(groups, self.push_targets, self.directory.from_registry, record)
        except NonFiniteStep as e:
            self.refuse_step(taken, e)
            return False
        self.reports.step(metrics, trainer.last_phases, trainer.last_skipped, trainer.last_reanchor)
        with contextlib.suppress(*redis_policy.ERRORS):
            self.stage.trim()  # housekeeping: the next step tries again
        logs.event(
            self.host.log,
            "step",
            step=trainer.step,
            version=trainer.version,
            reward=round(metrics.reward_mean, 4),
            loss=round(metrics.loss, 5),
            clip=round(metrics.clip_fraction, 4),
            staleness=round(metrics.mean_staleness, 2),
            seconds=round(metrics.step_seconds, 2),
            delta_kb=stats.nbytes // 1024,
            delta_pct=round(100 * stats.fraction_of_dense, 2),
            **({"delta_skipped": trainer.last_skipped} if trainer.last_skipped else {}),  # type: ignore[arg-type]  # a field, never `level`
            tis_truncated=round(trainer.last_truncated_fraction, 4),
            zero_var=metrics.zero_variance_groups,
            groups=logs.group_ids(groups),
        )
        return True

    def refuse_step(self, taken: validation.Groups, error: NonFiniteStep) -> None:
        """A step refused for a non-finite loss or gradient norm (nothing applied or
        published): the groups that make it non-finite on their own go to the dead letters
        with the reason and leave the batch; the others stay in it, pending on us, for the
        next step. Values inside validation's bounds can still overflow together (a ratio
        of 1e37 times an advantage); when no group does it alone, the step's groups all go."""
        trainer, host = self.trainer, self.host
        step = trainer.step + 1
        culprits = trainer.nonfinite_groups([g for _, g in taken])
        if culprits:
            refused = {
                taken[k][0].id: f"step {step} refused: on its own this group's {why}; nothing applied or published"
                for k, why in culprits.items()
            }
        else:
            refused = {
                e.id: f"step {step} refused: {error}, and no group of it alone: all {len(taken)} refused; nothing applied or published"
                for e, _ in taken
            }
        for entry, _ in taken:
            if entry.id in refused:
                self.stage.dead_letter(entry, refused[entry.id])
        self.batch[:] = [(e, g) for e, g in self.batch if e.id not in refused]
        counted = streams.Ops()
        counted.hincrby(self.stage.counters, "nonfinite_steps", 1)
        self.stage.apply(counted)
        logs.event(
            host.log,
            "step_refused",
            logging.ERROR,
            reason=str(error),
            groups=len(taken),
            refused=len(refused),
            refused_groups=logs.group_ids(g for e, g in taken if e.id in refused),
        )

    def save(self, path: str) -> tuple[Path, int]:
        """A checkpoint between steps, the trainer's own (`path` empty) or one SaveCheckpoint
        asked for (replay.save_checkpoint); its path and version."""
        fed, consumer = self.feeder.fed, self.stage.consumer
        return replay.save_checkpoint(self.trainer, self.host, self.client, self.keys, fed, consumer, path)

    def save_periodic(self) -> None:
        """The trainer's own checkpoint now. A full or failing disk must not stop training:
        the trained log keeps every step since the last good checkpoint, so a restart still
        loses nothing. Said loudly."""
        try:
            self.save("")
        except OSError as e:
            logs.event(self.host.log, "checkpoint_failed", logging.ERROR, step=self.trainer.step, error=str(e))

    def push_targets(self) -> list[str]:
        """The generators to push to, waiting out Redis trouble; a registry key someone
        overwrote (a lasting error) means: push where we pushed last."""
        try:
            return self.host.redis.call(lambda: self.directory.addresses(self.client, self.keys), "listing generators")
        except redis_policy.ERRORS as e:
            logs.event(
                self.host.log,
                "generator_registry_unreadable",
                logging.ERROR,
                error=redis_policy.short(e),
                pushing_to=len(self.directory.last),
            )
            return self.directory.last
