"""Processes rollstream starts for others (the services under `rollstream up`, the embedded
redis-server): they must not outlive whoever started them, and they are stopped one way."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
# Run data (the AOF's prompts, completions and test answers, checkpoints, logs) is its
# owner's alone: files 0600, folders 0700, whatever the umask of the shell that started us.
OWNER_ONLY_UMASK = 0o077


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
