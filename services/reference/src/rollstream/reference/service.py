"""The reference service: rs:{<run>}:scored -> the same groups with ref_logprobs -> rs:{<run>}:ready.

Loop (one thread): read scored groups; dead-letter what does not parse or cannot be
scored; score every completion of every group read in one call (packed into micro-batches
inside); write the groups to `ready` and acknowledge the inputs in one transaction; trim
the scored stream now and then. Every group's ref log-probs are this service's own: whatever
an upstream stage wrote in ref_logprobs is dropped and computed again (the reward's Redis
user can write `scored`, so a value found there is only its claim).

gRPC (server threads): ComputeLogprobs on the same frozen model, GetState.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from rollstream.core import logs, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.grpc_utils import Service
from rollstream.core.models import ModelNotFoundError, resolve_model
from rollstream.core.service import Every, ServiceHost
from rollstream.reference.config import ReferenceSettings
from rollstream.reference.scoring import ReferenceModel, TokenPair
from rollstream.v1 import reference_pb2, reference_pb2_grpc, rollout_pb2


@dataclass
class Totals:
    """What GetState reports; written by the loop and gRPC threads, hence the lock."""

    groups: int = 0  # groups given ref log-probs by the stream loop
    tokens: int = 0  # completion tokens scored, stream and gRPC together
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, groups: int, tokens: int) -> None:
        with self.lock:
            self.groups += groups
            self.tokens += tokens


@dataclass(frozen=True)
class Metrics:
    """The reference's own metrics (dead letters and redeliveries: ServiceHost.metrics)."""

    groups: Counter
    tokens: Counter
    seconds: Counter
    tokens_per_s: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_reference_"
        return cls(
            groups=Counter(p + "groups", "groups written to ready", ["outcome"], registry=registry),
            tokens=Counter(p + "tokens", "tokens run through the reference model", ["kind"], registry=registry),
            seconds=Counter(p + "compute_seconds", "time spent computing log-probs", registry=registry),
            tokens_per_s=Gauge(
                p + "tokens_per_second", "prompt+completion tokens/s of the last call", registry=registry
            ),
        )


class Scorer:
    """The model plus its accounting; the stream loop and the gRPC servicer both use it."""

    def __init__(self, model: ReferenceModel, metrics: Metrics, totals: Totals):
        self.model = model
        self.metrics = metrics
        self.totals = totals
        self.limits = validation.Limits(vocab_size=model.vocab_size)

    def score(self, sequences: Sequence[TokenPair]) -> list[list[float]]:
        start = time.perf_counter()
        values = self.model.logprobs(sequences)
        seconds = time.perf_counter() - start
        prompt_tokens = sum(len(p) for p, _ in sequences)
        completion_tokens = sum(len(c) for _, c in sequences)
        self.metrics.tokens.labels("prompt").inc(prompt_tokens)
        self.metrics.tokens.labels("completion").inc(completion_tokens)
        self.metrics.seconds.inc(seconds)
        if seconds > 0:
            self.metrics.tokens_per_s.set((prompt_tokens + completion_tokens) / seconds)
        self.totals.add(0, completion_tokens)
        return values


