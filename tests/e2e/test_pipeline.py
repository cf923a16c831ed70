"""The whole loop with real processes: trainer, two generators (one started late), reward,
reference, on a real redis-server and the tiny model. Checks the accounting of every
task, exact weight sync, dead-lettering of malformed entries in every stream, and that a
stage killed with SIGKILL mid-run loses nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from helpers import wait_for
from procs import generator_state, start_service, trainer_state
from rollstream.core import run_keys, validation
from rollstream.core.run_keys import read_counters
from rollstream.v1 import rollout_pb2

pytestmark = pytest.mark.e2e

STEPS = 8


def stream_group_ids(client: redis.Redis, key: str) -> set[str]:
    ids = set()
    for _eid, fields in client.xrange(key):
        try:
            ids.add(validation.decode(fields, rollout_pb2.RolloutGroup).group_id)
        except validation.EntryError:
            pass
    return ids


def write_malformed(client: redis.Redis, keys: run_keys.RunKeys) -> None:
    """One bad entry per stream, each wrong in a different way."""
    client.xadd(keys.stream("prompts"), {"type": b"rollstream.v1.Nonsense", "schema": b"1", "data": b""})
    client.xadd(
        keys.stream("rollouts"), {"type": b"rollstream.v1.RolloutGroup", "schema": b"1", "data": b"\xff\xfe\xfd"}
    )
    no_logprobs = rollout_pb2.RolloutGroup(
        group_id="hand-made", prompt_ids=[1, 2], completions=[rollout_pb2.Completion(token_ids=[3, 4])], scored=True
    )
    client.xadd(keys.stream("scored"), validation.encode(no_logprobs))
    client.xadd(keys.stream("ready"), {"type": b"rollstream.v1.RolloutGroup", "schema": b"99", "data": b""})


def test_pipeline_end_to_end(
    redis_url: str, rclient: redis.Redis, keys: run_keys.RunKeys, tiny_model_dir: Path, tmp_path: Path
) -> None:
    common = ["--redis-url", redis_url, "--run", keys.run, "--claim-idle-ms", "1500", "--threads", "1"]
    model = ["--model", str(tiny_model_dir)]
    trainer = start_service(
        "trainer",
        tmp_path,
        *common,
        *model,
        "--steps",
        str(STEPS),
        "--linger",
        "--groups-per-step",
        "3",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-3",
        "--beta",
        "0.05",
        "--anchor-interval",
        "3",
        "--prompt-buffer",
        "6",
        "--consumer",
        "trainer-0",
    ).wait_ready()
    gen_a = start_service(
        "generator",
        tmp_path,
        *common,
        *model,
        "--trainer-address",
        trainer.grpc_address,
        "--consumer",
        "gen-a",
        "--max-inflight-groups",
        "8",
        tag="-a",
    ).wait_ready()
    reward = start_service(
        "reward", tmp_path, *common[:-2], "--output-stage", "scored", "--consumer", "reward-0"
    ).wait_ready()
    reference = start_service("reference", tmp_path, *common, *model, "--consumer", "reference-0").wait_ready()
    procs = [trainer, gen_a, reward, reference]
    try:
        write_malformed(rclient, keys)

        def step() -> int:
            return int(rclient.get(keys.version) or 0)

        # SIGKILL the reward stage mid-run and restart it under the same consumer name.
        wait_for(lambda: step() >= 2, 300, "step 2", procs)
        reward.kill()
        time.sleep(1.0)  # deliberate: the stage stays down a moment (the fault under test), then comes back
        reward = start_service(
            "reward", tmp_path, *common[:-2], "--output-stage", "scored", "--consumer", "reward-0"
        ).wait_ready()
        procs[2] = reward

        # A generator started late catches up from anchor + deltas.
        wait_for(lambda: step() >= 4, 300, "step 4", procs)
        gen_b = start_service(
            "generator",
            tmp_path,
            *common,
            *model,
            "--trainer-address",
            trainer.grpc_address,
            "--consumer",
            "gen-b",
            "--max-inflight-groups",
            "8",
            tag="-b",
        ).wait_ready()
        procs.append(gen_b)
        wait_for(
            lambda: generator_state(gen_b.grpc_address).policy_version >= 4, 120, "late generator to catch up", procs
        )

        # Committed steps (the trainer's own counter moves before its push and commit).
        wait_for(
            lambda: int(rclient.hget(keys.counters("trainer"), "step") or 0) >= STEPS,
            600,
            f"{STEPS} steps committed",
            procs,
        )

        # Exactness: every generator's engine weights equal the trainer's published bf16 weights.
        final = trainer_state(trainer.grpc_address, sha=True)
        assert final.version == STEPS
        for gen in (gen_a, gen_b):
            wait_for(
                lambda gen=gen: generator_state(gen.grpc_address).policy_version == STEPS,
                60,
                f"{gen.name} at version {STEPS}",
                procs,
            )
            state = generator_state(gen.grpc_address, sha=True)
            assert state.weights_sha256 == final.weights_sha256, f"{gen.name} weights differ from the trainer's"

        # Drain: no more generation; let reward and reference finish what is in flight.
        for gen in (gen_a, gen_b):
            assert gen.stop() == 0, f"{gen.name} did not stop cleanly on SIGTERM:\n{gen.log()[-3000:]}"
        for stage, group in (("rollouts", "reward"), ("scored", "reference")):
            key = keys.stream(stage)
            wait_for(
                lambda key=key, group=group: (
                    rclient.xpending(key, group)["pending"] == 0 and _undelivered(rclient, key, group) == 0
                ),
                120,
                f"{stage} drained",
                procs,
            )

        stats = read_counters(rclient, keys)[0]
        generated = {m.decode() for m in rclient.smembers(keys.groups("generated"))}
        trained = {m.decode() for m in rclient.smembers(keys.groups("trained"))}
        stale = {m.decode() for m in rclient.smembers(keys.groups("stale"))}
        in_ready = stream_group_ids(rclient, keys.stream("ready"))
        dead_ids = set()
        reasons = []
        for _eid, fields in rclient.xrange(keys.dead):
            letter = validation.decode(fields, rollout_pb2.DeadLetter)
            reasons.append((letter.source_stream.rsplit(":", 1)[-1], letter.reason))
            try:
                dead_ids.add(
                    validation.decode(
                        {k.encode(): v for k, v in letter.original_fields.items()}, rollout_pb2.RolloutGroup
                    ).group_id
                )
            except validation.EntryError:
                pass

        # Every malformed entry is in the dead-letter stream with a reason, one per stream.
        dead_streams = {s for s, _ in reasons}
        assert {"prompts", "rollouts", "scored", "ready"} <= dead_streams, reasons
        assert any("Nonsense" in r for s, r in reasons if s == "prompts"), reasons
        assert any("does not parse" in r for s, r in reasons if s == "rollouts"), reasons
        assert any("log-probs" in r for s, r in reasons if s == "scored"), reasons
        assert any("schema 99" in r for s, r in reasons if s == "ready"), reasons

        # Accounting: every generated group is trained, dropped as stale, dead, or still waiting
        # in `ready` (fed after the last step); the four sets are disjoint; none trained twice.
        assert stats["trained"] == len(trained) == STEPS * 3
        assert stats.get("stale", 0) == len(stale)
        parts = [trained, stale, dead_ids & generated, in_ready - trained - stale]
        assert sum(len(p) for p in parts) == len(set().union(*parts)), "a group is in two outcomes"
        assert generated == set().union(*parts), f"untraced groups: {generated - set().union(*parts)}"
        assert stats["pushes_applied"] >= STEPS  # generator A applied every version pushed to it
    finally:
        for p in reversed(procs):
            p.stop()


def _undelivered(client: redis.Redis, key: str, group: str) -> int:
    """Entries after the group's last-delivered id (Redis 6.2 has no `lag`)."""
    info = next(g for g in client.xinfo_groups(key) if g["name"].decode() == group)
    return len(client.xrange(key, min=b"(" + info["last-delivered-id"]))
