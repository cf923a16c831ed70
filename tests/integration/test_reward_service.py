"""The reward service as a real process against a real redis-server, and its real gRPC API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from helpers import (
    MIN_WAIT_S,
    REWARD_GROUP,
    assert_scored_exactly_once,
    groups_in,
    wait_for,
    wait_healthy,
    write,
    write_many,
)
from procs import start_reward
from rollstream.core import grpc_utils, redis_policy, validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.core.streams import StreamStage
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2
from synthetic import rollout_group


def test_scores_valid_groups_and_dead_letters_malformed_entries(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    svc = start_reward(tmp_path, redis_url, keys.run, "--trim-every-s", "0.2", "--trust-scored-rollouts")
    try:
        rollouts = keys.stream("rollouts")
        write(
            rclient,
            keys,
            "rollouts",
            rollout_group("g1", ["8", " 8.", "The answer is 8", "The answer is 9 not 8", "eight", "-1,234"]),
        )
        bad_ids = {
            "garbage type": rclient.xadd(rollouts, {"type": "garbage", "schema": "1", "data": b"x"}),
            "corrupt data": rclient.xadd(
                rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "1", "data": b"\xff\xff"}
            ),
            "missing fields": rclient.xadd(rollouts, {"data": b""}),
            "future schema": rclient.xadd(
                rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "99", "data": b""}
            ),
            "no completions": write(
                rclient, keys, "rollouts", rollout_pb2.RolloutGroup(group_id="empty", prompt_ids=[1])
            ),
        }
        # The service must keep going after the bad entries.
        write(rclient, keys, "rollouts", rollout_group("g2", ["-3", "3"], answer="-3"))
        prescored = rollout_group("pre", ["8"])
        prescored.scored = True
        prescored.completions[0].reward = 0.7
        prescored.completions[0].reward_components.add(name="custom", value=0.7, weight=1.0, status="ok")
        write(rclient, keys, "rollouts", prescored)
        # A kind no recipe knows: refused, not scored 0 and trained on (issue 27).
        bad_ids["unknown kind"] = write(
            rclient, keys, "rollouts", rollout_group("chess", ["e4"], answer="e4", task_kind="chess")
        )
        write(rclient, keys, "rollouts", rollout_group("badref", ["8"], answer="eight"))

        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 4, 15, "4 groups scored", [svc])
        wait_for(lambda: rclient.xlen(keys.dead) == 6, 15, "6 dead letters", [svc])
        out = {g.group_id: g for g in groups_in(rclient, keys.stream("scored"))}
        assert list(out) == ["g1", "g2", "pre", "badref"]  # input order, bad ones left out

        g1 = out["g1"]
        assert g1.scored and not g1.has_ref_logprobs
        assert [c.reward for c in g1.completions] == pytest.approx([1.1, 1.1, 1.1, 0.0, 0.0, 0.1])
        for c in g1.completions:
            assert [(rc.name, rc.weight, rc.status) for rc in c.reward_components] == [
                ("answer", 1.0, "ok"),
                ("format", pytest.approx(0.1), "ok"),
            ]
        assert [(c.reward_components[0].value, c.reward_components[1].value) for c in g1.completions] == [
            (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0), (0.0, 1.0),
        ]  # fmt: skip
        # Everything the generator wrote is still there.
        original = rollout_group("g1", ["8"])
        assert (g1.task_id, g1.policy_version, list(g1.prompt_ids), g1.generator_id) == (
            "task-g1",
            3,
            [11, 12, 13],
            "gen-0",
        )
        assert list(g1.completions[0].token_ids) == list(original.completions[0].token_ids)
        assert list(g1.completions[0].behaviour_logprobs) == [-0.5, -0.25]
        assert g1.completions[0].versions == original.completions[0].versions

        assert [c.reward for c in out["g2"].completions] == pytest.approx([1.1, 0.1])
        assert out["pre"] == prescored  # passed through unchanged
        badref_answer, badref_format = out["badref"].completions[0].reward_components
        assert badref_answer.status.startswith("error: ValueError: reference answer 'eight' is not a number")
        assert badref_format.status == "ok"
        assert out["badref"].completions[0].reward == pytest.approx(0.1)

        dead = {}
        for _id, fields in rclient.xrange(keys.dead):
            letter = validation.decode(fields, rollout_pb2.DeadLetter)
            assert fields[b"reason"].decode() == letter.reason  # readable with redis-cli too
            dead[letter.source_id] = letter
        reasons = {what: dead[eid.decode()].reason for what, eid in bad_ids.items()}
        assert "type is 'garbage'" in reasons["garbage type"]
        assert "does not parse as rollstream.v1.RolloutGroup" in reasons["corrupt data"]
        assert "missing field(s) type, schema" in reasons["missing fields"]
        assert "schema 99 is not supported" in reasons["future schema"]
        assert "has no completions" in reasons["no completions"]
        assert (
            reasons["unknown kind"]
            == "task_kind 'chess' has no verifier in this reward service (known: arithmetic, code, countdown, exact, math)"
        )
        corrupt = dead[bad_ids["corrupt data"].decode()]
        assert corrupt.original_fields["data"] == b"\xff\xff"
        assert (corrupt.source_stream, corrupt.consumer_group) == (rollouts, REWARD_GROUP)

        assert rclient.xpending(rollouts, REWARD_GROUP)["pending"] == 0
        stats = read_counters(rclient, keys)[0]
        assert stats == {
            "scored": 3,
            "reward_passthrough": 1,
            "reward_verifier_errors": 1,
            "dead_rollouts": 6,
        }
        # Every entry is acknowledged, so the periodic trim empties the input stream.
        wait_for(lambda: rclient.xlen(rollouts) == 0, 15, "rollouts trimmed", [svc])

        metrics = httpx.get(f"http://127.0.0.1:{svc.http_port}/metrics", timeout=5).text
        for line in (
            'rollstream_reward_groups_total{outcome="scored"} 3.0',
            'rollstream_reward_groups_total{outcome="passed_through"} 1.0',
            "rollstream_reward_completions_total 9.0",
            "rollstream_reward_dead_lettered_total 6.0",
            'rollstream_reward_verifier_errors_total{component="answer"} 1.0',
        ):
            assert line in metrics.splitlines(), line
        assert svc.stop() == 0  # SIGTERM: a clean exit
        assert "dead_lettered" in svc.log() and "stopped" in svc.log()
    finally:
        svc.kill()


def test_a_group_claiming_its_own_rewards_is_scored_again_by_default(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    """Issue 27: the generator's Redis user writes `rollouts`; a group it marks scored, with
    reward 100, must not reach the trainer as such unless the operator trusts that stream."""
    svc = start_reward(tmp_path, redis_url, keys.run)
    try:
        forged = rollout_group("forged", ["7", "8"])  # the answer is 8
        forged.scored = True
        for c in forged.completions:
            c.reward = 100.0
            c.reward_components.add(name="custom", value=100.0, weight=1.0, status="ok")
        write(rclient, keys, "rollouts", forged)
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 1, 60, "the forged group scored", [svc])
        (out,) = groups_in(rclient, keys.stream("scored"))
        assert [c.reward for c in out.completions] == pytest.approx([0.1, 1.1])  # its own answers, scored here
        assert all(comp.name != "custom" for c in out.completions for comp in c.reward_components)
        stats = read_counters(rclient, keys)[0]
        assert stats.get("reward_passthrough", 0) == 0 and stats["scored"] == 1
    finally:
        svc.stop()


def test_grpc_score_and_ready_output_stage(tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys) -> None:
    # A token-length recipe too: Score items carry num_tokens (DAPO overlong shaping: 0 up to
    # 2 tokens, -0.5 at 3, -1 at 4 and beyond).
    length_recipe = (
        '{"short": [{"component": "length", "weight": 1.0, "params": {"max_length": 4, "cache_length": 2}}]}'
    )
    svc = start_reward(
        tmp_path,
        redis_url,
        keys.run,
        "--output-stage",
        "ready",
        "--answer-weight",
        "2",
        "--format-weight",
        "0.5",
        "--recipes",
        length_recipe,
    )
    try:
        wait_healthy(svc.grpc_address, timeout_s=10, service="rollstream.v1.Reward")
        request = reward_pb2.ScoreRequest(
            items=[
                reward_pb2.ScoreItem(
                    group_id="a", completion_index=0, task_kind="arithmetic", completion="8", answer="8"
                ),
                reward_pb2.ScoreItem(
                    group_id="a", completion_index=1, task_kind="arithmetic", completion="It is 7", answer="8"
                ),
                reward_pb2.ScoreItem(group_id="b", task_kind="exact", completion=" Paris ", answer="Paris"),
                reward_pb2.ScoreItem(group_id="c", task_kind="poetry", completion="roses", answer=""),
                reward_pb2.ScoreItem(
                    group_id="d", task_kind="short", completion="a b c", num_tokens=3, finish_reason="stop"
                ),
                reward_pb2.ScoreItem(
                    group_id="d", task_kind="short", completion="", num_tokens=0, finish_reason="stop"
                ),
                reward_pb2.ScoreItem(group_id="d", task_kind="short", completion="a b c"),  # token count unknown
            ]
        )
        with grpc_utils.channel(svc.grpc_address) as ch:
            reply = reward_pb2_grpc.RewardStub(ch).Score(request, timeout=10)
        assert [s.reward for s in reply.scores] == pytest.approx([2.5, 0.0, 2.0, 0.0, -0.5, 0.0, 0.0])
        assert [(c.name, c.value, c.weight) for c in reply.scores[0].components] == [
            ("answer", 1.0, 2.0),
            ("format", 1.0, 0.5),
        ]
        assert "unknown task_kind 'poetry'" in reply.scores[3].components[0].status
        # An absent num_tokens is "unknown", not 0: the component says so instead of scoring.
        assert [c.status for s in reply.scores[4:] for c in s.components] == [
            "ok",
            "ok",
            "error: ValueError: the token count is unknown here (use unit = 'chars')",
        ]

        # With --output-stage ready (beta = 0) the groups skip the reference stage.
        write(rclient, keys, "rollouts", rollout_group("r1", ["8", "7."]))
        wait_for(lambda: rclient.xlen(keys.stream("ready")) == 1, 15, "group in ready", [svc])
        (group,) = groups_in(rclient, keys.stream("ready"))
        assert [c.reward for c in group.completions] == pytest.approx([2.5, 0.5])
        assert rclient.xlen(keys.stream("scored")) == 0
    finally:
        svc.kill()


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--answer-weight", "abc"], "answer_weight"),
        (["--grpc-port", "99999"], "grpc_port"),
        (["--output-stage", "trainer"], "output_stage"),
    ],
)
def test_bad_config_exits_2_naming_the_field(flags: list[str], field: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.reward", *flags], capture_output=True, text=True, timeout=MIN_WAIT_S
    )
    assert done.returncode == 2, done.stderr
    assert f"field '{field}'" in done.stderr


def test_claims_entries_a_dead_consumer_left_pending(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    rollouts = keys.stream("rollouts")
    ids = [f"p{i}" for i in range(10)]
    write_many(rclient, keys, [rollout_group(i, ["8"]) for i in ids])
    # A consumer "reward-a" read six entries mid-batch and died before acknowledging them.
    StreamStage.ensure_group(rclient, rollouts, REWARD_GROUP)
    taken = rclient.xreadgroup(REWARD_GROUP, "reward-a", {rollouts: ">"}, count=6)
    assert len(taken[0][1]) == 6
    assert rclient.xpending(rollouts, REWARD_GROUP)["pending"] == 6

    svc = start_reward(tmp_path, redis_url, keys.run, "--claim-idle-ms", "500")
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) >= 10, 15, "all 10 scored", [svc])
        time.sleep(0.7)  # past another claim interval: a duplicate would show up now
        assert_scored_exactly_once(rclient, keys, ids)
        consumers = {c["name"].decode(): c["pending"] for c in rclient.xinfo_consumers(rollouts, REWARD_GROUP)}
        assert consumers["reward-a"] == 0
        metrics = httpx.get(f"http://127.0.0.1:{svc.http_port}/metrics", timeout=5).text
        assert "rollstream_reward_redelivered_total 6.0" in metrics.splitlines()
    finally:
        svc.kill()


def test_restart_under_same_consumer_name_finishes_its_own_pending(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    rollouts = keys.stream("rollouts")
    ids = [f"o{i}" for i in range(8)]
    write_many(rclient, keys, [rollout_group(i, ["8"]) for i in ids])
    # What a SIGKILLed "reward-x" leaves behind: five entries read, none acknowledged.
    StreamStage.ensure_group(rclient, rollouts, REWARD_GROUP)
    rclient.xreadgroup(REWARD_GROUP, "reward-x", {rollouts: ">"}, count=5)
    # An idle timeout far beyond the test: only "read my own pending first" can recover them.
    svc = start_reward(tmp_path, redis_url, keys.run, "--consumer", "reward-x", "--claim-idle-ms", "600000")
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) >= 8, 15, "all 8 scored", [svc])
        time.sleep(0.2)
        assert_scored_exactly_once(rclient, keys, ids)
    finally:
        svc.kill()


def test_sigkill_mid_stream_and_restart_loses_and_duplicates_nothing(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    n = 600
    ids = [f"k{i}" for i in range(n)]
    write_many(rclient, keys, [rollout_group(i, ["8", "9", "The answer is 8"]) for i in ids])
    args = ("--consumer", "reward-k", "--read-count", "2", "--claim-idle-ms", "600000")
    first = start_reward(tmp_path, redis_url, keys.run, *args, tag="-1", ready=False)
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) >= 40, 15, "scoring under way", [first])
        first.kill()  # SIGKILL while it works through the backlog
    finally:
        first.kill()
    at_kill = rclient.xlen(keys.stream("scored"))
    assert 0 < at_kill < n, "the kill should land mid-stream"

    second = start_reward(tmp_path, redis_url, keys.run, *args, tag="-2")
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) >= n, 15, f"all {n} scored", [second])
        time.sleep(0.2)
        assert_scored_exactly_once(rclient, keys, ids)
        assert all(
            [c.reward for c in g.completions] == pytest.approx([1.1, 0.1, 1.1])
            for g in groups_in(rclient, keys.stream("scored"))
        )
    finally:
        second.kill()


def test_waits_for_redis_and_survives_it_going_away(tmp_path: Path, keys: RunKeys) -> None:
    # Its own redis-server, so stopping it does not disturb the session's. Not started yet:
    # the service must come up anyway, report not-ready, and join once Redis answers.
    server = EmbeddedRedis(tmp_path / "redis")
    client = None
    svc = start_reward(tmp_path, server.url, keys.run, "--claim-idle-ms", "500", ready=False)
    try:
        wait_for(svc.state_file.exists, 15, "state file", [svc])
        http = f"http://127.0.0.1:{json.loads(svc.state_file.read_text())['http_port']}"

        def waiting_for_redis() -> bool:
            try:  # the state file can come a moment before the HTTP thread listens
                reply = httpx.get(http + "/readyz", timeout=5)
            except httpx.TransportError:
                return False
            assert reply.status_code == 503
            return "redis unavailable (connecting to" in reply.json()["detail"]

        wait_for(waiting_for_redis, 15, "readyz to say it waits for redis", [svc])
        assert httpx.get(http + "/healthz", timeout=5).status_code == 200  # alive, just not ready

        server.start()
        svc.wait_ready()
        client = redis_policy.connect(server.url)
        write(client, keys, "rollouts", rollout_group("before", ["8"]))
        wait_for(lambda: client.xlen(keys.stream("scored")) == 1, 15, "first group scored", [svc])

        server.stop()
        readyz = f"http://127.0.0.1:{svc.http_port}/readyz"
        wait_for(lambda: httpx.get(readyz, timeout=5).status_code == 503, 15, "readyz to fail", [svc])
        assert svc.proc.poll() is None

        server.start()  # same port and data dir: the AOF brings the streams back
        wait_for(lambda: httpx.get(readyz, timeout=5).status_code == 200, 15, "readyz to recover", [svc])
        write(client, keys, "rollouts", rollout_group("after", ["8"]))
        wait_for(lambda: client.xlen(keys.stream("scored")) == 2, 15, "second group scored", [svc])
        assert [g.group_id for g in groups_in(client, keys.stream("scored"))] == ["before", "after"]
        # One line when the outage starts, one when it ends (not one per retry).
        assert svc.log().count("redis_unavailable") <= 3 and "redis_recovered" in svc.log()
    finally:
        svc.kill()
        if client is not None:
            client.close()
        server.stop()


def test_timeouts_and_code_recipes_through_the_stream_and_rpc(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    recipes = {
        "math": [{"component": "math", "name": "answer", "weight": 1.0, "timeout_s": 0.5}],
        "code": [{"component": "code", "name": "tests", "weight": 1.0, "params": {"wall_s": 5, "test_timeout_s": 1}}],
    }
    svc = start_reward(tmp_path, redis_url, keys.run, "--recipes", json.dumps(recipes))
    try:
        tower = r"\boxed{9^{9^{9^{9}}}}"  # math-verify would compute this for a very long time
        write(
            rclient,
            keys,
            "rollouts",
            rollout_group("m", [r"\boxed{\frac{1}{2}}", tower, r"\boxed{3}"], answer="0.5", task_kind="math"),
        )
        code_group = rollout_group(
            "c",
            ["```python\ndef sq(x):\n    return x * x\n```", "def sq(x):\n    return x + x", "while True:\n    pass"],
            task_kind="code",
        )
        code_group.metadata_json = json.dumps({"tests": ["assert sq(3) == 9", "assert sq(2) == 4"]})
        write(rclient, keys, "rollouts", code_group)
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 2, 60, "2 groups scored", [svc])
        out = {g.group_id: g for g in groups_in(rclient, keys.stream("scored"))}
        assert [(c.reward, c.reward_components[0].status) for c in out["m"].completions] == [
            (1.0, "ok"),
            (0.0, "timeout"),
            (0.0, "ok"),
        ]
        # sq = x + x passes sq(2) == 4 only; the endless loop runs past the per-test limit: a
        # timeout (value 0), not a wrong answer.
        assert [(c.reward, c.reward_components[0].status) for c in out["c"].completions] == [
            (1.0, "ok"),
            (0.5, "ok"),
            (0.0, "timeout"),
        ]
        stats = read_counters(rclient, keys)[0]
        assert stats == {"scored": 2, "reward_timeouts": 2}

        # The Score RPC scores in the same worker pool, so its time limit is as hard.
        wait_healthy(svc.grpc_address, timeout_s=10, service="rollstream.v1.Reward")
        with grpc_utils.channel(svc.grpc_address) as ch:
            reply = reward_pb2_grpc.RewardStub(ch).Score(
                reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(task_kind="math", completion=tower, answer="1"),
                                               reward_pb2.ScoreItem(task_kind="math", completion=r"\boxed{1}", answer="1")]),
                timeout=30,
            )  # fmt: skip
        assert [(s.reward, s.components[0].status) for s in reply.scores] == [(0.0, "timeout"), (1.0, "ok")]
        metrics = httpx.get(f"http://127.0.0.1:{svc.http_port}/metrics", timeout=5).text.splitlines()
        assert 'rollstream_reward_timeouts_total{component="answer"} 2.0' in metrics
        assert 'rollstream_reward_timeouts_total{component="tests"} 1.0' in metrics
    finally:
        svc.kill()


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def score_workers(service_pid: int) -> list[int]:
    """The scoring pool's worker processes: the children of the service's forkserver."""
    forkservers = [p for p in children(service_pid) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return [w for f in forkservers for w in children(f)]


def test_scoring_workers_killed_mid_batch_lose_nothing(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    recipes = {"math": [{"component": "math", "name": "answer", "weight": 1.0, "timeout_s": 3}]}
    svc = start_reward(tmp_path, redis_url, keys.run, "--recipes", json.dumps(recipes), "--score-workers", "2")
    try:
        workers = score_workers(svc.proc.pid)
        assert len(workers) == 2, workers
        tower = r"\boxed{9^{9^{9^{9}}}}"  # busy until its 3 s limit: the batch is in flight meanwhile
        write(
            rclient,
            keys,
            "rollouts",
            rollout_group("k", [tower, r"\boxed{1}", r"\boxed{2}"], answer="1", task_kind="math"),
        )
        wait_for(
            lambda: rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 1,
            15,
            "the batch in flight",
            [svc],
        )
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 1, 60, "the group scored", [svc])
        (g,) = groups_in(rclient, keys.stream("scored"))
        assert [(c.reward, c.reward_components[0].status) for c in g.completions] == [
            (0.0, "timeout"),
            (1.0, "ok"),
            (0.0, "ok"),
        ]
        assert rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 0 and rclient.xlen(keys.dead) == 0
        # New workers took over; the service is still up and scoring.
        assert svc.proc.poll() is None and len(score_workers(svc.proc.pid)) == 2
        assert not set(score_workers(svc.proc.pid)) & set(workers)
    finally:
        svc.kill()


def test_bad_recipe_config_exits_2_naming_it() -> None:
    bad = json.dumps({"math": [{"component": "regex", "weight": 1, "params": {"pattern": "("}}]})
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.reward", "--recipes", bad],
        capture_output=True,
        text=True,
        timeout=MIN_WAIT_S,
    )
    assert done.returncode == 2, done.stderr
    assert "recipes.math[0]" in done.stderr and "pattern does not compile" in done.stderr
