"""S1 of issue 27, reproduced on a loopback `rollstream up`: an attacker holding only the
generator's Redis password registers a generator of its own in the registry, and the trainer
pushes to it. Before signed pushes that push carried `authorization: Bearer <trainer token>`,
with which the attacker pushed an all-zero anchor to the real generator, which sampled from it.

Now the fake generator receives no credential, and does its worst with what it does receive:
it relays the real generator's nonces to the trainer (so the signatures it gets are made for
the real generator), then replays the signed stream with other weights, and the genuine
stream twice. Only the genuine payload can land, once; the real generator keeps the trainer's
weights (docs/security.md, "Pushes are signed")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis

from rollstream.core import credentials, registry
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.core.streams import RunKeys
from rollstream.v1 import generator_pb2, generator_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2

from helpers import still_running, wait_for

pytestmark = pytest.mark.e2e


class FakeGenerator(generator_pb2_grpc.GeneratorServicer):
    """Keeps every push it gets (metadata and chunks); hands out the real generator's nonces."""

    def __init__(self, real_address: str):
        self.real_address = real_address
        self.pushes: list[tuple[tuple[tuple[str, str], ...], list[weights_pb2.WeightChunk]]] = []
        self.got_push = threading.Event()

    def PushNonce(self, request, context):  # type: ignore[no-untyped-def]
        with channel(self.real_address) as ch:  # PushNonce is open: no credential needed
            return generator_pb2_grpc.GeneratorStub(ch).PushNonce(request, timeout=30)

    def PushWeights(self, request_iterator, context):  # type: ignore[no-untyped-def]
        chunks = list(request_iterator)
        self.pushes.append((tuple((k, v) for k, v in context.invocation_metadata()), chunks))
        self.got_push.set()
        return weights_pb2.PushResult(applied=True, version=chunks[0].header.version if chunks else 0)

    def GetState(self, request, context):  # type: ignore[no-untyped-def]
        return generator_pb2.GeneratorState(generator_id="fake")


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_registered_fake_generator_gets_no_credential_and_can_push_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = "registry-attack"
    keys = RunKeys(run)
    cmd = [
        str(Path(sys.executable).parent / "rollstream"), "up", "--model", str(tiny_model_dir), "--steps", "1000", "--run", run,
        "--workdir", str(tmp_path), "--group-size", "4", "--groups-per-step", "2", "--max-new-tokens", "6", "--threads", "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    creds, state = tmp_path / "credentials", tmp_path / "state"
    fake_server = None
    try:
        up_running = still_running(proc, "up")
        wait_for(lambda: (state / "generator-0.json").exists() and (state / "redis.json").exists() and (state / "trainer.json").exists(),
                 300, "up to start its services", check=up_running, poll_s=0.5)  # fmt: skip
        port = int(json.loads((state / "redis.json").read_text())["url"].rsplit(":", 1)[1].split("/")[0])
        admin = redis.Redis(port=port, username="admin", password=credentials.read_secret(creds / "redis" / "admin.password", "a"))
        wait_for(lambda: admin.xlen(keys.metrics) >= 1, 300, "a first step", check=up_running, poll_s=0.5)
        real = f"127.0.0.1:{json.loads((state / 'generator-0.json').read_text())['grpc_port']}"
        trainer = f"127.0.0.1:{json.loads((state / 'trainer.json').read_text())['grpc_port']}"

        # The attacker: the generator's Redis password, nothing else.
        fake = FakeGenerator(real)
        fake_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generator_pb2_grpc.add_GeneratorServicer_to_server(fake, fake_server)
        fake_port = fake_server.add_insecure_port("127.0.0.1:0")
        fake_server.start()
        attacker = redis.Redis(port=port, username="generator", password=credentials.read_secret(creds / "redis" / "generator.password", "g"))

        def registered_and_pushed() -> bool:
            registry.heartbeat(attacker, keys, "fake-generator", f"127.0.0.1:{fake_port}")
            return fake.got_push.is_set()

        wait_for(registered_and_pushed, 600, "the trainer to push to the registered fake generator", check=up_running, poll_s=1.0)
        metadata, chunks = fake.pushes[0]
        keys_sent = {k for k, _ in metadata}
        assert "authorization" not in keys_sent, metadata  # before the fix: Bearer <trainer token>
        assert "rollstream-push-signature" in keys_sent, metadata
        signature = [(k, v) for k, v in metadata if k == "rollstream-push-signature"]
        trainer_token = credentials.read_secret(creds / "grpc" / "trainer.token", "t")
        assert all(trainer_token not in v for _, v in metadata)

        admin_creds = ClientCredentials(token=credentials.read_secret(creds / "grpc" / "admin.token", "a"))
        with channel(real, admin_creds) as ch:
            before = generator_pb2_grpc.GeneratorStub(ch).GetState(generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=60)
        # The review's attack with what the fake holds: an all-zero anchor under the signature.
        zero = [weights_pb2.WeightChunk(
            header=weights_pb2.WeightHeader(kind="anchor", version=before.policy_version + 1, total_bytes=8, sha256="00" * 32,
                                            model_fingerprint=chunks[0].header.model_fingerprint),
            data=b"\0" * 8,
        )]  # fmt: skip
        with channel(real) as ch:
            stub = generator_pb2_grpc.GeneratorStub(ch)
            assert code_of(lambda: stub.PushWeights(iter(zero), timeout=60, metadata=tuple(signature))) in (
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
            )
            # The genuine stream, replayed twice: the second is refused (the first carries the
            # trainer's own current payload, which the real generator may apply or already hold).
            outcomes = [code_of(lambda: stub.PushWeights(iter(chunks), timeout=60, metadata=tuple(signature))) for _ in range(2)]
        assert outcomes[1] in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), outcomes
        # With the trainer's token (which it never received) the attacker could at least have
        # tried: a bearer token, even the trainer's, no longer opens PushWeights.
        with channel(real, ClientCredentials(token=trainer_token)) as ch:
            assert code_of(lambda: generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(zero), timeout=60)) == grpc.StatusCode.UNAUTHENTICATED

        # The run goes on, and the real generator serves the trainer's weights, not the zeros.
        steps_then = admin.xlen(keys.metrics)
        wait_for(lambda: admin.xlen(keys.metrics) >= steps_then + 2, 600, "2 more steps after the attack", check=up_running, poll_s=0.5)

        def generator_holds_the_trainers_weights() -> bool:
            with channel(real, admin_creds) as ch:
                g = generator_pb2_grpc.GeneratorStub(ch).GetState(generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=60)
            with channel(trainer, admin_creds) as ch:
                t = trainer_pb2_grpc.TrainerStub(ch).GetState(trainer_pb2.TrainerStateRequest(with_weights_sha256=True), timeout=60)
            return g.policy_version == t.version and g.weights_sha256 == t.weights_sha256

        wait_for(generator_holds_the_trainers_weights, 300, "the real generator to hold the trainer's weights", check=up_running, poll_s=2.0)
        admin.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if fake_server is not None:
            fake_server.stop(0)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
