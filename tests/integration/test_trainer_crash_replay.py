"""kill -9 of the trainer at a random moment, then a resume, loses no trained work: the
groups trained after its last checkpoint are trained again from the trained log, and the
run ends with the same weights, bit for bit, and the same per-step losses as a run that
was never interrupted. Nothing is trained twice in the ledger either.

Both runs train 6 steps on the same groups written straight into the ready stream (the
test plays the upstream stages), with a checkpoint every 3 steps. The kill moment is drawn
from a seeded RNG: a step k to reach (0 to 5), then a delay of up to 1.5 of the uninterrupted
run's mean step time, so before the first step, between steps, mid-step and mid-checkpoint
are all possible; each seed is a reproducible case. No generator reads the weights here, so
every step's update runs on while the next step starts (the trainer's optimizer_overlap):
a kill mid-step is also a kill mid-overlap.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import redis

from helpers import assert_trained_once, committed_step, wait_for, write_ready
from procs import start_service, trainer_state
from rollstream.core import redis_policy, run_keys, validation
from rollstream.v1 import rollout_pb2
from synthetic import Decode, scored_groups

STEPS = 6
GROUPS_PER_STEP = 2


def trainer_args(redis_url: str, keys: run_keys.RunKeys, model: Path, ckpt: Path) -> list[str]:
    return [
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(model),
        "--threads",
        "1",
        "--consumer",
        "trainer-0",
        "--groups-per-step",
        str(GROUPS_PER_STEP),
        "--group-size",
        "4",
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
        str(STEPS),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "3",
        "--resume",
        "auto",
        "--linger",
    ]


def fill_ready(client: redis.Redis, keys: run_keys.RunKeys, decode: Decode) -> None:
    for step in range(1, STEPS + 1):
        write_ready(client, keys, scored_groups(step, GROUPS_PER_STEP, "g"), decode)


def losses(client: redis.Redis, keys: run_keys.RunKeys) -> dict[int, tuple[float, float]]:
    out = {}
    for _id, fields in client.xrange(keys.metrics):
        m = validation.decode(fields, rollout_pb2.StepMetrics)
        out[m.step] = (m.loss, m.grad_norm)
    return out


@pytest.fixture(scope="module")
def reference_run(
    redis_server, tiny_model_dir: Path, tiny_decode: Decode, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[int, tuple[float, float]], float]:
    """The uninterrupted run: final weights' sha256, per-step (loss, grad norm), mean step time."""
    tmp = tmp_path_factory.mktemp("reference-run")
    keys = run_keys.RunKeys("ref" + str(time.time_ns())[-8:])
    client = redis_policy.connect(redis_server.url)
    fill_ready(client, keys, tiny_decode)
    t = start_service("trainer", tmp, *trainer_args(redis_server.url, keys, tiny_model_dir, tmp / "ckpt")).wait_ready()
    started = time.monotonic()
    try:
        wait_for(
            lambda: trainer_state(t.grpc_address).step == STEPS and committed_step(client, keys) == STEPS,
            300,
            f"step {STEPS}",
            [t],
        )
        step_s = (time.monotonic() - started) / STEPS
        sha = trainer_state(t.grpc_address, sha=True).weights_sha256
        return sha, losses(client, keys), step_s
    finally:
        t.stop()
        client.close()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_trainer_killed_at_a_random_moment_resumes_bit_exact(
    seed: int,
    reference_run,
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    ref_sha, ref_losses, step_s = reference_run
    fill_ready(rclient, keys, tiny_decode)
    args = trainer_args(redis_url, keys, tiny_model_dir, tmp_path / "ckpt")
    first = start_service("trainer", tmp_path, *args, tag="-first")
    rng = random.Random(seed)
    target = rng.randrange(STEPS)
    wait_for(lambda: committed_step(rclient, keys) >= target, 300, f"step {target}", [first], poll_s=0.02)
    time.sleep(rng.uniform(0, 1.5 * step_s))  # deliberate: the kill lands at a random moment of the next step
    killed_at = committed_step(rclient, keys)
    first.kill()
    print(f"seed {seed}: killed after step {killed_at} of {STEPS}")  # which case this seed is (-s shows it)

    second = start_service("trainer", tmp_path, *args, tag="-second").wait_ready()
    try:
        wait_for(
            lambda: trainer_state(second.grpc_address).step == STEPS and committed_step(rclient, keys) == STEPS,
            300,
            f"step {STEPS} after the restart",
            [second],
        )
        state = trainer_state(second.grpc_address, sha=True)
        assert state.weights_sha256 == ref_sha, f"killed at step {killed_at}: weights differ from the uninterrupted run"
        # Every step's metrics were written once, by whichever process committed it, and agree.
        assert losses(rclient, keys) == ref_losses
        # The ledger: every group trained exactly once, nothing left pending, nothing dead.
        assert_trained_once(rclient, keys, STEPS * GROUPS_PER_STEP)
    finally:
        second.stop()
