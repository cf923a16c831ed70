"""Time limits for reward components, and the thread that can enforce them.

A verifier can run for a very long time on a completion a model wrote: math-verify asked to
compare `\\boxed{9^{9^{9^{9}}}}` with 1 computes the power. The limit is SIGALRM (an
interval timer), the only way to interrupt pure-Python work in the same process, and
Python runs signal handlers on the main thread only. So all scoring runs on the main
thread: the stream loop and the gRPC `Score` handlers hand their work to it through a
`MainThreadRunner`.

The limit cannot interrupt a single long C call that never returns to the interpreter
(one huge regular-expression match, say); the code reward runs in a subprocess and has
its own wall-clock limit for that reason.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class ComponentTimeout(BaseException):
    """A component ran out of time. A BaseException, like KeyboardInterrupt, so that the
    `except Exception` blocks inside libraries (math-verify has several) do not swallow it
    and carry on computing."""


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ComponentTimeout in the block once `seconds` have passed (None or <= 0: no limit).

    On the main thread this is a hard limit (ITIMER_REAL + SIGALRM). Elsewhere signals
    cannot reach the code, so the limit is checked when the block ends: the work is not
    cut short, but it still reports a timeout rather than a result that came too late.
    """
    if seconds is None or seconds <= 0:
        yield
        return
    if not on_main_thread():
        start = time.monotonic()
        yield
        if time.monotonic() - start > seconds:
            raise ComponentTimeout(f"took more than {seconds}s")
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise ComponentTimeout(f"took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            # Restored even if the alarm fired between the block's end and the line above.
            signal.signal(signal.SIGALRM, previous)


class MainThreadRunner:
    """Runs functions on the main thread on behalf of other threads (see the module doc).

    The main thread calls `serve(until)`; any thread calls `call(fn)` and gets fn's result
    (or its exception). A call from the main thread itself runs directly.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()

    def call(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run `fn` on the main thread and wait for it; TimeoutError after `timeout_s`
        (the job is then cancelled if it has not started)."""
        if on_main_thread():
            return fn()
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def serve(self, until: Callable[[], bool], poll_s: float = 0.1) -> None:
        """Run submitted jobs, one at a time, until `until()` is true (checked every poll_s)."""
        if not on_main_thread():
            raise RuntimeError("MainThreadRunner.serve must run on the main thread")
        while not until():
            try:
                fn, future = self._jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue  # the caller gave up waiting before it started
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
                future.set_exception(e)
