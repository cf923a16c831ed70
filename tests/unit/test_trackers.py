"""report_to (trainer/trackers.py): each backend writes steps, eval rounds and the run
configuration through its own library, and what it wrote is read back with that library's own
reader (tests/tracker_readers.py: TensorBoard's EventAccumulator, MLflow's MlflowClient, W&B's
DataStore over the offline run's .wandb file). A tracker that fails is logged once and turned
off; a missing extra fails at start with the pip command."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

import tracker_readers
from rollstream.core.config import ConfigError, load_settings
from rollstream.trainer import trackers
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trackers import Trackers
from rollstream.v1 import rollout_pb2

RUN = "trackers-demo"
# Exact in float32 and in decimal: read back equal, not close.
REWARDS = {1: 0.25, 2: 0.5, 3: 0.875}
LOSSES = {1: 0.125, 2: -0.0625, 3: 0.03125}
EVALS = {0: 0.25, 3: 0.75}  # eval/accuracy by step


def settings(tmp_path: Path, report_to: str) -> TrainerSettings:
    return load_settings(
        TrainerSettings,
        ["--report-to", report_to, "--tracker-dir", str(tmp_path / "trackers")],
        run=RUN,
        redis_password="hunter2",
    )


def write_run(s: TrainerSettings) -> None:
    """What the trainer writes: the configuration, three steps (StepMetrics and phase times, as
    log_step does), eval rounds at steps 0 and 3 (step 0's reported late, after step 1: an
    eval round is reported when its last group is in), and a NaN and a None that are left out."""
    t = Trackers.from_settings(s, RUN)
    assert sorted(t.backends) == sorted(s.report_to)
    t.log_config(trackers.run_config(s))
    for step in (1, 2, 3):
        metrics = rollout_pb2.StepMetrics(
            step=step, version=step, reward_mean=REWARDS[step], loss=LOSSES[step], groups=2, time=1.8e9 + step
        )
        t.log_metrics(trackers.step_metrics(metrics, {"forward_s": 0.5, "optimizer_s": 0.25}), step)
        if step == 1:
            t.log_metrics(
                trackers.eval_metrics(rollout_pb2.EvalMetrics(step=0, accuracy=EVALS[0], prompts=20, samples=1)), 0
            )
    t.log_metrics({"eval/accuracy": EVALS[3], "eval/pass_at_k": float("nan"), "eval/nothing": None}, 3)  # type: ignore[dict-item]  # a value that is no number, on purpose
    t.close()
    assert not t.backends


def assert_config(config: dict[str, object]) -> None:
    assert config["lr"] == 2e-5 and config["groups_per_step"] == 8 and config["token_budget"] == 4096
    assert "redis_url" not in config and "redis_password" not in config and "redis_password_file" not in config


def test_tensorboard_reads_back_every_step(tmp_path: Path) -> None:
    s = settings(tmp_path, "tensorboard")
    write_run(s)
    written = tracker_readers.tensorboard(tmp_path / "trackers")
    assert written.series["train/reward_mean"] == REWARDS
    assert written.series["train/loss"] == LOSSES
    assert written.series["train/groups"] == {1: 2.0, 2: 2.0, 3: 2.0}
    assert written.series["time/forward"] == {1: 0.5, 2: 0.5, 3: 0.5}
    assert written.series["eval/accuracy"] == EVALS
    assert written.series["eval/prompts"] == {0: 20.0}
    assert written.series["eval/pass_at_k"] == {0: 0.0}  # step 3's NaN left out
    assert (
        not {"train/step", "train/time", "eval/step", "eval/time", "eval/nothing"} & written.series.keys()
    )  # the x-axis, and no curve
    assert_config(written.config)
    assert written.config["report_to"] == ["tensorboard"]


def test_mlflow_file_store_reads_back_every_step(tmp_path: Path) -> None:
    s = settings(tmp_path, "mlflow")
    write_run(s)
    written, run = tracker_readers.mlflow(tmp_path / "trackers", RUN)
    assert run.info.run_name == RUN and run.info.status == "FINISHED"
    assert written.series["train/reward_mean"] == REWARDS
    assert written.series["train/loss"] == LOSSES
    assert written.series["eval/accuracy"] == EVALS
    assert written.series["eval/pass_at_k"] == {0: 0.0}  # step 3's NaN left out
    params = written.config  # text: strings as they are, the rest as JSON
    assert params["lr"] == "2e-05" and params["groups_per_step"] == "8" and params["token_budget"] == "4096"
    assert params["betas"] == "[0.9, 0.999]" and params["report_to"] == '["mlflow"]' and params["model"] == s.model
    assert "redis_url" not in params and "redis_password" not in params and "redis_password_file" not in params


def test_wandb_offline_run_reads_back_every_step(tmp_path: Path) -> None:
    s = settings(tmp_path, "wandb")
    write_run(s)
    written, records = tracker_readers.wandb(tmp_path / "trackers")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == RUN and run.display_name == RUN
    assert written.series["train/reward_mean"] == REWARDS
    assert written.series["train/loss"] == LOSSES
    # Step 0's round came in after step 1 was logged and is still there, at step 0.
    assert written.series["eval/accuracy"] == EVALS
    assert written.series["eval/pass_at_k"] == {0: 0.0}  # step 3's NaN left out
    assert_config(written.config)
    assert written.config["report_to"] == ["wandb"]


def test_run_config_leaves_secrets_out(tmp_path: Path) -> None:
    s = load_settings(
        TrainerSettings,
        [],
        redis_url="redis://:hunter2@db:6379/0",
        redis_password="hunter2",
        grpc_token_file="/run/secrets/t",
    )
    config = trackers.run_config(s)
    assert "hunter2" not in json.dumps(config)
    assert (
        not {"redis_url", "redis_password", "redis_password_file", "grpc_token_file", "redis_observer_password_file"}
        & config.keys()
    )
    assert config["token_budget"] == 4096 and config["max_new_tokens"] == 16 and config["betas"] == [0.9, 0.999]
    assert trackers.flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x"}


def test_no_report_to_no_trackers(tmp_path: Path) -> None:
    t = Trackers.from_settings(load_settings(TrainerSettings, []), RUN)
    assert not t.backends
    t.log_metrics({"train/loss": 1.0}, 1)
    t.close()
    assert not (tmp_path / "trackers").exists()


def test_a_missing_extra_fails_at_start_with_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert trackers.missing_extras(["tensorboard", "mlflow", "wandb"]) == ""  # the dev install has them all
    absent = {"tensorboard": "tensorboard", "mlflow": "rollstream_no_mlflow_here", "wandb": "rollstream_no_wandb_here"}
    assert (
        trackers.missing_extras(["wandb"], absent)
        == "report_to = ['wandb'] needs the rollstream_no_wandb_here package: pip install 'rollstream-trainer[wandb]'"
    )
    assert trackers.missing_extras(["tensorboard", "mlflow", "wandb"], absent) == (
        "report_to = ['tensorboard', 'mlflow', 'wandb'] needs the rollstream_no_mlflow_here and rollstream_no_wandb_here packages: "
        "pip install 'rollstream-trainer[mlflow,wandb]'"
    )
    # Through the settings, as the trainer (and `rollstream up`) load them: before any model.
    monkeypatch.setattr(trackers.WandB, "module", "rollstream_no_wandb_here")
    with pytest.raises(
        ConfigError,
        match=r"report_to = \['wandb'\] needs the rollstream_no_wandb_here package: pip install 'rollstream-trainer\[wandb\]'",
    ):
        settings(tmp_path, "wandb")


def failures(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The tracker_failed events' fields (logs.event puts them on the record)."""
    return [getattr(r, "fields") for r in caplog.records if r.getMessage() == "tracker_failed"]  # noqa: B009 - logs.event's attribute, not LogRecord's


