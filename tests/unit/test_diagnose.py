"""The bottleneck rules (core/diagnose.py) on snapshots built by hand: each rule fires on its
state and the headline names the right stage. No Redis, no clock: see
tests/integration/test_status.py for the same states built in a real Redis."""

from __future__ import annotations

from rollstream.core.diagnose import PIPELINE, Consumer, Group, Snapshot, StreamState, Thresholds, diagnose, rate

T = Thresholds(idle_s=60.0, max_staleness=1, crash_restarts=3)


def stream(
    length: int, group: str | None = None, pending: int = 0, lag: int = 0, idle: tuple[float, ...] = (1.0,)
) -> StreamState:
    if group is None:
        return StreamState(length=length, exists=True)
    consumers = tuple(Consumer(f"{group}-{i}", pending if i == 0 else 0, s) for i, s in enumerate(idle))
    return StreamState(length=length, exists=True, groups=(Group(group, pending, lag, consumers),))


def healthy(**over) -> dict:
    """A run in its usual state: prompts full, the trainer training a step, generators current."""
    base = dict(
        at=100.0,
        streams={
            "prompts": stream(16, "generator", pending=2, lag=14),
            "rollouts": stream(0, "reward"),
            "ready": stream(8, "trainer", pending=8, lag=0),
        },
        counters={"generated": 40, "scored": 40, "trained": 32, "groups_per_step": 8, "step": 4},
        trainer_version=4,
        trainer_step=4,
        generators={"g0": 4},
    )
    base.update(over)
    return base


def head(cur: Snapshot, prev: Snapshot | None = None):
    return diagnose(cur, prev, T)[0]


def test_a_training_trainer_is_the_bottleneck() -> None:
    f = head(Snapshot(**healthy()))
    assert (f.level, f.stage) == ("info", "trainer") and "training a step on 8 groups" in f.reason


def test_trainer_waiting_names_the_nearest_stage_with_a_backlog() -> None:
    s = healthy()
    s["streams"] = {
        **s["streams"],
        "rollouts": stream(5, "reward", pending=2, lag=3),
        "ready": stream(0, "trainer", pending=3),
    }
    prev = Snapshot(**{**s, "at": 90.0, "counters": {**s["counters"], "scored": 30}})
    f = head(Snapshot(**s), prev)
    assert (f.level, f.stage) == ("info", "reward")
    assert "the trainer waits for groups (it holds 3 pending)" in f.reason and "5 in rollouts (1.00/s)" in f.reason


def test_no_consumer_group_on_a_stream_with_entries() -> None:
    s = healthy()
    s["streams"] = {**s["streams"], "rollouts": stream(7), "ready": stream(0, "trainer")}
    f = head(Snapshot(**s))
    assert (f.level, f.stage) == ("stuck", "reward") and "no consumer group" in f.reason and "7 entries" in f.reason


def test_a_group_without_consumers() -> None:
    s = healthy()
    s["streams"] = {**s["streams"], "rollouts": StreamState(4, True, (Group("reward", 0, 4, ()),))}
    f = head(Snapshot(**s))
    assert (f.level, f.stage) == ("stuck", "reward") and "has no consumer" in f.reason


def test_pending_piling_up_with_idle_consumers() -> None:
    s = healthy()
    s["streams"] = {**s["streams"], "rollouts": stream(9, "reward", pending=6, lag=3, idle=(300.0, 120.0))}
    f = head(Snapshot(**s))
    assert (f.level, f.stage) == ("stuck", "reward")
    assert "not reading rollouts: 9 waiting (6 pending)" in f.reason and "idle for 120s" in f.reason


def test_generators_held_by_back_pressure_are_not_stuck() -> None:
    s = healthy()
    s["streams"] = {**s["streams"], "prompts": stream(16, "generator", lag=16, idle=(500.0,))}
    assert head(Snapshot(**s)).stage == "trainer"  # groups wait in ready: the generators wait on purpose


def test_a_stage_whose_backlog_grows_while_it_consumes_nothing() -> None:
    s = healthy()
    s["streams"] = {**s["streams"], "rollouts": stream(3, "reward", pending=1, lag=2)}
    prev = Snapshot(**s)
    s2 = {**s, "at": 130.0, "streams": {**s["streams"], "rollouts": stream(9, "reward", pending=1, lag=8)}}
    f = head(Snapshot(**s2), prev)
    assert (f.level, f.stage) == ("warn", "reward") and "grew 3 -> 9 in 30s" in f.reason
    # consuming meanwhile: not falling behind
    s3 = {**s2, "counters": {**s["counters"], "scored": 45}}
    assert head(Snapshot(**s3), prev).level == "info"


