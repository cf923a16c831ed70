"""A real trainer process resumed from a checkpoint continues exactly, and brings a generator
that is ahead of it (on the abandoned lineage) back to the restored version.

Trainer A trains 4 steps on scored groups written straight into the ready stream (the test
plays the upstream stages), checkpointing every step (the trained log then reaches back to
step 3, the spare), and the operator saves a checkpoint at step 2; a real generator follows
it by pushes. Trainer B, on the same run and port, resumes from the operator's step-2
checkpoint, older than the log reaches (so steps 3 and 4 are not replayed): it moves the
run's version back to 2, pushes an anchor that the generator (at version 4) takes, drops
a group sampled by the abandoned lineage, and trained on the same groups it reaches A's
step-4 weights bit for bit, with the same losses.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import redis

from helpers import wait_for, write_ready
from procs import ServiceProc, free_port, generator_state, start_service, trainer_state
from rollstream.core import run_keys, validation
from rollstream.core.grpc_utils import channel
from rollstream.trainer import checkpoint
from rollstream.v1 import rollout_pb2, trainer_pb2, trainer_pb2_grpc
from synthetic import Decode, scored_groups

GROUPS_PER_STEP = 2


def groups_for(step: int, tag: str) -> list[rollout_pb2.RolloutGroup]:
    """The same content for a step whatever the tag (group ids must differ: the trainer
    deduplicates by group id, and A trained the first copies)."""
    return scored_groups(step, GROUPS_PER_STEP, tag, group_size=2)  # the run's --group-size


def save_checkpoint(address: str, path: str) -> trainer_pb2.SaveCheckpointResult:
    with channel(address) as ch:
        return trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=path), timeout=120
        )


def step_metrics(client: redis.Redis, keys: run_keys.RunKeys) -> list[rollout_pb2.StepMetrics]:
    return [validation.decode(fields, rollout_pb2.StepMetrics) for _id, fields in client.xrange(keys.metrics)]


def test_resumed_trainer_process_continues_exactly(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    dir_a, dir_b = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    common = [
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--grpc-port",
        str(port),
        "--consumer",
        "trainer-0",
        "--groups-per-step",
        str(GROUPS_PER_STEP),
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--prompt-buffer",
        "2",
        "--lr",
        "1e-3",
        "--max-staleness",
        "100",
        "--block-ms",
        "100",
        "--steps",
        "4",
        "--checkpoint-every",
        "1",
        "--linger",
    ]
    a = start_service("trainer", tmp_path, *common, "--checkpoint-dir", str(dir_a), tag="-a").wait_ready()
    gen = start_service(
        "generator",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--trainer-address",
        address,
        "--consumer",
        "gen-0",
        "--max-inflight-groups",
        "1",
        "--sync-interval-s",
        "0.5",
        "--block-ms",
        "100",
        tag="-gen",
    ).wait_ready()
    procs = [a, gen]
    b: ServiceProc | None = None
    try:
        wait_for(lambda: generator_state(gen.grpc_address).policy_version == 0, 60, "generator at version 0", procs)
        for step in range(1, 3):
            write_ready(rclient, keys, groups_for(step, "first"), tiny_decode)
        wait_for(lambda: trainer_state(address).step == 2, 120, "trainer A at step 2", procs)
        # An explicit path (inside the checkpoint folder: anywhere else is refused,
        # tests/integration/test_grpc_auth_services.py) is the operator's: written once, never
        # overwritten, never pruned.
        manual = dir_a / "manual"
        result = save_checkpoint(address, str(manual))
        assert (result.path, result.version) == (str(manual), 2)
        assert checkpoint.load_state(manual).step == 2
        for step in range(3, 5):
            write_ready(rclient, keys, groups_for(step, "first"), tiny_decode)
        wait_for(lambda: trainer_state(address).step == 4, 120, "trainer A at step 4", procs)
        final_a = trainer_state(address, sha=True)
        wait_for(lambda: generator_state(gen.grpc_address).policy_version == 4, 60, "generator at version 4", procs)
        assert generator_state(gen.grpc_address, sha=True).weights_sha256 == final_a.weights_sha256

        # SaveCheckpoint: the default path is the step's folder (written by checkpoint_every
        # already, and written again); the latest two of the trainer's own are kept.
        # Written after the step is committed (and GetState says 4): waited for, not read at once.
        wait_for(lambda: (dir_a / "step-00000004" / "state.json").is_file(), 120, "step 4's checkpoint", procs)
        result = save_checkpoint(address, "")
        assert (result.path, result.version) == (str(dir_a / "step-00000004"), 4)
        assert checkpoint.load_state(dir_a / "step-00000004").version == 4
        assert sorted(p.name for p in dir_a.iterdir()) == ["manual", "step-00000003", "step-00000004"]  # no leftovers
        with pytest.raises(grpc.RpcError) as err:
            save_checkpoint(address, str(manual))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert a.stop() == 0
        metrics_a = step_metrics(rclient, keys)
        assert [m.step for m in metrics_a] == [1, 2, 3, 4]

        # B resumes from the operator's step-2 checkpoint, same run, same address.
        b = start_service(
            "trainer", tmp_path, *common, "--checkpoint-dir", str(dir_b), "--resume", str(manual), tag="-b"
        ).wait_ready()
        procs = [b, gen]
        assert int(rclient.get(keys.version)) == 2  # the run's version moved back
        restored = trainer_state(address, sha=True)
        assert (restored.step, restored.version, restored.groups_trained) == (2, 2, 4)
        # The generator was at version 4 of the abandoned lineage; the anchor brings it back.
        wait_for(
            lambda: generator_state(gen.grpc_address).policy_version == 2, 60, "generator back at version 2", procs
        )
        assert generator_state(gen.grpc_address, sha=True).weights_sha256 == restored.weights_sha256
        assert restored.weights_sha256 != final_a.weights_sha256

        # A group sampled by version 3 of the abandoned lineage is dropped as stale, not trained.
        future = groups_for(9, "future")[0]
        future.policy_version = 3
        write_ready(rclient, keys, [future], tiny_decode)
        for step in (3, 4):
            write_ready(rclient, keys, groups_for(step, "again"), tiny_decode)
        wait_for(lambda: trainer_state(address).step == 4, 120, "trainer B at step 4", procs)
        final_b = trainer_state(address, sha=True)
        # The step's commit (metrics) and then its checkpoint come after the step itself.
        wait_for(lambda: (dir_b / "step-00000004" / "state.json").is_file(), 60, "B's step-4 checkpoint", procs)
        assert final_b.weights_sha256 == final_a.weights_sha256  # bit for bit
        assert rclient.sismember(keys.groups("stale"), future.group_id)
        assert not rclient.sismember(keys.groups("trained"), future.group_id)
        wait_for(
            lambda: generator_state(gen.grpc_address).policy_version == 4, 60, "generator at version 4 again", procs
        )
        assert generator_state(gen.grpc_address, sha=True).weights_sha256 == final_b.weights_sha256

        metrics_b = step_metrics(rclient, keys)[4:]
        assert [m.step for m in metrics_b] == [3, 4]
        for ma, mb in zip(metrics_a[2:], metrics_b, strict=True):
            assert (mb.loss, mb.grad_norm, mb.tokens, mb.version) == (ma.loss, ma.grad_norm, ma.tokens, ma.version)
        # B's own step-4 checkpoint holds the same optimizer state as A's, byte for byte.
        optimizer_file = "step-00000004/" + checkpoint.OPTIMIZER_FILE
        assert (dir_b / optimizer_file).read_bytes() == (dir_a / optimizer_file).read_bytes()
        assert b.stop() == 0
    finally:
        for p in [a, gen, *([b] if b is not None else [])]:
            p.stop()
