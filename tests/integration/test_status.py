"""`rollstream status` against a real Redis: pipeline states built with real streams, groups,
consumers, dead letters and registry entries; the snapshot read back (core/status.py) and
the diagnosis (core/diagnose.py) name the stage. Idle thresholds are 0 (every consumer is
idle 0 ms or more) or an hour (none is), so nothing depends on timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from helpers import wait_for, write
from rollstream.core import diagnose, run_keys, status, streams, validation
from rollstream.core.run_keys import RunKeys
from rollstream.launcher import cli
from rollstream.v1 import rollout_pb2

NOW = diagnose.Thresholds(idle_s=0.0)  # any consumer counts as idle
HOUR = diagnose.Thresholds(idle_s=3600.0)  # no consumer does


def group(i: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(group_id=f"g{i}", task_id=f"t{i}", policy_version=0)


def fill(client: redis.Redis, keys: RunKeys, stage: str, n: int) -> None:
    for i in range(n):
        write(client, keys, stage, group(i))


def take(client: redis.Redis, keys: RunKeys, stage: str, grp: str, consumer: str, n: int) -> None:
    """Create the group (from the start) and let `consumer` read n entries: they are pending on it."""
    streams.StreamStage.ensure_group(client, keys.stream(stage), grp)
    if n:
        client.xreadgroup(grp, consumer, {keys.stream(stage): ">"}, count=n)
    else:
        client.xgroup_createconsumer(keys.stream(stage), grp, consumer)


def headline(
    client: redis.Redis, keys: RunKeys, t: diagnose.Thresholds, prev: diagnose.Snapshot | None = None
) -> diagnose.Finding:
    snap, _ = status.collect(client, keys)
    return diagnose.diagnose(snap, prev, t)[0]


def test_snapshot_reads_backlog_pending_lag_and_consumers(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "rollouts", 5)
    take(rclient, keys, "rollouts", "reward", "reward-0", 2)
    snap, _ = status.collect(rclient, keys)
    s = snap.stream("rollouts")
    (g,) = s.groups
    assert (s.length, g.name, g.pending, g.lag, g.backlog) == (5, "reward", 2, 3, 5)
    assert [(c.name, c.pending) for c in g.consumers] == [("reward-0", 2)] and g.consumers[0].idle_s >= 0
    assert not snap.stream("scored").exists and not snap.active(diagnose.PIPELINE[2])  # no reference stage in this run


def test_no_consumer_group(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "rollouts", 3)
    f = headline(rclient, keys, HOUR)
    assert (f.level, f.stage) == ("stuck", "reward") and "3 entries wait in rollouts and no consumer group" in f.reason


def test_pending_piling_up_on_idle_consumers(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "rollouts", 4)
    take(rclient, keys, "rollouts", "reward", "reward-0", 3)
    f = headline(rclient, keys, NOW)
    assert (f.level, f.stage) == ("stuck", "reward") and "not reading rollouts: 4 waiting (3 pending)" in f.reason
    # consumers that read recently: not stuck; the trainer waits on the reward stage
    f = headline(rclient, keys, HOUR)
    assert (f.level, f.stage) == ("info", "reward") and "nearest backlog: 4 in rollouts" in f.reason


def test_generators_behind_and_their_versions(rclient: redis.Redis, keys: RunKeys) -> None:
    rclient.set(keys.version, 5)
    run_keys.heartbeat(rclient, keys, "gen-0", "127.0.0.1:1", version=5)
    run_keys.heartbeat(rclient, keys, "gen-1", "127.0.0.1:2", version=2)
    snap, _ = status.collect(rclient, keys)
    assert snap.generators == {"gen-0": 5, "gen-1": 2} and snap.trainer_version == 5
    f = diagnose.diagnose(snap, None, HOUR)[0]
    assert (f.level, f.stage) == ("warn", "gen-1") and "3 versions behind" in f.reason


def test_dead_letters_growing_with_their_reason(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "rollouts", 2)
    stage = streams.StreamStage(rclient, keys, "rollouts", "reward", "reward-0")
    stage.ensure_group(rclient, stage.stream, "reward")
    prev, _ = status.collect(rclient, keys)
    entries = stage.read(count=2, block_ms=0)
    for e in entries:
        stage.dead_letter(e, "reward nan is not finite")
    f = headline(rclient, keys, HOUR, prev)
    assert (
        (f.level, f.stage) == ("warn", "dead letters")
        and "+2 since the last look" in f.reason
        and "rollouts: reward nan" in f.reason
    )


def test_the_back_pressure_deadlock(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "prompts", 16)
    take(rclient, keys, "prompts", "generator", "generator-0", 0)
    fill(rclient, keys, "ready", 3)
    take(rclient, keys, "ready", "trainer", "trainer-0", 3)
    rclient.hset(keys.counters("trainer"), "groups_per_step", 8)
    f = headline(rclient, keys, NOW)
    assert (f.level, f.stage) == ("stuck", "generator") and "deadlock" in f.reason and "holds 3 groups" in f.reason


def test_a_training_trainer_is_the_bottleneck(rclient: redis.Redis, keys: RunKeys) -> None:
    fill(rclient, keys, "prompts", 16)
    take(rclient, keys, "prompts", "generator", "generator-0", 0)
    fill(rclient, keys, "ready", 10)
    take(rclient, keys, "ready", "trainer", "trainer-0", 8)
    rclient.hset(keys.counters("trainer"), "groups_per_step", 8)
    run_keys.heartbeat(rclient, keys, "gen-0", "127.0.0.1:1", version=0)
    f = headline(rclient, keys, NOW)
    assert (
        (f.level, f.stage) == ("info", "trainer")
        and "training a step on 8 groups for " in f.reason
        and ", 2 more wait in ready" in f.reason
    )


def test_status_command_shows_the_pipeline_and_the_diagnosis(
    redis_url: str, rclient: redis.Redis, keys: RunKeys, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(rclient, keys, "rollouts", 3)
    rclient.hset(keys.counters("generator"), "generated", 3)
    rclient.hset(keys.counters("trainer"), mapping={"step": 0, "trained": 2})
    rclient.hset(keys.counters("reward"), mapping={"scored": 1, "dead_rollouts": 1})
    rclient.hset(keys.counters("reference"), "dead_rollouts", 1)  # each role's counters, summed
    assert cli.main_code(["status", "--redis-url", redis_url, "--run", keys.run]) == 0
    out = capsys.readouterr().out
    assert keys.stream("rollouts") in out and "no consumer group" in out and "generated=3" in out
    assert "dead_rollouts=2" in out and "scored=1" in out and "trained=2" in out
    assert "STUCK: reward: 3 entries wait in rollouts and no consumer group reads it" in out
    # a key of the wrong type is reported, not a crash
    rclient.set(keys.stream("ready"), "not a stream")
    rclient.hset(keys.counters("trainer"), "trained", "x")  # a poisoned counter: named, the others still shown
    assert cli.main_code(["status", "--redis-url", redis_url, "--run", keys.run]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "holds a string, not a stream" in out
    assert f"{keys.counters('trainer')}: field 'trained' is not an integer" in out and "generated=3" in out


def test_status_watch_refreshes_with_rates(redis_url: str, rclient: redis.Redis, keys: RunKeys, tmp_path: Path) -> None:
    fill(rclient, keys, "rollouts", 4)
    take(rclient, keys, "rollouts", "reward", "reward-0", 1)
    out = tmp_path / "status.out"
    cmd = [
        str(Path(sys.executable).parent / "rollstream"),
        "status",
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--watch",
        "0.2",
    ]
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    try:
        wait_for(lambda: out.read_text().count("policy version") >= 2, 120, "two refreshes of status --watch",
                 details=lambda: out.read_text()[-3000:])  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)  # a loaded machine: a Redis call can take seconds
    views = out.read_text().split("run " + keys.run)
    assert "…" in views[1]  # the first look has no rate yet
    assert "0.00" in views[2]  # the second: per second since the first (nothing consumed)


def test_a_crash_loop_recorded_by_up(rclient: redis.Redis, keys: RunKeys, tmp_path: Path) -> None:
    (tmp_path / "restarts.json").write_text('{"reward-0": 4}')
    snap, _ = status.collect(rclient, keys, tmp_path)
    assert snap.restarts == {"reward-0": 4}
    f = diagnose.diagnose(snap, None, HOUR)[0]
    assert (f.level, f.stage) == ("stuck", "reward-0") and "restarted 4 times" in f.reason
    (tmp_path / "restarts.json").write_text("garbage")
    assert status.collect(rclient, keys, tmp_path)[0].restarts == {}


def test_status_shows_the_last_held_out_round_and_the_evaluated_groups(redis_url: str, rclient: redis.Redis, keys: RunKeys,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The last entry of `evals` is shown as one line; held-out groups are in the ledger as
    `evaluated` beside trained and stale (the trainer never trains them)."""
    rclient.hset(keys.counters("generator"), "generated", 40)
    rclient.hset(keys.counters("trainer"), mapping={"step": 15, "trained": 24, "stale": 0, "evaluated": 16})
    for step, accuracy in ((0, 0.25), (15, 0.953125)):
        rclient.xadd(keys.evals, validation.encode(rollout_pb2.EvalMetrics(
            step=step, version=step, version_max=step, prompts=32, prompts_fed=32, samples=4, reward_mean=1.02, accuracy=accuracy, pass_at_k=1.0,
            completion_tokens=6.0, time=1_790_000_000.0,
        )))  # fmt: skip
    snap, extra = status.collect(rclient, keys)
    assert extra["last_eval"].step == 15 and not extra["errors"]
    assert snap.consumed(diagnose.PIPELINE[-1]) == 40  # trained + stale + evaluated
    assert cli.main_code(["status", "--redis-url", redis_url, "--run", keys.run]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "held-out: accuracy 95% (pass@4 100%), reward 1.02 at step 15, version 15, 32 prompts" in out
    assert "groups: generated 40 trained 24 stale 0 evaluated 16" in out

    # A round that was cut short, and one that is not a share: shown as such, named, not a crash.
    rclient.xadd(keys.evals, validation.encode(rollout_pb2.EvalMetrics(step=16, version=15, version_max=16, prompts=30, prompts_fed=32, samples=1,
                                                                  accuracy=0.5)))  # fmt: skip
    assert status.eval_line(status.collect(rclient, keys)[1]["last_eval"]) == (
        "held-out: accuracy 50%, reward 0.00 at step 16, versions 15-16, 30 of 32 prompts (incomplete)"
    )
    rclient.xadd(keys.evals, validation.encode(rollout_pb2.EvalMetrics(step=17, accuracy=1.5)))
    snap, extra = status.collect(rclient, keys)
    assert extra["last_eval"] is None and extra["errors"] == [
        "last eval entry unreadable: EvalMetrics step 17: accuracy 1.5 is not a share within [0, 1]"
    ]
