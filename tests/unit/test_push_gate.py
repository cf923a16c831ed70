"""The trainer's side of signed pushes (push.PushGate / fleet.push_one), against real in-process
gRPC servers: nothing is pushed to an address whose PushNonce answer does not prove the
generator's key, or, for a registry address, proves another address (a fake registered
address relaying a real generator's answer); an honest generator gets the push, signed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from rollstream.core import credentials, grpc_auth, grpc_utils, push_signing
from rollstream.core.credentials import ROLES
from rollstream.trainer.fleet import push_one
from rollstream.trainer.push import PushGate, push_call
from rollstream.v1 import generator_pb2, generator_pb2_grpc, weights_pb2

TOKENS = {role: f"{role}-token-{i}" for i, role in enumerate(ROLES)}
ROLE_TABLE = grpc_auth.parse_roles(json.dumps(credentials.roles_table(TOKENS)), "test")


class Generator(generator_pb2_grpc.GeneratorServicer):
    """A generator's PushNonce and PushWeights, behind the real interceptor. `proves`: the
    address its proof names (None: its own); `token`: whose key it proves with."""

    def __init__(self, nonces: push_signing.PushNonces, token: str | None, proves: str | None = None):
        self.nonces = nonces
        self.prover = push_signing.GeneratorProver(token) if token else None
        self.proves = proves
        self.address = ""
        self.payloads = 0

    def PushNonce(
        self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext
    ) -> generator_pb2.PushNonceResponse:
        nonce = self.nonces.issue()
        address = self.proves if self.proves is not None else self.address
        proof = self.prover.prove(request.challenge, nonce, address) if self.prover else b""
        return generator_pb2.PushNonceResponse(nonce=nonce, address=address, proof=proof)

    def PushWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.PushResult:
        header = next(iter(request_iterator)).header
        for _ in request_iterator:
            pass
        self.payloads += 1
        nonce, _ = push_signing.parse_signature(context.invocation_metadata())
        return weights_pb2.PushResult(
            applied=True, version=4, ack=self.prover.ack(nonce, header) if self.prover else b""
        )


@pytest.fixture
def serve() -> Iterator:
    servers: list[grpc.Server] = []

    def start(token: str | None, proves: str | None = None) -> tuple[Generator, str]:
        nonces = push_signing.PushNonces()
        gen = Generator(nonces, token, proves)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2),
            interceptors=[grpc_auth.AuthInterceptor(ROLE_TABLE, nonces=nonces)],
        )
        generator_pb2_grpc.add_GeneratorServicer_to_server(gen, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        gen.address = f"127.0.0.1:{port}"
        return gen, gen.address

    yield start
    for s in servers:
        s.stop(0)


HEADER = weights_pb2.WeightHeader(
    kind="delta", base_version=3, version=4, total_bytes=1, sha256="ab" * 32, model_fingerprint="f"
)
WIRE = [weights_pb2.WeightChunk(header=HEADER, data=b"x").SerializeToString()]
GATE = PushGate(push_signing.PushSigner(TOKENS["trainer"]), ROLE_TABLE.generator_key, prove_address=True)


def push(address: str, gate: PushGate = GATE):
    with grpc_utils.channel(address) as ch:
        return push_one(push_call(ch), address, WIRE, HEADER, gate, nonce_timeout_s=30, timeout_s=30)


def test_an_honest_generator_gets_a_signed_push(serve) -> None:
    gen, address = serve(TOKENS["generator"])
    outcome = push(address)
    assert outcome.applied and outcome.error == "" and gen.payloads == 1


def test_a_registered_address_relaying_another_generators_proof_gets_nothing(serve) -> None:
    real, real_address = serve(TOKENS["generator"])
    fake, fake_address = serve(TOKENS["generator"], proves=real_address)  # the real answer, relayed
    outcome = push(fake_address)
    assert not outcome.applied and "not pushing there" in outcome.error and real_address in outcome.error
    assert fake.payloads == 0
    # An address the operator configured (not the registry's) is not bound to what the
    # generator advertises (a Service name, a pod IP): its proof of the key is enough.
    assert push(fake_address, PushGate(GATE.signer, GATE.generator_key, prove_address=False)).applied


@pytest.mark.parametrize("token", [None, TOKENS["reward"], TOKENS["trainer"]])
def test_an_address_without_the_generators_key_gets_nothing(serve, token: str | None) -> None:
    gen, address = serve(token)
    outcome = push(address)
    assert not outcome.applied and "gave no proof of the generator's key" in outcome.error
    assert gen.payloads == 0
