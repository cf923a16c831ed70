"""Issue 42 N3 against a real redis-server: a poisoned counter (a field holding text, as an
operator's mistake can leave one; no role can write another's counters any more, see
test_redis_acl.py) refuses the commit that would count it whole. Nothing is half-written,
the entries stay pending, the stage says it is not ready and why, retries slowly instead
of exiting or calling it an outage, and commits once when the key is fixed.

- the trainer, a real process on the tiny model: `trained` poisoned before its first step
  (the review: each crash-loop cycle marked 8 groups trained that never were);
- the reward stage's `scored`, and a stage's dead-letter counter, through StreamStage with
  the Redis policy (RedisHealth), as every service commits.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import httpx
import pytest
import redis

from helpers import wait_for
from procs import start_service
from rollstream.core import redis_policy, validation
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import StreamStage
from rollstream.v1 import rollout_pb2
from synthetic import record_tasks, scored_groups, tokenizer_decode

WAIT_S = 60.0  # for an event; never a timing assumption


def _group(i: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=f"g{i}", task_id=f"t{i}", prompt_ids=[1, 2, 3],
        completions=[rollout_pb2.Completion(token_ids=[4, 5], behaviour_logprobs=[-0.5, -1.0])],
    )  # fmt: skip


class Refusals:
    """A RedisHealth whose readiness changes are events, retrying refusals quickly."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.down = threading.Event()
        self.up = threading.Event()
        self.health = redis_policy.RedisHealth(
            logging.getLogger("test-ledger"), self.stop, on_change=self._changed, user="reward"
        )
        self.health.refused_retry_s = 0.05

    def _changed(self, ok: bool) -> None:
        (self.up if ok else self.down).set()


