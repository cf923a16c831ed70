"""Processes rollstream starts for others (the services under `rollstream up`, the embedded
redis-server): they must not outlive whoever started them, and they are stopped one way."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollstream.core.service import OWNER_ONLY_UMASK
from rollstream.core.status import printable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: the child gets SIGTERM when its parent dies, even by
    kill -9 (Linux's PR_SET_PDEATHSIG). Without it a killed `up` left a 10 GB trainer running,
    and the next run's trainer was killed for memory over and over. Elsewhere: a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """While inside: every file and folder this process (and any child it starts) creates is
    its owner's only. The umask is the process's, so this is for whole runs (`up`, a
    service's main), not for library code; the previous umask comes back on the way out."""
    previous = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def private_child() -> None:
    """`preexec_fn` for a child that writes run data we do not create ourselves (the embedded
    redis-server's AOF and RDB): owner-only files, and it dies with its parent."""
    os.umask(OWNER_ONLY_UMASK)
    die_with_parent()


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM (a clean stop: services finish the work in hand), SIGKILL if the process is
    still there after `timeout_s`; returns its exit status. One already gone is left alone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ChildFailed(RuntimeError):
    """A service exited while `up` waited for it to serve."""

    def __init__(self, returncode: int, message: str):
        super().__init__(message)
        self.returncode = returncode


@dataclass
class Child:
    """One service process under `up`'s supervision; restarted if it dies unexpectedly."""

    name: str
    args: list[str]
    env: dict[str, str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.workdir / "logs" / f"{self.name}.log"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state" / f"{self.name}.json"

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    f"rollstream.{self.args[0]}",
                    *self.args[1:],
                    "--state-file",
                    str(self.state_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches `up` only
                preexec_fn=die_with_parent,
            )

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def restart_delay_s(self) -> float:
        """A child that keeps dying right after its start is restarted ever more slowly (a
        crash loop must not eat the machine), one that ran a while at once."""
        ran = time.monotonic() - self.started_at
        return 0.0 if ran > 60 else min(2.0 ** min(self.restarts, 5), 30.0)

    def grpc_address(self, timeout_s: float = 600.0) -> str:
        """Wait for the service's state file (written once it serves) and return its gRPC
        address (unix:/path under `up`)."""
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise ChildFailed(
                    self.proc.returncode,
                    f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{tail(self.log_path)}",
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start within {timeout_s}s; see {self.log_path}")
            time.sleep(0.2)
        return str(json.loads(self.state_file.read_text())["grpc_address"])

    def http_port(self) -> int:
        """The HTTP side's port (after grpc_address: the state file exists)."""
        return int(json.loads(self.state_file.read_text())["http_port"])

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` of a log, printable (a logged group id may hold terminal escapes)."""
    if not path.exists():
        return ""
    return printable("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
