"""Processes rollstream starts for others (the services under `rollstream up`, the embedded
redis-server): they must not outlive whoever started them."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: the child gets SIGTERM when its parent dies, even by
    kill -9 (Linux's PR_SET_PDEATHSIG). Without it a killed `up` left a 10 GB trainer running,
    and the next run's trainer was killed for memory over and over. Elsewhere: a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
