"""rollstream on a real 3-node Redis Cluster (3 primaries on loopback, no replicas).

Checks that `redis_policy.connect` picks the cluster client, that two runs placed on
different shards each get the whole stream-stage contract (read, take-over, commit,
idempotent retry, dead letter, trim, `waiting`) and the generator registry, with every key
of a run in its one slot, and that the tiny pipeline (trainer, generator, reward with beta 0)
trains on the cluster. The cluster is formed once for the module (see tests/cluster.py).
Two more tests hold the Redis policy to its word on a cluster: a lost XREADGROUP reply is
read again (no hidden client retries), and a whole-cluster restart is waited out (the
cluster client's "no node reachable" is not a RedisError, and used to end the services).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from cluster import RedisClusterNodes
from helpers import wait_for, write
from procs import start_service, trainer_state
from rollstream.core import redis_policy, run_keys, streams, validation
from rollstream.core.run_keys import read_counters
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import rollout_pb2

pytestmark = pytest.mark.cluster

STEPS = 2
GROUPS_PER_STEP = 2
GROUP_SIZE = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(tmp_path_factory.mktemp("cluster")) as nodes:
        print(f"\n[cluster] 3 nodes on ports {nodes.ports}: cluster_state:ok after {nodes.form_seconds:.2f}s")
        yield nodes


@pytest.fixture
def cclient(cluster: RedisClusterNodes) -> Iterator[RedisCluster]:
    client = redis_policy.connect(cluster.url)
    assert isinstance(client, RedisCluster)
    yield client
    client.close()


def run_on_node(cluster: RedisClusterNodes, node: int, prefix: str = "c") -> str:
    """A fresh run name whose hash tag `{<run>}` falls in a slot that `node` serves."""
    for _ in range(10_000):
        run = f"{prefix}{uuid.uuid4().hex[:10]}"
        if cluster.node_of_slot(key_slot(run.encode())) == node:
            return run
    raise AssertionError(f"no run name found for node {node}")


def every_key(keys: run_keys.RunKeys) -> list[str]:
    return [
        *(keys.stream(s) for s in run_keys.STAGES), keys.dead, keys.metrics, *map(keys.counters, run_keys.COUNTER_ROLES), keys.version, keys.fed, keys.trained_log,
        keys.generators, keys.generators_seen, keys.generators_versions, *(keys.groups(o) for o in ("generated", "trained", "stale")),
    ]  # fmt: skip


def keys_on_node(cluster: RedisClusterNodes, node: int, keys: run_keys.RunKeys) -> set[str]:
    """The run's keys stored on one node (a plain client on that node: SCAN sees its keyspace only)."""
    client = cluster.node_client(node)
    try:
        return {
            k.decode()
            for k in client.scan_iter(match=keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*", count=1000)
        }
    finally:
        client.close()


def group(group_id: str) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=group_id,
        task_id=f"task-{group_id}",
        prompt_ids=[1, 2],
        completions=[rollout_pb2.Completion(token_ids=[3, 4])],
    )


# -- (1) the client -----------------------------------------------------------------------


def test_connect_returns_cluster_client_for_a_cluster_and_plain_for_a_plain_server(
    cluster: RedisClusterNodes, redis_server: EmbeddedRedis
) -> None:
    for port in cluster.ports:  # any node of the cluster will do as the seed
        client = redis_policy.connect(f"redis://127.0.0.1:{port}/0")
        try:
            assert isinstance(client, RedisCluster)
            assert client.ping()
            assert {(n.host, n.port) for n in client.get_primaries()} == {("127.0.0.1", p) for p in cluster.ports}
        finally:
            client.close()
    plain = redis_policy.connect(redis_server.url)
    try:
        assert isinstance(plain, redis.Redis) and not isinstance(plain, RedisCluster)
        assert plain.ping()
    finally:
        plain.close()


# -- (2) two runs, two shards ---------------------------------------------------------------


