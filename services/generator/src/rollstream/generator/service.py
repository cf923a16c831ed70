"""The generator service: rs:{<run>}:prompts -> sampled rollout groups -> rs:{<run>}:rollouts,
plus the weight path from the trainer.

Loop (one thread, `GeneratorLoop.turn`): wait while too many versions behind (again once tasks are taken); take the
trainer's held-out evaluation tasks first (rs:{<run>}:eval_prompts: never held back by the
training groups downstream, which wait for the trainer and would otherwise block the round the
trainer waits for); else, while downstream has room, read PromptTasks; sample `group_size`
completions each (generator.py), write the RolloutGroups and ack the tasks in one transaction. Beside it: gRPC threads (PushWeights
applies payloads between batches), the weight-sync thread (catches up from the store or the
trainer whatever fails; readiness red while too far behind) and the heartbeat thread (keeps
this generator in the Redis registry the trainer pushes to).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from dataclasses import dataclass

from rollstream.core import logs, redis_acl, redis_policy, run_keys, streams, validation
from rollstream.core.config import load_or_exit
from rollstream.core.grpc_utils import Service
from rollstream.core.service import ServiceHost
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.generator import Generator, GeneratorServicer
from rollstream.v1 import generator_pb2_grpc, rollout_pb2


def main(argv: list[str] | None = None) -> int:
    return run(load_or_exit(GeneratorSettings, sys.argv[1:] if argv is None else argv))


def run(settings: GeneratorSettings) -> int:
    with ServiceHost("generator", settings) as host:
        host.install_signal_handlers()
        gen = Generator(settings, host)
        host.start(
            [
                Service(
                    "rollstream.v1.Generator",
                    GeneratorServicer(gen),
                    generator_pb2_grpc.add_GeneratorServicer_to_server,
                )
            ]
        )
        sync = threading.Thread(target=gen.sync.forever, name="weight-sync", daemon=True)
        sync.start()
        address = settings.advertise_address or host.grpc_address
        gen.advertised_address = address  # what PushNonce proves, before the registry names it
        try:
            sample_forever(gen, host, register_as=address)
        finally:
            # Let the sync thread leave its gRPC call before the interpreter exits: a daemon
            # thread killed inside grpc's C++ core can abort the process (exit 139 after a
            # clean stop, seen in the containers tier).
            gen.sync.wake.set()
            sync.join(timeout=30.0)
    return 0


def sample_forever(gen: Generator, host: ServiceHost, register_as: str) -> None:
    """The stream loop until stopped: join the prompts stage, then sample turn after turn.
    `register_as`: the address kept in the registry the trainer pushes to (heartbeat_forever);
    empty for a generator colocated with its trainer: registered with its version, so status
    and the dashboard see it, but with no address, so nothing is pushed to it."""
    settings = gen.settings
    keys = run_keys.RunKeys(settings.run)
    client = observer = None
    beat = None
    try:
        client = host.connect_redis()
        # Back-pressure reads `scored` and `ready`, which the generator's own user may not
        # touch: through the read-only observer user where one is configured.
        observer = client
        if settings.redis_observer_password_file:
            observer = host.connect_redis(
                redis_acl.OBSERVER, settings.redis_observer_password_file, "redis_observer_password_file"
            )
        stage = host.open_stage(client, "prompts", settings.group)
        evals = host.open_stage(client, "eval_prompts", settings.group)
        beat = threading.Thread(
            target=heartbeat_forever, args=(client, keys, gen, register_as, host), name="heartbeat", daemon=True
        )
        beat.start()
        # Ready from here while no more than max_staleness behind the trainer (CatchUpHealth).
        gen.sync.health.sampling(f"sampling from {stage.stream}", gen.weights.version)
        logs.event(
            host.log, "started", id=gen.generator_id, address=register_as, backend=gen.backend.name, source=stage.stream
        )
        host.run_loop(
            stage,
            GeneratorLoop(gen, host, stage, evals, client, observer).turn,
            "generator loop",
            on_redis_error=evals.reread_own_pending,
        )
    finally:
        host.stop.set()
        if beat is not None:
            beat.join(timeout=10.0)
        if client is not None:
            with contextlib.suppress(*redis_policy.ERRORS):
                run_keys.leave(client, keys, gen.generator_id)
            client.close()
        if observer is not None and observer is not client:
            observer.close()


def heartbeat_forever(
    client: redis_policy.Client, keys: run_keys.RunKeys, gen: Generator, address: str, host: ServiceHost
) -> None:
    """Keep this generator in the registry, with the version it holds; the trainer forgets
    generators that stop beating."""
    while not host.stop.is_set():
        try:
            run_keys.heartbeat(client, keys, gen.generator_id, address, gen.weights.version)
        except redis_policy.ERRORS as e:
            # A refusal (the ACL lacks a registry command) will not pass by itself: say so loudly.
            level = logging.ERROR if redis_policy.is_denied(e) else logging.DEBUG
            logs.event(host.log, "heartbeat_failed", level, error=redis_policy.short(e))
        host.stop.wait(run_keys.BEAT_EVERY_S)


@dataclass
class GeneratorLoop:
    """What a turn uses: the generator, its stages (training tasks, evaluation tasks), its Redis
    clients (`observer` counts what waits downstream)."""

    gen: Generator
    host: ServiceHost
    stage: streams.StreamStage
    evals: streams.StreamStage
    client: redis_policy.Client
    observer: redis_policy.Client

    def turn(self) -> None:
        gen, stage, host, keys, s = self.gen, self.stage, self.host, self.stage.keys, self.gen.settings
        if self.behind():
            return
        # Evaluation tasks first, whatever waits downstream: a round is a few tasks the trainer
        # takes off `ready` at once, and it waits for them at the end of a run.
        taken = host.read(self.evals, gen.parse_task, count=s.tasks_per_batch, wait=False)
        if taken:
            self.write(self.evals, taken)
            return
        # Back-pressure on what really waits downstream (unacknowledged groups, not stream lengths).
        inflight = sum(
            run_keys.waiting(self.observer, keys.stream(name), limit=s.max_inflight_groups)
            for name in ("rollouts", "scored", "ready")
        )
        # Tasks another generator has taken and is sampling now are in flight too: without them
        # every generator would fill the same room (check, then read), and with max_staleness 0
        # the extra groups come out stale.
        inflight += stage.held_by_others()
        if inflight >= s.max_inflight_groups:
            host.stop.wait(0.2)
            return
        # No more tasks than the room left: a batch that overshoots max_inflight_groups is sampled
        # ahead of the version that will train it, and with max_staleness 0 dropped as stale.
        taken = host.read(stage, gen.parse_task, count=min(s.tasks_per_batch, s.max_inflight_groups - inflight))
        if taken:
            self.write(stage, taken)

    def behind(self) -> bool:
        """More than max_staleness versions behind the trainer's: the sync thread woken, a moment waited."""
        current = run_keys.current_version(self.client, self.stage.keys)
        self.gen.sync.health.trainer_at("redis", current, self.gen.weights.version)
        if current - (self.gen.weights.version or 0) <= self.gen.settings.max_staleness:
            return False
        self.gen.sync.wake.set()
        self.host.stop.wait(0.2)
        return True

    def write(self, stage: streams.StreamStage, taken: list[tuple[streams.Entry, rollout_pb2.PromptTask]]) -> None:
        """Sample the tasks taken from `stage`, write their groups to rollouts and ack the tasks,
        with the ledger, in one transaction."""
        keys, host = stage.keys, self.host
        # Again now the tasks are ours: the trainer's commit that made room (its acks) or fed the round sets
        # its version too, maybe after turn's look; sampled before those weights land, they come out stale.
        while self.behind():
            if host.stop.is_set():
                return  # still pending on us: read again first on restart
        with host.metrics.batch_seconds.time():
            done = self.sample(stage, taken)
            if not done:
                return
            groups = [g for _, g in done]

            def ledger(ops: streams.Ops) -> None:
                ops.hincrby(stage.counters, "generated", len(groups))
                ops.sadd(keys.groups("generated"), *[g.group_id for g in groups])

            committed = stage.commit([e for e, _ in done], outputs=[("rollouts", g) for g in groups], extra=ledger)
        stage.trim()
        # Not committed: another consumer took these tasks over meanwhile and writes them itself.
        logs.event(
            host.log,
            "groups_written" if committed else "groups_taken_over",
            n=len(groups),
            version=groups[0].policy_version,
            source=stage.stream,
            groups=logs.group_ids(groups),
        )

    def sample(
        self, stage: streams.StreamStage, taken: list[tuple[streams.Entry, rollout_pb2.PromptTask]]
    ) -> validation.Groups:
        """The batch's groups; when the engine chokes on the batch, its tasks one by one, and
        a task that fails alone goes to the dead letters (it must not take its batch with it)."""
        if len(taken) > 1:
            try:
                return [(entry, group) for (entry, _), group in zip(taken, self.gen.generate([t for _, t in taken]))]
            except Exception as e:  # noqa: BLE001 - whatever the engine raised: the batch is sampled task by task instead
                logs.event(
                    self.host.log,
                    "batch_failed",
                    logging.WARNING,
                    tasks=len(taken),
                    error=f"{type(e).__name__}: {e}",
                    action="sampling its tasks one by one",
                )
        done = []
        for entry, task in taken:
            try:
                done.append((entry, self.gen.generate([task])[0]))
            except Exception as e:  # noqa: BLE001 - whatever the engine raised: the task goes to the dead letters, the batch on
                stage.dead_letter(entry, f"sampling failed: {type(e).__name__}: {e}")
        return done
