"""Generator discovery from a DNS name (Kubernetes headless Services resolve to every pod)."""

from __future__ import annotations

import socket

import pytest
import redis

from rollstream.core import run_keys
from rollstream.core.run_keys import RunKeys
from rollstream.trainer import fleet
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.fleet import GeneratorDirectory


def test_localhost_resolves_to_loopback_with_the_port() -> None:
    addresses = fleet.resolve_all("localhost:50123")
    assert addresses, "localhost did not resolve"
    assert set(addresses) <= {"127.0.0.1:50123", "[::1]:50123"}
    assert addresses == sorted(set(addresses))


def test_every_record_of_a_name_is_a_generator() -> None:
    # What getaddrinfo itself returns for the name, as addresses: no more, no fewer.
    expected = {info[4][0] for info in socket.getaddrinfo("localhost", 50123, type=socket.SOCK_STREAM)}
    got = {a.rpartition(":")[0].strip("[]") for a in fleet.resolve_all("localhost:50123")}
    assert got == expected


def test_a_name_that_does_not_resolve_gives_nobody() -> None:
    # .invalid never resolves (RFC 2606): no pod ready yet, nothing to push to.
    assert fleet.resolve_all("no-such-generator.invalid:50051") == []


@pytest.mark.parametrize(
    "bad", ["localhost", "localhost:", ":50051", "localhost:0", "localhost:70000", "localhost:http"]
)
def test_a_target_without_a_usable_port_is_refused(bad: str) -> None:
    with pytest.raises(fleet.DiscoveryError):
        fleet.resolve_all(bad)


def test_ipv6_literal_targets() -> None:
    assert fleet.split_host_port("[::1]:50051") == ("::1", 50051)


def test_directory_combines_configured_addresses_and_the_dns_name(rclient: redis.Redis, keys: RunKeys) -> None:
    # A generator registered in Redis is ignored once addresses are configured.
    run_keys.heartbeat(rclient, keys, "g-redis", "10.1.2.3:50051")
    directory = GeneratorDirectory(["127.0.0.2:7000"], dns_name="localhost:50124")
    addresses = directory.addresses(rclient, keys)
    assert "127.0.0.2:7000" in addresses
    assert set(addresses) - {"127.0.0.2:7000"} <= {"127.0.0.1:50124", "[::1]:50124"}
    assert len(addresses) >= 2 and "10.1.2.3:50051" not in addresses
    # Neither configured: the live generators of the Redis registry.
    assert GeneratorDirectory([]).addresses(rclient, keys) == ["10.1.2.3:50051"]


def test_registry_forgets_generators_that_stop_beating(rclient: redis.Redis, keys: RunKeys) -> None:
    run_keys.heartbeat(rclient, keys, "alive", "127.0.0.1:1")
    run_keys.heartbeat(rclient, keys, "dead", "127.0.0.1:2")
    # "dead" last beat an hour ago (its score is written as a dead generator would have left it).
    seconds, _ = rclient.time()
    rclient.zadd(keys.generators_seen, {"dead": (int(seconds) - 3600) * 1000})
    rclient.hset(keys.generators, "legacy", "127.0.0.1:3")  # an address with no heartbeat at all
    assert run_keys.live_generators(rclient, keys, forget=False) == {"alive": "127.0.0.1:1"}
    assert rclient.hexists(keys.generators, "dead")  # a read-only look changes nothing
    assert run_keys.live_generators(rclient, keys) == {"alive": "127.0.0.1:1"}
    assert set(rclient.hkeys(keys.generators)) == {b"alive"}
    assert rclient.zrange(keys.generators_seen, 0, -1) == [b"alive"]
    # A restarted generator registers again and is pushed to.
    run_keys.heartbeat(rclient, keys, "dead", "127.0.0.1:2")
    assert run_keys.live_generators(rclient, keys) == {"alive": "127.0.0.1:1", "dead": "127.0.0.1:2"}
    run_keys.leave(rclient, keys, "alive")
    assert run_keys.live_generators(rclient, keys) == {"dead": "127.0.0.1:2"}


def test_setting_reads_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollstream.core.config import load_settings

    assert (
        load_settings(TrainerSettings, ["--generators-dns", "gen-headless.ns.svc:50051"]).generators_dns
        == "gen-headless.ns.svc:50051"
    )
    monkeypatch.setenv("ROLLSTREAM_GENERATORS_DNS", "gen.ns.svc:50051")
    assert load_settings(TrainerSettings, []).generators_dns == "gen.ns.svc:50051"


def test_a_colocated_generator_is_registered_but_never_pushed_to(rclient: redis.Redis, keys: RunKeys) -> None:
    """`up --colocate`'s generator beats with no address (status sees it and its version):
    the trainer's directory leaves it out of its pushes."""
    run_keys.heartbeat(rclient, keys, "generator-0", "", version=3)
    run_keys.heartbeat(rclient, keys, "remote-1", "10.0.0.7:50051", version=3)
    assert GeneratorDirectory([]).addresses(rclient, keys) == ["10.0.0.7:50051"]
    assert set(run_keys.live_generators(rclient, keys)) == {"generator-0", "remote-1"}