def test_generators_behind_the_trainer() -> None:
    f = head(
        Snapshot(
            **healthy(
                trainer_version=7,
                generators={"g0": 7, "g1": 3},
                counters={**healthy()["counters"], "pushes_not_applied": 4},
            )
        )
    )
    assert (
        (f.level, f.stage) == ("warn", "g1")
        and "at policy v3, the trainer at v7: 4 versions behind" in f.reason
        and "4)" in f.reason
    )
    assert head(Snapshot(**healthy(generators={"g0": None}))).reason.startswith("holds no weights")
    assert head(Snapshot(**healthy(generators={}))).reason.startswith("no generator registered")


def test_dead_letters_growing() -> None:
    prev = Snapshot(**healthy(dead=2))
    f = head(Snapshot(**healthy(at=110.0, dead=5, last_dead={"rollouts": "reward 1e9 out of range"})), prev)
    assert (
        (f.level, f.stage) == ("warn", "dead letters")
        and "+3 since the last look (5 in all)" in f.reason
        and "rollouts: reward 1e9" in f.reason
    )
    assert head(Snapshot(**healthy(at=120.0, dead=5)), Snapshot(**healthy(dead=5))).level == "info"  # not growing


def test_the_back_pressure_deadlock() -> None:
    """The trainer holds 3 of its 8 groups; the generators count those 3 as in flight and stop
    at max_inflight_groups = 3: nothing moves, and nothing is 'slow'."""
    s = healthy()
    s["streams"] = {
        "prompts": stream(16, "generator", lag=16, idle=(400.0,)),
        "rollouts": stream(0, "reward"),
        "ready": stream(3, "trainer", pending=3, lag=0, idle=(0.2,)),
    }
    f = head(Snapshot(**s), Snapshot(**{**s, "at": 50.0}))
    assert (f.level, f.stage) == ("stuck", "generator") and "deadlock" in f.reason and "holds 3 groups" in f.reason


def test_a_crash_loop() -> None:
    f = head(Snapshot(**healthy(restarts={"reward-0": 3})))
    assert (f.level, f.stage) == ("stuck", "reward-0") and "restarted 3 times" in f.reason
    f = head(Snapshot(**healthy(at=130.0, restarts={"trainer": 2})), Snapshot(**healthy(restarts={"trainer": 1})))
    assert (f.level, f.stage) == ("stuck", "trainer") and "(1 since the last look)" in f.reason
    assert (
        head(Snapshot(**healthy(at=130.0, restarts={"trainer": 1})), Snapshot(**healthy(restarts={"trainer": 1}))).level
        == "info"
    )


def test_an_empty_run_is_ok_and_rates_need_two_looks() -> None:
    empty = Snapshot(at=1.0, streams={}, counters={})
    f = head(empty)
    assert f.level == "ok" and "nothing waiting" in f.reason
    cur = Snapshot(**healthy())
    assert rate(None, cur, PIPELINE[0]) is None
    assert rate(Snapshot(**healthy(at=90.0, counters={"generated": 20})), cur, PIPELINE[0]) == 2.0


def test_a_slow_batch_is_not_a_stuck_stage() -> None:
    """A consumer idle past the threshold whose stage consumed since the last look is slow, not stuck."""
    s = healthy()
    s["streams"] = {**s["streams"], "rollouts": stream(9, "reward", pending=6, lag=3, idle=(300.0,))}
    prev = Snapshot(**{**s, "at": 50.0, "counters": {**s["counters"], "scored": 30}})
    assert head(Snapshot(**s), prev).level != "stuck"
    assert head(Snapshot(**s), Snapshot(**{**s, "at": 50.0})).level == "stuck"


def test_held_out_groups_count_as_the_trainers_progress() -> None:
    """The trainer acknowledges a held-out round's groups as `evaluated`, never trained: an
    idle-looking trainer that evaluated since the last look is reading, not stuck."""
    s = healthy()
    s["streams"] = {**s["streams"], "ready": stream(4, "trainer", pending=4, idle=(600.0,))}
    prev = Snapshot(**{**s, "at": 90.0})
    cur = Snapshot(**{**s, "counters": {**s["counters"], "evaluated": 10}})
    assert rate(prev, cur, PIPELINE[-1]) == 1.0
    assert all(f.stage != "trainer" or f.level != "stuck" for f in diagnose(cur, prev, T))
    assert any(
        f.level == "stuck" and f.stage == "trainer" for f in diagnose(Snapshot(**s), prev, T)
    )  # nothing done: not reading
