"""Shared fixtures: a real redis-server per test session, a fresh run name per test,
a tiny real model (random weights, locally trained tokenizer) built once, and the custom
reward example's protobuf stubs. Helper functions are in tests/helpers.py."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import procs
from helpers import CUSTOM_REWARD_EXAMPLE, build_tiny_model
from rollstream.core.redis_policy import connect
from rollstream.core.run_keys import RunKeys
from rollstream.launcher.redis_server import EmbeddedRedis
from synthetic import Decode, tokenizer_decode


@pytest.fixture(autouse=True)
def _no_service_outlives_its_test() -> Iterator[None]:
    # Only what started after this point: a module-scoped fixture's service was set up before.
    before = len(procs.STARTED)
    yield
    while len(procs.STARTED) > before:
        procs.STARTED.pop().kill()  # a no-op for one that stopped


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def rclient(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def run_name() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def keys(run_name: str) -> RunKeys:
    return RunKeys(run_name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_decode(tiny_model_dir: Path) -> Decode:
    """The tiny model's decode (special tokens skipped): the text the trainer checks a
    completion against (helpers.write_ready)."""
    return tokenizer_decode(tiny_model_dir)


@pytest.fixture(scope="session")
def custom_reward_stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/custom_reward's rollout_pb2, generated from proto/ by the example's own script."""
    out = tmp_path_factory.mktemp("custom-reward-stubs")
    subprocess.run(
        [sys.executable, str(CUSTOM_REWARD_EXAMPLE / "generate_stubs.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread for the test: on two shared cores torch's default thread pool
    oversubscribes them badly."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
