"""examples/custom_reward/parity_reward.py against a real redis-server, without a model:
the contract of docs/custom-reward.md (dead letters, pass-through, resuming its own
pending entries, giving up on entries delivered too often, trimming, a clean stop)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from helpers import CUSTOM_REWARD_EXAMPLE, MIN_WAIT_S, LoggedProc, groups_in, wait_for, write, write_many
from rollstream.core import streams, validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.v1 import rollout_pb2
from synthetic import rollout_group

GROUP = "custom-reward"


def start(stubs: Path, redis_url: str, run: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(
            [sys.executable, str(CUSTOM_REWARD_EXAMPLE / "parity_reward.py"), "--redis-url", redis_url, "--run", run, "--stubs", str(stubs),
             "--consumer", "parity-0", "--block-ms", "50", *args],
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


def example(proc: subprocess.Popen[bytes], log: Path) -> list[LoggedProc]:
    """The example's process, for wait_for to watch."""
    return [LoggedProc("the example", proc, log)]


@pytest.fixture
def log(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "parity.log"
    path.touch()
    yield path


def test_scores_dead_letters_passes_through_and_stops_cleanly(
    custom_reward_stubs: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, log: Path
) -> None:
    rollouts = keys.stream("rollouts")
    group = rollout_group("even-odd", ["a", "b"])
    group.completions[1].token_ids.append(7)  # 2 tokens and 3 tokens
    write(rclient, keys, "rollouts", group)
    bad = rclient.xadd(rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "2", "data": b""})
    prescored = rollout_group("pre", ["x"])
    prescored.scored = True
    prescored.completions[0].reward = 0.25
    write(rclient, keys, "rollouts", prescored)
    # A group of a task the trainer never fed (written past helpers.write, which records one).
    stranger = rclient.xadd(rollouts, validation.encode(rollout_group("stranger", ["ab"])))
    proc = start(custom_reward_stubs, redis_url, keys.run, log)
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 2, 20, "two groups scored", procs=example(proc, log))
        wait_for(lambda: rclient.xlen(keys.dead) == 2, 20, "two dead letters", procs=example(proc, log))
        out = {g.group_id: g for g in groups_in(rclient, keys.stream("scored"))}
        assert [c.reward for c in out["even-odd"].completions] == [1.0, 0.0]
        assert [
            [(rc.name, rc.value, rc.status) for rc in c.reward_components] for c in out["even-odd"].completions
        ] == [
            [("parity", 1.0, "ok")],
            [("parity", 0.0, "ok")],
        ]
        assert out["even-odd"].scored and list(out["even-odd"].completions[0].behaviour_logprobs) == [-0.5, -0.25]
        assert out["pre"] == prescored  # forwarded unchanged
        (_, fields), (_, unknown) = rclient.xrange(keys.dead)
        assert unknown[b"reason"].decode().endswith(f"is not in {keys.tasks}: not a task the trainer fed")
        assert validation.decode(unknown, rollout_pb2.DeadLetter).source_id == stranger.decode()
        letter = validation.decode(fields, rollout_pb2.DeadLetter)  # readable by rollstream's own decode
        assert letter.source_id == bad.decode() and letter.consumer_group == GROUP
        assert "schema b'2' is not supported" in fields[b"reason"].decode() == letter.reason
        assert rclient.xpending(rollouts, GROUP)["pending"] == 0
        assert read_counters(rclient, keys)[0] == {"scored": 2, "dead_rollouts": 2}
        wait_for(lambda: rclient.xlen(rollouts) == 0, 20, "rollouts trimmed behind the acks", procs=example(proc, log))
    finally:
        proc.terminate()
        proc.wait(timeout=MIN_WAIT_S)
    assert proc.returncode == 0, log.read_text()


def test_resumes_its_own_pending_and_dead_letters_over_delivered(
    custom_reward_stubs: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, log: Path
) -> None:
    rollouts = keys.stream("rollouts")
    write_many(rclient, keys, [rollout_group(f"p{i}", ["ab"]) for i in range(6)])
    streams.StreamStage.ensure_group(rclient, rollouts, GROUP)
    # What a killed "parity-0" leaves: four entries read and never acknowledged; one of them
    # read six times over (each XCLAIM to itself counts a delivery).
    taken = rclient.xreadgroup(GROUP, "parity-0", {rollouts: ">"}, count=4)[0][1]
    poison = taken[0][0]
    for _ in range(5):
        rclient.xclaim(rollouts, GROUP, "parity-0", 0, [poison])
    proc = start(custom_reward_stubs, redis_url, keys.run, log, "--claim-idle-ms", "600000")
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 5, 20, "five scored", procs=example(proc, log))
        wait_for(lambda: rclient.xlen(keys.dead) == 1, 20, "one dead letter", procs=example(proc, log))
        ((_, fields),) = rclient.xrange(keys.dead)
        # 1 read + 5 claims before, + the restart's re-read of its own pending entries.
        assert fields[b"reason"] == b"delivered 7 times without being acknowledged"
        assert sorted(g.group_id for g in groups_in(rclient, keys.stream("scored"))) == ["p1", "p2", "p3", "p4", "p5"]
        assert rclient.xpending(rollouts, GROUP)["pending"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=MIN_WAIT_S)
