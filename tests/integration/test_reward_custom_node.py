"""examples/custom_reward_node (Node.js: npm redis + protobufjs) against a real redis-server,
without a model: the contract of docs/custom-reward.md as a service in another language
keeps it. Scores with the rewards spliced into the original bytes (unknown fields and
64-bit integers intact), dead letters with reasons, resuming its own pending entries after
kill -9, taking over a dead consumer's, giving up on entries delivered too often, trimming,
a clean stop, and the `reward` ACL user with nothing refused. Skips where node/npm or the
npm registry is missing (tests/node_example.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from helpers import MIN_WAIT_S, groups_in, wait_for, write, write_many
from node_example import install_node_example, start_node_reward
from procs import ChildProcess
from rollstream.core import redis_acl, streams, validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import rollout_pb2
from synthetic import record_tasks, rollout_group

GROUP = "reward"
# A field number rollout.proto does not have (varint 7): what a newer writer might add.
UNKNOWN_FIELD = bytes([(99 << 3) & 0x7F | 0x80, 99 >> 4, 7])


def node_rule(n_tokens: int) -> float:
    """The example's grader: (number of completion tokens mod 3) / 2."""
    return (n_tokens % 3) / 2


@pytest.fixture(scope="module")
def node_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_node_example(tmp_path_factory.mktemp("node-reward"))


@pytest.fixture
def started(node_folder: Path, redis_url: str, keys: RunKeys, tmp_path: Path) -> Iterator[list[ChildProcess]]:
    """Processes the test started (stopped at the end, whatever happened)."""
    procs: list[ChildProcess] = []
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)


def start(
    node_folder: Path, redis_url: str, keys: RunKeys, tmp_path: Path, *args: str, consumer: str = "node-0"
) -> ChildProcess:
    return start_node_reward(
        node_folder, tmp_path / f"{consumer}.log", "--redis-url", redis_url, "--run", keys.run, "--consumer", consumer,
        "--output-stage", "ready", "--block-ms", "50", "--trim-every-ms", "200", *args, name=consumer,
    )  # fmt: skip


def test_scores_by_splicing_and_dead_letters_bad_entries(
    node_folder: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, tmp_path: Path, started: list[ChildProcess]
) -> None:
    rollouts = keys.stream("rollouts")
    group = rollout_group("g1", ["a", "b", "c"])
    group.policy_version = 2**64 - 1  # a uint64 past JavaScript's 2^53: must travel exactly
    group.group_size = 3
    for i, c in enumerate(group.completions):
        c.token_ids.extend([7] * i)  # 2, 3, 4 tokens
        c.behaviour_logprobs.extend([-1.0] * i)
    data = group.SerializeToString() + UNKNOWN_FIELD
    record_tasks(rclient, keys, [group])  # a task the trainer fed (helpers.write does it for the others)
    good = rclient.xadd(rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "1", "data": data})
    prescored = rollout_group("pre", ["x"])
    prescored.scored = True
    prescored.completions[0].reward = 0.25
    write(rclient, keys, "rollouts", prescored)
    short = rollout_group("short", ["x", "y"])
    short.group_size = 4
    bad = {
        rclient.xadd(
            rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "2", "data": b""}
        ): 'schema "2" is not supported',
        rclient.xadd(
            rollouts, {"type": "rollstream.v1.PromptTask", "schema": "1", "data": b""}
        ): "expected rollstream.v1.RolloutGroup",
        rclient.xadd(
            rollouts, {"type": "rollstream.v1.RolloutGroup", "schema": "1", "data": b"\xff\xff\xff"}
        ): "data does not parse",
        write(rclient, keys, "rollouts", short): "2 completions, the task asked for 4",
        # A group of a task the trainer never fed (written past helpers.write, which records one).
        rclient.xadd(rollouts, validation.encode(rollout_group("stranger", ["ab"]))): "is not in " + keys.tasks,
    }
    proc = start(node_folder, redis_url, keys, tmp_path)
    started.append(proc)
    wait_for(
        lambda: rclient.xlen(keys.stream("ready")) == 2 and rclient.xlen(keys.dead) == 5,
        60,
        "2 groups written, 5 dead letters",
        procs=[proc],
    )

    entries = dict(rclient.xrange(keys.stream("ready")))
    out = {validation.decode(f, rollout_pb2.RolloutGroup).group_id: f[b"data"] for f in entries.values()}
    scored = rollout_pb2.RolloutGroup.FromString(out["g1"])
    assert scored.scored and scored.policy_version == 2**64 - 1 and scored.group_size == 3
    assert [c.reward for c in scored.completions] == [node_rule(2), node_rule(3), node_rule(4)] == [1.0, 0.0, 0.5]
    assert [[(rc.name, rc.value, rc.weight, rc.status) for rc in c.reward_components] for c in scored.completions] == [
        [("length_mod3", r, 1.0, "ok")] for r in (1.0, 0.0, 0.5)
    ]
    assert UNKNOWN_FIELD in out["g1"], "an unknown field was dropped"
    # Everything but the rewards, components and `scored` is what the generator wrote.
    expected = rollout_pb2.RolloutGroup.FromString(data)
    expected.scored = True
    for c, s in zip(expected.completions, scored.completions):
        c.reward = s.reward
        c.reward_components.extend(s.reward_components)
    assert scored == expected
    assert out["pre"] == prescored.SerializeToString()  # scored upstream: forwarded byte for byte

    letters = {}
    for _id, fields in rclient.xrange(keys.dead):
        letter = validation.decode(fields, rollout_pb2.DeadLetter)  # readable by rollstream's own decode
        assert fields[b"reason"].decode() == letter.reason
        assert letter.consumer_group == GROUP and letter.consumer == "node-0" and letter.deliveries == 1
        assert letter.source_stream == rollouts and 1e9 < letter.dead_at < 1e11  # seconds since the epoch
        letters[letter.source_id.encode()] = letter
    assert set(letters) == set(bad)
    for eid, why in bad.items():
        assert why in letters[eid].reason, letters[eid].reason
        assert letters[eid].original_fields["type"].startswith(b"rollstream.v1."), "the original entry is kept"
    assert read_counters(rclient, keys)[0] == {"scored": 1, "reward_passthrough": 1, "dead_rollouts": 5}
    assert good not in letters
    wait_for(lambda: rclient.xlen(rollouts) == 0, 30, "rollouts trimmed behind the acks", procs=[proc])
    assert proc.stop() == 0, proc.log()
    assert '"event":"stopped"' in proc.log()


