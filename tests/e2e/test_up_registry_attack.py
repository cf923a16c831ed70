"""S1 of issue 27, reproduced on a loopback `rollstream up`: an attacker holding only the
generator's Redis password registers a generator of its own in the registry, and the trainer
pushes to it. Before signed pushes that push carried `authorization: Bearer <trainer token>`,
with which the attacker pushed an all-zero anchor to the real generator, which sampled from it.

Now the trainer sends no token to any generator, and pushes only to an address whose
PushNonce answer proves the generator's key for that very address. The fake does its best:
it relays the trainer's challenge to the real generator and hands back the real answer, so
the proof verifies, but for the real generator's address: the trainer pushes nothing there
and the fake receives no weights and no credential (docs/security.md, "Pushes are signed").
The signature a push does carry is checked in tests/unit/test_grpc_auth.py (replayed,
tampered, foreign nonce, appended payload)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis

from helpers import code_of, still_running, wait_for
from rollstream.core import credentials, run_keys
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import generator_pb2, generator_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2

pytestmark = pytest.mark.e2e


class FakeGenerator(generator_pb2_grpc.GeneratorServicer):
    """Keeps the metadata of every call and every chunk it gets; answers PushNonce with the
    real generator's answer to the same challenge."""

    def __init__(self, real_address: str):
        self.real_address = real_address
        self.metadata: list[tuple[str, str]] = []
        self.chunks: list[weights_pb2.WeightChunk] = []
        self.nonces_asked = threading.Event()

    def PushNonce(
        self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext
    ) -> generator_pb2.PushNonceResponse:
        self.metadata += list(context.invocation_metadata())
        with channel(self.real_address) as ch:  # PushNonce is open: no credential needed
            answer = generator_pb2_grpc.GeneratorStub(ch).PushNonce(request, timeout=30)
        self.nonces_asked.set()
        return answer

    def PushWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.PushResult:
        self.metadata += list(context.invocation_metadata())
        self.chunks += list(request_iterator)
        return weights_pb2.PushResult(applied=True, version=self.chunks[0].header.version if self.chunks else 0)

    def GetState(self, request, context):
        return generator_pb2.GeneratorState(generator_id="fake")


def test_a_registered_fake_generator_gets_no_credential_and_can_push_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = "registry-attack"
    keys = RunKeys(run)
    cmd = [
        str(Path(sys.executable).parent / "rollstream"),
        "up",
        "--model",
        str(tiny_model_dir),
        "--trainer.steps",
        "1000000",
        "--run",
        run,
        "--workdir",
        str(tmp_path),
        "--trainer.group-size",
        "4",
        "--trainer.groups-per-step",
        "2",
        "--trainer.max-new-tokens",
        "6",
        "--threads",
        "1",
        "--colocate",
        "off",  # the real generator as a process, beside the fake one
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    creds, state = tmp_path / "credentials", tmp_path / "state"
    fake_server = None
    try:
        up_running = still_running(proc, "up")
        wait_for(lambda: (state / "generator-0.json").exists() and (state / "redis.json").exists() and (state / "trainer.json").exists(),
                 300, "up to start its services", check=up_running, poll_s=0.5)  # fmt: skip
        sock = redis.connection.parse_url(json.loads((state / "redis.json").read_text())["url"])[
            "path"
        ]  # up's Redis: a unix socket
        admin = redis.Redis(
            unix_socket_path=sock,
            username="admin",
            password=credentials.read_secret(creds / "redis" / "admin.password", "a"),
        )
        wait_for(lambda: admin.xlen(keys.metrics) >= 1, 300, "a first step", check=up_running, poll_s=0.5)
        real = json.loads((state / "generator-0.json").read_text())["grpc_address"]
        trainer = json.loads((state / "trainer.json").read_text())["grpc_address"]

        # The attacker: the generator's Redis password, nothing else.
        fake = FakeGenerator(real)
        fake_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generator_pb2_grpc.add_GeneratorServicer_to_server(fake, fake_server)
        fake_port = fake_server.add_insecure_port("127.0.0.1:0")
        fake_server.start()
        attacker = redis.Redis(
            unix_socket_path=sock,
            username="generator",
            password=credentials.read_secret(creds / "redis" / "generator.password", "g"),
        )

        def registered_and_asked() -> bool:
            run_keys.heartbeat(attacker, keys, "fake-generator", f"127.0.0.1:{fake_port}")
            return fake.nonces_asked.is_set()

        wait_for(
            registered_and_asked, 600, "the trainer to call the registered fake generator", check=up_running, poll_s=1.0
        )
        # Two more steps (two more pushes) with the fake registered all along.
        steps_then = admin.xlen(keys.metrics)

        def registered_and_two_more_steps() -> bool:
            run_keys.heartbeat(attacker, keys, "fake-generator", f"127.0.0.1:{fake_port}")
            return admin.xlen(keys.metrics) >= steps_then + 2

        wait_for(
            registered_and_two_more_steps, 600, "2 more steps with the fake registered", check=up_running, poll_s=1.0
        )
        # Before the fix the fake got `authorization: Bearer <trainer token>` and every delta.
        trainer_token = credentials.read_secret(creds / "grpc" / "trainer.token", "t")
        assert not [k for k, _ in fake.metadata if k in ("authorization", "rollstream-push-signature")], fake.metadata
        assert all(trainer_token not in str(v) for _, v in fake.metadata)
        assert fake.chunks == []  # no weights left for the fake's address
        # The review's next move, had it got the token: a bearer token, the trainer's
        # included, no longer opens PushWeights at all.
        zero = [
            weights_pb2.WeightChunk(
                header=weights_pb2.WeightHeader(kind="anchor", version=10**6, total_bytes=8, sha256="00" * 32),
                data=b"\0" * 8,
            )
        ]
        with channel(real, ClientCredentials(token=trainer_token)) as ch:
            assert (
                code_of(lambda: generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(zero), timeout=60))
                == grpc.StatusCode.UNAUTHENTICATED
            )
        admin_creds = ClientCredentials(token=credentials.read_secret(creds / "grpc" / "admin.token", "a"))

        def generator_holds_the_trainers_weights() -> bool:
            with channel(real, admin_creds) as ch:
                g = generator_pb2_grpc.GeneratorStub(ch).GetState(
                    generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=60
                )
            with channel(trainer, admin_creds) as ch:
                t = trainer_pb2_grpc.TrainerStub(ch).GetState(
                    trainer_pb2.TrainerStateRequest(with_weights_sha256=True), timeout=60
                )
            return g.policy_version == t.version and g.weights_sha256 == t.weights_sha256

        wait_for(
            generator_holds_the_trainers_weights,
            300,
            "the real generator to hold the trainer's weights",
            check=up_running,
            poll_s=2.0,
        )
        admin.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
        assert "push_refused_not_a_generator" in (tmp_path / "logs" / "trainer.log").read_text()
    finally:
        if fake_server is not None:
            fake_server.stop(0)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
