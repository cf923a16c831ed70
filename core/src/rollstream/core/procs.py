"""Processes rollstream starts for others (the services under `rollstream up`, the embedded
redis-server): they must not outlive whoever started them, and they are stopped one way."""

from __future__ import annotations

import ctypes
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: the child gets SIGTERM when its parent dies, even by
    kill -9 (Linux's PR_SET_PDEATHSIG). Without it a killed `up` left a 10 GB trainer running,
    and the next run's trainer was killed for memory over and over. Elsewhere: a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


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