def test_kill9_restart_takeover_and_over_delivered(
    node_folder: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, tmp_path: Path, started: list[ChildProcess]
) -> None:
    rollouts = keys.stream("rollouts")
    streams.StreamStage.ensure_group(rclient, rollouts, GROUP)
    write_many(rclient, keys, [rollout_group(f"p{i}", ["ab"]) for i in range(12)])
    # A dead consumer "ghost" holds two entries; one of them already delivered 5 times.
    held = rclient.xreadgroup(GROUP, "ghost", {rollouts: ">"}, count=2)[0][1]
    poison = held[0][0]
    rclient.xclaim(rollouts, GROUP, "ghost", 0, [poison], retrycount=5)

    # node-0 holds each batch 1 s (a slow scorer) and is killed while it holds some.
    first = start(
        node_folder, redis_url, keys, tmp_path, "--hold-ms", "1000", "--count", "3", "--claim-idle-ms", "600000"
    )
    started.append(first)

    def node0_holds() -> bool:
        return any(c["name"] == b"node-0" and c["pending"] > 0 for c in rclient.xinfo_consumers(rollouts, GROUP))

    wait_for(node0_holds, 60, "node-0 holding entries", procs=[first])
    first.kill()
    held_by_node0 = [
        p["message_id"] for p in rclient.xpending_range(rollouts, GROUP, "-", "+", 100, consumername="node-0")
    ]
    assert held_by_node0, "the kill landed after node-0 committed everything it read"

    # Restarted under the same name: its own pending entries first; and, with a short claim
    # idle time, the ghost's entries (the over-delivered one to the dead letters).
    again = start(node_folder, redis_url, keys, tmp_path, "--claim-idle-ms", "300")
    started.append(again)
    wait_for(
        lambda: rclient.xlen(keys.stream("ready")) >= 11 and rclient.xlen(keys.dead) == 1,
        60,
        "11 groups scored, 1 dead letter",
        procs=[again],
    )
    wait_for(lambda: rclient.xpending(rollouts, GROUP)["pending"] == 0, 30, "nothing pending", procs=[again])
    ids = sorted(g.group_id for g in groups_in(rclient, keys.stream("ready")))
    assert len(ids) == len(set(ids)) == 11, ids  # exactly once each, the poison excepted
    ((_, fields),) = rclient.xrange(keys.dead)
    letter = validation.decode(fields, rollout_pb2.DeadLetter)
    # 1 read + RETRYCOUNT 5 set by hand, + the take-over's XCLAIM: 6 > max_deliveries (5).
    assert letter.deliveries == 6 and "delivered 6 times (max_deliveries=5)" in letter.reason
    assert (
        validation.decode({k.encode(): v for k, v in letter.original_fields.items()}, rollout_pb2.RolloutGroup).group_id
        == "p0"
    )
    assert '"event":"claimed"' in again.log()
    assert again.stop() == 0, again.log()