def _in_thread(fn) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("counter", ["scored", "dead_rollouts"])
def test_a_poisoned_counter_holds_the_commit_until_fixed(
    rclient: redis.Redis, keys: RunKeys, counter: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The reward's `scored` (the review: the reward kept re-adding its batch to `ready`)
    and its dead-letter counter: the commit writes nothing while the field holds text, the
    stage is not ready with the key named, the ERROR line says so, and once the field is
    fixed the commit lands once."""
    for i in range(2):
        rclient.xadd(keys.stream("rollouts"), validation.encode(_group(i)))
    refusals = Refusals()
    stage = StreamStage(rclient, keys, "rollouts", "reward", "reward-0", health=refusals.health)
    entries = stage.read(count=10, block_ms=10)
    assert len(entries) == 2
    rclient.hset(keys.counters("reward"), counter, "x")

    def commit() -> object:
        if counter == "scored":
            return stage.commit(entries, outputs=[("ready", _group(i)) for i in range(2)],
                                extra=lambda ops: ops.hincrby(stage.counters, "scored", 2))  # fmt: skip
        stage.dead_letter(entries[0], "unusable")
        return True

    with caplog.at_level(logging.INFO, logger="test-ledger"):
        thread, result = _in_thread(commit)
        assert refusals.down.wait(WAIT_S), "the stage never reported the refusal"
        # Held, not half-written: nothing in ready or dead, both entries pending on us.
        assert rclient.xlen(keys.stream("ready")) == 0 and rclient.xlen(keys.dead) == 0
        assert rclient.xpending(keys.stream("rollouts"), "reward")["pending"] == 2
        assert (
            not refusals.health.ok
            and keys.counters("reward") in refusals.health.detail
            and counter in refusals.health.detail
        )
        assert "nothing written" in refusals.health.detail and "unavailable" not in refusals.health.detail
        assert thread.is_alive()
        rclient.hdel(keys.counters("reward"), counter)  # the operator's fix
        thread.join(WAIT_S)
    assert not thread.is_alive() and result == [True]
    assert refusals.up.is_set() and refusals.health.ok
    refused = [r for r in caplog.records if r.getMessage() == "redis_write_refused"]
    assert refused and refused[0].levelno == logging.ERROR
    assert not [r for r in caplog.records if r.getMessage() == "redis_unavailable"]
    if counter == "scored":
        assert rclient.xlen(keys.stream("ready")) == 2 and rclient.hget(keys.counters("reward"), "scored") == b"2"
        assert rclient.xpending(keys.stream("rollouts"), "reward")["pending"] == 0
    else:
        assert rclient.xlen(keys.dead) == 1 and rclient.hget(keys.counters("reward"), "dead_rollouts") == b"1"
        assert rclient.xpending(keys.stream("rollouts"), "reward")["pending"] == 1


def test_a_stop_ends_the_wait(rclient: redis.Redis, keys: RunKeys) -> None:
    """A service stopping while its commit is refused stops (Stopped, a clean stop), its
    entries still pending for its restart."""
    rclient.xadd(keys.stream("rollouts"), validation.encode(_group(0)))
    refusals = Refusals()
    stage = StreamStage(rclient, keys, "rollouts", "reward", "reward-0", health=refusals.health)
    entries = stage.read(count=10, block_ms=10)
    rclient.hset(keys.counters("reward"), "scored", "x")
    errors: list[BaseException] = []

    def commit() -> None:
        try:
            stage.commit(
                entries, outputs=[("ready", _group(0))], extra=lambda ops: ops.hincrby(stage.counters, "scored", 1)
            )
        except redis_policy.Stopped as e:
            errors.append(e)

    thread = threading.Thread(target=commit, daemon=True)
    thread.start()
    assert refusals.down.wait(WAIT_S)
    refusals.stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and len(errors) == 1
    assert (
        rclient.xlen(keys.stream("ready")) == 0 and rclient.xpending(keys.stream("rollouts"), "reward")["pending"] == 1
    )


def test_a_loop_meeting_a_key_of_another_type_says_so(
    rclient: redis.Redis, keys: RunKeys, caplog: pytest.LogCaptureFixture
) -> None:
    """A service loop's read of a key someone replaced (WRONGTYPE) goes through the same
    policy (ServiceHost.run_loop -> RedisHealth.failed): a refusal, said at ERROR and
    retried slowly, not "redis unavailable" backed off from forever."""
    rclient.set(keys.stream("ready"), "not a stream")
    refusals = Refusals()
    with pytest.raises(redis.ResponseError) as e:
        rclient.xreadgroup("trainer", "t", {keys.stream("ready"): ">"}, count=1)
    with caplog.at_level(logging.INFO, logger="test-ledger"):
        refusals.health.failed(e.value, "trainer loop")
    assert refusals.down.is_set() and refusals.health.detail.startswith(
        "redis refused (trainer loop): ResponseError: WRONGTYPE"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "test-ledger"] == ["redis_write_refused"]


def test_without_the_policy_a_refusal_is_an_error_not_an_outage(rclient: redis.Redis, keys: RunKeys) -> None:
    """What the classification says: a refused write is neither transient (an outage to
    back off from) nor a denied user (exit 2)."""
    rclient.xadd(keys.stream("rollouts"), validation.encode(_group(0)))
    stage = StreamStage(rclient, keys, "rollouts", "reward", "reward-0")
    entries = stage.read(count=10, block_ms=10)
    rclient.hset(keys.counters("reward"), "scored", "x")
    with pytest.raises(redis.ResponseError) as e:
        stage.commit(
            entries, outputs=[("ready", _group(0))], extra=lambda ops: ops.hincrby(stage.counters, "scored", 1)
        )
    assert redis_policy.is_refused_write(e.value)
    assert not redis_policy.is_transient(e.value) and not redis_policy.is_denied(e.value)
    rclient.delete(keys.counters("reward"))
    rclient.set(keys.counters("reward"), "a string")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE HINCRBY on .*, a string: nothing written") as e:
        stage.commit(
            entries, outputs=[("ready", _group(0))], extra=lambda ops: ops.hincrby(stage.counters, "scored", 1)
        )
    assert redis_policy.is_refused_write(e.value)
    assert rclient.xlen(keys.stream("ready")) == 0


@pytest.mark.parametrize("poison", ["field", "key"])
def test_the_trainer_waits_out_a_poisoned_counter_and_trains_each_group_once(
    redis_url: str, rclient: redis.Redis, keys: RunKeys, tiny_model_dir: Path, tmp_path: Path, poison: str
) -> None:
    """The review's attack, by an admin's mistake now that no role can. `field`: `trained`
    holds text before the first step; the step's commit is refused whole (groups:trained
    stays empty, the groups pending). `key`: the trainer's counters are a string; it starts
    anyway (replay cannot read the run's step: said) and waits at its first write. Either
    way the trainer says why, not ready, and keeps running (no crash loop); once the key is
    fixed the step commits: each group trained once."""
    groups = scored_groups(1, 2)
    for i, g in enumerate(groups):
        g.group_id = g.task_id = f"group-{i}"
    record_tasks(rclient, keys, groups, tokenizer_decode(tiny_model_dir))  # as if this trainer had fed them
    for g in groups:
        rclient.xadd(keys.stream("ready"), validation.encode(g))
    counters = keys.counters("trainer")
    if poison == "field":
        rclient.hset(counters, "trained", "x")
    else:
        rclient.set(counters, "x")
    trainer = start_service(
        "trainer", tmp_path,
        "--redis-url", redis_url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1", "--consumer", "trainer-0",
        "--groups-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--prompt-buffer", "2", "--lr", "1e-3",
        "--max-staleness", "100", "--block-ms", "100", "--steps", "1", "--linger",
    )  # fmt: skip
    try:
        # Refused: not ready (never ready yet), saying why.
        wait_for(lambda: "redis_write_refused" in trainer.log(), 180, "a write refused", [trainer])
        port = json.loads(trainer.state_file.read_text())["http_port"]
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert answer.status_code == 503 and "redis refused (commit to" in answer.json()["detail"], answer.text
        if poison == "field":
            assert f"field trained of {counters} holds 'x'" in answer.json()["detail"]
            assert rclient.xpending(keys.stream("ready"), "trainer")["pending"] == 2  # the step trained, held
            assert rclient.hget(counters, "trained") == b"x" and rclient.hget(counters, "step") is None
        else:
            assert f"WRONGTYPE HSET on {counters}, a string" in answer.json()["detail"]
            assert "run_step_unreadable" in trainer.log()
        assert rclient.scard(keys.groups("trained")) == 0 and rclient.xlen(keys.metrics) == 0
        assert trainer.proc.poll() is None, trainer.log()[-3000:]
        if poison == "field":  # the operator's fix
            rclient.hset(counters, "trained", 0)
        else:
            rclient.delete(counters)
        wait_for(lambda: int(rclient.hget(counters, "step") or 0) == 1, 120, "step 1 committed", [trainer])
        assert rclient.scard(keys.groups("trained")) == 2
        assert rclient.sismember(keys.groups("trained"), "group-0") and rclient.sismember(
            keys.groups("trained"), "group-1"
        )
        assert rclient.hget(counters, "trained") == b"2"
        assert rclient.xpending(keys.stream("ready"), "trainer")["pending"] == 0
        assert trainer.proc.poll() is None and "step_not_recorded" not in trainer.log().lower()
    finally:
        trainer.stop()
