"""rollstream.core.grpc_auth: the permission table, roles.json loading, the settings rules, and
the interceptor on a real in-process gRPC server (health, reflection, and small servicers of
our own protos: one per kind of call, unary and streaming)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pydantic import ValidationError

from helpers import code_of, wait_healthy
from rollstream.core import credentials, grpc_auth, grpc_utils, push_signing, redis_policy, weight_transfer
from rollstream.core.config import CommonSettings, ConfigError, load_settings
from rollstream.core.credentials import ROLES
from rollstream.core.service import ServiceHost
from rollstream.v1 import (
    generator_pb2,
    generator_pb2_grpc,
    reference_pb2,
    reward_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)

TOKENS = {role: f"{role}-token-{i}" for i, role in enumerate(ROLES)}
GENERATOR_PUSH = "/rollstream.v1.Generator/PushWeights"


# -- the table -------------------------------------------------------------------------------


def proto_methods() -> set[str]:
    out = set()
    for module in (generator_pb2, trainer_pb2, reward_pb2, reference_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_table_covers_exactly_the_methods_of_our_protos() -> None:
    # A new RPC without an entry would be refused to everyone: this says so at once.
    assert set(grpc_auth.PERMISSIONS) | grpc_auth.OPEN_METHODS == proto_methods()
    assert not set(grpc_auth.PERMISSIONS) & grpc_auth.OPEN_METHODS


def test_table_rules() -> None:
    allowed = grpc_auth.allowed_roles
    # No bearer token opens PushWeights, the trainer's included: it signs (push_signing).
    assert allowed(GENERATOR_PUSH) == frozenset() and grpc_auth.SIGNED_METHODS[GENERATOR_PUSH] == "trainer"
    assert grpc_auth.is_open("/rollstream.v1.Generator/PushNonce")
    assert allowed("/rollstream.v1.Generator/Generate") == {"admin", "trainer"}
    assert allowed("/rollstream.v1.Trainer/FetchWeights") == {"generator", "admin"}
    assert allowed("/rollstream.v1.Trainer/SaveCheckpoint") == {"admin"}
    for method in (
        "/rollstream.v1.Generator/GetState",
        "/rollstream.v1.Trainer/GetState",
        "/rollstream.v1.Reference/GetState",
        "/rollstream.v1.Reward/Score",
        "/rollstream.v1.Reference/ComputeLogprobs",
    ):
        assert allowed(method) == set(ROLES), method
    assert allowed("/rollstream.v1.Generator/Nope") == frozenset()  # default deny
    assert grpc_auth.is_open("/grpc.health.v1.Health/Check") and grpc_auth.is_open(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    )
    assert not grpc_auth.is_open(GENERATOR_PUSH)


# -- roles.json ------------------------------------------------------------------------------


def table() -> grpc_auth.RoleTable:
    return grpc_auth.parse_roles(json.dumps(credentials.roles_table(TOKENS)), "test")


def test_role_of_finds_each_role_and_nothing_else() -> None:
    t = table()
    for role, token in TOKENS.items():
        assert t.role_of(token) == role
    assert t.role_of("") is None and t.role_of("trainer") is None and t.role_of(TOKENS["admin"] + " ") is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "not valid JSON"),
        ('["trainer"]', "expected a JSON object"),
        ("{}", "no roles"),
        (json.dumps({"root": "a" * 64}), "unknown role 'root'"),
        (json.dumps({"trainer": "a" * 63}), "role 'trainer' must map to the sha256"),
        (json.dumps({"trainer": "A" * 64}), "role 'trainer' must map to the sha256"),
        (json.dumps({"trainer": "g" * 64}), "role 'trainer' must map to the sha256"),
        (json.dumps({"trainer": 5}), "role 'trainer' must map to the sha256"),
        (json.dumps({"trainer": "a" * 64, "admin": "a" * 64}), "roles 'trainer' and 'admin' have the same token"),
    ],
)
def test_bad_roles_files_are_refused_naming_the_file(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "roles.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=error) as e:
        grpc_auth.load_roles(path)
    assert str(path) in str(e.value) and "grpc_auth_file" in str(e.value)


def test_missing_or_empty_roles_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grpc_auth_file: cannot read"):
        grpc_auth.load_roles(tmp_path / "absent.json")
    (tmp_path / "empty.json").write_text("\n")
    with pytest.raises(ValueError, match="grpc_auth_file: .* is empty"):
        grpc_auth.load_roles(tmp_path / "empty.json")


def test_roles_file_written_with_the_credentials_layout_loads(tmp_path: Path) -> None:
    root = tmp_path / "secrets"
    for role, token in TOKENS.items():
        credentials.write_secret(root / "grpc" / f"{role}.token", token)
    credentials.write_secret(
        root / "grpc" / "roles.json", json.dumps({r: credentials.digest(t) for r, t in TOKENS.items()})
    )
    t = grpc_auth.load_roles(root / "grpc" / "roles.json")
    assert t.role_of(credentials.read_secret(root / "grpc" / "generator.token", "token")) == "generator"


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((), None),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "Bearer "),), None),
        ((("authorization", "Bearer a"), ("authorization", "Bearer b")), None),  # two: ambiguous
    ],
)
def test_bearer_token(metadata: tuple, token: str | None) -> None:
    assert grpc_auth.bearer_token(metadata) == token


# -- settings ----------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ROLLSTREAM_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_serves_without_a_role_table(host: str, clean_env: None) -> None:
    assert CommonSettings(host=host).grpc_auth_file == ""


def test_other_hosts_need_a_role_table_or_an_explicit_opt_out(clean_env: None) -> None:
    with pytest.raises(ValidationError, match="grpc_auth_file: serving gRPC on 0.0.0.0 without authentication"):
        CommonSettings(host="0.0.0.0")
    with pytest.raises(ConfigError, match="allow_unauthenticated=true"):
        load_settings(CommonSettings, ["--host", "10.1.2.3"])
    assert CommonSettings(host="0.0.0.0", allow_unauthenticated=True).allow_unauthenticated
    # Existence is checked at start (the secrets may not be mounted where settings are checked).
    assert CommonSettings(host="0.0.0.0", grpc_auth_file="/run/secrets/roles.json").grpc_auth_file


def test_tls_certificate_and_key_come_together(clean_env: None) -> None:
    with pytest.raises(ValidationError, match="grpc_tls_key_file: required with grpc_tls_cert_file"):
        CommonSettings(grpc_tls_cert_file="a.pem")
    with pytest.raises(ValidationError, match="grpc_tls_cert_file: required with grpc_tls_key_file"):
        CommonSettings(grpc_tls_key_file="a.key")


def test_missing_files_fail_the_start_naming_the_field(tmp_path: Path, clean_env: None) -> None:
    missing = str(tmp_path / "absent")
    for fields, name in [
        ({"grpc_auth_file": missing}, "grpc_auth_file"),
        ({"grpc_token_file": missing}, "grpc_token_file"),
        ({"grpc_tls_cert_file": missing, "grpc_tls_key_file": missing}, "grpc_tls_cert_file"),
        ({"grpc_tls_ca_file": missing}, "grpc_tls_ca_file"),
    ]:
        host = ServiceHost("test", CommonSettings(**fields))
        # A configuration error: exit status 2, the field named (as a bad setting at load).
        with pytest.raises(redis_policy.Misconfigured, match=f"{name}: cannot read {missing}") as refused:
            host.start([])
        assert refused.value.code == 2
        assert host.grpc is None and host.http is None  # nothing was served
    (tmp_path / "not.pem").write_text("hello")
    with pytest.raises(ValueError, match="grpc_tls_ca_file: .* is not a PEM file"):
        grpc_auth.ClientCredentials.from_settings(CommonSettings(grpc_tls_ca_file=str(tmp_path / "not.pem")))


def test_client_credentials_from_settings_do_not_show_secrets(tmp_path: Path, clean_env: None) -> None:
    credentials.write_secret(tmp_path / "t.token", "s3cret-token")
    creds = grpc_auth.ClientCredentials.from_settings(CommonSettings(grpc_token_file=str(tmp_path / "t.token")))
    assert creds.token == "s3cret-token" and not creds.tls
    assert "s3cret" not in repr(creds)
    assert grpc_auth.ClientCredentials.from_settings(CommonSettings()) == grpc_auth.ClientCredentials()


# -- the interceptor on a real server ---------------------------------------------------------------


class Generator(generator_pb2_grpc.GeneratorServicer):
    """Counts what it reads: a refused push must have read nothing."""

    def __init__(self, nonces: push_signing.PushNonces) -> None:
        self.chunks_read = 0
        self.nonces = nonces

    def GetState(self, request, context):
        return generator_pb2.GeneratorState(generator_id="g")

    def PushWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.PushResult:
        try:
            for _ in request_iterator:
                self.chunks_read += 1
        except weight_transfer.TransferRefused as e:  # as the real generator answers it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return weights_pb2.PushResult(applied=True)

    def PushNonce(
        self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext
    ) -> generator_pb2.PushNonceResponse:
        return generator_pb2.PushNonceResponse(nonce=self.nonces.issue())


class Trainer(trainer_pb2_grpc.TrainerServicer):
    def FetchWeights(
        self, request: trainer_pb2.FetchWeightsRequest, context: grpc.ServicerContext
    ) -> Iterator[weights_pb2.WeightChunk]:
        yield weights_pb2.WeightChunk(data=b"w")

    def SaveCheckpoint(self, request, context):
        return trainer_pb2.SaveCheckpointResult(path="ok")


def _echo(request_iterator, context):
    yield from request_iterator


class Server:
    """On a unix socket in `folder`: a token goes over no plain TCP (grpc_auth.token_refusal)."""

    def __init__(self, folder: Path, roles: grpc_auth.RoleTable | None = None) -> None:
        self.nonces = push_signing.PushNonces()
        self.generator = Generator(self.nonces)
        services = [
            grpc_utils.Service(
                "rollstream.v1.Generator", self.generator, generator_pb2_grpc.add_GeneratorServicer_to_server
            ),
            grpc_utils.Service("rollstream.v1.Trainer", Trainer(), trainer_pb2_grpc.add_TrainerServicer_to_server),
            # A stream-stream method that is in no table: default deny for every role.
            grpc_utils.Service(
                "test.Echo",
                None,
                lambda _s, server: server.add_generic_rpc_handlers(
                    [
                        grpc.method_handlers_generic_handler(
                            "test.Echo", {"Both": grpc.stream_stream_rpc_method_handler(_echo)}
                        )
                    ]
                ),
            ),
        ]
        self.running = grpc_utils.serve(
            services,
            "127.0.0.1",
            0,
            interceptors=[grpc_auth.AuthInterceptor(roles or table(), nonces=self.nonces)],
            unix_socket=str(folder / "grpc.sock"),
        )
        self.running.set_serving(True)
        self.address = self.running.address

    def channel(self, token: str) -> grpc.Channel:
        return grpc_utils.channel(self.address, grpc_auth.ClientCredentials(token=token))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("grpc"))
    yield s
    s.running.stop(0)


def test_health_and_reflection_need_no_token(server: Server) -> None:
    with grpc_utils.channel(server.address) as ch:
        assert (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "rollstream.v1.Generator" in names
    wait_healthy(server.address, timeout_s=5)


@pytest.mark.parametrize("token", ["", "garbage", *TOKENS.values()])
def test_each_kind_of_call_is_allowed_or_refused_by_role(server: Server, token: str) -> None:
    role = next((r for r, t in TOKENS.items() if t == token), None)

    def expect(allowed: frozenset[str]) -> grpc.StatusCode:
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED
        return grpc.StatusCode.OK if role in allowed else grpc.StatusCode.PERMISSION_DENIED

    with server.channel(token) as ch:
        gen, tr = generator_pb2_grpc.GeneratorStub(ch), trainer_pb2_grpc.TrainerStub(ch)
        echo = ch.stream_stream("/test.Echo/Both")
        calls = {
            "/rollstream.v1.Generator/GetState": lambda: gen.GetState(
                generator_pb2.GetStateRequest(), timeout=5
            ),  # unary-unary
            GENERATOR_PUSH: lambda: gen.PushWeights(
                iter([weights_pb2.WeightChunk(data=b"x")] * 3), timeout=5
            ),  # stream-unary
            "/rollstream.v1.Trainer/FetchWeights": lambda: list(
                tr.FetchWeights(trainer_pb2.FetchWeightsRequest(), timeout=5)
            ),  # unary-stream
            "/rollstream.v1.Trainer/SaveCheckpoint": lambda: tr.SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(), timeout=5
            ),
            "/test.Echo/Both": lambda: list(echo(iter([b"a", b"b"]), timeout=5)),  # stream-stream
        }
        for method, call in calls.items():
            want = (
                grpc.StatusCode.UNAUTHENTICATED
                if method in grpc_auth.SIGNED_METHODS
                else expect(grpc_auth.allowed_roles(method))
            )
            assert code_of(call) == want, (role, method)
        # Not a method of this server: UNIMPLEMENTED for anyone (gRPC's own answer; the protos
        # are public, so it reveals nothing), and nothing of the request is read.
        missing = ch.unary_unary("/rollstream.v1.Reward/Score")
        assert code_of(lambda: missing(b"", timeout=5)) == grpc.StatusCode.UNIMPLEMENTED


def test_refusals_say_why_and_read_nothing_of_the_stream(server: Server) -> None:
    pulled = 0

    def chunks() -> Iterator[weights_pb2.WeightChunk]:
        nonlocal pulled
        for _ in range(300):
            pulled += 1
            yield weights_pb2.WeightChunk(data=b"x" * (1 << 20))

    before = server.generator.chunks_read
    for token in ["", "garbage", TOKENS["generator"], TOKENS["trainer"]]:
        pulled = 0
        with server.channel(token) as ch, pytest.raises(grpc.RpcError) as e:
            generator_pb2_grpc.GeneratorStub(ch).PushWeights(chunks(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            f"{GENERATOR_PUSH} takes the trainer's signature (rollstream-push-signature), not a bearer token"
            in e.value.details()
        )
        # The client stops at the refusal: a few MiB in flight at most, never the 300 MiB.
        assert pulled < 20, pulled
    assert server.generator.chunks_read == before  # the servicer never saw a chunk
    with grpc_utils.channel(server.address) as ch:
        assert signed_push(ch, push_signing.PushSigner(TOKENS["trainer"]), header(), [b"x"] * 3).applied
    assert server.generator.chunks_read == before + 3


# -- signed pushes (S1 of issue 27: a registry address must not yield the trainer's token) --------


def header(sha256: str = "ab" * 32) -> weights_pb2.WeightHeader:
    return weights_pb2.WeightHeader(
        kind="delta", base_version=3, version=4, total_bytes=3, sha256=sha256, model_fingerprint="f"
    )


def signed_push(ch: grpc.Channel, signer: push_signing.PushSigner, head: weights_pb2.WeightHeader, data: list[bytes],
                nonce: bytes | None = None, signed_header: weights_pb2.WeightHeader | None = None) -> weights_pb2.PushResult:  # fmt: skip
    """What the trainer's publisher sends: a nonce from the server, a signature over it and
    `signed_header` (default: the header sent), then the chunks."""
    stub = generator_pb2_grpc.GeneratorStub(ch)
    nonce = nonce if nonce is not None else stub.PushNonce(generator_pb2.PushNonceRequest(), timeout=5).nonce
    chunks = [weights_pb2.WeightChunk(header=head, data=data[0]), *(weights_pb2.WeightChunk(data=d) for d in data[1:])]
    return stub.PushWeights(iter(chunks), timeout=30, metadata=signer.metadata(nonce, signed_header or head))


def test_a_signed_push_lands_once_and_only_with_its_own_header(server: Server) -> None:
    trainer = push_signing.PushSigner(TOKENS["trainer"])
    with grpc_utils.channel(server.address) as ch:
        stub = generator_pb2_grpc.GeneratorStub(ch)
        nonce = stub.PushNonce(generator_pb2.PushNonceRequest(), timeout=5).nonce
        assert signed_push(ch, trainer, header(), [b"x"], nonce=nonce).applied
        # What a fake generator holds after receiving that push: the same stream, replayed.
        with pytest.raises(grpc.RpcError) as e:
            signed_push(ch, trainer, header(), [b"x"], nonce=nonce)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "nonce already used" in e.value.details()
        # Another payload under a signature made for the first one's header.
        with pytest.raises(grpc.RpcError) as e:
            signed_push(ch, trainer, header("cd" * 32), [b"y"], signed_header=header())
        assert (
            e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            and "does not match this payload's header" in e.value.details()
        )
        # Signed with another role's key (a generator's token, derived the same way).
        with pytest.raises(grpc.RpcError) as e:
            signed_push(ch, push_signing.PushSigner(TOKENS["generator"]), header(), [b"x"])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A nonce another generator made (or this one before a restart).
        with pytest.raises(grpc.RpcError) as e:
            signed_push(ch, trainer, header(), [b"x"], nonce=push_signing.PushNonces().issue())
        assert (
            e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not a nonce of this generator" in e.value.details()
        )
        # A genuine signed payload with a second, unsigned payload appended to its stream.
        nonce = stub.PushNonce(generator_pb2.PushNonceRequest(), timeout=5).nonce
        chunks = [
            weights_pb2.WeightChunk(header=header(), data=b"x"),
            weights_pb2.WeightChunk(header=header("ee" * 32), data=b"evil"),
        ]
        with pytest.raises(grpc.RpcError) as e:
            stub.PushWeights(iter(chunks), timeout=30, metadata=trainer.metadata(nonce, header()))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one payload" in e.value.details()


def test_a_roles_file_without_the_push_key_refuses_every_push(tmp_path: Path) -> None:
    old = grpc_auth.parse_roles(json.dumps({r: credentials.digest(t) for r, t in TOKENS.items()}), "old roles.json")
    assert old.push_key is None
    s = Server(tmp_path, old)
    try:
        with grpc_utils.channel(s.address) as ch, pytest.raises(grpc.RpcError) as e:
            signed_push(ch, push_signing.PushSigner(TOKENS["trainer"]), header(), [b"x"])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "no trainer_push_key" in e.value.details()
    finally:
        s.running.stop(0)


def test_nonces_expire_and_are_spent_once() -> None:
    nonces = push_signing.PushNonces()
    nonce = nonces.issue()
    assert nonces.check(nonce) is None and nonces.spend(nonce) is None and nonces.spend(nonce) == "nonce already used"
    stale = push_signing.PushNonces(ttl_s=-1.0)
    assert "expired" in (stale.check(stale.issue()) or "")
    forged = bytearray(nonces.issue())
    forged[0] ^= 1  # an older clock reading, to stretch its life: the MAC no longer matches
    assert nonces.check(bytes(forged)) == "not a nonce of this generator (restarted since?)"
    assert nonces.check(b"short") == "malformed nonce"


def test_roles_json_push_key_is_checked() -> None:
    roles = credentials.roles_table(TOKENS)
    assert grpc_auth.parse_roles(json.dumps(roles), "t").push_key is not None
    for bad in ("zz", "ab" * 31, 5):
        with pytest.raises(ValueError, match="trainer_push_key"):
            grpc_auth.parse_roles(json.dumps({**roles, "trainer_push_key": bad}), "t")


def test_token_interceptor_replaces_a_token_set_by_hand(server: Server) -> None:
    with server.channel(TOKENS["admin"]) as ch:
        reply = trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(), metadata=(("authorization", f"Bearer {TOKENS['reward']}"),), timeout=5
        )
    assert reply.path == "ok"
