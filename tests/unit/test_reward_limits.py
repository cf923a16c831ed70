"""Time limits: the scoring pool (rollstream.reward.scoring.ScorePool) runs every component in a worker
process and kills one that overruns; a worker killed from outside is replaced and its task
run again. Also the remote scorer's circuit breaker, reply checks and retry service config
(with an injected clock: no sleeping).

Real worker processes. No test depends on timing beyond "a limit of 0.5-1 s is hit by work
that would take hours": the assertions are on statuses, never on durations."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import MIN_WAIT_S, wait_for
from rollstream.reward.recipes import (
    ComponentSpec,
    RecipeComponent,
    Recipes,
    Sample,
    build_check,
    default_specs,
    recipe_source,
)
from rollstream.reward.remote import CircuitBreaker, check_reply, service_config
from rollstream.reward.scoring import ScorePool
from rollstream.v1 import reward_pb2

# -- checks the test recipes are made of (module-level: the workers import them) ------------------


def spin(sample: Sample) -> float:
    """Pure-Python work that never ends, behind the `except Exception` libraries have (a
    completion that is a path: our pid is written there first)."""
    if sample.completion.startswith("/"):
        Path(sample.completion).write_text(str(os.getpid()))
    try:
        while True:
            pass
    except Exception:  # noqa: BLE001 - what libraries do; the limit must get through it
        return 1.0


def whoami(sample: Sample) -> float:
    return float(os.getpid())


def wait_for_kill(sample: Sample) -> float:
    """First run: write our pid to the file named by the completion and sleep (the test
    kills us). Any later run (on a fresh worker): answer 1."""
    marker = Path(sample.completion)
    if marker.exists():
        return 1.0
    marker.write_text(str(os.getpid()))
    time.sleep(600)
    return 0.0


def suicide(sample: Sample) -> float:
    os._exit(3)


def nan(sample: Sample) -> float:
    return float(sample.answer)


def test_recipes(default_timeout_s: float = 0.5) -> Recipes:
    fmt = build_check(ComponentSpec(component="arithmetic_format", weight=0.1))
    no_limit = 120.0  # checks the test ends itself: the limit only stops a runaway
    return Recipes(
        {
            "spin": (
                RecipeComponent("slow", 1.0, spin, default_timeout_s),
                RecipeComponent("format", 0.1, fmt, default_timeout_s),
            ),
            "pid": (RecipeComponent("pid", 1.0, whoami, no_limit),),
            "kill": (RecipeComponent("answer", 1.0, wait_for_kill, no_limit),),
            "die": (RecipeComponent("answer", 1.0, suicide, no_limit), RecipeComponent("format", 0.1, fmt, no_limit)),
            "value": (RecipeComponent("value", 1.0, nan, no_limit),),
            "format": (RecipeComponent("format", 0.1, fmt, no_limit),),
        }
    )


test_recipes.__test__ = False  # type: ignore[attr-defined]  # a factory, not a test


@pytest.fixture(scope="module")
def pool() -> Iterator[ScorePool]:
    p = ScorePool(functools.partial(test_recipes, 0.5), workers=2)
    p.warm_up()
    yield p
    p.close()


@pytest.fixture(scope="module")
def builtin_pool() -> Iterator[ScorePool]:
    specs = {
        **default_specs(),
        "math": [ComponentSpec(component="math", weight=1.0, timeout_s=1.0)],
        # Catastrophic backtracking: one C call (re's matcher) for ever on 40 a's and a b.
        "regex": [
            ComponentSpec(component="regex", weight=1.0, timeout_s=0.5, params={"pattern": "(a+)+$", "match": "search"})
        ],
    }
    p = ScorePool(recipe_source(specs, 5.0), workers=2)
    p.warm_up()
    yield p
    p.close()


def statuses(score: object) -> list[tuple[str, float, str]]:
    return [(c.name, c.value, c.status) for c in score.components]  # type: ignore[attr-defined]  # a RewardScore, typed loosely here


def worker_pids(pool: ScorePool) -> set[int]:
    return {int(s.reward) for s in pool.score_many([("pid", Sample(""))] * 8)}


def test_endless_python_loop_times_out_and_the_other_components_still_count(pool: ScorePool, tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    (s,) = pool.score_many([("spin", Sample(str(marker)))])
    assert statuses(s) == [("slow", 0.0, "timeout"), ("format", 0.0, "ok")]
    assert s.reward == 0.0 and s.timeouts == 1 and s.errors == 0
    (s,) = pool.score_many([("spin", Sample("8"))])
    assert statuses(s) == [("slow", 0.0, "timeout"), ("format", 1.0, "ok")] and s.reward == pytest.approx(0.1)
    # The worker that ran it was killed, and replaced: the pool works, as big as before.
    spinner = int(marker.read_text())
    wait_for(lambda: not _alive(spinner), 30, "the worker past its limit to be gone")
    pids = worker_pids(pool)
    assert spinner not in pids and 1 <= len(pids) <= 2


def _alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_one_timeout_leaves_the_other_completions_alone(pool: ScorePool) -> None:
    scores = pool.score_many(
        [("format", Sample("8")), ("spin", Sample("x")), ("format", Sample("The answer is 8")), ("chess", Sample("e4"))]
    )
    assert [s.reward for s in scores] == pytest.approx([0.1, 0.0, 0.1, 0.0])
    assert statuses(scores[1])[0][2] == "timeout"
    assert scores[3].unknown_kind  # answered here, without a worker


def test_math_verify_on_a_tower_of_powers_times_out(builtin_pool: ScorePool) -> None:
    # math-verify would compute 9^(9^(9^9)); its `except Exception` blocks cannot swallow a kill.
    tower, fine = builtin_pool.score_many(
        [("math", Sample(r"\boxed{9^{9^{9^{9}}}}", "1")), ("math", Sample(r"\boxed{1}", "1"))]
    )
    assert statuses(tower) == [("math", 0.0, "timeout")]
    assert statuses(fine) == [("math", 1.0, "ok")]


def test_catastrophic_regex_stuck_in_one_c_call_times_out(builtin_pool: ScorePool) -> None:
    stuck, matched = builtin_pool.score_many([("regex", Sample("a" * 40 + "b")), ("regex", Sample("aaa"))])
    assert statuses(stuck) == [("regex", 0.0, "timeout")]  # SIGALRM could not stop this one
    assert statuses(matched) == [("regex", 1.0, "ok")]
    # And the builtin recipes still work on the replacement worker.
    assert builtin_pool.score_many([("arithmetic", Sample("8", "8"))])[0].reward == pytest.approx(1.1)


def test_a_worker_killed_mid_task_is_replaced_and_the_task_run_again(pool: ScorePool, tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    result: list[object] = []
    scoring = threading.Thread(
        target=lambda: result.append(pool.score_many([("kill", Sample(str(marker))), ("format", Sample("8"))]))
    )
    scoring.start()
    wait_for(lambda: marker.exists() and marker.read_text(), 60, "the check to start")
    os.kill(int(marker.read_text()), signal.SIGKILL)
    scoring.join(timeout=MIN_WAIT_S)
    assert not scoring.is_alive()
    killed, other = result[0]  # type: ignore[misc]  # the thread's one result: a list of two scores
    assert statuses(killed) == [("answer", 1.0, "ok")]  # run again on a fresh worker, not lost
    assert statuses(other) == [("format", 1.0, "ok")]


def test_idle_workers_killed_are_replaced(pool: ScorePool) -> None:
    # pebble gives up on the whole pool when a worker dies while no task runs: it is replaced.
    for pid in worker_pids(pool):
        os.kill(pid, signal.SIGKILL)
    assert pool.score_many([("format", Sample("8"))])[0].reward == pytest.approx(0.1)
    assert len(worker_pids(pool)) <= 2


def test_a_check_that_kills_its_worker_every_time_is_an_error(pool: ScorePool) -> None:
    (s,) = pool.score_many([("die", Sample("8"))])
    (answer, fmt) = s.components
    assert answer.value == 0.0 and answer.status.startswith("error: ProcessExpired: the scoring worker died 2 times")
    assert (fmt.value, fmt.status) == (1.0, "ok")
    assert s.errors == 1 and s.timeouts == 0


def test_non_finite_values_are_errors_and_finite_ones_pass(pool: ScorePool) -> None:
    scores = pool.score_many(
        [
            ("value", Sample("", "nan")),
            ("value", Sample("", "inf")),
            ("value", Sample("", "1e300")),
            ("value", Sample("", "x")),
        ]
    )
    assert [c.status for s in scores for c in s.components] == [
        "error: ValueError: the check gave a non-finite value (nan)",
        "error: ValueError: the check gave a non-finite value (inf)",
        "ok",  # huge but finite: the stage's output check (|reward| <= 1e4) dead-letters such a group
        "error: ValueError: could not convert string to float: 'x'",
    ]
    assert [s.reward for s in scores] == [0.0, 0.0, 1e300, 0.0]


def test_a_deadline_cancels_what_is_left(pool: ScorePool, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError):
        pool.score_many([("kill", Sample(str(tmp_path / "pid")))], timeout_s=0.3)  # would sleep 600 s
    # The cancelled task's worker was killed; the pool carries on.
    assert pool.score_many([("format", Sample("8"))])[0].reward == pytest.approx(0.1)


def test_the_sandbox_probe_runs_in_a_worker_and_reports_back(builtin_pool: ScorePool) -> None:
    """check_sandboxes, what the service runs at start (code_sandbox_unavailable): the specs go
    to a worker as plain data, recipes.sandbox_problems runs there, its answer comes back."""
    broken = ComponentSpec(component="code", weight=1.0, params={"python": "/nonexistent/python3"})
    found: list[dict[str, str]] = []
    reported = threading.Event()

    def report(problems: dict[str, str]) -> None:
        found.append(problems)
        reported.set()

    builtin_pool.check_sandboxes({"broken_code": [broken], "arithmetic": default_specs()["arithmetic"]}, report)
    assert reported.wait(120), "no report from the sandbox probe"
    assert list(found[0]) == ["broken_code"] and "/nonexistent/python3" in found[0]["broken_code"]


def parent_pid(pid: int) -> int:
    """From /proc/PID/stat: the field after the command's closing parenthesis is the state, then the parent."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_a_sandbox_probe_whose_worker_is_killed_reports_every_code_kind(tmp_path: Path) -> None:
    """The probe's worker killed mid-check (its interpreter hangs, the test kills the worker):
    every code kind is reported as unchecked, with the reason, not lost in a callback's
    exception; the pool carries on."""
    started = tmp_path / "started"
    hang = tmp_path / "python3"
    hang.write_text(f"#!/bin/sh\necho $$ > {started}\nexec sleep 600\n")
    hang.chmod(0o755)
    code = ComponentSpec(component="code", weight=1.0, params={"python": str(hang)})
    specs = {"code_a": [code], "code_b": [code], "arithmetic": default_specs()["arithmetic"]}
    p = ScorePool(recipe_source(specs, 5.0), workers=1)
    try:
        found: list[dict[str, str]] = []
        reported = threading.Event()
        p.check_sandboxes(specs, lambda problems: (found.append(problems), reported.set()))
        deadline = time.monotonic() + 120
        while not started.exists() or not started.read_text().strip():
            assert time.monotonic() < deadline, "the probe never ran the interpreter"
            time.sleep(0.05)
        # The worker: the ancestor of the hanging interpreter that is a child of this process.
        hung = worker = int(started.read_text())
        while parent_pid(worker) != os.getpid():
            worker = parent_pid(worker)
            assert worker > 1, "the interpreter is not under this process"
        os.kill(worker, signal.SIGKILL)
        assert reported.wait(120), "no report after the probe's worker died"
        assert sorted(found[0]) == ["code_a", "code_b"]
        assert all("did not finish" in why for why in found[0].values()), found[0]
        os.kill(hung, signal.SIGKILL)
        assert p.score_many([("arithmetic", Sample("The answer is 8.", "8"))])[0].reward > 1.0
    finally:
        p.close()


