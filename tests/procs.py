"""Start rollstream services as real subprocesses for tests (`python -m rollstream.<name>`),
and ask them for their state. Waiting on them: helpers.wait_for(..., procs=[...])."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from helpers import MIN_WAIT_S, wait_for
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.launcher.procs import stop_process
from rollstream.launcher.redis_server import free_port  # noqa: F401 - tests import it from here
from rollstream.v1 import generator_pb2, generator_pb2_grpc, trainer_pb2, trainer_pb2_grpc


@dataclass
class ChildProcess:
    """A process a test started (helpers.wait_for can watch it): its log, kill -9, a clean stop."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = MIN_WAIT_S) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`: a clean stop finishes the work in hand,
        which on a loaded machine can take far longer than it does idle."""
        return stop_process(self.proc, timeout_s)


@dataclass
class ServiceProc(ChildProcess):
    state_file: Path
    grpc_address: str = ""  # from the state file: unix:/path (start_service's default) or 127.0.0.1:port
    http_port: int = 0

    def wait_ready(self, timeout_s: float = 120.0) -> "ServiceProc":
        """Wait for the state file, then for /readyz to answer 200 (fail if the process exits)."""

        def ready() -> bool:
            if not self.state_file.exists():
                return False
            state = json.loads(self.state_file.read_text())
            self.grpc_address, self.http_port = state["grpc_address"], state["http_port"]
            try:
                return httpx.get(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s, f"{self.name} ready (/readyz 200)", procs=[self], poll_s=0.2)
        return self


# Every service a test started: conftest kills what is still running when the test ends (a
# service whose wait_ready failed was never handed to the test's own cleanup, and one left
# running took a core from every later test).
STARTED: list[ChildProcess] = []


def start_service(
    name: str, workdir: Path, *args: str, env: dict[str, str] | None = None, tag: str = "", ranks: int = 0
) -> ServiceProc:
    """Start `python -m rollstream.<name> ARGS --state-file ...` (with `ranks`: as that many
    ranks under torchrun, its standalone rendezvous on loopback; the process is torchrun's);
    logs go to workdir/<name><tag>.log. Its gRPC listens on a unix socket in workdir/sockets
    (0700), as under `up`, unless ARGS give a --grpc-port."""
    workdir.mkdir(parents=True, exist_ok=True)
    label = f"{name}{tag}"
    if "--grpc-port" not in args:
        sockets = workdir / "sockets"
        sockets.mkdir(mode=0o700, exist_ok=True)
        sockets.chmod(0o700)
        args = ("--grpc-socket", str(sockets / f"{label}.sock"), *args)
    state_file = workdir / f"{label}.state.json"
    state_file.unlink(missing_ok=True)
    log_path = workdir / f"{label}.log"
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **(env or {}),
    }
    log = log_path.open("ab")
    # torchrun's own parser takes any later flag that abbreviates one of its own (--run: its
    # --run-path) unless `--` ends its options.
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks else []
    module = ["-m", f"rollstream.{name}", *(["--"] if ranks else [])]
    proc = subprocess.Popen(
        [sys.executable, *launcher, *module, "--state-file", str(state_file), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    log.close()
    service = ServiceProc(name=label, proc=proc, log_path=log_path, state_file=state_file)
    STARTED.append(service)
    return service


def _creds(token: str) -> ClientCredentials | None:
    return ClientCredentials(token=token) if token else None


def trainer_state(address: str, sha: bool = False, token: str = "") -> trainer_pb2.TrainerState:
    """Trainer.GetState (with the weights' sha256 when `sha`; with `token` for a server that checks one)."""
    with channel(address, _creds(token)) as ch:
        return trainer_pb2_grpc.TrainerStub(ch).GetState(
            trainer_pb2.TrainerStateRequest(with_weights_sha256=sha), timeout=30
        )


def generator_state(address: str, sha: bool = False, token: str = "") -> generator_pb2.GeneratorState:
    """Generator.GetState (with the weights' sha256 when `sha`; with `token` for a server that checks one)."""
    with channel(address, _creds(token)) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).GetState(
            generator_pb2.GetStateRequest(with_weights_sha256=sha), timeout=30
        )


def alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def start_reward(
    tmp_path: Path, redis_url: str, run: str, *args: str, tag: str = "", ready: bool = True
) -> ServiceProc:
    """The reward service on `run`, reading fast (50 ms blocks); waited for until ready unless `ready=False`."""
    proc = start_service("reward", tmp_path, "--redis-url", redis_url, "--run", run, "--block-ms", "50", *args, tag=tag)
    return proc.wait_ready() if ready else proc
