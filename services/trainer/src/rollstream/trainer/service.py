"""The trainer service: feed prompts, collect scored groups, GRPO step, publish, push.

One loop, top to bottom:
  1. top up rs:{<run>}:prompts to `prompt_buffer` tasks;
  2. read rs:{<run>}:ready; drop duplicates (group_id already trained) and groups more than
     `max_staleness` versions old (counted, acknowledged);
  3. with `groups_per_step` groups: one GRPO step (step.py: advantages, the policy loss
     over token-budget micro-batches, backward, AdamW on the host masters) -> new bf16
     weights (version + 1); with LoRA the published weights are the merged ones (lora.py),
     and with kl_reference = lora_base the KL's pi_ref is the same model with its adapters off;
  4. encode the exact delta, push it to every generator, then in one transaction: ack the
     groups, record them as trained, set the version, append the step's metrics;
  5. every `checkpoint_every` steps, and on SaveCheckpoint, a checkpoint (checkpoint.py).
`--resume` restores one, trains again the groups logged as trained after it (so a crash
loses no trained work), moves the run's version to it and pushes its anchor.
Redis trouble never ends the loop: it waits (rollstream.core.redis_policy), and from the
step on it only retries, since the update exists and its groups must be acknowledged.
A non-finite loss or gradient norm applies and publishes nothing; the step's groups go to
the dead letters with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Gauge

from rollstream.core import codec, deltas, logs, modeling, redis_policy, streams, validation, weight_transfer
from rollstream.core.config import load_or_exit
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import Service
from rollstream.core.models import resolve_model, vocab_size
from rollstream.core.service import ServiceHost
from rollstream.trainer import checkpoint, lora
from rollstream.trainer.checkpoint import CheckpointRequests
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.discovery import GeneratorDirectory
from rollstream.trainer.feeder import PromptFeeder
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep
from rollstream.trainer.step import StepConfig, train_step
from rollstream.trainer.publisher import Published, WeightPublisher
from rollstream.v1 import rollout_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2


class Trainer:
    def __init__(self, settings: TrainerSettings, host: ServiceHost):
        s = self.settings = settings
        self.log = host.log
        torch.manual_seed(s.seed)
        self.model_dir = str(resolve_model(s.model))
        # What a ready group may hold: ids inside the vocabulary, completions no longer than
        # the tasks this trainer feeds ask for (dr_grpo normalises by that length), bounded
        # rewards (rollstream.core.validation).
        self.limits = validation.Limits(vocab_size=vocab_size(self.model_dir), max_new_tokens=s.max_new_tokens, max_reward_abs=s.max_abs_reward)
        self.need_ref = s.beta > 0 and s.kl_reference == "service"
        self.model, self.tokenizer = modeling.load_model(self.model_dir, dtype=s.dtype, device=s.device)
        if s.activation_checkpointing:
            # Non-reentrant: works with frozen inputs (LoRA) and with our own checkpointed LM head.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora: lora.LoraModel | None = None
        if s.lora_rank:
            self.lora = lora.LoraModel(self.model, lora.LoraSpec(s.lora_rank, s.lora_alpha, tuple(s.lora_target_modules)))
            self.model = self.lora.model
            self.lora.round_base_to_bf16()
            self.params = self.lora.adapters
        else:
            self.params = modeling.named_weights(self.model)
        self.model.train()
        # pi_ref from the frozen base under the adapters: the groups need no ref_logprobs.
        self.ref_from_base = s.beta > 0 and s.kl_reference == "lora_base"
        self.step_config = StepConfig.from_settings(s)
        self.optimizer = HostAdamW(
            self.params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay,
            bucket_mb=s.bucket_mb, moments_dtype=s.moments_dtype, grad_offload=s.grad_offload,
        )
        self.step = 0
        self.groups_trained = 0
        self.groups_stale = 0
        self.last_truncated_fraction = 0.0
        self.restored: checkpoint.CheckpointState | None = None
        version = 0
        path = checkpoint.resolve(s.resume, s.checkpoint_dir) if s.resume else None
        if path is not None:
            self.restored = self._restore(path)
            version = self.restored.version
            bits = self._published_bits(self.optimizer.published_bits())
            logs.event(self.log, "resumed", checkpoint=str(path), step=self.step, version=version)
        else:
            # Version 0 = bf16 rounding of the checkpoint; the model computes with exactly that.
            bits = self._published_bits(self.optimizer.sync_model())
        self.publisher = WeightPublisher(bits, s.anchor_interval, version=version, creds=ClientCredentials.from_settings(s))
        reg = host.registry
        self.m_steps = Counter("rollstream_trainer_steps", "optimizer steps", registry=reg)
        self.m_reward = Gauge("rollstream_trainer_reward_mean", "mean reward of the last step", registry=reg)
        self.m_version = Gauge("rollstream_trainer_version", "current policy version", registry=reg)
        self.m_stale = Counter("rollstream_trainer_stale_groups", "groups dropped as stale", registry=reg)
        self.m_delta = Gauge("rollstream_trainer_delta_fraction", "last delta size / dense bf16", registry=reg)
        self.m_version.set(version)

    @property
    def version(self) -> int:
        return self.publisher.version

    def _published_bits(self, trained_bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What generators get: the trained weights, or with LoRA the merged base weights."""
        return self.lora.merged_bits() if self.lora is not None else trained_bits

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self, path: Path, prompts_fed: int = 0, consumer: str = "", held_groups: list[str] | None = None, replace: bool = False) -> Path:
        """Write everything a resume needs (call between steps)."""
        s = self.settings
        state = checkpoint.CheckpointState(
            version=self.version,
            step=self.step,
            optimizer_steps=self.optimizer.step_count,
            groups_trained=self.groups_trained,
            groups_stale=self.groups_stale,
            prompts_fed=prompts_fed,
            run=s.run,
            consumer=consumer,
            consumer_group=s.group,
            held_groups=list(held_groups or []),
            model_fingerprint=self.publisher.fingerprint,
            base_weights_sha256=deltas.weights_sha256(self.lora.base_bits) if self.lora is not None else "",
            lora=self.lora.spec.as_dict() if self.lora is not None else None,
            moments_dtype=s.moments_dtype,
            # The Redis URL may carry a password: it stays out of the file.
            settings=s.model_dump(mode="json", exclude={"redis_url"}),
        )
        saved = checkpoint.save(path, state, self.optimizer.state_tensors(), checkpoint.rng_state(), replace=replace)
        logs.event(self.log, "checkpoint saved", path=str(saved), step=self.step, version=self.version)
        return saved

    def _restore(self, path: Path) -> checkpoint.CheckpointState:
        state = checkpoint.load_state(path)
        want_lora = self.lora.spec.as_dict() if self.lora is not None else None
        if state.lora != want_lora:
            raise checkpoint.CheckpointError(f"{path}: checkpoint LoRA config {state.lora} != this trainer's {want_lora}")
        if self.lora is not None and state.base_weights_sha256 != deltas.weights_sha256(self.lora.base_bits):
            raise checkpoint.CheckpointError(f"{path}: the adapters belong to another base model than {self.model_dir}")
        if state.moments_dtype != self.settings.moments_dtype:
            raise checkpoint.CheckpointError(f"{path}: checkpoint moments are {state.moments_dtype}, moments_dtype is {self.settings.moments_dtype}")
        published = self.lora.base if self.lora is not None else self.params
        fingerprint = deltas.model_fingerprint({name: tuple(p.shape) for name, p in published.items()})
        if state.model_fingerprint != fingerprint:
            raise checkpoint.CheckpointError(f"{path}: checkpoint is for model {state.model_fingerprint}, this one is {fingerprint}")
        self.optimizer.load_state(checkpoint.optimizer_tensors(path), state.optimizer_steps)
        checkpoint.set_rng_state(checkpoint.rng_tensors(path))
        self.step = state.step
        self.groups_trained = state.groups_trained
        self.groups_stale = state.groups_stale
        return state

    # -- the step -----------------------------------------------------------------------

    def parse_group(self, entry: streams.Entry) -> rollout_pb2.RolloutGroup:
        """Decode and check one ready entry (raises codec.EntryError with the reason)."""
        group = codec.decode(entry.fields, rollout_pb2.RolloutGroup)
        validation.check_group(group, self.limits, stage="ready", need_ref=self.need_ref)
        return group

    def train_step(self, groups: list[rollout_pb2.RolloutGroup]) -> tuple[rollout_pb2.StepMetrics, Published, deltas.DeltaStats]:
        """One GRPO step (step.py), published as the next version. Raises NonFiniteStep
        with nothing applied or published."""
        start = time.perf_counter()
        adapters_off = self.lora.model.disable_adapter if self.ref_from_base and self.lora is not None else None
        r = train_step(self.model, self.optimizer, groups, self.step_config, pad_id=self.tokenizer.pad_token_id, adapters_off=adapters_off)
        # No update (dapo filtered every group): the version still advances, since the groups
        # were consumed, with an empty delta.
        new_bits = self.publisher.bits() if r.trained_bits is None else self._published_bits(r.trained_bits)
        published, stats = self.publisher.publish(new_bits)
        self.step += 1
        self.last_truncated_fraction = r.truncated_fraction
        step_seconds = time.perf_counter() - start
        metrics = rollout_pb2.StepMetrics(
            step=self.step, version=self.version, groups=r.groups, completions=r.completions,
            reward_mean=r.reward_mean, reward_std=r.reward_std, loss=r.loss, kl=r.kl, clip_fraction=r.clip_fraction,
            entropy=r.entropy, tokens=r.tokens, step_seconds=step_seconds, train_tokens_per_s=r.train_tokens / step_seconds,
            delta_bytes=stats.nbytes, dense_bytes=stats.dense_bytes,
            mean_staleness=sum(self.version - 1 - g.policy_version for g in groups) / len(groups),
            grad_norm=r.grad_norm, time=time.time(), zero_variance_groups=r.zero_variance_groups,
        )
        self.m_steps.inc()
        self.m_reward.set(r.reward_mean)
        self.m_version.set(self.version)
        self.m_delta.set(stats.fraction_of_dense)
        return metrics, published, stats


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer, generators: GeneratorDirectory, checkpoints: CheckpointRequests):
        self.trainer = trainer
        self.generators = generators
        self.checkpoints = checkpoints

    def GetState(self, request: trainer_pb2.TrainerStateRequest, context: grpc.ServicerContext) -> trainer_pb2.TrainerState:
        t = self.trainer
        sha = deltas.weights_sha256(t.publisher.bits()) if request.with_weights_sha256 else ""
        return trainer_pb2.TrainerState(
            version=t.version,
            step=t.step,
            model=t.model_dir,
            model_fingerprint=t.publisher.fingerprint,
            groups_trained=t.groups_trained,
            groups_stale=t.groups_stale,
            generators=self.generators.last,
            weights_sha256=sha,
        )

    def FetchWeights(self, request: trainer_pb2.FetchWeightsRequest, context: grpc.ServicerContext) -> Iterator[weights_pb2.WeightChunk]:
        try:
            payloads = self.trainer.publisher.catch_up_payloads(request.have_version, request.model_fingerprint)
        except deltas.DeltaError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        for p in payloads:
            yield from weight_transfer.to_chunks(p.payload, p.info)

    def SaveCheckpoint(self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext) -> trainer_pb2.SaveCheckpointResult:
        """Saved by the loop after the step in progress (empty path: checkpoint_dir/step-N;
        any other path must lie inside checkpoint_dir, and a relative one is taken there)."""
        target = ""
        if request.path:
            try:
                target = str(checkpoint.confine(request.path, self.trainer.settings.checkpoint_dir))
            except checkpoint.CheckpointPathRefused as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            except checkpoint.CheckpointError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        try:
            path, version = self.checkpoints.request(target, context.time_remaining())
        except FileExistsError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the step in progress did not finish in time; the checkpoint is still queued")
        except (ValueError, OSError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return trainer_pb2.SaveCheckpointResult(path=str(path), version=version)


def run(settings: TrainerSettings) -> None:
    with ServiceHost("trainer", settings) as host:
        host.install_signal_handlers()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        trainer = Trainer(settings, host)
        restored = trainer.restored
        if restored is not None and restored.consumer and not settings.consumer and restored.run == settings.run:
            # Resume as the same consumer: the entries it held come back to it first.
            settings = settings.model_copy(update={"consumer": restored.consumer})
        directory = GeneratorDirectory(settings.generators, dns_name=settings.generators_dns)
        checkpoints = CheckpointRequests()
        host.start([Service("rollstream.v1.Trainer", TrainerServicer(trainer, directory, checkpoints), trainer_pb2_grpc.add_TrainerServicer_to_server)], ready=lambda: (True, f"version {trainer.version}"))
        client = host.connect_redis()
        try:
            keys = streams.RunKeys(settings.run)
            stage = host.open_stage(client, "ready", settings.group)
            fed = host.redis.call(lambda: PromptFeeder.position(client, keys, restored.prompts_fed if restored else 0), "reading the feeder's position")
            feeder = PromptFeeder(settings, client, stage, fed)
            # Also without a checkpoint: a trainer killed before its first one starts from the
            # model again, and the steps it trained are replayed from there.
            replay_trained_log(trainer, client, keys, host)
            # After a resume this moves the version back; generators ahead of it get the anchor.
            host.redis.call(lambda: client.set(keys.version, trainer.version), "setting the version")
            host.set_ready(True)
            if restored is not None:
                push_anchor(trainer, directory, client, keys, host)
            loop(trainer, stage, feeder, directory, client, keys, host, checkpoints)
        finally:
            checkpoints.close()
            client.close()


def replay_trained_log(trainer: Trainer, client: redis_policy.Client, keys: streams.RunKeys, host: ServiceHost) -> None:
    """Train again, step by step and in their order, the groups trained after the checkpoint
    we resumed from (their acknowledgements outlived the update they fed, which died with
    the process). Same groups, same optimizer state and RNG: the same weights, bit for bit."""
    logged = host.redis.call(lambda: client.xrange(keys.trained_log), "reading the trained log")
    steps: dict[int, list[rollout_pb2.RolloutGroup]] = {}
    for eid, fields in logged:
        try:
            step = int(fields.get(b"step", b""))
            if step > trainer.step:
                steps.setdefault(step, []).append(codec.decode(fields, rollout_pb2.RolloutGroup))
        except (ValueError, codec.EntryError) as e:  # not written by a trainer: say so, skip it
            logs.event(host.log, "trained log entry unreadable", logging.ERROR, entry=eid.decode(), error=str(e))
    replayed = 0
    for step in sorted(steps):
        if step != trainer.step + 1:
            logs.event(host.log, "trained log has a gap; replay stops", logging.ERROR, expected=trainer.step + 1, found=step)
            break
        trainer.train_step(steps[step])
        trainer.groups_trained += len(steps[step])
        replayed += 1
    last = host.redis.call(lambda: client.hget(keys.stats, "step"), "reading the run's step")
    lost = int(last or 0) - trainer.step
    if lost > 0:
        # Resumed from an older checkpoint than the latest: those steps' groups stay counted
        # as trained, but their updates are not in these weights. Say so, loudly.
        host.redis.call(lambda: client.hincrby(keys.stats, "steps_lost_on_resume", lost), "counting lost steps")
        logs.event(host.log, "steps not replayable", logging.ERROR, run_step=int(last or 0), resumed_step=trainer.step, lost=lost)
    if replayed:
        logs.event(host.log, "replayed trained log", steps=replayed, step=trainer.step, version=trainer.version)


def push_anchor(trainer: Trainer, directory: GeneratorDirectory, client: redis_policy.Client, keys: streams.RunKeys, host: ServiceHost) -> None:
    """After a resume, every generator gets the restored version as an anchor: whatever it
    holds (a later version of the abandoned run, or the same number from another lineage)
    is replaced. Generators not reachable now catch up by themselves (hashes + anchor)."""
    anchor = trainer.publisher.catch_up_payloads(-1, "")[0]
    addresses = push_targets(directory, client, keys, host)
    outcomes = trainer.publisher.push(addresses, anchor, trainer.settings.push_timeout_s)
    logs.event(host.log, "anchor pushed after resume", version=trainer.version, applied=sum(o.applied for o in outcomes), generators=len(outcomes))


def push_targets(directory: GeneratorDirectory, client: redis_policy.Client, keys: streams.RunKeys, host: ServiceHost) -> list[str]:
    """The generators to push to, waiting out Redis trouble; a registry key someone overwrote
    (a lasting error) means: push where we pushed last."""
    try:
        return host.redis.call(lambda: directory.addresses(client, keys), "listing generators")
    except redis_policy.ERRORS as e:
        logs.event(host.log, "generator registry unreadable", logging.ERROR, error=redis_policy.short(e), pushing_to=len(directory.last))
        return directory.last


Held = list[tuple[streams.Entry, rollout_pb2.RolloutGroup]]


class StepNotRecorded(RuntimeError):
    """A step applied in memory whose commit Redis refused for good: the process ends (not a
    Redis error, so no loop catches it)."""


def loop(
    trainer: Trainer, stage: streams.StreamStage, feeder: PromptFeeder, directory: GeneratorDirectory,
    client: redis_policy.Client, keys: streams.RunKeys, host: ServiceHost, checkpoints: CheckpointRequests,
) -> None:
    s = trainer.settings
    batch: Held = []  # read, valid and not yet trained: ours until committed

    def save(path: str) -> tuple[Path, int]:
        """`path`: empty (the step's folder), or one SaveCheckpoint confined to checkpoint_dir."""
        if not path and not s.checkpoint_dir:
            raise ValueError("no checkpoint path given and no checkpoint_dir configured")
        target = Path(path) if path else Path(s.checkpoint_dir) / checkpoint.step_dir_name(trainer.step)
        held = [g.group_id for _, g in batch]
        # A step's default folder always holds this trainer's state at that step: after a
        # resume from an earlier step it may hold the abandoned lineage's. Explicit paths
        # are never overwritten.
        saved = trainer.save_checkpoint(target, prompts_fed=feeder.fed, consumer=stage.consumer, replace=not path)
        if not path:
            # `latest` now holds every logged step: the log starts over. Not after an explicit
            # path (now always inside checkpoint_dir too): `latest` does not see it, so the
            # steps since the last step folder must stay replayable.
            host.redis.call(lambda: client.delete(keys.trained_log), "clearing the trained log")
            checkpoint.prune(Path(s.checkpoint_dir), s.keep_checkpoints)
        return saved, trainer.version

    while not host.stop.is_set() and (s.steps == 0 or trainer.step < s.steps):
        checkpoints.serve(save)
        try:
            batch = turn(trainer, stage, feeder, directory, client, keys, host, batch, save)
        except redis_policy.ERRORS as e:
            stage.reread_own_pending()
            host.redis.failed(e, "trainer loop")
            continue
        host.redis.recovered()
    logs.event(host.log, "training finished", steps=trainer.step, version=trainer.version)
    if s.linger:
        while not host.stop.wait(0.2):
            checkpoints.serve(save)


def turn(
    trainer: Trainer, stage: streams.StreamStage, feeder: PromptFeeder, directory: GeneratorDirectory,
    client: redis_policy.Client, keys: streams.RunKeys, host: ServiceHost, batch: Held, save: Callable[[str], tuple[Path, int]],
) -> Held:
    """Feed prompts, read ready groups into `batch`, and train once it holds a step's worth.
    Returns what is left in the batch."""
    s = trainer.settings
    feeder.top_up(trainer.version)
    held_ids = {e.id for e, _ in batch}
    for entry, group in stage.read_valid(s.read_count, s.block_ms, trainer.parse_group):
        if entry.id in held_ids:
            continue  # already held (re-read after a failed call): not a duplicate group
        seen = group.group_id in {g.group_id for _, g in batch}
        if seen or client.sismember(keys.groups("trained"), group.group_id) or client.sismember(keys.groups("stale"), group.group_id):
            stage.commit([entry], extra=lambda ops: ops.hincrby(keys.stats, "duplicates", 1))
            continue
        batch.append((entry, group))
    batch = drop_stale(trainer, stage, keys, batch)
    if len(batch) < s.groups_per_step:
        stage.touch([e for e, _ in batch])  # still ours: keep other consumers off them
        return batch
    taken, rest = batch[: s.groups_per_step], batch[s.groups_per_step :]
    train_and_commit(trainer, stage, directory, client, keys, host, taken)
    if s.checkpoint_every and trainer.step % s.checkpoint_every == 0:
        try:
            save("")
        except OSError as e:
            # A full or failing disk must not stop training: the trained log keeps every step
            # since the last good checkpoint, so a restart still loses nothing. Say it loudly.
            logs.event(host.log, "checkpoint failed", logging.ERROR, step=trainer.step, error=str(e))
    return rest


def train_and_commit(
    trainer: Trainer, stage: streams.StreamStage, directory: GeneratorDirectory, client: redis_policy.Client,
    keys: streams.RunKeys, host: ServiceHost, taken: Held,
) -> None:
    """One step on `taken`, pushed to the generators, then acknowledged with the ledger in one
    script. From the step on, Redis trouble is waited out (host.redis.call, commit's own
    retries), never raised: the update exists, so its groups must be acknowledged."""
    s = trainer.settings
    groups = [g for _, g in taken]
    try:
        metrics, published, stats = trainer.train_step(groups)
    except NonFiniteStep as e:
        # Nothing applied, nothing published; the groups cannot be trained, so they go to the
        # dead letters with the reason (validation let them in: their values were finite).
        reason = f"step {trainer.step + 1} refused: {e}; nothing applied or published"
        for entry, _ in taken:
            stage.dead_letter(entry, reason)
        host.redis.call(lambda: client.hincrby(keys.stats, "nonfinite_steps", 1), "counting a refused step")
        logs.event(host.log, "step refused", logging.ERROR, reason=str(e), groups=len(groups))
        return
    outcomes = trainer.publisher.push(push_targets(directory, client, keys, host), published, s.push_timeout_s)
    for o in outcomes:
        if not o.applied:
            logs.event(host.log, "push not applied", logging.WARNING, generator=o.address, error=o.error)
    applied = sum(o.applied for o in outcomes)
    log_trained = bool(s.checkpoint_dir)  # replayed on resume; without checkpoints nothing resumes

    def ledger(ops: streams.Ops) -> None:
        ops.sadd(keys.groups("trained"), *[g.group_id for g in groups])
        ops.hincrby(keys.stats, "trained", len(groups))
        ops.hincrby(keys.stats, "pushes_applied", applied)
        ops.hincrby(keys.stats, "pushes_not_applied", len(outcomes) - applied)
        ops.hset(keys.stats, "step", trainer.step)
        ops.set(keys.version, trainer.version)
        ops.xadd(keys.metrics, codec.encode(metrics), maxlen=100_000, approximate=True)
        if log_trained:
            for entry, _ in taken:
                ops.xadd(keys.trained_log, {"step": trainer.step, **{k.decode(): v for k, v in entry.fields.items()}})

    try:
        stage.commit([e for e, _ in taken], extra=ledger)
    except redis_policy.ERRORS as e:
        # Not a transient error (those are retried inside commit): Redis refuses the record
        # (a key of the wrong type, say). The update must not live on without it, or its
        # groups, still pending, would be trained a second time: end the process; the
        # restart resumes from the checkpoint and trains them once.
        raise StepNotRecorded(f"step {trainer.step}: Redis refused its commit ({redis_policy.short(e)})") from e
    trainer.groups_trained += len(groups)
    with contextlib.suppress(*redis_policy.ERRORS):
        stage.trim()  # housekeeping: the next step tries again
    logs.event(
        host.log, "step",
        step=trainer.step, version=trainer.version, reward=round(metrics.reward_mean, 4), loss=round(metrics.loss, 5),
        clip=round(metrics.clip_fraction, 4), staleness=round(metrics.mean_staleness, 2), seconds=round(metrics.step_seconds, 2),
        delta_kb=stats.nbytes // 1024, delta_pct=round(100 * stats.fraction_of_dense, 2),
        pushed=applied, generators=len(outcomes), tis_truncated=round(trainer.last_truncated_fraction, 4),
        zero_var=metrics.zero_variance_groups,
    )


def drop_stale(trainer: Trainer, stage: streams.StreamStage, keys: streams.RunKeys, batch: Held) -> Held:
    """Acknowledge and count groups sampled more than max_staleness versions ago, and groups
    from a version this trainer has not published (sampled before it resumed from an
    earlier checkpoint: that lineage was abandoned)."""
    limit = trainer.settings.max_staleness

    def usable(g: rollout_pb2.RolloutGroup) -> bool:
        return 0 <= trainer.version - g.policy_version <= limit

    keep = [(e, g) for e, g in batch if usable(g)]
    stale = [(e, g) for e, g in batch if not usable(g)]
    if stale:
        def ledger(ops: streams.Ops) -> None:
            ops.sadd(keys.groups("stale"), *[g.group_id for _, g in stale])
            ops.hincrby(keys.stats, "stale", len(stale))

        stage.commit([e for e, _ in stale], extra=ledger)
        trainer.groups_stale += len(stale)
        trainer.m_stale.inc(len(stale))
    return keep


def main(argv: list[str] | None = None) -> None:
    run(load_or_exit(TrainerSettings, sys.argv[1:] if argv is None else argv))
