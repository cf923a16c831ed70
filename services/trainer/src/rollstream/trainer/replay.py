"""Replaying the trained log after a resume: the steps trained after the checkpoint the
trainer restarted from, trained again in order (service.py calls it once, before the loop);
where the log ends, which each checkpoint records as what it has trained through; and the
checkpoint between steps that records it (and trims the log to what a resume may replay)."""

from __future__ import annotations

import logging
from pathlib import Path

import redis

from rollstream.core import logs, redis_policy, run_keys, streams, validation
from rollstream.core.service import ServiceHost
from rollstream.trainer.trainer import Trainer
from rollstream.v1 import rollout_pb2


def replay_trained_log(
    trainer: Trainer, host: ServiceHost, client: redis_policy.Client, stage: streams.StreamStage
) -> None:
    """Train again, step by step and in their order, the groups trained after the checkpoint
    we resumed from (their acknowledgements outlived the update they fed, which died with
    the process). Same groups, same optimizer state and RNG: the same weights, bit for bit.
    The run's step is the trainer's own counter (`stage.counters`, its hash alone)."""
    keys = stage.keys
    logged = host.redis.call(lambda: client.xrange(keys.trained_log), "reading the trained log")
    steps: dict[int, list[rollout_pb2.RolloutGroup]] = {}
    for eid, fields in logged:
        try:
            step = int(fields.get(b"step", b""))
            if step > trainer.step:
                steps.setdefault(step, []).append(validation.decode(fields, rollout_pb2.RolloutGroup))
        except (ValueError, validation.EntryError) as e:  # not written by a trainer: say so, skip it
            logs.event(host.log, "trained_log_entry_unreadable", logging.ERROR, entry=eid.decode(), error=str(e))
    replayed = 0
    for step in sorted(steps):
        if step != trainer.step + 1:
            logs.event(
                host.log,
                "trained_log_gap",
                logging.ERROR,
                expected=trainer.step + 1,
                found=step,
                note="replay stops here",
            )
            break
        trainer.replay_step(steps[step])
        replayed += 1
    try:
        run_step = int(host.redis.call(lambda: client.hget(stage.counters, "step"), "reading the run's step") or 0)
    except (redis.ResponseError, ValueError) as e:
        # Not the trainer's writing (an operator's mistake): no lost steps can be told, and no
        # crash loop for it. The next step's commit writes the field again, or, the key being
        # of another type, is refused (not ready) until it is fixed.
        logs.event(host.log, "run_step_unreadable", logging.ERROR, key=stage.counters, error=str(e)[:200])
        run_step = trainer.step
    lost = run_step - trainer.step
    if lost > 0:
        # Resumed from an older checkpoint than the latest: those steps' groups stay counted
        # as trained, but their updates are not in these weights. Say so, loudly.
        counted = streams.Ops()
        counted.hincrby(stage.counters, "steps_lost_on_resume", lost)
        stage.apply(counted)
        logs.event(
            host.log, "steps_not_replayable", logging.ERROR, run_step=run_step, resumed_step=trainer.step, lost=lost
        )
    if replayed:
        logs.event(host.log, "replayed_trained_log", steps=replayed, step=trainer.step, version=trainer.version)


def trained_log_end(client: redis_policy.Client, keys: run_keys.RunKeys) -> str:
    """The id of the trained log's last entry ("" when empty): what a checkpoint has trained
    through, and where a resume's replay starts after."""
    last = client.xrevrange(keys.trained_log, count=1)
    return last[0][0].decode() if last else ""


def save_checkpoint(
    trainer: Trainer,
    host: ServiceHost,
    client: redis_policy.Client,
    keys: run_keys.RunKeys,
    prompts_fed: int,
    consumer: str,
    path: str,
) -> tuple[Path, int]:
    """A checkpoint between steps, recording where the trained log ends; its path and version.
    `path` empty: the trainer's own, checkpoint_dir/step-N, what a restart resumes from: the
    folder is pruned to keep_checkpoints and the trained log trimmed to what a resume may still
    replay. Else one SaveCheckpoint asked for, already confined to checkpoint_dir and outside
    the trainer's names: the operator's, written once, never pruned, never resumed from unless
    named."""
    if not path and not trainer.settings.checkpoint_dir:
        raise ValueError("no checkpoint path given and no checkpoint_dir configured")
    log_end = host.redis.call(lambda: trained_log_end(client, keys), "reading the trained log's end")
    if path:
        saved = trainer.save_checkpoint(Path(path), prompts_fed=prompts_fed, consumer=consumer, trained_log_id=log_end)
        return saved, trainer.version

    def trim_log(through: str) -> None:
        ms, seq = run_keys.id_tuple(through)
        host.redis.call(
            lambda: client.xtrim(keys.trained_log, minid=f"{ms}-{seq + 1}", approximate=False),
            "trimming the trained log",
        )

    return trainer.save_own_checkpoint(prompts_fed, consumer, log_end, trim_log), trainer.version