class ReferenceServicer(reference_pb2_grpc.ReferenceServicer):
    """Serves from the moment the server starts; answers UNAVAILABLE until the model is loaded."""

    def __init__(self, model_name: str, totals: Totals):
        self.model_name = model_name
        self.totals = totals
        self.scorer: Scorer | None = None  # set once, by run(), after the model loads

    def ComputeLogprobs(
        self, request: reference_pb2.LogprobsRequest, context: grpc.ServicerContext
    ) -> reference_pb2.LogprobsResponse:
        scorer = self.scorer
        if scorer is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the reference model is still loading")
        sequences = [(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        for i, (prompt, completion) in enumerate(sequences):
            try:
                scorer.model.check(prompt, completion)  # type: ignore[union-attr]  # context.abort raised above: grpc has no types to say so
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sequence {i}: {e}")
        values = scorer.score(sequences)  # type: ignore[union-attr]  # context.abort raised above: grpc has no types to say so
        return reference_pb2.LogprobsResponse(sequences=[reference_pb2.SequenceLogprobs(logprobs=v) for v in values])

    def GetState(
        self, request: reference_pb2.ReferenceStateRequest, context: grpc.ServicerContext
    ) -> reference_pb2.ReferenceState:
        with self.totals.lock:
            return reference_pb2.ReferenceState(
                model=self.model_name, groups_processed=self.totals.groups, tokens_processed=self.totals.tokens
            )


def main(argv: list[str] | None = None) -> int:
    return run(load_or_exit(ReferenceSettings, sys.argv[1:] if argv is None else argv))


def run(settings: ReferenceSettings) -> int:
    with ServiceHost("reference", settings) as host:
        host.install_signal_handlers()
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        metrics = Metrics.register(host.registry)
        totals = Totals()
        servicer = ReferenceServicer(settings.model, totals)
        # Servers first, so /healthz answers while the model loads; /readyz and gRPC health
        # say "not ready" until it has and the stage is joined.
        host.start([Service("rollstream.v1.Reference", servicer, reference_pb2_grpc.add_ReferenceServicer_to_server)])
        host.set_ready(False, "loading model")

        started = time.perf_counter()
        try:
            model_dir = resolve_model(settings.model)
        except ModelNotFoundError as e:
            logs.event(host.log, "model_not_found", logging.ERROR, error=str(e))
            return 2
        model = ReferenceModel.load(
            model_dir,
            dtype=settings.dtype,
            device=settings.device,
            token_budget=settings.token_budget,
            chunk_tokens=settings.chunk_tokens,
            temperature=settings.temperature,
            share_prompts=settings.share_prompts,
        )
        scorer = Scorer(model, metrics, totals)
        servicer.model_name = str(model_dir)
        servicer.scorer = scorer
        logs.event(
            host.log,
            "model_loaded",
            model=model_dir,
            dtype=settings.dtype,
            device=settings.device,
            vocab=model.vocab_size,
            seconds=round(time.perf_counter() - started, 1),
        )
        host.set_ready(False, "joining the scored stream")

        client = host.connect_redis()
        try:
            stage = host.open_stage(client, "scored", settings.group)
            loop = ReferenceLoop(host, stage, scorer, Every(settings.trim_every_s))
            host.set_ready(True, f"reading {stage.stream}")
            logs.event(
                host.log,
                "started",
                run=settings.run,
                source=stage.stream,
                group=settings.group,
                consumer=stage.consumer,
            )
            host.run_loop(stage, loop.turn, "reference loop")
        finally:
            client.close()
    return 0


@dataclass
class ReferenceLoop:
    """What a turn uses: the stage it reads, the model (with its accounting), the trim clock."""

    host: ServiceHost
    stage: streams.StreamStage
    scorer: Scorer
    trim: Every

    def turn(self) -> None:
        batch = self.host.read(self.stage, self.parse)
        if batch:
            with self.host.metrics.batch_seconds.time():
                self.reference(batch)
        if self.trim.due():
            self.stage.trim()

    def parse(self, entry: streams.Entry) -> rollout_pb2.RolloutGroup:
        """Decode and check one scored entry (raises validation.EntryError with the reason). Any
        ref log-probs it carries are dropped first: they are computed here, never passed on."""
        group = validation.parse_group(entry, self.scorer.limits, stage="scored", drop_ref=True)
        for i, c in enumerate(group.completions):
            try:
                self.scorer.model.check(group.prompt_ids, c.token_ids)
            except ValueError as e:
                raise validation.EntryError(f"completion {i} of {group.group_id}: {e}") from None
        return group

    def reference(self, good: validation.Groups) -> None:
        """Add ref log-probs to the (checked, at least one) groups, write them to ready, ack the inputs."""
        stage, scorer, host = self.stage, self.scorer, self.host
        # 1. Score every completion of every group, in one call (parse emptied ref_logprobs).
        sequences = [(list(g.prompt_ids), list(c.token_ids)) for _, g in good for c in g.completions]
        start = time.perf_counter()
        values = iter(scorer.score(sequences))
        seconds = time.perf_counter() - start
        for _, g in good:
            for c in g.completions:
                c.ref_logprobs.extend(next(values))
            g.has_ref_logprobs = True
        # A non-finite log-prob must not reach the trainer's KL: refused here, group by group.
        ok = []
        for entry, g in good:
            try:
                validation.check_group(g, scorer.limits, stage="ready", need_ref=True)
            except validation.EntryError as e:
                stage.dead_letter(entry, f"reference log-probs unusable: {e}")
            else:
                ok.append((entry, g))
        referenced = len(ok)

        # 2. Write to ready and ack in one transaction (a crash before EXEC leaves them pending).
        def ledger(ops: streams.Ops) -> None:
            ops.hincrby(stage.counters, "referenced", referenced)

        # GetState counts the groups before they show in ready, so whoever sees one there and
        # then asks GetState finds it counted; a commit that fails takes the count back (the
        # entries stay pending and are read again).
        scorer.totals.add(referenced, 0)
        try:
            stage.commit([e for e, _ in ok], outputs=[("ready", g) for _, g in ok], extra=ledger)
        except BaseException:
            scorer.totals.add(-referenced, 0)
            raise
        scorer.metrics.groups.labels("referenced").inc(referenced)
        tokens = sum(len(p) + len(c) for p, c in sequences)
        logs.event(
            host.log,
            "groups_referenced",
            referenced=referenced,
            completions=len(sequences),
            tokens=tokens,
            seconds=round(seconds, 3),
            tokens_per_s=round(tokens / seconds) if seconds > 0 else 0,
            versions=",".join(sorted({str(g.policy_version) for _, g in ok})),
            groups=logs.group_ids(g for _, g in ok),
        )
