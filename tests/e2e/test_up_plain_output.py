"""`rollstream up` attacked through what its services log, and its run data left to others
(issue 27): rollouts whose group_id is rich markup ("evil[/]") are dead-lettered by the
reward, which logs the reason; the reward then dies, and `up` prints its last log lines as
they are and restarts it (S4: it raised MarkupError and stopped every service). Started
from a shell whose umask is 022, everything the run leaves in its workdir is its owner's
only (S2: the AOF and the checkpoints were 0644 in 0755 folders)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import redis

from helpers import still_running, wait_for
from procs import alive
from rollstream.core import credentials, validation
from rollstream.core.run_keys import RunKeys
from rollstream.launcher.procs import tail
from rollstream.v1 import rollout_pb2

MARKUP_IDS = ["evil[/]", "[bold", "[link=https://example.com]x[/link]"]


def rollstream_cmd() -> str:
    return str(Path(sys.executable).parent / "rollstream")


def open_to_others(root: Path) -> list[str]:
    paths = [root, *root.rglob("*")]
    return [f"{p} {oct(p.lstat().st_mode & 0o777)}" for p in paths if p.lstat().st_mode & 0o077 and not p.is_symlink()]


def test_up_prints_a_dead_services_log_as_written_and_keeps_its_workdir_private(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = "plain"
    keys = RunKeys(run)
    workdir = tmp_path / "run"
    workdir.mkdir(mode=0o755)
    workdir.chmod(0o755)  # as an older run, or a shell, may have left it
    cmd = [
        rollstream_cmd(), "up", "--model", str(tiny_model_dir), "--trainer.steps", "1000000", "--run", run, "--workdir", str(workdir),
        "--trainer.group-size", "4", "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "6", "--threads", "1", "--trainer.checkpoint-every", "1",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "1000"}  # no wrapped lines
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, umask=0o022, env=env)
    printed: list[str] = []  # up's output so far, read on a thread (a wait never blocks on it)
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]  # proc.stdout is asserted above; the lambda loses the narrowing
    reader.start()
    try:
        up_running = still_running(proc, "up")
        state = workdir / "state"
        wait_for(lambda: (state / "reward-0.json").exists() and (state / "redis.json").exists(), 300, "up to start its services",
                 check=up_running, poll_s=0.5)  # fmt: skip
        sock = redis.connection.parse_url(json.loads((state / "redis.json").read_text())["url"])[
            "path"
        ]  # up's Redis: a unix socket
        admin = redis.Redis(
            unix_socket_path=sock,
            username="admin",
            password=credentials.read_secret(workdir / "credentials" / "redis" / "admin.password", "a"),
        )
        wait_for(lambda: admin.xlen(keys.metrics) >= 1, 300, "a first step", check=up_running, poll_s=0.5)

        # Groups the reward refuses (no completions), with markup for ids: their reasons are
        # logged. Frozen once those lines are among its last five, then killed. `up` prints a
        # dead service's last ten: what dies with it may add a few (its pool's resource
        # tracker warns of leaked semaphores after a kill -9).
        reward_pid = json.loads((state / "reward-0.json").read_text())["pid"]
        reward_log = workdir / "logs" / "reward-0.log"

        def markup_logged_last() -> bool:
            os.kill(reward_pid, signal.SIGCONT)
            dead = admin.xlen(keys.dead)
            for group_id in MARKUP_IDS:
                admin.xadd(
                    keys.stream("rollouts"), validation.encode(rollout_pb2.RolloutGroup(group_id=group_id, task_id="t"))
                )
            wait_for(
                lambda: admin.xlen(keys.dead) >= dead + len(MARKUP_IDS),
                120,
                "the groups dead-lettered",
                check=up_running,
            )
            os.kill(reward_pid, signal.SIGSTOP)
            return all(repr(g) in tail(reward_log, 5) for g in MARKUP_IDS)

        wait_for(markup_logged_last, 300, "the reward's last log lines to be the markup ones", check=up_running)
        os.kill(reward_pid, signal.SIGKILL)

        # up says so, with those lines as they are, restarts it, and the run goes on.
        def reported() -> bool:
            text = "".join(printed)
            return "reward-0 exited with" in text and all(
                repr(g) in text.split("reward-0 exited with", 1)[1] for g in MARKUP_IDS
            )

        wait_for(
            reported,
            120,
            "up to print the dead reward's log lines",
            check=up_running,
            details=lambda: "".join(printed)[-3000:],
        )
        steps_then = admin.xlen(keys.metrics)
        wait_for(
            lambda: admin.xlen(keys.metrics) >= steps_then + 1,
            300,
            "a step after the restart",
            check=up_running,
            poll_s=0.5,
        )
        assert json.loads((state / "reward-0.json").read_text())["pid"] != reward_pid
        admin.close()

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=60)
    out = "".join(printed)
    assert proc.returncode == 0, out[-3000:]
    assert "MarkupError" not in out
    pids = [json.loads(p.read_text())["pid"] for p in (workdir / "state").glob("*.json")]
    wait_for(lambda: not [pid for pid in pids if alive(pid)], 60, "every service and redis-server stopped")

    # Everything the run left, the AOF and the checkpoints among it, is the owner's only.
    written = {p.relative_to(workdir).parts[0] for p in workdir.rglob("*") if p.is_file()}
    assert {"redis", "checkpoints", "logs", "summary.json"} <= written, written
    assert open_to_others(workdir) == []