def test_two_runs_on_different_shards_each_get_streams_and_registry(
    cluster: RedisClusterNodes, cclient: RedisCluster
) -> None:
    runs = {1: run_on_node(cluster, 1), 2: run_on_node(cluster, 2)}
    seed = cluster.node_client(0)
    try:
        for node, run in runs.items():
            keys = run_keys.RunKeys(run)
            slot = key_slot(run.encode())
            # Every key of the run hashes to the run's slot: client side, and as the server says.
            for key in every_key(keys):
                assert cclient.keyslot(key) == slot == key_slot(key.encode()), key
                assert int(seed.execute_command("CLUSTER", "KEYSLOT", key)) == slot, key
            assert cclient.get_node_from_key(keys.stream("prompts")).port == cluster.ports[node]
        assert key_slot(runs[1].encode()) != key_slot(runs[2].encode())
    finally:
        seed.close()

    for node, run in runs.items():
        keys = run_keys.RunKeys(run)
        _stage_cycle(cclient, keys)
        _registry_cycle(cclient, keys)
        # The run's keys are stored on its node and nowhere else.
        stored = keys_on_node(cluster, node, keys)
        assert {
            keys.stream("rollouts"),
            keys.stream("scored"),
            keys.dead,
            keys.counters("reward"),
            keys.groups("generated"),
        } <= stored, stored
        for other in set(range(3)) - {node}:
            assert keys_on_node(cluster, other, keys) == set()


def _stage_cycle(client: RedisCluster, keys: run_keys.RunKeys) -> None:
    source, scored = keys.stream("rollouts"), keys.stream("scored")
    stage = streams.StreamStage(client, keys, "rollouts", "reward", "reward-0", claim_idle_ms=60_000, max_deliveries=5)
    for gid in ("g1", "g2", "g3"):
        write(client, keys, "rollouts", group(gid))
    assert run_keys.waiting(client, source) == 3  # unread by the group

    entries = stage.read(count=10, block_ms=100)
    assert [validation.decode(e.fields, rollout_pb2.RolloutGroup).group_id for e in entries] == ["g1", "g2", "g3"]
    assert all(e.deliveries == 1 for e in entries)
    assert run_keys.waiting(client, source) == 3  # pending now
    assert stage.read(count=10, block_ms=50) == []

    def ledger(ops: streams.Ops) -> None:
        ops.hincrby(keys.counters("reward"), "scored", 2)
        ops.sadd(keys.groups("generated"), "g1", "g2")

    outputs = [("scored", group("g1")), ("scored", group("g2"))]
    assert stage.commit(entries[:2], outputs, extra=ledger) is True
    assert stage.commit(entries[:2], outputs, extra=ledger) is False  # a retried commit writes nothing twice
    assert client.xlen(scored) == 2
    assert int(client.hget(keys.counters("reward"), "scored")) == 2
    assert {m.decode() for m in client.smembers(keys.groups("generated"))} == {"g1", "g2"}

    stage.dead_letter(entries[2], "test: unusable")
    ((_id, dead_fields),) = client.xrange(keys.dead)
    letter = validation.decode(dead_fields, rollout_pb2.DeadLetter)
    assert (letter.source_stream, letter.reason, dead_fields[b"reason"]) == (
        source,
        "test: unusable",
        b"test: unusable",
    )
    assert int(client.hget(keys.counters("reward"), "dead_rollouts")) == 1
    assert run_keys.waiting(client, source) == 0
    assert run_keys.waiting(client, scored) == 2  # no group reads `scored` here: all of it

    # Restart under the same consumer name: its pending entry comes back first (a 2nd
    # delivery); another consumer takes it over once idle; the first one's commit is refused.
    write(client, keys, "rollouts", group("g4"))
    (held,) = stage.read(count=10, block_ms=100)
    restarted = streams.StreamStage(client, keys, "rollouts", "reward", "reward-0", claim_idle_ms=60_000)
    (again,) = restarted.read(count=10, block_ms=100)
    assert again.id == held.id and again.deliveries == 2
    other = streams.StreamStage(client, keys, "rollouts", "reward", "reward-1", claim_idle_ms=50)
    time.sleep(0.2)  # deliberate: the entry must sit idle past claim_idle_ms (50 ms) to be taken over
    (taken,) = other.read(count=10, block_ms=100)
    assert taken.id == held.id and taken.deliveries == 3
    assert other.commit([taken], [("scored", group("g4"))]) is True
    assert restarted.commit([again], [("scored", group("g4"))]) is False
    assert client.xlen(scored) == 3

    # Everything acknowledged: trim empties the input stream.
    assert stage.trim() == 4
    assert client.xlen(source) == 0 and run_keys.waiting(client, source) == 0


