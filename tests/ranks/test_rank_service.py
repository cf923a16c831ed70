"""The trainer service on N ranks under torchrun (ranks.py, follower.py) against one process:
the same groups, written straight into the ready stream, train to the same weights, bit for
bit, with the same per-step metrics; and a rank killed with SIGKILL at a random moment (seeded:
before, between or inside steps and checkpoints) ends the job, whose restart, at another
world size, resumes from the last sharded checkpoint, replays the trained log and ends with
those same weights, every group trained exactly once in the ledger."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from helpers import assert_trained_once, committed_step, wait_for, write_ready
from procs import ServiceProc, start_service, trainer_state
from rollstream.core import redis_policy, run_keys, validation
from rollstream.v1 import rollout_pb2
from synthetic import Decode, scored_groups

pytestmark = pytest.mark.ranks

STEPS = 6
GROUPS_PER_STEP = 2
# torchrun, N interpreters importing torch and the model, on a loaded 2-core machine.
START_S = 600
RUN_S = 900


def trainer_args(redis_url: str, keys: run_keys.RunKeys, model: Path, ckpt: Path) -> list[str]:
    """The run's settings; the model exported at its end in float32 (the fp32 masters: on N
    ranks read back from the final checkpoint's shards) beside the checkpoints."""
    return [
        *("--export-dir", str(ckpt.parent / "export"), "--export-dtype", "float32"),
        *("--redis-url", redis_url, "--run", keys.run, "--model", str(model), "--threads", "1"),
        *("--consumer", "trainer-0", "--groups-per-step", str(GROUPS_PER_STEP), "--group-size", "4"),
        *("--max-new-tokens", "6", "--prompt-buffer", "2", "--lr", "1e-3", "--max-staleness", "100"),
        *("--block-ms", "100", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"),
        # Small micro-batches: every step has several, so each rank runs some.
        *("--token-budget", "24", "--resume", "auto", "--linger"),
    ]


def fill_ready(client: redis.Redis, keys: run_keys.RunKeys, decode: Decode) -> None:
    for step in range(1, STEPS + 1):
        write_ready(client, keys, scored_groups(step, GROUPS_PER_STEP, "g"), decode)


def metrics(client: redis.Redis, keys: run_keys.RunKeys) -> dict[int, rollout_pb2.StepMetrics]:
    out = {}
    for _id, fields in client.xrange(keys.metrics):
        m = validation.decode(fields, rollout_pb2.StepMetrics)
        out[m.step] = m
    return out


def run_to_end(service: ServiceProc, client: redis.Redis, keys: run_keys.RunKeys) -> str:
    """Wait for the last step's commit; the weights' sha256."""
    wait_for(
        lambda: trainer_state(service.grpc_address).step == STEPS and committed_step(client, keys) == STEPS,
        RUN_S,
        f"step {STEPS}",
        [service],
    )
    return trainer_state(service.grpc_address, sha=True).weights_sha256


def exported(root: Path, service: ServiceProc) -> dict[str, torch.Tensor]:
    """The run's export (written once its last step is committed, before it lingers)."""
    folder = root / "export"
    wait_for(lambda: any(folder.glob("*.safetensors")) and "exported" in service.log(), RUN_S, "the export", [service])
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights |= load_file(file)
    return weights


def rank_pids(torchrun: ServiceProc, n: int) -> list[int]:
    """The ranks' processes: torchrun's children (of any of its threads), in rank order (started
    in that order); waits until all are there."""
    tasks = Path(f"/proc/{torchrun.proc.pid}/task")

    def children() -> list[int]:
        return sorted(int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split())

    wait_for(lambda: len(children()) == n, RUN_S, f"{n} ranks", [torchrun])
    return children()


@pytest.fixture(scope="module")
def one_process(redis_server, tiny_model_dir: Path, tiny_decode: Decode, tmp_path_factory: pytest.TempPathFactory):
    """The one-process trainer's run: its weights' sha256 and its step metrics."""
    tmp = tmp_path_factory.mktemp("one-process")
    keys = run_keys.RunKeys("one" + str(time.time_ns())[-8:])
    client = redis_policy.connect(redis_server.url)
    fill_ready(client, keys, tiny_decode)
    service = start_service("trainer", tmp, *trainer_args(redis_server.url, keys, tiny_model_dir, tmp / "ckpt"))
    try:
        sha = run_to_end(service.wait_ready(START_S), client, keys)
        return sha, metrics(client, keys), exported(tmp, service)
    finally:
        service.stop()
        client.close()


def same_metrics(ours: dict[int, rollout_pb2.StepMetrics], theirs: dict[int, rollout_pb2.StepMetrics]) -> None:
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    for step, m in ours.items():
        ref = theirs[step]
        assert (m.version, m.groups, m.tokens, m.delta_bytes) == (ref.version, ref.groups, ref.tokens, ref.delta_bytes)
        # Sums over the ranks in fp64, grouped otherwise than one process's: equal to rounding.
        assert m.loss == pytest.approx(ref.loss, rel=1e-6, abs=1e-9)
        assert m.grad_norm == pytest.approx(ref.grad_norm, rel=1e-9)


def test_two_ranks_train_as_one_process(
    one_process,
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    ref_sha, ref_metrics, ref_export = one_process
    fill_ready(rclient, keys, tiny_decode)
    service = start_service(
        "trainer", tmp_path, *trainer_args(redis_url, keys, tiny_model_dir, tmp_path / "ckpt"), ranks=2
    )
    try:
        assert run_to_end(service.wait_ready(START_S), rclient, keys) == ref_sha
        same_metrics(metrics(rclient, keys), ref_metrics)
        ours = exported(tmp_path, service)
        assert ours.keys() == ref_export.keys()
        for name, t in ref_export.items():
            assert t.dtype == torch.float32 and torch.equal(ours[name], t), name
    finally:
        service.stop()


@pytest.mark.parametrize(("seed", "first", "then"), [(0, 2, 4), (1, 2, 1), (2, 4, 2), (3, 2, 2)])
def test_a_rank_killed_resumes_at_another_world_size(
    seed: int,
    first: int,
    then: int,
    one_process,
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    ref_sha, ref_metrics, _ = one_process
    fill_ready(rclient, keys, tiny_decode)
    args = trainer_args(redis_url, keys, tiny_model_dir, tmp_path / "ckpt")
    job = start_service("trainer", tmp_path, *args, tag="-first", ranks=first)
    rng = random.Random(seed)
    target = rng.randrange(STEPS - 2)  # 0: before the first step's commit
    wait_for(lambda: committed_step(rclient, keys) >= target, RUN_S, f"step {target}", [job], poll_s=0.02)
    time.sleep(rng.uniform(0, 1.0))  # deliberate: the kill lands at a random moment of what follows (a step takes ~1 s)
    pids = rank_pids(job, first)
    victim = rng.randrange(len(pids))
    killed_at = committed_step(rclient, keys)
    os.kill(pids[victim], signal.SIGKILL)
    print(f"seed {seed}: rank {victim} of {first} killed after step {killed_at}")  # (-s shows which case)
    job.proc.wait(timeout=RUN_S)  # torchrun ends the other ranks and exits
    assert job.proc.returncode != 0, "torchrun said success with a rank killed"
    second = start_service("trainer", tmp_path, *args, tag="-second", ranks=then)
    try:
        assert run_to_end(second.wait_ready(START_S), rclient, keys) == ref_sha, f"killed after step {killed_at}"
        # Every step's metrics were written once, by whichever job committed it.
        same_metrics(metrics(rclient, keys), ref_metrics)
        assert_trained_once(rclient, keys, STEPS * GROUPS_PER_STEP)
    finally:
        second.stop()
