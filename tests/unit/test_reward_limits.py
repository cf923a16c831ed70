"""Time limits (SIGALRM on the main thread) and the runner that brings work to the main thread;
the remote scorer's circuit breaker and reply checks (with an injected clock: no sleeping)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rollstream.reward.limits import ComponentTimeout, MainThreadRunner, time_limit
from rollstream.reward.remote import CircuitBreaker, check_reply
from rollstream.v1 import reward_pb2


def test_time_limit_interrupts_busy_python_code_on_the_main_thread() -> None:
    spins = 0
    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(ComponentTimeout):
        with time_limit(0.1):
            while True:
                spins += 1
    assert spins > 0
    # The alarm is disarmed and the previous handler is back.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_time_limit_is_not_swallowed_by_except_exception() -> None:
    def library_code() -> str:
        try:
            while True:
                pass
        except Exception:  # noqa: BLE001 - what libraries do; the limit must get through it
            return "swallowed"

    with pytest.raises(ComponentTimeout):
        with time_limit(0.1):
            library_code()


def test_time_limit_leaves_fast_work_alone_and_restores_the_handler() -> None:
    calls: list[str] = []

    def mine(*_: object) -> None:
        calls.append("mine")

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with time_limit(5.0):
            value = sum(range(1000))
        assert value == 499500
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) is mine and calls == []
        with time_limit(None):  # no limit at all
            pass
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_the_limit_is_checked_at_the_end() -> None:
    outcome: list[str] = []

    def worker() -> None:
        try:
            with time_limit(0.05):
                time.sleep(0.2)
            outcome.append("finished")
        except ComponentTimeout:
            outcome.append("timeout")

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert outcome == ["timeout"]


def test_runner_runs_calls_from_other_threads_on_the_main_thread() -> None:
    runner = MainThreadRunner()
    results: dict[str, object] = {}

    def worker() -> None:
        results["thread"] = runner.call(lambda: threading.current_thread() is threading.main_thread())
        try:
            runner.call(lambda: 1 / 0)
        except ZeroDivisionError as e:
            results["error"] = e
        results["limited"] = runner.call(lambda: _limited_spin())

    t = threading.Thread(target=worker)
    t.start()
    runner.serve(until=lambda: not t.is_alive())
    t.join()
    assert results["thread"] is True
    assert isinstance(results["error"], ZeroDivisionError)
    assert results["limited"] == "timeout"  # SIGALRM works there


def _limited_spin() -> str:
    try:
        with time_limit(0.05):
            while True:
                pass
    except ComponentTimeout:
        return "timeout"


def test_runner_call_times_out_when_nobody_serves_and_the_job_is_dropped() -> None:
    runner = MainThreadRunner()
    ran: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            runner.call(lambda: ran.append(1), timeout_s=0.05)
        except TimeoutError as e:
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    runner.serve(until=lambda: True)  # nothing left to run: the cancelled job is skipped
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    runner.serve(until=stop.is_set)
    assert len(errors) == 1 and ran == []


def test_runner_call_on_the_main_thread_runs_directly() -> None:
    assert MainThreadRunner().call(lambda: 42) == 42


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_half_opens_after_the_cooldown() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10.0, clock=clock)
    assert breaker.allow() and breaker.state == "closed"
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # a success resets the count: failures must be consecutive
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.retry_in_s() == pytest.approx(10.0)
    clock.now += 9.0
    assert not breaker.allow() and breaker.retry_in_s() == pytest.approx(1.0)
    clock.now += 1.0
    assert breaker.allow() and breaker.state == "half_open"
    breaker.record_failure()  # the trial call failed: open again, for a full cool-down
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 10.0
    assert breaker.allow() and breaker.state == "half_open"
    breaker.record_success()
    assert breaker.state == "closed" and breaker.failures == 0 and breaker.retry_in_s() == 0.0


def test_check_reply() -> None:
    ok = reward_pb2.ScoreResponse(scores=[reward_pb2.ItemScore(reward=1.0), reward_pb2.ItemScore(reward=0.0)])
    assert check_reply(ok, 2) == ""
    assert check_reply(ok, 3) == "the scorer returned 2 scores for 3 items"
    nan = reward_pb2.ScoreResponse(scores=[reward_pb2.ItemScore(reward=float("nan"))])
    assert "non-finite reward" in check_reply(nan, 1)