def _registry_cycle(client: RedisCluster, keys: run_keys.RunKeys) -> None:
    run_keys.heartbeat(client, keys, "gen-a", "10.0.0.1:5001")
    run_keys.heartbeat(client, keys, "gen-b", "10.0.0.2:5001")
    assert run_keys.live_generators(client, keys) == {"gen-a": "10.0.0.1:5001", "gen-b": "10.0.0.2:5001"}
    # gen-b's last beat an hour ago: dead, forgotten from both keys.
    client.zadd(keys.generators_seen, {"gen-b": 1})
    assert run_keys.live_generators(client, keys, forget=False) == {"gen-a": "10.0.0.1:5001"}
    assert client.hexists(keys.generators, "gen-b")
    assert run_keys.live_generators(client, keys) == {"gen-a": "10.0.0.1:5001"}
    assert not client.hexists(keys.generators, "gen-b") and client.zscore(keys.generators_seen, "gen-b") is None
    run_keys.leave(client, keys, "gen-a")
    assert run_keys.live_generators(client, keys) == {}
    assert client.hlen(keys.generators) == 0 and client.zcard(keys.generators_seen) == 0


# -- (3) the tiny pipeline ------------------------------------------------------------------


def test_tiny_pipeline_trains_on_the_cluster(
    cluster: RedisClusterNodes, cclient: RedisCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A run on node 2: the URL names node 0, so every command of the services is routed.
    run = run_on_node(cluster, 2, prefix="p")
    keys = run_keys.RunKeys(run)
    common = ["--redis-url", cluster.url, "--run", run, "--claim-idle-ms", "1500", "--threads", "1"]
    model = ["--model", str(tiny_model_dir)]
    started = time.monotonic()
    trainer = start_service(
        "trainer", tmp_path, *common, *model, "--steps", str(STEPS), "--linger", "--groups-per-step", str(GROUPS_PER_STEP),
        "--group-size", str(GROUP_SIZE), "--max-new-tokens", "6", "--lr", "1e-3", "--beta", "0", "--prompt-buffer", "4",
        "--consumer", "trainer-0",
    ).wait_ready()  # fmt: skip
    procs = [trainer]
    try:
        procs.append(start_service(
            "generator", tmp_path, *common, *model, "--trainer-address", trainer.grpc_address, "--consumer", "gen-0", "--max-inflight-groups", "8",
        ).wait_ready())  # fmt: skip
        procs.append(
            start_service(
                "reward", tmp_path, *common[:-2], "--output-stage", "ready", "--consumer", "reward-0"
            ).wait_ready()
        )
        ready_s = time.monotonic() - started

        # The step's commit is what counts: the trainer's own counter (GetState) moves before
        # the push and the commit, so it can be ahead of Redis for a moment.
        wait_for(
            lambda: int(cclient.hget(keys.counters("trainer"), "step") or 0) >= STEPS,
            240,
            f"{STEPS} steps committed on the cluster",
            procs=procs,
        )
        trained_s = time.monotonic() - started
        print(f"\n[cluster] pipeline: services ready after {ready_s:.1f}s, {STEPS} steps after {trained_s:.1f}s")

        # GetState's version is the newest whose push has ended: the last step's push goes on after
        # its commit (a step commits, then pushes), so wait for it rather than race it.
        wait_for(
            lambda: trainer_state(trainer.grpc_address).version >= STEPS,
            120,
            f"version {STEPS}'s push to end (the trainer's GetState)",
            procs=procs,
        )
        state = trainer_state(trainer.grpc_address)
        assert state.step == STEPS and state.version == STEPS
        assert int(cclient.get(keys.version)) == STEPS
        trained = {m.decode() for m in cclient.smembers(keys.groups("trained"))}
        stats = read_counters(cclient, keys)[0]
        assert len(trained) == stats["trained"] == STEPS * GROUPS_PER_STEP, stats
        generated = {m.decode() for m in cclient.smembers(keys.groups("generated"))}
        assert trained <= generated
        assert cclient.xlen(keys.metrics) == STEPS
        # Nothing dead-lettered, in the stream or the counters.
        assert cclient.xlen(keys.dead) == 0, [f[b"reason"] for _i, f in cclient.xrange(keys.dead)]
        assert not {k: v for k, v in stats.items() if k.startswith("dead")}, stats
        # The registry lives in the run's slot too: the generator registered there.
        assert list(run_keys.live_generators(cclient, keys, forget=False)) == ["gen-0"]
        # All of the run's keys are on node 2.
        assert {
            keys.stream("prompts"),
            keys.stream("rollouts"),
            keys.stream("ready"),
            keys.version,
            keys.groups("trained"),
        } <= keys_on_node(cluster, 2, keys)
        assert keys_on_node(cluster, 0, keys) == keys_on_node(cluster, 1, keys) == set()
        for p in reversed(procs):
            assert p.stop() == 0, f"{p.name} did not stop cleanly on SIGTERM:\n{p.log()[-3000:]}"
    finally:
        for p in reversed(procs):
            p.stop()


# -- (4) Redis trouble on a cluster: what the services' Redis policy expects ----------------

# Busy-waits on the server for ARGV[1] ms: every client of that node stalls meanwhile (a
# stand-in for a network or server stall; DEBUG SLEEP is off by default on Redis 7).
_STALL = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until (t[1] * 1000000 + t[2]) - start >= tonumber(ARGV[1]) * 1000
return 1
"""


@pytest.mark.parametrize("where", ["plain", "cluster"])
def test_a_lost_xreadgroup_reply_is_read_again(
    where: str, cluster: RedisClusterNodes, redis_server: EmbeddedRedis
) -> None:
    url = cluster.url if where == "cluster" else redis_server.url
    client = redis_policy.connect(url, socket_timeout_s=1.0)
    if isinstance(client, RedisCluster):
        # A run on a node other than the client's default node (where redis-py sends the
        # COMMAND GETKEYS it needs to route an XREADGROUP): only the read itself stalls.
        default = client.get_default_node().port
        node = next(i for i, p in enumerate(cluster.ports) if p != default)
        keys = run_keys.RunKeys(run_on_node(cluster, node, prefix="l"))
        admin = cluster.node_client(node)
    else:
        keys = run_keys.RunKeys("l" + uuid.uuid4().hex[:10])
        admin = redis.Redis.from_url(url)
    try:
        stage = streams.StreamStage(client, keys, "rollouts", "reward", "reward-0", claim_idle_ms=60_000)
        assert stage.read(count=10, block_ms=100) == []  # past its own pending entries (none)

        def write_then_stall() -> None:
            wait_for(
                lambda: int(admin.info("clients")["blocked_clients"]) >= 1, 10, "the read below to block on the server"
            )
            pipe = admin.pipeline(transaction=False)
            pipe.xadd(keys.stream("rollouts"), validation.encode(group("g1")))  # delivered to the blocked read...
            pipe.eval(_STALL, 0, 1500)  # ...whose reply then waits past the client's 1 s socket timeout
            pipe.execute()

        writer = threading.Thread(target=write_then_stall)
        writer.start()
        try:
            first = stage.read(count=10, block_ms=800)
        except redis.TimeoutError:
            first = []
        writer.join()
        assert first == []
        got = [e for _ in range(5) for e in stage.read(count=10, block_ms=100)]
        assert [validation.decode(e.fields, rollout_pb2.RolloutGroup).group_id for e in got] == ["g1"], (
            f"the entry delivered by the lost reply is pending on us ({client.xpending(keys.stream('rollouts'), 'reward')['pending']}) "
            "but no read returns it"
        )
    finally:
        admin.close()
        client.close()


def test_services_wait_out_a_whole_cluster_restart(tmp_path: Path) -> None:
    with RedisClusterNodes(tmp_path / "restart") as nodes:
        client = redis_policy.connect(nodes.url)
        keys = run_keys.RunKeys("w")
        stop = threading.Event()
        health = redis_policy.RedisHealth(logging.getLogger("test.cluster"), stop)
        try:
            assert health.call(lambda: client.incr(keys.version), "counting") == 1
            for i in range(3):
                nodes.kill_node(i)
            restarted = threading.Timer(2.0, lambda: [nodes.restart_node(i) for i in range(3)])
            restarted.start()
            failsafe = threading.Timer(60.0, stop.set)
            failsafe.start()
            try:
                value = health.call(lambda: client.incr(keys.version), "counting")  # waits the outage out
            finally:
                failsafe.cancel()
                restarted.join()
            assert value >= 1 and health.ok
        finally:
            stop.set()
            client.close()
