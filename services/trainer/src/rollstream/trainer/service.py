"""The trainer service: feed prompts, collect scored groups, GRPO step, publish, push.

One loop, top to bottom:
  1. top up rs:<run>:prompts to `prompt_buffer` tasks;
  2. read rs:<run>:ready; drop duplicates (group_id already trained) and groups more than
     `max_staleness` versions old (counted, acknowledged);
  3. with `groups_per_step` groups: advantages, GRPO loss over token-budget micro-batches,
     backward, AdamW on the host masters -> new bf16 weights (version + 1);
  4. encode the exact delta, push it to every generator, then in one transaction: ack the
     groups, record them as trained, set the version, append the step's metrics.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator

import grpc
import redis
import torch
from prometheus_client import Counter, Gauge

from rollstream.core import codec, deltas, logs, modeling, streams, weight_transfer
from rollstream.core.config import ConfigError, load_settings
from rollstream.core.grpc_utils import Service
from rollstream.core.models import resolve_model
from rollstream.core.service import ServiceHost
from rollstream.trainer import grpo, prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.publisher import Published, WeightPublisher
from rollstream.v1 import rollout_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2


class Trainer:
    def __init__(self, settings: TrainerSettings, host: ServiceHost):
        self.settings = settings
        self.log = host.log
        torch.manual_seed(settings.seed)
        self.model_dir = str(resolve_model(settings.model))
        self.model, self.tokenizer = modeling.load_model(self.model_dir, dtype=settings.dtype, device=settings.device)
        self.model.train()
        self.params = modeling.named_weights(self.model)
        self.optimizer = HostAdamW(self.params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
        # Version 0 = bf16 rounding of the checkpoint; the model computes with exactly that.
        self.publisher = WeightPublisher(self.optimizer.sync_model(), settings.anchor_interval)
        self.step = 0
        self.groups_trained = 0
        self.groups_stale = 0
        reg = host.registry
        self.m_steps = Counter("rollstream_trainer_steps", "optimizer steps", registry=reg)
        self.m_reward = Gauge("rollstream_trainer_reward_mean", "mean reward of the last step", registry=reg)
        self.m_version = Gauge("rollstream_trainer_version", "current policy version", registry=reg)
        self.m_stale = Counter("rollstream_trainer_stale_groups", "groups dropped as stale", registry=reg)
        self.m_delta = Gauge("rollstream_trainer_delta_fraction", "last delta size / dense bf16", registry=reg)

    @property
    def version(self) -> int:
        return self.publisher.version

    def train_step(self, groups: list[rollout_pb2.RolloutGroup]) -> tuple[rollout_pb2.StepMetrics, Published, deltas.DeltaStats]:
        s = self.settings
        start = time.perf_counter()
        sequences: list[tuple[list[int], list[int]]] = []
        seq_adv: list[float] = []
        behaviour: list[list[float]] = []
        refs: list[list[float]] = []
        rewards: list[float] = []
        zero_var = 0
        for g in groups:
            r = [c.reward for c in g.completions]
            rewards.extend(r)
            if max(r) == min(r):
                zero_var += 1
            adv = grpo.group_advantages(r)
            for c, a in zip(g.completions, adv):
                sequences.append((list(g.prompt_ids), list(c.token_ids)))
                seq_adv.append(a)
                behaviour.append(list(c.behaviour_logprobs))
                refs.append(list(c.ref_logprobs))
        total = len(sequences)
        lengths = [len(p) + len(c) for p, c in sequences]
        kl_sum = entropy_sum = 0.0
        clipped = tokens = 0
        loss_sum = 0.0
        for micro in modeling.pack_by_tokens(lengths, s.token_budget):
            batch = modeling.make_batch([sequences[i] for i in micro], self.tokenizer.pad_token_id, s.device)
            logp, entropy = modeling.completion_logprobs(self.model, batch, chunk_tokens=s.chunk_tokens, temperature=s.temperature, with_entropy=True)
            dev = logp.device
            seq = torch.repeat_interleave(torch.arange(len(micro), device=dev), torch.tensor(batch.lengths, device=dev))
            adv_tok = torch.repeat_interleave(torch.tensor([seq_adv[i] for i in micro], dtype=torch.float32, device=dev), torch.tensor(batch.lengths, device=dev))
            beh = torch.tensor([x for i in micro for x in behaviour[i]], dtype=torch.float32, device=dev)
            ref = torch.tensor([x for i in micro for x in refs[i]], dtype=torch.float32, device=dev) if s.beta > 0 else None
            parts = grpo.grpo_loss(
                logp, beh, adv_tok, seq, torch.tensor(batch.lengths, device=dev), total, s.clip_eps, s.beta, ref, entropy
            )
            parts.loss.backward()
            loss_sum += float(parts.loss.detach())
            kl_sum += parts.kl_sum
            entropy_sum += parts.entropy_sum
            clipped += parts.clipped_tokens
            tokens += parts.tokens
        grad_norm, new_bits = self.optimizer.step(s.max_grad_norm)
        published, stats = self.publisher.publish(new_bits)
        self.step += 1
        step_seconds = time.perf_counter() - start
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        metrics = rollout_pb2.StepMetrics(
            step=self.step,
            version=self.version,
            groups=len(groups),
            completions=total,
            reward_mean=mean,
            reward_std=std,
            loss=loss_sum,
            kl=kl_sum / max(tokens, 1),
            clip_fraction=clipped / max(tokens, 1),
            entropy=entropy_sum / max(tokens, 1),
            tokens=tokens,
            step_seconds=step_seconds,
            train_tokens_per_s=sum(lengths) / step_seconds,
            delta_bytes=stats.nbytes,
            dense_bytes=stats.dense_bytes,
            mean_staleness=sum(self.version - 1 - g.policy_version for g in groups) / len(groups),
            grad_norm=grad_norm,
            time=time.time(),
            zero_variance_groups=zero_var,
        )
        self.m_steps.inc()
        self.m_reward.set(mean)
        self.m_version.set(self.version)
        self.m_delta.set(stats.fraction_of_dense)
        return metrics, published, stats


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer, generators: "GeneratorDirectory"):
        self.trainer = trainer
        self.generators = generators

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
            generators=self.generators.addresses(),
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
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "checkpoints are not implemented yet (issue 4)")


class GeneratorDirectory:
    """Where to push: the configured addresses, else the generators registered in Redis."""

    def __init__(self, configured: list[str], client: redis.Redis, keys: streams.RunKeys):
        self.configured = configured
        self.client = client
        self.keys = keys

    def addresses(self) -> list[str]:
        if self.configured:
            return list(self.configured)
        return sorted(v.decode() for v in self.client.hgetall(self.keys.generators).values())


class PromptFeeder:
    def __init__(self, settings: TrainerSettings, client: redis.Redis, keys: streams.RunKeys):
        self.settings = settings
        self.client = client
        self.keys = keys
        if settings.task == "arithmetic":
            self.source = prompts.arithmetic(settings.seed, settings.max_operand)
        else:
            self.source = prompts.from_file(settings.dataset_path, settings.prompt_field, settings.answer_field, settings.task_kind, settings.seed)
        self.fed = 0

    def top_up(self, version: int) -> int:
        s = self.settings
        stream = self.keys.stream("prompts")
        streams.trim_acknowledged(self.client, stream)
        missing = s.prompt_buffer - int(self.client.xlen(stream))
        if missing <= 0:
            return 0
        # Task ids come from a Redis counter so they stay unique across trainer restarts.
        first = int(self.client.incrby(f"rs:{self.keys.run}:task_seq", missing)) - missing
        pipe = self.client.pipeline(transaction=True)
        for n, p in zip(range(first, first + missing), itertools.islice(self.source, missing)):
            task = rollout_pb2.PromptTask(
                task_id=f"{self.keys.run}-{n:08d}",
                messages=[rollout_pb2.ChatMessage(role=r, content=c) for r, c in p.messages],
                answer=p.answer,
                group_size=s.group_size,
                sampling=rollout_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens),
                fed_at_version=version,
                task_kind=p.task_kind,
            )
            pipe.xadd(stream, codec.encode(task))
        pipe.execute()
        self.fed += missing
        return missing


def run(settings: TrainerSettings) -> None:
    with ServiceHost("trainer", settings) as host:
        host.install_signal_handlers()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        trainer = Trainer(settings, host)
        client = streams.connect(settings.redis_url)
        keys = streams.RunKeys(settings.run)
        client.set(keys.version, trainer.version)
        stage = streams.StreamStage.for_service(client, settings, "ready", settings.group)
        directory = GeneratorDirectory(settings.generators, client, keys)
        host.start([Service("rollstream.v1.Trainer", TrainerServicer(trainer, directory), trainer_pb2_grpc.add_TrainerServicer_to_server)], ready=lambda: (True, f"version {trainer.version}"))
        host.set_ready(True)
        try:
            loop(trainer, stage, PromptFeeder(settings, client, keys), directory, client, keys, host)
            if settings.linger:
                host.stop.wait()
        finally:
            client.close()


def loop(trainer: Trainer, stage: streams.StreamStage, feeder: PromptFeeder, directory: GeneratorDirectory, client: redis.Redis, keys: streams.RunKeys, host: ServiceHost) -> None:
    s = trainer.settings
    batch: list[tuple[streams.Entry, rollout_pb2.RolloutGroup]] = []
    while not host.stop.is_set() and (s.steps == 0 or trainer.step < s.steps):
        feeder.top_up(trainer.version)
        for entry in stage.read(s.read_count, s.block_ms):
            try:
                group = codec.decode(entry.fields, rollout_pb2.RolloutGroup)
                codec.validate_group(group)
                if not group.scored:
                    raise codec.EntryError(f"group {group.group_id} reached the trainer without rewards")
                if s.beta > 0 and not group.has_ref_logprobs:
                    raise codec.EntryError(f"group {group.group_id} has no reference log-probs but beta = {s.beta}")
            except codec.EntryError as e:
                stage.dead_letter(entry, str(e))
                continue
            if entry.id in {e.id for e, _ in batch}:
                continue  # already held (re-read after a failed commit): not a duplicate group
            seen = group.group_id in {g.group_id for _, g in batch}
            if seen or client.sismember(keys.groups("trained"), group.group_id) or client.sismember(keys.groups("stale"), group.group_id):
                stage.commit([entry], extra=lambda ops: ops.hincrby(keys.stats, "duplicates", 1))
                continue
            batch.append((entry, group))
        batch = drop_stale(trainer, stage, keys, batch)
        if len(batch) < s.groups_per_step:
            stage.touch([e for e, _ in batch])  # still ours: keep other consumers off them
            continue
        taken, batch = batch[: s.groups_per_step], batch[s.groups_per_step :]
        groups = [g for _, g in taken]
        metrics, published, stats = trainer.train_step(groups)
        outcomes = trainer.publisher.push(directory.addresses(), published, s.push_timeout_s)
        for o in outcomes:
            if not o.applied:
                logs.event(host.log, "push not applied", level=30, generator=o.address, error=o.error)

        applied = sum(o.applied for o in outcomes)

        def ledger(ops: streams.Ops, groups=groups, metrics=metrics, applied=applied) -> None:
            ops.sadd(keys.groups("trained"), *[g.group_id for g in groups])
            ops.hincrby(keys.stats, "trained", len(groups))
            ops.hincrby(keys.stats, "pushes_applied", applied)
            ops.hincrby(keys.stats, "pushes_not_applied", len(outcomes) - applied)
            ops.set(keys.version, trainer.version)
            ops.xadd(keys.metrics, codec.encode(metrics), maxlen=100_000, approximate=True)

        stage.commit([e for e, _ in taken], extra=ledger)
        stage.trim()
        trainer.groups_trained += len(groups)
        logs.event(
            host.log, "step",
            step=trainer.step, version=trainer.version, reward=round(metrics.reward_mean, 4), loss=round(metrics.loss, 5),
            clip=round(metrics.clip_fraction, 4), staleness=round(metrics.mean_staleness, 2), seconds=round(metrics.step_seconds, 2),
            delta_kb=stats.nbytes // 1024, delta_pct=round(100 * stats.fraction_of_dense, 2),
            pushed=applied, generators=len(outcomes),
        )
    logs.event(host.log, "training finished", steps=trainer.step, version=trainer.version)


def drop_stale(trainer: Trainer, stage: streams.StreamStage, keys: streams.RunKeys, batch: list[tuple[streams.Entry, rollout_pb2.RolloutGroup]]) -> list[tuple[streams.Entry, rollout_pb2.RolloutGroup]]:
    """Acknowledge and count groups sampled more than max_staleness versions ago."""
    limit = trainer.settings.max_staleness
    keep = [(e, g) for e, g in batch if trainer.version - g.policy_version <= limit]
    stale = [(e, g) for e, g in batch if trainer.version - g.policy_version > limit]
    if stale:
        def ledger(ops: streams.Ops) -> None:
            ops.sadd(keys.groups("stale"), *[g.group_id for _, g in stale])
            ops.hincrby(keys.stats, "stale", len(stale))

        stage.commit([e for e, _ in stale], extra=ledger)
        trainer.groups_stale += len(stale)
        trainer.m_stale.inc(len(stale))
    return keep


def main(argv: list[str] | None = None) -> None:
    try:
        settings = load_settings(TrainerSettings, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    run(settings)
