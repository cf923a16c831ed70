"""`rollstream status --workdir` after the `up` run has ended: its embedded Redis stopped with
`up`, and status says so (and where the run's results are) instead of a refused connection."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_up import rollstream_cmd

from procs import alive

pytestmark = pytest.mark.e2e


def test_status_of_a_finished_up_run_says_its_redis_stopped(tiny_model_dir: Path, tmp_path: Path) -> None:
    cmd = [
        rollstream_cmd(), "up", "--model", str(tiny_model_dir), "--trainer.steps", "1", "--run", "ended", "--workdir", str(tmp_path),
        "--trainer.group-size", "2", "--trainer.groups-per-step", "1", "--trainer.max-new-tokens", "4", "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads((tmp_path / "state" / "redis.json").read_text())
    assert not alive(recorded["pid"])  # `up` stopped its Redis

    status = subprocess.run(
        [rollstream_cmd(), "status", "--workdir", str(tmp_path), "--run", "ended"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = " ".join(status.stdout.split())
    assert status.returncode == 1, status.stdout + status.stderr
    assert "this run's embedded Redis" in out and "stopped with `rollstream up`" in out, out
    assert str(tmp_path / "steps.jsonl") in out and str(tmp_path / "summary.json") in out, out
    assert (tmp_path / "steps.jsonl").is_file() and (tmp_path / "summary.json").is_file()  # what it points at is there
    assert "ConnectionError" not in out and "Connection refused" not in out, out
