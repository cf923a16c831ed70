"""Issue 42, N1 and N2: `rollstream up --colocate off` holds no TCP port a local user could
squat. The embedded Redis and every service's gRPC listen on unix sockets in the run's 0700
folder, so a restarted redis-server or trainer comes back on the same path and nobody
else can have bound it; the only TCP sockets of the whole process tree are the HTTP sides
on loopback (browser, Prometheus). Before: Redis and the trainer kept a fixed loopback port
across their restarts, and whoever bound it first heard `HELLO 3 AUTH` and the tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from helpers import MIN_WAIT_S, process_tree, still_running, tcp_sockets, wait_for
from procs import alive
from rollstream.core import credentials
from rollstream.core.run_keys import RunKeys

pytestmark = pytest.mark.e2e


def test_up_holds_no_tcp_port_but_its_http_sides_across_restarts(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = "noport"
    cmd = [
        str(Path(sys.executable).parent / "rollstream"), "up", "--model", str(tiny_model_dir), "--trainer.steps", "1000000", "--run", run,
        "--workdir", str(tmp_path), "--trainer.group-size", "2", "--trainer.groups-per-step", "1", "--trainer.max-new-tokens", "4",
        "--threads", "1", "--colocate", "off",  # every service a process of its own, each with its own server
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = tmp_path / "state"
    services = ("trainer", "generator-0", "reward-0")

    def recorded(name: str) -> dict:
        return json.loads((state / f"{name}.json").read_text())

    def only_http_sides() -> None:
        http = {recorded(name)["http_port"] for name in services}
        held = tcp_sockets(process_tree(proc.pid))
        assert {s.local for s in held if s.listening} == {("127.0.0.1", port) for port in http}, held
        assert [s for s in held if not s.listening and http.isdisjoint({s.local[1], s.remote[1]})] == [], held
        for name in services:
            assert recorded(name)["grpc_address"] == f"unix:{tmp_path / 'sockets' / name}.sock"
        assert recorded("redis")["url"] == f"unix://{tmp_path / 'redis' / 'redis.sock'}?db=0"

    try:
        up_running = still_running(proc, "up")
        wait_for(lambda: all((state / f"{n}.json").exists() for n in (*services, "redis")), 300, "up to start its services",
                 check=up_running, poll_s=0.5)  # fmt: skip
        only_http_sides()  # each state file is written once its servers listen
        password = credentials.read_secret(tmp_path / "credentials" / "redis" / "admin.password", "admin")
        admin = redis.Redis(
            unix_socket_path=str(tmp_path / "redis" / "redis.sock"), username="admin", password=password
        )

        def steps() -> int:
            try:
                return int(admin.xlen(RunKeys(run).metrics))
            except redis.ConnectionError:
                return 0  # redis-server restarting

        wait_for(lambda: steps() >= 1, 300, "a first step", check=up_running, poll_s=0.5)
        only_http_sides()

        # Redis and the trainer die (their squat windows before): both come back on their sockets.
        redis_pid, trainer_pid = recorded("redis")["pid"], recorded("trainer")["pid"]
        os.kill(redis_pid, signal.SIGKILL)
        os.kill(trainer_pid, signal.SIGKILL)

        def back() -> bool:
            pids = {}
            for name in ("redis", "trainer"):
                try:
                    pids[name] = recorded(name)["pid"]
                except (OSError, ValueError):
                    return False  # being rewritten
            return (
                pids["redis"] != redis_pid
                and pids["trainer"] != trainer_pid
                and alive(pids["redis"])
                and alive(pids["trainer"])
            )

        wait_for(back, 300, "redis-server and the trainer restarted by up", check=up_running, poll_s=0.5)
        steps_then = steps()
        wait_for(lambda: steps() >= steps_then + 1, 300, "a step after both restarts", check=up_running, poll_s=0.5)
        only_http_sides()
        admin.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=MIN_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