def test_a_failing_tracker_is_logged_once_and_turned_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="rollstream.trainer")
    t = Trackers.from_settings(settings(tmp_path, "tensorboard,mlflow"), RUN)
    t.log_metrics({"train/loss": 0.5}, 1)
    # MLflow's store gone from under it (a disk swapped, a folder cleaned): its next write fails.
    shutil.rmtree(tmp_path / "trackers" / "mlruns")
    for step in (2, 3):
        t.log_metrics({"train/loss": 0.5}, step)
    t.close()
    (fields,) = failures(caplog)
    assert fields["tracker"] == "mlflow" and fields["doing"] == "logging step 2" and fields["turned_off"] is True
    # The other tracker went on.
    assert tracker_readers.tensorboard(tmp_path / "trackers").series["train/loss"] == {1: 0.5, 2: 0.5, 3: 0.5}


def test_a_tracker_that_cannot_open_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="rollstream.trainer")
    (tmp_path / "trackers").mkdir()
    (tmp_path / "trackers" / "mlruns").write_text("a file where MLflow's store would go")
    t = Trackers.from_settings(settings(tmp_path, "mlflow"), RUN)
    assert not t.backends
    t.log_metrics({"train/loss": 0.5}, 1)  # nothing to write to, nothing raised
    t.close()
    (fields,) = failures(caplog)
    assert fields["tracker"] == "mlflow" and fields["doing"] == "opening"