def test_recipes_are_rebuilt_in_the_workers_from_plain_data() -> None:
    spec = ComponentSpec(component="exact", weight=2.0, name="answer", timeout_s=3.0, params={"case_sensitive": False})
    source = recipe_source({"exact": [spec]}, 5.0)
    assert source.args[0] == {"exact": [spec.model_dump()]}  # type: ignore[attr-defined]  # recipe_source's functools.partial
    assert json.loads(json.dumps(source.args[0])) == source.args[0]  # type: ignore[attr-defined]  # recipe_source's functools.partial
    p = ScorePool(source, workers=1)
    try:
        (s,) = p.score_many([("exact", Sample("PARIS", "paris"))])
        assert statuses(s) == [("answer", 1.0, "ok")] and s.reward == 2.0
        assert p.recipes.table["exact"][0].timeout_s == 3.0
    finally:
        p.close()


# -- the remote scorer's pieces ----------------------------------------------------------------------


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
    nan_reply = reward_pb2.ScoreResponse(scores=[reward_pb2.ItemScore(reward=float("nan"))])
    assert "non-finite reward" in check_reply(nan_reply, 1)


def test_retry_settings_become_the_channels_retry_policy() -> None:
    (method,) = json.loads(service_config(3, 0.5, 10.0))["methodConfig"]
    assert method["name"] == [{"service": "rollstream.v1.Reward", "method": "Score"}]
    assert method["retryPolicy"] == {
        "maxAttempts": 4,
        "initialBackoff": "0.500000s",
        "maxBackoff": "10.000000s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED"],
    }
    # No retries: no policy (gRPC wants maxAttempts >= 2). A max below the first delay is raised to it.
    assert "retryPolicy" not in json.loads(service_config(0, 0.5, 10.0))["methodConfig"][0]
    assert json.loads(service_config(1, 2.0, 1.0))["methodConfig"][0]["retryPolicy"]["maxBackoff"] == "2.000000s"


def test_a_submit_that_fails_cancels_the_components_submitted_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool closed while one item's components are being queued: the ones already queued
    (here the endless `slow`) are cancelled, not left to run on a worker until their limit."""
    p = ScorePool(functools.partial(test_recipes, 120.0), workers=1)
    p.warm_up()
    submitted = []
    real_submit = p._submit

    def submit_then_fail(task: object) -> None:
        if submitted:
            raise RuntimeError("the pool went away")
        real_submit(task)  # type: ignore[arg-type]  # the pool's own task, passed through
        submitted.append(task)

    monkeypatch.setattr(p, "_submit", submit_then_fail)
    try:
        with pytest.raises(RuntimeError, match="went away"):
            p.score_many([("spin", Sample("x"))])
        (first,) = submitted
        wait_for(first.future.done, MIN_WAIT_S, "the queued component to be cancelled")  # type: ignore[attr-defined]  # a pool task, held as an object
        assert first.future.cancelled()  # type: ignore[attr-defined]  # a pool task, held as an object
    finally:
        p.close()
