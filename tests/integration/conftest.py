"""Fixtures shared by the integration tests that run Redis with the run's ACL users
(test_redis_acl, test_forged_groups): one embedded redis-server a module, its credentials,
the admin's client and a client per role."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rollstream.core import redis_acl, redis_policy
from rollstream.launcher.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def secrets_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("secrets")


@pytest.fixture(scope="module")
def passwords(secrets_root: Path) -> dict[str, str]:
    return redis_acl.ensure_redis_credentials(secrets_root)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, secrets_root: Path, passwords: dict[str, str]
) -> Iterator[EmbeddedRedis]:
    aclfile = redis_acl.acl_file(secrets_root)
    with EmbeddedRedis(tmp_path_factory.mktemp("redis-acl"), aclfile=aclfile, admin_password=passwords["admin"]) as r:
        yield r


@pytest.fixture
def admin(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = server.admin_client()
    client.acl_log_reset()
    yield client
    client.close()


@pytest.fixture
def connect_as(server: EmbeddedRedis, passwords: dict[str, str]) -> Iterator[Callable[[str], redis_policy.Client]]:
    clients: list[redis_policy.Client] = []

    def connect(role: str) -> redis_policy.Client:
        clients.append(redis_policy.connect(server.url, role, passwords[role]))
        return clients[-1]

    yield connect
    for c in clients:
        c.close()
