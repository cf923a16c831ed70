"""`rollstream up` as a user runs it: all services as local processes, progress lines,
a clean stop on Ctrl-C (SIGINT) with nothing left running, and `rollstream status`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis

from helpers import MIN_WAIT_S, still_running, wait_for
from procs import alive
from rollstream.core import steplog, validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

pytestmark = pytest.mark.e2e


def rollstream_cmd() -> str:
    return str(Path(sys.executable).parent / "rollstream")


def four_small_steps(
    model_dir: Path, redis_url: str, run_name: str, workdir: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    """`up --steps 4` on the tiny model with small groups, to the end; its output."""
    cmd = [
        rollstream_cmd(),
        "up",
        "--model",
        str(model_dir),
        "--trainer.steps",
        "4",
        "--run",
        run_name,
        "--workdir",
        str(workdir),
        "--redis-url",
        redis_url,
        "--trainer.group-size",
        "4",
        "--trainer.groups-per-step",
        "2",
        "--trainer.max-new-tokens",
        "6",
        "--threads",
        "1",
        "--colocate",
        "off",
        *flags,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def step_metrics(rclient: redis.Redis, keys: RunKeys) -> list[rollout_pb2.StepMetrics]:
    metrics = [validation.decode(fields, rollout_pb2.StepMetrics) for _id, fields in rclient.xrange(keys.metrics)]
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    return metrics


def test_up_runs_steps_and_stops_cleanly_on_ctrl_c(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    cmd = [
        rollstream_cmd(),
        "up",
        "--model",
        str(tiny_model_dir),
        "--trainer.steps",
        "1000000",
        "--run",
        run_name,
        "--workdir",
        str(tmp_path),
        "--redis-url",
        redis_url,
        "--trainer.group-size",
        "4",
        "--trainer.groups-per-step",
        "2",
        "--trainer.max-new-tokens",
        "6",
        "--threads",
        "1",
        "--trainer.beta",
        "0.05",
        "--colocate",
        "off",  # the services as processes of their own (the demo profile colocates the generator)
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    keys = RunKeys(run_name)
    try:
        wait_for(lambda: rclient.xlen(keys.metrics) >= 3, 300, "3 steps", check=still_running(proc, "up"), poll_s=0.5)
        pids = {p.stem: json.loads(p.read_text())["pid"] for p in (tmp_path / "state").glob("*.json")}
        assert set(pids) == {"trainer", "generator-0", "reward-0", "reference-0"}

        status = subprocess.run(
            [rollstream_cmd(), "status", "--redis-url", redis_url, "--run", run_name],
            capture_output=True,
            text=True,
            timeout=MIN_WAIT_S,
        )
        assert status.returncode == 0, status.stderr
        assert keys.stream("ready") in status.stdout and "trained=" in status.stdout
        assert (
            "groups: generated " in status.stdout and " evaluated " in status.stdout
        )  # the demo profile's held-out rounds
        # every stage has its consumer, the generator its version, and one diagnosis line
        assert "generator-0 v" in status.stdout and "reference: reference-0" in status.stdout
        assert any(
            line.startswith(("bottleneck: ", "ok: ", "warning: ", "STUCK: ")) for line in status.stdout.splitlines()
        ), status.stdout

        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=MIN_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "step   1/1000000" in out and "done" in out
    # Stopped, it leaves the model it trained (trainer/export.py), and says where.
    assert (
        json.loads((tmp_path / "model" / "rollstream-export.json").read_text())["step"] >= 3
        and f"model: {tmp_path / 'model'}" in out
    )
    # The step line's loss in significant digits (GRPO's is ~1e-8), with the gradient norm and the completion length.
    assert re.search(
        r"step 1/1000000 reward \S+ ±\S+ loss [+-]\S+ grad norm \S+ length \S+ tokens staleness", " ".join(out.split())
    ), out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] >= 3 and len(summary["reward_curve"]) == summary["steps"]
    assert not [name for name, pid in pids.items() if alive(pid)], "services left running after Ctrl-C"
    for name in pids:
        assert "stopped" in (tmp_path / "logs" / f"{name}.log").read_text(), f"{name} did not shut down cleanly"


def test_up_with_lora_base_reference_runs_no_reference_service(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """LoRA with kl_reference = lora_base: the KL trains against the trainer's own base, the
    reward stage writes straight to `ready`, and no reference service is started."""
    done = four_small_steps(
        tiny_model_dir,
        redis_url,
        run_name,
        tmp_path,
        "--trainer.beta",
        "0.05",
        "--trainer.lr",
        "1e-2",
        "--trainer.lora-rank",
        "4",
        "--trainer.kl-reference",
        "lora_base",
    )
    assert {p.stem for p in (tmp_path / "state").glob("*.json")} == {"trainer", "generator-0", "reward-0"}
    keys = RunKeys(run_name)
    metrics = step_metrics(rclient, keys)
    # Version 0 is the base: no KL at the first step. (The tiny random model earns no reward,
    # so nothing moves it later; tests/unit/test_lora.py shows the KL growing under training.)
    assert metrics[0].kl == 0.0
    assert rclient.xlen(keys.stream("scored")) == 0 and rclient.xlen(keys.stream("dead")) == 0
    # The step log (one line per step, with the phase times) and the curve drawn from it.
    log = steplog.read(tmp_path / steplog.FILE_NAME)
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4] and not log.skipped
    assert all(
        r["forward_s"] > 0 and r["optimizer_s"] > 0 and r["push_s"] >= 0 and r["run"] == run_name for r in log.steps
    )
    assert (
        f"curves: {tmp_path / 'curves.png'}" in done.stderr
        and (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    )
    # A LoRA run's model is its PEFT adapter folder, of the last step.
    assert (
        json.loads((tmp_path / "model" / "rollstream-export.json").read_text())["step"] == 4
        and (tmp_path / "model" / "adapter_config.json").is_file()
    )


def test_up_synchronous_trains_every_group_on_the_weights_that_sampled_it(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """--max-staleness 0: the generator samples a batch only once the last one is trained, so
    every step trains groups of the version before it, and none is sampled only to be dropped."""
    four_small_steps(
        tiny_model_dir,
        redis_url,
        run_name,
        tmp_path,
        "--trainer.max-staleness",
        "0",
        "--trainer.tis-cap",
        "2",
        "--trainer.loss",
        "dapo",
        "--trainer.lr",
        "1e-3",
    )
    keys = RunKeys(run_name)
    metrics = step_metrics(rclient, keys)
    assert [m.mean_staleness for m in metrics] == [0.0] * 4
    assert [m.clip_fraction for m in metrics] == [0.0] * 4  # truncated IS replaces the clip
    stats = read_counters(rclient, keys)[0]
    assert stats.get("stale", 0) == 0 and stats["trained"] == 8
    # Never more than the next step's batch sampled ahead (it may have started after step 4),
    # beside the demo profile's held-out rounds (32 groups before step 1 and after step 4).
    assert stats["evaluated"] == 64 and stats["generated"] - stats["evaluated"] <= 8 + 2, stats


def test_up_refuses_a_negative_max_staleness(tmp_path: Path) -> None:
    done = subprocess.run(
        [rollstream_cmd(), "up", "--trainer.max-staleness", "-1", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=MIN_WAIT_S,
    )
    assert done.returncode == 2 and "trainer.max_staleness" in done.stderr


def test_up_refuses_lora_base_without_lora(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            rollstream_cmd(),
            "up",
            "--workdir",
            str(tmp_path),
            "--trainer.beta",
            "0.1",
            "--trainer.kl-reference",
            "lora_base",
        ],
        capture_output=True,
        text=True,
        timeout=MIN_WAIT_S,
    )
    assert done.returncode == 2 and "lora_rank" in done.stderr


def test_services_die_with_a_killed_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    """kill -9 of `up` itself (no cleanup runs) leaves no service and no redis-server behind:
    each child gets SIGTERM from the kernel when its parent dies (PR_SET_PDEATHSIG)."""
    cmd = [
        rollstream_cmd(),
        "up",
        "--model",
        str(tiny_model_dir),
        "--trainer.steps",
        "1000000",
        "--run",
        "orphans",
        "--workdir",
        str(tmp_path),
        "--trainer.group-size",
        "4",
        "--trainer.groups-per-step",
        "2",
        "--trainer.max-new-tokens",
        "6",
        "--threads",
        "1",
        "--colocate",
        "off",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = {"redis", "trainer", "generator-0", "reward-0"}

    def pids() -> dict[str, int]:
        return {p.stem: json.loads(p.read_text())["pid"] for p in (tmp_path / "state").glob("*.json")}

    try:
        wait_for(lambda: set(pids()) == expected, 300, f"up to start {sorted(expected)}", check=still_running(proc, "up"),
                 details=lambda: f"started: {sorted(pids())}", poll_s=0.5)  # fmt: skip
        started = pids()
        proc.kill()
        proc.wait()

        def left_running() -> list[str]:
            return [name for name, pid in started.items() if alive(pid)]

        wait_for(
            lambda: not left_running(),
            60,
            "every service to exit after up was killed",
            details=lambda: f"left running: {left_running()}",
            poll_s=0.5,
        )
    finally:
        proc.kill()
        for pid in pids().values():  # whatever happened, leave nothing to the next test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--external-reward", "--reward.scorer-address", "127.0.0.1:50061"], "reward.scorer_address"),
        (["--reward.group", "two words"], "reward.group"),
    ],
)
def test_up_refuses_bad_reward_flags(flags: list[str], field: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [rollstream_cmd(), "up", "--workdir", str(tmp_path), *flags], capture_output=True, text=True, timeout=MIN_WAIT_S
    )
    assert done.returncode == 2 and field in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()  # refused before anything started


class QuarterScorer(reward_pb2_grpc.RewardServicer):
    """A remote grader that gives every completion 0.25."""

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        component = rollout_pb2.RewardComponent(name="quarter", value=0.25, weight=1.0, status="ok")
        return reward_pb2.ScoreResponse(
            scores=[reward_pb2.ItemScore(reward=0.25, components=[component]) for _ in request.items]
        )


def test_up_scores_with_a_remote_scorer(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """`up --scorer-address`: the built-in reward stage scores every completion with it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reward_pb2_grpc.add_RewardServicer_to_server(QuarterScorer(), server)
    # On a unix socket in a 0700 folder: `up` sends the reward's token only to a server nobody else can be.
    (tmp_path / "scorer").mkdir(mode=0o700)
    address = f"unix:{tmp_path / 'scorer' / 'scorer.sock'}"
    server.add_insecure_port(address)
    server.start()
    try:
        cmd = [
            rollstream_cmd(), "up", "--model", str(tiny_model_dir), "--trainer.steps", "2", "--run", run_name, "--workdir", str(tmp_path),
            "--redis-url", redis_url, "--trainer.group-size", "4", "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "6", "--threads", "1",
            "--reward.scorer-address", address,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        server.stop(grace=None)
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = [
        validation.decode(fields, rollout_pb2.StepMetrics) for _id, fields in rclient.xrange(RunKeys(run_name).metrics)
    ]
    assert [m.reward_mean for m in metrics] == [0.25, 0.25]
