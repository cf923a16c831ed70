"""Least privilege on Redis (rollstream.core.redis_acl) against a real redis-server that
loads the rendered users.acl.

Each role connects as itself and does its real work through the project's own code (stream
stages: read, take-over, re-read, touch, commit, dead letter, trim; back-pressure; the
registry; the trainer's feeder and ledger), and the server's ACL LOG must stay empty: the
cheapest way to find a command the table forgets. Then what each role must not do is
refused (NOPERM), the default user and a wrong password are refused, and a refusal is a
clear configuration error (exit status 2), not an outage waited out forever. The read-only
`observer` counts the generator's back-pressure and writes nothing, anywhere, so the
generator's own user needs neither `scored` nor `ready`. Last, the real reward and reference
services, the generator (with the observer), and the custom reward example run as their role.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from helpers import CUSTOM_REWARD_EXAMPLE, MIN_WAIT_S, LoggedProc, wait_for, write
from procs import start_service, trainer_state
from rollstream.core import dashboard, redis_acl, redis_policy, run_keys, streams, validation
from rollstream.core.credentials import ROLES
from rollstream.core.models import vocab_size
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import StreamStage
from rollstream.launcher import cli
from rollstream.launcher.redis_server import EmbeddedRedis, find_redis_server
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.fleet import GeneratorDirectory
from rollstream.trainer.prompts import PromptFeeder, chat_encoder
from rollstream.v1 import rollout_pb2
from synthetic import rollout_group, scored_group_in_vocab

SERVICES = ("trainer", "generator", "reward", "reference")
# Commands no service role may have (the `admin` user's alone).
ADMIN_ONLY = ("debug", "config", "flushall", "flushdb", "shutdown", "keys", "scan", "acl", "monitor", "module", "replicaof",
              "slaveof", "client", "migrate", "restore", "save", "bgsave", "bgrewriteaof", "sync", "psync", "failover",
              "swapdb", "move", "rename", "object", "memory", "latency", "slowlog", "lastsave", "pfdebug", "cluster")  # fmt: skip


# -- the server (its fixtures: conftest.py) ----------------------------------------------


def denials(admin: redis.Redis, user: str | None = None) -> list[str]:
    """What the server refused (ACL LOG), as `user: reason object` lines."""
    return [
        f"{e['username']}: {e['reason']} {e['object']}"
        for e in admin.acl_log(count=1000)
        if user is None or e["username"] == user
    ]


def assert_denied(call: Callable[[], object]) -> None:
    with pytest.raises(redis.RedisError) as e:
        call()
    assert redis_policy.is_denied(e.value), f"{type(e.value).__name__}: {e.value}"
    assert not redis_policy.is_transient(e.value)


# -- the file -----------------------------------------------------------------------------


def test_acl_file_holds_hashes_only_and_keeps_passwords(tmp_path: Path) -> None:
    first = redis_acl.ensure_redis_credentials(tmp_path)
    text = redis_acl.acl_file(tmp_path).read_text()
    assert set(first) == set(ROLES) | {"observer"} == set(redis_acl.REDIS_USERS)
    for role, password in first.items():
        assert password not in text
        assert f"user {role} reset on #" in text
        path = redis_acl.password_file(tmp_path, role)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "user default reset resetchannels\n" in text  # off, no password, nothing allowed
    assert stat.S_IMODE(redis_acl.acl_file(tmp_path).stat().st_mode) == 0o600
    # A restarted `up` keeps every password (its services keep working); a deleted file rotates one.
    redis_acl.password_file(tmp_path, "reward").unlink()
    second = redis_acl.ensure_redis_credentials(tmp_path)
    assert {r: p for r, p in second.items() if r != "reward"} == {r: p for r, p in first.items() if r != "reward"}
    assert second["reward"] != first["reward"]
    with pytest.raises(ValueError, match="missing"):
        redis_acl.render_acl_file({"trainer": "x"})


@pytest.mark.parametrize("role", SERVICES)
def test_no_service_role_has_an_admin_command(role: str) -> None:
    commands, keys = redis_acl.ROLE_RULES[role]
    # The only subcommands granted of a multi-purpose command: each read-only or our own.
    subcommands = {c for c in commands if "|" in c}
    assert subcommands == {"xgroup|create", "script|load", "xinfo|groups", "cluster|slots"}
    names = {c for c in commands if "|" not in c}
    assert not names & set(ADMIN_ONLY), names & set(ADMIN_ONLY)
    assert not names & {"script", "xinfo", "xgroup"}  # never all of them
    assert not any(c.startswith("@") for c in commands)  # commands one by one, never a category
    assert all(k and "*" not in k for k in keys)


def test_observer_has_read_commands_only() -> None:
    commands, keys = redis_acl.ROLE_RULES[redis_acl.OBSERVER]
    assert keys == ("rollouts", "scored", "ready", "prompts", "dead", "stats:generator", "stats:reward", "stats:reference", "stats:trainer",
                    "version", "metrics", "evals", "generators", "generators:seen", "generators:versions")  # fmt: skip
    assert set(commands) == {"ping", "info", "select", "cluster|slots", "command", "eval", "evalsha", "script|load", "exists",
                             "xinfo|groups", "xlen", "xrange", "xinfo|consumers", "xrevrange", "type", "time", "get", "hgetall",
                             "zrangebyscore"}  # fmt: skip
    assert redis_acl.OBSERVER not in ROLES  # a Redis user only: no gRPC token, no certificate
    # The generator's own user has neither stage downstream of it.
    assert not {"scored", "ready"} & set(redis_acl.ROLE_RULES["generator"][1])


def test_custom_reward_doc_shows_the_reward_line() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "custom-reward.md").read_text()
    assert f"user reward reset on #<sha256 of the password> {redis_acl.acl_rules('reward')}\n" in doc


def test_redis_cli_as_reward_as_the_doc_says(
    server: EmbeddedRedis, passwords: dict[str, str], secrets_root: Path, keys: RunKeys
) -> None:
    """The doc's redis-cli line: the password from REDISCLI_AUTH, the user as a flag."""
    cli = shutil.which("redis-cli") or str(Path(find_redis_server()).with_name("redis-cli"))
    if not Path(cli).exists():
        pytest.skip("no redis-cli")
    env = {**os.environ, "REDISCLI_AUTH": redis_acl.password_file(secrets_root, "reward").read_text().strip()}
    base = [cli, "-h", "127.0.0.1", "-p", str(server.port), "--user", "reward", "--no-auth-warning"]
    ok = subprocess.run(
        [*base, "XADD", keys.stream("scored"), "*", "a", "1"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0 and "-" in ok.stdout and "NOPERM" not in ok.stdout, ok
    refused = subprocess.run(
        [*base, "XADD", keys.stream("prompts"), "*", "a", "1"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "NOPERM" in refused.stdout + refused.stderr, refused


# -- each role can do its job -------------------------------------------------------------


def work_through_stage(admin: redis.Redis, client: redis_policy.Client, keys: RunKeys, source: str, group: str, output: str | None,
                       extra: streams.Extra | None = None) -> None:  # fmt: skip
    """Every path of a StreamStage, as `client`'s role: read new entries, re-read its own
    pending ones after a failure, touch them, another consumer taking them over once idle,
    commit (with `extra`) to `output`, dead-letter, trim."""
    for i in range(4):
        write(admin, keys, source, rollout_group(f"{source}-{i}", ["8"]))
    a = StreamStage(client, keys, source, group, "consumer-a", claim_idle_ms=100)
    b = StreamStage(client, keys, source, group, "consumer-b", claim_idle_ms=100)
    held = a.read(1, 10)
    assert len(held) == 1
    a.reread_own_pending()
    again = a.read(1, 10)  # XPENDING + XCLAIM RETRYCOUNT: the same entry, no delivery counted
    assert [e.id for e in again] == [held[0].id]
    a.touch(again)
    time.sleep(0.2)  # deliberate: the entry must sit idle past claim_idle_ms (100 ms) before b may take it over
    taken = b.read(1, 10)  # b's own pending (none), then the take-over of a's idle entry
    assert [e.id for e in taken] == [held[0].id]
    outputs = [(output, rollout_group("out-0", ["8"]))] if output else []
    assert b.commit(taken, outputs=outputs, extra=extra)
    rest = b.read(3, 10)
    assert len(rest) == 3
    b.dead_letter(rest[0], "refused by the test")
    assert b.commit(
        rest[1:], outputs=[(output, rollout_group(f"out-{i}", ["8"])) for i in (1, 2)] if output else [], extra=extra
    )
    assert b.trim() >= 0
    assert admin.xpending(keys.stream(source), group)["pending"] == 0
    assert admin.xlen(keys.dead) == 1
    if output:
        assert admin.xlen(keys.stream(output)) == 3


def test_generator_can_do_its_job(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    client = connect_as("generator")
    observer = connect_as("observer")

    def ledger(ops: streams.Ops) -> None:  # the generator's commit extra (generator/service.py turn)
        ops.hincrby(keys.counters("generator"), "generated", 1)
        ops.sadd(keys.groups("generated"), "g-1")

    work_through_stage(admin, client, keys, "prompts", "generators", "rollouts", extra=ledger)
    # Back-pressure (as the observer) and staleness (turn), the registry heartbeat and leave
    # (heartbeat_forever, run).
    assert sum(run_keys.waiting(observer, keys.stream(name), limit=64) for name in ("rollouts", "scored", "ready")) == 3
    admin.set(keys.version, 7)
    assert run_keys.current_version(client, keys) == 7
    run_keys.heartbeat(client, keys, "gen-0", "127.0.0.1:5000", version=6)
    assert admin.hget(keys.generators, "gen-0") == b"127.0.0.1:5000"
    assert run_keys.held_versions(admin, keys) == {"gen-0": 6}
    run_keys.leave(client, keys, "gen-0")
    assert admin.hlen(keys.generators) == 0 and admin.hlen(keys.generators_versions) == 0
    assert denials(admin) == []


def test_reward_can_do_its_job(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    client = connect_as("reward")

    def count(ops: streams.Ops) -> None:  # reward/service.py process_batch
        ops.hincrby(keys.counters("reward"), "scored", 1)

    work_through_stage(admin, client, keys, "rollouts", "reward", "scored", extra=count)
    # --output-stage ready (no reference stage), and XAUTOCLAIM as a custom reward may use it.
    stage = StreamStage(client, keys, "rollouts", "reward", "consumer-c")
    write(admin, keys, "rollouts", rollout_group("to-ready", ["8"]))
    assert stage.commit(stage.read(1, 10), outputs=[("ready", rollout_group("to-ready", ["8"]))], extra=count)
    assert client.xautoclaim(keys.stream("rollouts"), "reward", "consumer-c", 1000)[1] == []
    assert list(validation.fetch_tasks(client, keys.tasks, ["task-to-ready"])) == [
        "task-to-ready"
    ]  # RewardLoop.of_known_tasks
    assert admin.xlen(keys.stream("ready")) == 1
    assert denials(admin) == []


def test_with_a_reference_stage_reward_cannot_write_ready(
    tmp_path: Path, keys: RunKeys, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27: where a reference stage runs, a stolen reward password cannot put a group
    in `ready` past it (forged ref log-probs, no reference at all): not by XADD, not inside
    a script, not through the commit script. `rollstream secrets --reference` writes that
    users.acl (as `up` does when it starts a reference), and the reward still writes
    `scored` and the reference `ready`."""
    root = tmp_path / "secrets"
    assert cli.main_code(["secrets", str(root), "--reference"]) == 0
    capsys.readouterr()
    passwords = {user: redis_acl.password_file(root, user).read_text().strip() for user in redis_acl.REDIS_USERS}
    with EmbeddedRedis(
        tmp_path / "redis", aclfile=redis_acl.acl_file(root), admin_password=passwords[redis_acl.ADMIN]
    ) as server:
        admin = server.admin_client()
        reward = redis_policy.connect(server.url, "reward", passwords["reward"])
        reference = redis_policy.connect(server.url, "reference", passwords["reference"])
        try:
            forged = validation.encode(rollout_group("forged", ["8"]))
            assert_denied(lambda: reward.xadd(keys.stream("ready"), forged))
            assert_denied(
                lambda: reward.eval("return redis.call('XADD', KEYS[1], '*', 'a', 1)", 1, keys.stream("ready"))
            )
            write(admin, keys, "rollouts", rollout_group("g", ["8"]))
            stage = StreamStage(reward, keys, "rollouts", "reward", "c")
            taken = stage.read(1, 10)
            assert_denied(lambda: stage.commit(taken, outputs=[("ready", rollout_group("g", ["8"]))]))
            assert stage.commit(taken, outputs=[("scored", rollout_group("g", ["8"]))])
            assert reference.xadd(keys.stream("ready"), forged)
            assert (admin.xlen(keys.stream("scored")), admin.xlen(keys.stream("ready"))) == (1, 1)
        finally:
            reward.close()
            reference.close()
            admin.close()
    # Without --reference (no reference stage: the reward's output is `ready`) it may.
    assert "~rs:{*}:ready" in redis_acl.acl_rules("reward") and "~rs:{*}:ready" not in redis_acl.acl_rules(
        "reward", reference_stage=True
    )


def test_reference_can_do_its_job(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    client = connect_as("reference")

    def count(ops: streams.Ops) -> None:  # reference/service.py ReferenceLoop.reference
        ops.hincrby(keys.counters("reference"), "referenced", 1)

    work_through_stage(admin, client, keys, "scored", "reference", "ready", extra=count)
    assert denials(admin) == []


def test_trainer_can_do_its_job(admin: redis.Redis, connect_as, keys: RunKeys, tiny_model_dir: Path) -> None:
    client = connect_as("trainer")
    generator = connect_as("generator")
    settings = TrainerSettings(run=keys.run, prompt_buffer=4, group_size=2, consumer="trainer-0")

    def step_ledger(ops: streams.Ops) -> None:  # trainer/service.py train_and_commit, drop_stale, duplicates
        ops.sadd(keys.groups("trained"), "g-1")
        ops.hincrby(keys.counters("trainer"), "trained", 1)
        ops.hset(keys.counters("trainer"), "step", 1)
        ops.set(keys.version, 1)
        ops.xadd(keys.metrics, validation.encode(rollout_pb2.StepMetrics(step=1)), maxlen=100_000, approximate=True)
        ops.xadd(keys.trained_log, {"step": 1, "type": b"x"})
        ops.sadd(keys.groups("stale"), "g-2")
        ops.hincrby(keys.counters("trainer"), "duplicates", 1)

    work_through_stage(admin, client, keys, "ready", "trainer", None, extra=step_ledger)
    # run(): the feeder's position, the version; replay_trained_log: the trained log, the step.
    stage = StreamStage.for_service(client, settings, "ready", "trainer")
    encode = chat_encoder(AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True))
    feeder = PromptFeeder(settings, client, stage, PromptFeeder.position(client, keys, 0), encode)
    assert feeder.top_up(version=1) == 4  # TRIM + waiting on prompts, then XADD + HSET tasks + SET fed in the script
    assert PromptFeeder.position(client, keys, 0) == 4
    # The task map: the groups' checks (HMGET), the sweep (XRANGE + HGET the head, HLEN, HDEL).
    assert len(validation.fetch_tasks(client, keys.tasks, [f"{keys.run}-{n:08d}" for n in range(4)])) == 4
    feeder.top_up(version=3)
    feeder.sweep(version=9)
    client.set(keys.version, 1)
    assert len(client.xrange(keys.trained_log)) == 2
    assert client.hget(keys.counters("trainer"), "step") == b"1"
    client.hincrby(keys.counters("trainer"), "steps_lost_on_resume", 0)
    assert client.sismember(keys.groups("trained"), "g-1") and not client.sismember(keys.groups("stale"), "g-9")
    # A checkpoint: the log's end recorded, then the log trimmed up to a kept checkpoint's end.
    end = client.xrevrange(keys.trained_log, count=1)[0][0]
    assert client.xtrim(keys.trained_log, minid=end, approximate=False) == 1
    # The generator registry: the live ones, and dead ones forgotten.
    run_keys.heartbeat(generator, keys, "gen-live", "127.0.0.1:5001")
    assert GeneratorDirectory([]).addresses(client, keys) == ["127.0.0.1:5001"]
    time.sleep(0.01)  # deliberate: the heartbeat must be older than the 1 ms ttl below
    assert run_keys.live_generators(client, keys, ttl_s=0.001) == {}
    assert admin.hlen(keys.generators) == 0 and admin.hlen(keys.generators_versions) == 0
    assert denials(admin) == []


# -- and nothing else ---------------------------------------------------------------------


@pytest.mark.parametrize("role", SERVICES)
@pytest.mark.parametrize(
    "command",
    [("DEBUG", "SLEEP", "0"), ("CONFIG", "SET", "maxmemory-policy", "noeviction"), ("CONFIG", "GET", "*"), ("FLUSHALL",), ("FLUSHDB",),
     ("KEYS", "*"), ("SCAN", "0"), ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("ACL", "LIST"), ("ACL", "WHOAMI"), ("CLIENT", "LIST"),
     ("MODULE", "LIST"), ("REPLICAOF", "NO", "ONE"), ("SHUTDOWN", "NOSAVE"), ("SUBSCRIBE", "x"), ("PUBLISH", "x", "y")],
    ids=lambda c: " ".join(c[:2]),
)  # fmt: skip
def test_no_role_but_admin_runs_admin_commands(connect_as, role: str, command: tuple[str, ...]) -> None:
    client = connect_as(role)
    if command[0] == "DEBUG":  # Redis 7 refuses DEBUG to everyone before the ACL (enable-debug-command no)
        with pytest.raises(redis.RedisError, match="NOPERM|no permissions|DEBUG command not allowed"):
            client.execute_command(*command)
        return
    assert_denied(lambda: client.execute_command(*command))


def test_roles_are_refused_other_stages_keys(connect_as, keys: RunKeys) -> None:
    group = validation.encode(rollout_group("forged", ["8"]))
    generator, reward, reference, trainer = (connect_as(r) for r in ("generator", "reward", "reference", "trainer"))
    assert_denied(lambda: reward.xadd(keys.stream("prompts"), group))
    assert_denied(lambda: reference.xadd(keys.stream("prompts"), group))
    assert_denied(lambda: reference.xadd(keys.stream("rollouts"), group))
    assert_denied(lambda: trainer.xadd(keys.stream("rollouts"), group))
    assert_denied(lambda: trainer.xadd(keys.stream("scored"), group))
    # The trainer's ledger and version are the trainer's: the generator reads the version only.
    assert_denied(lambda: generator.set(keys.version, 999))
    assert_denied(lambda: generator.sadd(keys.groups("trained"), "g"))
    assert_denied(lambda: generator.xadd(keys.metrics, {"a": 1}))
    assert_denied(lambda: reward.get(keys.version))
    assert_denied(lambda: reward.hset(keys.generators, "evil", "10.0.0.1:1"))  # no one but generators registers
    assert_denied(lambda: reward.delete(keys.stream("rollouts")))
    # Keys outside the layout: the braces are literal in the pattern.
    assert_denied(lambda: reward.xadd(f"rs:{keys.run}:scored", group))
    assert_denied(lambda: reward.xadd(keys.stream("scored") + "x", group))
    assert_denied(lambda: reward.set("anything", 1))
    # Inside a script too (Redis checks a script's calls as the caller).
    assert_denied(lambda: reward.eval("return redis.call('SET', KEYS[1], 1)", 1, keys.counters("trainer")))
    stage = StreamStage(reward, keys, "rollouts", "reward", "c")
    assert_denied(lambda: stage.apply(_xadd_ops(keys.stream("prompts"), group)))


def _xadd_ops(key: str, fields: dict) -> streams.Ops:
    ops = streams.Ops()
    ops.xadd(key, fields)
    return ops


@pytest.mark.parametrize("role", SERVICES)
def test_a_role_writes_its_own_counters_and_no_one_elses(
    admin: redis.Redis, connect_as, keys: RunKeys, role: str
) -> None:
    """Issue 42 N3: with the generator's password, `HSET <stats> trained x` poisoned the
    trainer's counter, and the trainer's commit failed after its SADD, again and again. Each
    role now counts in its own hash, the only one its user may write, by a command or by a
    script (the commit script runs as the caller); the observer writes none."""
    client = connect_as(role)
    others = [r for r in run_keys.COUNTER_ROLES if r != role]
    for other in others:
        key = keys.counters(other)
        assert_denied(lambda key=key: client.hset(key, "trained", "x"))
        assert_denied(lambda key=key: client.hincrby(key, "scored", 1))
        assert_denied(lambda key=key: client.hget(key, "trained"))
    # Inside its own commit script too: refused, and nothing written.
    stage = StreamStage(client, keys, next(s for s, r in run_keys.STAGE_READER.items() if r == role), role, "c")
    ops = streams.Ops()
    ops.hincrby(keys.counters(others[0]), "trained", 1)
    assert_denied(lambda: stage.apply(ops))
    assert all(admin.exists(keys.counters(o)) == 0 for o in others)
    # Its own counters: counted, by a command and in its commit script.
    own = streams.Ops()
    own.hincrby(stage.counters, "counted", 2)
    stage.apply(own)
    assert client.hincrby(keys.counters(role), "counted", 1) == 3
    observer = connect_as(redis_acl.OBSERVER)
    for each in run_keys.COUNTER_ROLES:
        assert_denied(lambda each=each: observer.hset(keys.counters(each), "trained", "x"))
    assert observer.hgetall(keys.counters(role)) == {b"counted": b"3"}
    # The old shared hash is nobody's but the admin's.
    assert_denied(lambda: client.hset(f"rs:{{{keys.run}}}:stats", "trained", "x"))
    admin.delete(keys.counters(role))
    admin.acl_log_reset()


def test_dead_is_a_stream_from_the_first_stage_on(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    """Issue 42 N3's `dead_<stage>`: every stage writes `dead`, and every role may HINCRBY
    (some HSET, SADD) it, so while it did not exist one HINCRBY made it a hash and every
    dead letter after failed. The first stage to start makes it a stream; a stage that
    finds it poisoned already still starts (its dead letters say why, refused)."""
    generator = connect_as("generator")
    reward = connect_as("reward")
    stage = StreamStage(reward, keys, "rollouts", "reward", "c")
    assert admin.type(keys.dead) == b"stream" and admin.xlen(keys.dead) == 0
    for poison in (
        lambda: generator.hincrby(keys.dead, "x", 1),
        lambda: generator.hset(keys.dead, "x", 1),
        lambda: generator.sadd(keys.dead, "x"),
    ):
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            poison()
    entry = admin.xadd(keys.stream("rollouts"), {"type": b"garbage"})
    (got,) = stage.read(count=1, block_ms=10)
    stage.dead_letter(got, "garbage")
    assert admin.xlen(keys.dead) == 1 and got.id == entry
    assert admin.hget(keys.counters("reward"), "dead_rollouts") == b"1"
    # Poisoned before any stage started (an admin's mistake, or a role before the first start).
    admin.delete(keys.dead)
    admin.hset(keys.dead, "x", 1)
    StreamStage(reward, keys, "rollouts", "reward", "c")
    assert admin.type(keys.dead) == b"hash"
    admin.delete(keys.dead, keys.counters("reward"))
    admin.acl_log_reset()


@pytest.mark.parametrize("user", [redis_acl.ADMIN, *SERVICES, redis_acl.OBSERVER])
def test_no_user_can_make_the_server_write_a_file(server: EmbeddedRedis, passwords: dict[str, str], user: str) -> None:
    """Issue 42 N1's tail: with the admin password, CONFIG SET dir/dbfilename and SAVE wrote
    a file with the server owner's rights. No rollstream user has Redis's @dangerous
    commands (the admin only INFO, ACL LOG and CLUSTER SLOTS of them, which read)."""
    client = redis_policy.connect(server.url, user, passwords[user])
    try:
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "SET", "dbfilename", "x.rdb"), ("CONFIG", "GET", "dir"), ("SAVE",),
                        ("BGSAVE",), ("BGREWRITEAOF",), ("DEBUG", "SLEEP", "0"), ("FLUSHALL",), ("SHUTDOWN", "NOSAVE"),
                        ("ACL", "SETUSER", "intruder", "on", ">pw", "+@all", "~*"), ("ACL", "LOAD"), ("ACL", "SAVE"),
                        ("MODULE", "LOAD", "/tmp/x.so"), ("REPLICAOF", "127.0.0.1", "1"), ("CLIENT", "KILL", "USER", "trainer"),
                        ("MIGRATE", "127.0.0.1", "1", "", "0", "1", "KEYS", "k")):  # fmt: skip
            with pytest.raises(redis.RedisError) as e:
                client.execute_command(*command)
            # Redis 7 refuses DEBUG and MODULE to everyone before the ACL, by its own settings.
            assert redis_policy.is_denied(e.value) or "command not allowed" in str(e.value), (command, e.value)
        if user == redis_acl.ADMIN:  # what `up`, `rollstream status` and the tests use
            assert client.info("server")["redis_version"]
            assert isinstance(client.acl_log(), list)
            with pytest.raises(redis.ResponseError, match="NOTBUSY"):
                client.script_kill()  # a runaway script can still be stopped
    finally:
        client.close()
    assert server.admin_client().ping()  # still up, as it was


def test_generator_cannot_write_ready_or_scored(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    """A stolen generator password cannot put a forged, self-rewarded group where the
    trainer (or the reference) reads: not by XADD, not inside a script; nor read there."""
    generator = connect_as("generator")
    forged = validation.encode(rollout_group("forged", ["8"]))
    for name in ("ready", "scored"):
        assert_denied(lambda name=name: generator.xadd(keys.stream(name), forged))
        assert_denied(
            lambda name=name: generator.eval("return redis.call('XADD', KEYS[1], '*', 'a', 1)", 1, keys.stream(name))
        )
        assert_denied(lambda name=name: run_keys.waiting(generator, keys.stream(name)))
    stage = StreamStage(generator, keys, "prompts", "generators", "c")
    assert_denied(lambda: stage.apply(_xadd_ops(keys.stream("ready"), forged)))
    assert admin.exists(keys.stream("ready"), keys.stream("scored")) == 0


def test_observer_counts_back_pressure(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    """run_keys.waiting as the observer on each stream it counts: no group yet, groups with
    pending and unread entries, a stream that does not exist; the server refuses nothing."""
    observer = connect_as("observer")
    assert run_keys.waiting(observer, keys.stream("ready")) == 0  # no such stream yet
    for i in range(3):
        write(admin, keys, "scored", rollout_group(f"s{i}", ["8"]))
    assert run_keys.waiting(observer, keys.stream("scored")) == 3  # no group: its length
    write(admin, keys, "rollouts", rollout_group("r0", ["8"]))
    write(admin, keys, "rollouts", rollout_group("r1", ["8"]))
    admin.xgroup_create(keys.stream("rollouts"), "reward", id="0")
    admin.xreadgroup("reward", "c", {keys.stream("rollouts"): ">"}, count=1)
    assert run_keys.waiting(observer, keys.stream("rollouts")) == 2  # one pending, one unread
    write(admin, keys, "ready", rollout_group("g0", ["8"]))
    assert run_keys.waiting(observer, keys.stream("ready"), limit=64) == 1
    assert denials(admin) == []


def test_observer_sees_the_whole_pipeline_for_the_dashboard(admin: redis.Redis, connect_as, keys: RunKeys) -> None:
    """The trainer's dashboard looks as the observer (core/dashboard.py): every stage, its
    consumers, the ledger's counters, the registry, the last step, held-out round and dead letter; the
    server refuses nothing and the snapshot notes no unreadable key."""
    for stage, group in (
        ("prompts", "generator"),
        ("rollouts", "reward"),
        ("scored", "reference"),
        ("ready", "trainer"),
    ):
        write(admin, keys, stage, rollout_group(f"{stage}-0", ["8"]))
        write(admin, keys, stage, rollout_group(f"{stage}-1", ["8"]))
        admin.xgroup_create(keys.stream(stage), group, id="0")
        admin.xreadgroup(group, f"{group}-0", {keys.stream(stage): ">"}, count=1)
    admin.hset(keys.counters("generator"), "generated", 1)
    admin.hset(keys.counters("trainer"), "step", 2)
    admin.set(keys.version, 2)
    admin.xadd(keys.metrics, validation.encode(rollout_pb2.StepMetrics(step=2, version=2, groups=1)))
    admin.xadd(
        keys.evals,
        validation.encode(
            rollout_pb2.EvalMetrics(step=2, version=2, version_max=2, prompts=4, prompts_fed=4, samples=1, accuracy=0.5)
        ),
    )
    admin.xadd(
        keys.dead, validation.encode(rollout_pb2.DeadLetter(source_stream=keys.stream("rollouts"), reason="bad"))
    )
    run_keys.heartbeat(admin, keys, "gen-0", "127.0.0.1:1", version=2)
    view = dashboard.PipelineView(lambda: connect_as("observer"), keys)
    got = view.look()
    assert got["ok"] and got["errors"] == [], got
    assert {s["name"]: (s["lag"], s["pending"], len(s["consumers"])) for s in got["stages"]} == {
        "generator": (1, 1, 1),
        "reward": (1, 1, 1),
        "reference": (1, 1, 1),
        "trainer": (1, 1, 1),
    }
    assert got["generators"] == [{"id": "gen-0", "version": 2}] and got["dead"] == 1 and got["last_step"]["step"] == 2
    assert got["trainer"]["version"] == 2 and got["last_eval"]["eval_accuracy"] == 0.5
    assert denials(admin) == []


@pytest.mark.parametrize("name", ["rollouts", "scored", "ready", "prompts", "version"])
def test_observer_writes_nothing(admin: redis.Redis, connect_as, keys: RunKeys, name: str) -> None:
    observer = connect_as("observer")
    key = keys.version if name == "version" else keys.stream(name)
    write(admin, keys, "scored", rollout_group("s", ["8"]))
    admin.xgroup_create(keys.stream("scored"), "reference", id="0", mkstream=True)
    entry = admin.xreadgroup("reference", "c", {keys.stream("scored"): ">"}, count=1)[0][1][0][0]
    forged = validation.encode(rollout_group("forged", ["8"]))
    assert_denied(lambda: observer.xadd(key, forged))
    assert_denied(lambda: observer.xack(keys.stream("scored"), "reference", entry))
    assert_denied(lambda: observer.xgroup_create(key, "evil", id="$", mkstream=True))
    assert_denied(lambda: observer.xgroup_destroy(keys.stream("scored"), "reference"))
    assert_denied(lambda: observer.delete(key))
    assert_denied(lambda: observer.hset(key, "a", 1))
    assert_denied(lambda: observer.set(key, 1))
    assert_denied(lambda: observer.xtrim(key, maxlen=0))
    # Inside a script it runs, on keys it may read: the script's command is checked as the observer.
    for script in ("return redis.call('XADD', KEYS[1], '*', 'a', 1)", "return redis.call('DEL', KEYS[1])",
                   "return redis.call('XACK', KEYS[1], 'reference', ARGV[1])"):  # fmt: skip
        assert_denied(lambda script=script: observer.eval(script, 1, key, entry))
    assert admin.xpending(keys.stream("scored"), "reference")["pending"] == 1
    assert admin.xlen(keys.stream("scored")) == 1 and [
        g["name"] for g in admin.xinfo_groups(keys.stream("scored"))
    ] == [b"reference"]
    assert admin.exists(keys.stream("ready"), keys.stream("rollouts"), keys.stream("prompts"), keys.version) == 0


def test_default_user_and_wrong_password_are_refused(server: EmbeddedRedis, caplog: pytest.LogCaptureFixture) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=server.port)
    assert_denied(anonymous.ping)
    anonymous.close()
    with pytest.raises(redis.AuthenticationError) as e:
        redis_policy.connect(server.url, "reward", "not-the-password")
    assert redis_policy.is_denied(e.value) and not redis_policy.is_transient(e.value)
    # Through the Redis policy: one ERROR line naming the user, then Misconfigured (status 2),
    # not "redis_unavailable" and a back-off forever.
    health = redis_policy.RedisHealth(logging.getLogger("test-acl"), threading.Event(), user="reward")
    with caplog.at_level(logging.INFO, logger="test-acl"), pytest.raises(redis_policy.Misconfigured) as refused:
        health.call(lambda: redis_policy.connect(server.url, "reward", "not-the-password"), "connecting")
    assert refused.value.code == 2
    assert "'reward'" in str(refused.value) and "redis_password_file" in str(refused.value)
    lines = [r for r in caplog.records if r.name == "test-acl"]
    assert [r.getMessage() for r in lines] == ["redis_refused_access"]
    assert lines[0].levelno == logging.ERROR and lines[0].fields["user"] == "reward"  # type: ignore[attr-defined]  # logs.event's attribute, not LogRecord's
    assert health.ok  # never reported as an outage


def test_a_refused_command_ends_the_loop(connect_as, keys: RunKeys, caplog: pytest.LogCaptureFixture) -> None:
    """A NOPERM in a loop (a command missing from the table) raises Misconfigured from
    RedisHealth.failed, naming the user and the fix, instead of backing off forever."""
    reward = connect_as("reward")
    health = redis_policy.RedisHealth(logging.getLogger("test-acl"), threading.Event(), user="reward")
    try:
        reward.get(keys.version)
    except redis_policy.ERRORS as e:
        with caplog.at_level(logging.INFO, logger="test-acl"), pytest.raises(redis_policy.Misconfigured) as refused:
            health.failed(e, "reward loop")
    assert "rollstream.core.redis_acl" in str(refused.value)
    assert health.ok


def test_credentials_from_settings(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:6379/0"
    file = tmp_path / "reward.password"
    file.write_text("s3cret\n")
    assert redis_policy.credentials(url, "reward", str(file)) == ("reward", "s3cret")
    assert redis_policy.credentials(url, "reward", str(file), "from-env") == ("reward", "s3cret")  # the file wins
    assert redis_policy.credentials(url, "reward", "", "from-env") == ("reward", "from-env")
    assert redis_policy.credentials("redis://reward:p@h/0") == (None, None)  # the URL's own, left to it
    assert redis_policy.credentials("redis://reward@h/0", password_file=str(file)) == (None, "s3cret")
    with pytest.raises(ValueError, match="redis_password_file: cannot read"):
        redis_policy.credentials(url, "reward", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="redis_password_file: .* is empty"):
        redis_policy.credentials(url, "reward", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="redis_username: user 'reward' needs a password"):
        redis_policy.credentials(url, "reward")
    with pytest.raises(ValueError, match="redis_username"):
        redis_policy.credentials("redis://other:p@h/0", "reward", str(file))
    with pytest.raises(ValueError, match="redis_password_file"):
        redis_policy.credentials("redis://:p@h/0", "", str(file))
    with pytest.raises(ValueError, match="both"):
        redis_policy.connect("redis://:p@h/0", password="q")


def test_redact_hides_every_password() -> None:
    assert redis_policy.redact("redis://reward:s3cret@h:1/0") == "redis://reward:***@h:1/0"
    assert redis_policy.redact("redis://:s3cret@h/0") == "redis://:***@h/0"
    assert (
        redis_policy.redact("unix:///run/redis.sock?db=1&password=s3cret") == "unix:///run/redis.sock?db=1&password=***"
    )
    assert redis_policy.redact("redis://h:6379/0") == "redis://h:6379/0"


def test_restart_keeps_every_role_working(tmp_path: Path) -> None:
    """`rollstream up` started again: same passwords, the ACL file written again, the server
    restarted on it; a wrong admin password fails the start at once, not after a timeout."""
    first = redis_acl.ensure_redis_credentials(tmp_path / "s")
    server = EmbeddedRedis(
        tmp_path / "redis", aclfile=redis_acl.acl_file(tmp_path / "s"), admin_password=first["admin"]
    ).start()
    server.stop()
    again = redis_acl.ensure_redis_credentials(tmp_path / "s")
    assert again == first
    with server:
        client = redis_policy.connect(server.url, "reward", again["reward"])
        assert client.ping()
        client.close()
    wrong = EmbeddedRedis(tmp_path / "redis", aclfile=redis_acl.acl_file(tmp_path / "s"), admin_password="wrong")
    # The refusal is recognised, not waited out: waiting would end in "did not answer ... within"
    # (and a generous timeout keeps a slow start on a loaded machine from ending that way).
    with pytest.raises(RuntimeError, match="refused the admin user"):
        wrong.start(timeout_s=600)
    with pytest.raises(ValueError, match="admin_password"):
        EmbeddedRedis(tmp_path / "redis", aclfile=redis_acl.acl_file(tmp_path / "s"))


# -- the real services, as their role -----------------------------------------------------


def role_flags(secrets_root: Path, role: str) -> list[str]:
    flags = ["--redis-username", role, "--redis-password-file", str(redis_acl.password_file(secrets_root, role))]
    if role == "generator":  # back-pressure as the read-only observer (as credentials.service_flags)
        flags += ["--redis-observer-password-file", str(redis_acl.password_file(secrets_root, redis_acl.OBSERVER))]
    return flags


def test_reward_service_scores_as_reward(
    tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, admin: redis.Redis, keys: RunKeys
) -> None:
    svc = start_service("reward", tmp_path, "--redis-url", server.url, "--run", keys.run, "--block-ms", "50", "--trim-every-s", "0.2",
                        *role_flags(secrets_root, "reward"))  # fmt: skip
    try:
        svc.wait_ready()
        for i in range(3):
            write(admin, keys, "rollouts", rollout_group(f"g{i}", ["8", "7"]))
        admin.xadd(keys.stream("rollouts"), {"type": b"garbage"})  # a dead letter too
        wait_for(
            lambda: admin.xlen(keys.stream("scored")) == 3 and admin.xlen(keys.dead) == 1,
            60,
            "3 groups scored and 1 dead",
            procs=[svc],
        )
        wait_for(lambda: admin.xlen(keys.stream("rollouts")) == 0, 60, "rollouts trimmed", procs=[svc])
    finally:
        rc = svc.stop()
    assert rc == 0, svc.log()[-4000:]
    assert "NOPERM" not in svc.log() and "refused" not in svc.log()
    assert denials(admin) == []


def test_reference_service_references_as_reference(
    tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, admin: redis.Redis, keys: RunKeys, tiny_model_dir: Path
) -> None:
    svc = start_service("reference", tmp_path, "--model", str(tiny_model_dir), "--redis-url", server.url, "--run", keys.run,
                        "--block-ms", "100", "--trim-every-s", "0.2", "--threads", "1", *role_flags(secrets_root, "reference"))  # fmt: skip
    try:
        svc.wait_ready(timeout_s=120)
        vocab = vocab_size(str(tiny_model_dir))
        for seed in range(2):
            write(admin, keys, "scored", scored_group_in_vocab(vocab, seed=seed))
        wait_for(lambda: admin.xlen(keys.stream("ready")) == 2, 120, "2 groups ready", procs=[svc])
        wait_for(lambda: admin.xlen(keys.stream("scored")) == 0, 60, "scored trimmed", procs=[svc])
    finally:
        rc = svc.stop()
    assert rc == 0, svc.log()[-4000:]
    assert "NOPERM" not in svc.log() and "refused" not in svc.log()
    assert denials(admin) == []


def test_tiny_pipeline_trains_with_every_service_as_its_role(
    tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, admin: redis.Redis, keys: RunKeys, tiny_model_dir: Path
) -> None:
    """Trainer (with checkpoints: the trained log is written, then cleared), generator
    (registry; back-pressure as the observer) and reward (beta 0: output `ready`), each as
    its role, train two steps; the server refused nothing."""
    steps = 2
    common = ["--redis-url", server.url, "--run", keys.run, "--claim-idle-ms", "1500"]
    model = ["--model", str(tiny_model_dir), "--threads", "1"]
    trainer = start_service(
        "trainer", tmp_path, *common, *model, *role_flags(secrets_root, "trainer"), "--steps", str(steps), "--linger",
        "--groups-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3", "--beta", "0", "--prompt-buffer", "4",
        "--consumer", "trainer-0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
    ).wait_ready()  # fmt: skip
    procs = [trainer]
    try:
        procs.append(start_service(
            "generator", tmp_path, *common, *model, *role_flags(secrets_root, "generator"), "--trainer-address", trainer.grpc_address,
            "--consumer", "gen-0", "--max-inflight-groups", "8",
        ).wait_ready())  # fmt: skip
        procs.append(
            start_service(
                "reward", tmp_path, *common, *role_flags(secrets_root, "reward"), "--output-stage", "ready"
            ).wait_ready()
        )
        # The step's commit (its ledger, the version) lands after GetState already says the step.
        wait_for(lambda: int(admin.get(keys.version) or 0) >= steps, 240, f"{steps} steps as roles", procs=procs)
        # The generator counts its back-pressure as the observer: its own user may not read
        # `scored` or `ready`, so doing it as itself would show in denials() below (the
        # admin has no CLIENT LIST to see who is connected: @dangerous).
        assert trainer_state(trainer.grpc_address).step == steps
        assert admin.scard(keys.groups("trained")) == 2 * steps
        assert admin.xlen(keys.dead) == 0
        assert list(run_keys.live_generators(admin, keys, forget=False)) == ["gen-0"]
        for p in reversed(procs):
            assert p.stop() == 0, f"{p.name} did not stop cleanly:\n{p.log()[-3000:]}"
    finally:
        for p in reversed(procs):
            p.stop()
    for p in procs:
        assert "NOPERM" not in p.log() and "refused" not in p.log(), p.log()[-3000:]
    assert denials(admin) == []


def test_service_with_wrong_credentials_exits_2_saying_why(
    tmp_path: Path, server: EmbeddedRedis, keys: RunKeys
) -> None:
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    cases = {
        "wrong": (
            ["--redis-username", "reward", "--redis-password-file", str(wrong)],
            ["redis_refused_access", "user=reward"],
        ),
        "missing": (
            ["--redis-username", "reward", "--redis-password-file", str(tmp_path / "nope")],
            ["redis_password_file: cannot read"],
        ),
        "anonymous": ([], ["redis_refused_access", "user=default"]),
    }
    for tag, (flags, expected) in cases.items():
        svc = start_service("reward", tmp_path, "--redis-url", server.url, "--run", keys.run, *flags, tag=tag)
        try:
            rc = svc.proc.wait(timeout=MIN_WAIT_S)
        finally:
            svc.stop()
        log = svc.log()
        assert rc == 2, log[-4000:]
        assert all(e in log for e in expected), log[-4000:]
        assert "redis_unavailable" not in log


def test_generator_with_unusable_observer_credentials_exits_2(tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, keys: RunKeys,
                                                              tiny_model_dir: Path) -> None:  # fmt: skip
    """redis_observer_password_file that cannot be read, or that Redis refuses: one line
    naming the field or the observer user, status 2, no waiting for an outage."""
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    own = [
        "--redis-username",
        "generator",
        "--redis-password-file",
        str(redis_acl.password_file(secrets_root, "generator")),
    ]
    cases = {
        "missing": (str(tmp_path / "nope"), ["redis_observer_password_file: cannot read"]),
        "wrong": (str(wrong), ["redis_refused_access", "user=observer", "redis_observer_password_file"]),
    }
    for tag, (file, expected) in cases.items():
        svc = start_service("generator", tmp_path, "--model", str(tiny_model_dir), "--threads", "1", "--redis-url", server.url,
                            "--run", keys.run, *own, "--redis-observer-password-file", file, tag=tag)  # fmt: skip
        try:
            rc = svc.proc.wait(timeout=MIN_WAIT_S)
        finally:
            svc.stop()
        log = svc.log()
        assert rc == 2, log[-4000:]
        assert all(e in log for e in expected), log[-4000:]
        assert "redis_unavailable" not in log


def test_custom_reward_example_runs_as_reward(
    custom_reward_stubs: Path,
    tmp_path: Path, server: EmbeddedRedis, passwords: dict[str, str], admin: redis.Redis, keys: RunKeys,
) -> None:  # fmt: skip
    """docs/custom-reward.md's ACL line covers a custom reward service (the example: plain
    redis-py, XAUTOCLAIM, its own commit script), given the password in its URL."""
    url = f"redis://reward:{passwords['reward']}@127.0.0.1:{server.port}/0"
    log = tmp_path / "parity.log"
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, str(CUSTOM_REWARD_EXAMPLE / "parity_reward.py"), "--run", keys.run, "--stubs", str(custom_reward_stubs), "--consumer", "parity-0",
             "--block-ms", "50"],
            # The URL carries the password: through the environment, as the doc says, not argv.
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": url},
        )  # fmt: skip
    try:
        write(admin, keys, "rollouts", rollout_group("even-odd", ["a", "b"]))
        wait_for(
            lambda: admin.xlen(keys.stream("scored")) >= 1,
            30,
            "the example to score a group",
            procs=[LoggedProc("parity_reward.py", proc, log)],
        )
    finally:
        proc.terminate()
        proc.wait(timeout=MIN_WAIT_S)
    # A plain redis-py client sends CLIENT SETINFO on connect, refused and ignored: nothing else.
    assert [d for d in denials(admin) if not d.endswith(" client")] == []
