"""Issue 27 (F1): an operator's SaveCheckpoint cannot shadow or prune the trainer's own
checkpoints, resume takes the latest by the step a checkpoint records, a torn latest falls
back to the spare without losing a step, and a finished run keeps its final checkpoint.

Before the fix, SaveCheckpoint("step-99999999") was written into the checkpoint folder;
checkpoints were ranked by the number in their name, so every real one after it was pruned
at once and the next restart resumed from it (steps logged as `steps_not_replayable`).

One real trainer process (A) trains 7 steps on scored groups written straight into the
ready stream (the test plays the upstream stages), a checkpoint every 2 steps and the final
one at step 7, the default keep (2: the latest and a spare). Then B resumes with
`--resume auto` (the real latest: step 7, nothing to replay), and C resumes after the latest
has been torn by hand (the spare, step 6, then step 7 replayed from the trained log).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import redis

from helpers import wait_for, write_ready
from procs import ServiceProc, free_port, start_service, trainer_state
from rollstream.core import run_keys
from rollstream.core.grpc_utils import channel
from rollstream.trainer import checkpoint
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc
from synthetic import Decode, scored_groups

GROUPS_PER_STEP = 2
STEPS = 7


def save_checkpoint(address: str, path: str) -> trainer_pb2.SaveCheckpointResult:
    with channel(address) as ch:
        return trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=path), timeout=120
        )


def feed(client: redis.Redis, keys: run_keys.RunKeys, steps: range, decode: Decode) -> None:
    for step in steps:
        write_ready(client, keys, scored_groups(step, GROUPS_PER_STEP, "ns", group_size=2), decode)


def kept_line(proc: ServiceProc, step: int) -> str:
    """The trainer's `checkpoints_kept` line after its checkpoint at `step` (written once the
    new checkpoint is in place, the old ones pruned and the trained log trimmed), or ''."""
    return next(
        (line for line in proc.log().splitlines() if " checkpoints_kept " in line and f" step={step} " in line), ""
    )


def trainer_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_operator_checkpoints_never_shadow_or_prune_the_trainers(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    root = tmp_path / "ckpt"
    args = [
        "--redis-url", redis_url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1",
        "--grpc-port", str(port), "--consumer", "trainer-0", "--groups-per-step", str(GROUPS_PER_STEP),
        "--group-size", "2", "--max-new-tokens", "6", "--prompt-buffer", "2", "--lr", "1e-3",
        "--max-staleness", "100", "--block-ms", "100", "--steps", str(STEPS), "--linger",
        "--checkpoint-dir", str(root), "--checkpoint-every", "2", "--resume", "auto",
    ]  # fmt: skip
    procs: list[ServiceProc] = []
    try:
        a = start_service("trainer", tmp_path, *args, tag="-a").wait_ready()
        procs.append(a)
        feed(rclient, keys, range(1, 3), tiny_decode)
        wait_for(
            lambda: (root / "step-00000002" / checkpoint.STATE_FILE).is_file(), 120, "A's step-2 checkpoint", procs
        )

        # The trainer's own names are refused, with the reason; nothing is written.
        with pytest.raises(grpc.RpcError) as err:
            save_checkpoint(address, "step-99999999")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the trainer's own" in err.value.details()
        assert not (root / "step-99999999").exists()
        # Under any other name it is the operator's: written once, never pruned, never resumed from.
        result = save_checkpoint(address, "operator/step-99999999")
        assert Path(result.path) == root.resolve() / "operator" / "step-99999999"

        feed(rclient, keys, range(3, STEPS + 1), tiny_decode)
        # Step 7 is no multiple of 2: its checkpoint is the final one of a finished run.
        wait_for(lambda: kept_line(a, STEPS), 180, "A's final checkpoint, pruned", procs)
        final = trainer_state(address, sha=True)
        assert final.step == STEPS
        # The latest and one spare; the operator's untouched; the trained log holds what the
        # spare needs replayed (step 7) and nothing older.
        assert trainer_names(root) == ["operator", "step-00000006", "step-00000007"]
        assert checkpoint.verify(root / "operator" / "step-99999999").step == 2
        assert [int(f[b"step"]) for _, f in rclient.xrange(keys.trained_log)] == [STEPS] * GROUPS_PER_STEP
        assert "dir_mb=" in kept_line(a, STEPS)
        assert a.stop() == 0

        # B: `auto` takes the real latest; nothing is lost, nothing replayed.
        b = start_service("trainer", tmp_path, *args, tag="-b").wait_ready()
        procs.append(b)
        state = trainer_state(address, sha=True)
        assert (state.step, state.version, state.weights_sha256) == (STEPS, STEPS, final.weights_sha256)
        assert rclient.hget(keys.counters("trainer"), "steps_lost_on_resume") is None
        assert str(root / "step-00000007") in b.log()
        assert b.stop() == 0

        # C: the latest torn (its optimizer file cut short): the spare and the trained log
        # give the same weights, bit for bit; the final checkpoint is written whole again.
        optimizer_file = root / "step-00000007" / checkpoint.OPTIMIZER_FILE
        with open(optimizer_file, "r+b") as f:
            f.truncate(optimizer_file.stat().st_size // 2)
        c = start_service("trainer", tmp_path, *args, tag="-c").wait_ready()
        procs.append(c)
        state = trainer_state(address, sha=True)
        assert (state.step, state.weights_sha256) == (STEPS, final.weights_sha256)
        assert rclient.hget(keys.counters("trainer"), "steps_lost_on_resume") is None
        assert "checkpoint_unusable" in c.log() and str(root / "step-00000006") in c.log()
        wait_for(lambda: kept_line(c, STEPS), 60, "C's final checkpoint", [c])  # A and B have exited: only C is watched
        assert checkpoint.verify(root / "step-00000007").step == STEPS
        assert trainer_names(root) == ["operator", "step-00000006", "step-00000007"]
        assert c.stop() == 0
    finally:
        for p in procs:
            p.stop()
