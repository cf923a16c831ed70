"""report_to through a real trainer process (tiny model, real Redis): three steps trained with
TensorBoard, MLflow and W&B (offline) at once; each tracker, read back with its own library
(tests/tracker_readers.py), holds every step's reward and loss as steps.jsonl has them, with
the right step numbers, and the run's configuration without its secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

import tracker_readers
from helpers import MIN_WAIT_S, wait_for, write_ready
from procs import start_service
from rollstream.core import run_keys, steplog
from synthetic import Decode, scored_groups

STEPS = 3


def test_a_trainer_reports_every_step_to_tensorboard_mlflow_and_wandb(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    write_ready(rclient, keys, [g for step in range(1, STEPS + 1) for g in scored_groups(step, 1)], tiny_decode)
    trackers, steps_file = tmp_path / "trackers", tmp_path / "steps.jsonl"
    trainer = start_service(
        "trainer", tmp_path,
        "--redis-url", redis_url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1",
        "--groups-per-step", "1", "--group-size", "4", "--max-new-tokens", "6", "--prompt-buffer", "2", "--lr", "1e-3",
        "--max-staleness", "100", "--block-ms", "100", "--steps", str(STEPS),
        "--report-to", "tensorboard,mlflow,wandb", "--tracker-dir", str(trackers), "--metrics-file", str(steps_file),
    )  # fmt: skip
    try:
        # It ends by itself after its last step, closing the trackers on the way out.
        wait_for(
            lambda: trainer.proc.poll() is not None,
            300,
            f"the trainer to finish {STEPS} steps and exit",
            details=lambda: trainer.log()[-3000:],
        )
        assert trainer.proc.returncode == 0, trainer.log()
    finally:
        trainer.stop(MIN_WAIT_S)
    assert "tracker_failed" not in trainer.log()
    steps = steplog.read(steps_file).steps
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    rewards = {s["step"]: s["reward_mean"] for s in steps}
    losses = {s["step"]: s["loss"] for s in steps}
    assert len(set(losses.values())) > 1, losses  # figures that move: a step mixed up would show

    tb = tracker_readers.tensorboard(trackers)
    ml, ml_run = tracker_readers.mlflow(trackers, keys.run)
    wb, _ = tracker_readers.wandb(trackers)
    for name, written in (("tensorboard", tb), ("mlflow", ml), ("wandb", wb)):
        # TensorBoard keeps float32 scalars; steps.jsonl has them at their 7 significant digits.
        assert written.series["train/reward_mean"] == pytest.approx(rewards, rel=1e-6), name
        assert written.series["train/loss"] == pytest.approx(losses, rel=1e-6, abs=1e-12), name
        assert set(written.series["time/forward"]) == set(range(1, STEPS + 1)), name
    assert ml_run.info.status == "FINISHED" and ml.config["run"] == keys.run and ml.config["groups_per_step"] == "1"
    for config in (tb.config, wb.config):
        assert (
            config["run"] == keys.run
            and config["groups_per_step"] == 1
            and config["report_to"] == ["tensorboard", "mlflow", "wandb"]
        )
        assert "redis_url" not in config
    assert "redis_url" not in ml.config