def test_runs_as_the_reward_acl_user_with_nothing_refused(
    node_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
    keys: RunKeys,
    tmp_path: Path,
    started: list[ChildProcess],
) -> None:
    """The ACL line docs/custom-reward.md shows (redis_acl's `reward` user) is all the service
    needs: connect (HELLO, node-redis's first command), read, claim, commit, dead-letter, trim."""
    secrets = tmp_path_factory.mktemp("secrets")
    passwords = redis_acl.ensure_redis_credentials(secrets)
    with EmbeddedRedis(
        tmp_path_factory.mktemp("redis-acl"), aclfile=redis_acl.acl_file(secrets), admin_password=passwords["admin"]
    ) as server:
        admin = server.admin_client()
        try:
            admin.acl_log_reset()
            write_many(admin, keys, [rollout_group(f"a{i}", ["ab"]) for i in range(3)])
            admin.xadd(keys.stream("rollouts"), {"type": "garbage"})
            proc = start_node_reward(
                node_folder, tmp_path / "acl.log", "--redis-url", server.url, "--redis-username", "reward",
                "--redis-password-file", str(redis_acl.password_file(secrets, "reward")), "--run", keys.run, "--consumer", "node-acl",
                "--output-stage", "ready", "--block-ms", "50", "--trim-every-ms", "100",
            )  # fmt: skip
            started.append(proc)
            wait_for(
                lambda: admin.xlen(keys.stream("ready")) == 3 and admin.xlen(keys.dead) == 1,
                60,
                "3 scored, 1 dead letter as `reward`",
                procs=[proc],
            )
            wait_for(lambda: admin.xlen(keys.stream("rollouts")) == 0, 30, "trimmed as `reward`", procs=[proc])
            assert proc.stop() == 0, proc.log()
            assert [f"{e['username']}: {e['reason']} {e['object']}" for e in admin.acl_log(count=100)] == []
            # A wrong password is a configuration error: exit 2, said once.
            bad_file = tmp_path / "wrong.password"
            bad_file.write_text("not-the-password\n")
            wrong = start_node_reward(
                node_folder, tmp_path / "wrong.log", "--redis-url", server.url, "--redis-username", "reward",
                "--redis-password-file", str(bad_file), "--run", keys.run,
            )  # fmt: skip
            started.append(wrong)
            assert wrong.proc.wait(timeout=MIN_WAIT_S) == 2, wrong.log()
            assert "misconfigured" in wrong.log()
        finally:
            admin.close()


def test_waits_out_a_redis_restart_and_counts_no_delivery_for_it(
    node_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
    keys: RunKeys,
    tmp_path: Path,
    started: list[ChildProcess],
) -> None:
    """kill -9 of redis-server while the service holds entries, then a restart on its AOF:
    the service waits, loads its commit script again (NOSCRIPT), and commits everything once.
    With --max-deliveries 1, an outage counted as a delivery would dead-letter the entries."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-restart")).start()
    try:
        admin = server.admin_client()
        write_many(admin, keys, [rollout_group(f"r{i}", ["ab"]) for i in range(6)])
        proc = start_node_reward(
            node_folder, tmp_path / "restart.log", "--redis-url", server.url, "--run", keys.run, "--consumer", "node-0",
            "--output-stage", "ready", "--block-ms", "50", "--hold-ms", "3000", "--count", "3", "--max-deliveries", "1",
        )  # fmt: skip
        started.append(proc)
        source = keys.stream("rollouts")

        def holds() -> bool:
            try:
                return any(c["pending"] > 0 for c in admin.xinfo_consumers(source, GROUP))
            except redis.ResponseError:  # NOGROUP: the service has not created its group yet
                return False

        # After its first commit (the script is loaded), while it holds the second batch.
        wait_for(
            lambda: admin.xlen(keys.stream("ready")) == 3 and holds(),
            60,
            "node-0 holding its second batch",
            procs=[proc],
            poll_s=0.02,
        )
        # Redis 6.2 replays SCRIPT LOAD from its AOF; Redis 7 (or a server without that AOF)
        # forgets scripts on a restart: the service must answer NOSCRIPT by loading it again.
        admin.script_flush()
        admin.close()
        assert server.proc is not None
        server.proc.kill()  # kill -9: the pending entries list survives in the AOF (appendfsync always)
        server.proc.wait()
        server.proc = None
        server.start(timeout_s=60)
        admin = server.admin_client()
        wait_for(lambda: admin.xlen(keys.stream("ready")) == 6, 60, "all 6 scored after the restart", procs=[proc])
        assert sorted(g.group_id for g in groups_in(admin, keys.stream("ready"))) == [f"r{i}" for i in range(6)]
        assert admin.xlen(keys.dead) == 0 and admin.xpending(source, GROUP)["pending"] == 0
        assert proc.stop() == 0, proc.log()
        assert proc.log().count('"event":"commit_script_loaded"') == 2, (
            "the script was not loaded again after the restart"
        )
        admin.close()
    finally:
        server.stop()
