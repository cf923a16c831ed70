"""A real trainer and generator serving with a role table (rollstream.core.grpc_auth): every
method allowed or refused with exactly the right code for each role's token, no token and a
garbage one; an outsider's poisoned anchor, weight downloads and checkpoint writes refused;
weight streams that lie about their size cut at once; and the same services over mTLS
(certificates made with the openssl CLI) refusing clients without the CA or a certificate.

Credentials are laid out as rollstream.core.credentials writes them: <dir>/grpc/<role>.token
and <dir>/grpc/roles.json."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest

from helpers import code_of, wait_for, wait_healthy
from procs import ServiceProc, generator_state, start_service, trainer_state
from rollstream.core import credentials, deltas, grpc_auth, modeling, push_signing, weight_transfer
from rollstream.core.credentials import ROLES
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.trainer import checkpoint
from rollstream.v1 import generator_pb2, generator_pb2_grpc, rollout_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@dataclass
class Secrets:
    root: Path
    tokens: dict[str, str]

    @property
    def roles_file(self) -> Path:
        return self.root / "grpc" / "roles.json"

    def flags(self, role: str) -> list[str]:
        return [
            "--grpc-token-file",
            str(self.root / "grpc" / f"{role}.token"),
            "--grpc-auth-file",
            str(self.roles_file),
        ]

    def creds(self, role: str | None) -> ClientCredentials:
        return ClientCredentials(token=self.tokens[role] if role else "")


def write_secrets(root: Path) -> Secrets:
    tokens = {role: credentials.new_secret() for role in ROLES}
    for role, token in tokens.items():
        credentials.write_secret(root / "grpc" / f"{role}.token", token)
    credentials.write_secret(root / "grpc" / "roles.json", json.dumps(credentials.roles_table(tokens)))
    return Secrets(root, tokens)


def service_args(redis_url: str, run: str, model: Path) -> list[str]:
    return ["--redis-url", redis_url, "--run", run, "--model", str(model), "--threads", "1", "--block-ms", "100"]


TRAINER_ARGS = ["--group-size", "2", "--max-new-tokens", "2", "--prompt-buffer", "1"]
# One group waiting downstream (nobody scores here) stops the generator sampling: little CPU.
GENERATOR_ARGS = ["--sync-interval-s", "0.5", "--max-inflight-groups", "1"]


@dataclass
class Pair:
    trainer: ServiceProc
    generator: ServiceProc
    secrets: Secrets
    checkpoint_dir: Path
    work: Path


@pytest.fixture(scope="module")
def pair(redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("auth")
    secrets = write_secrets(work / "secrets")
    ckpt = work / "checkpoints"
    ckpt.mkdir()
    common = service_args(redis_server.url, "t" + uuid.uuid4().hex[:10], tiny_model_dir)
    trainer = start_service(
        "trainer", work, *common, *TRAINER_ARGS, "--checkpoint-dir", str(ckpt), *secrets.flags("trainer")
    ).wait_ready()
    generator = None
    try:
        generator = start_service(
            "generator",
            work,
            *common,
            *GENERATOR_ARGS,
            "--trainer-address",
            trainer.grpc_address,
            *secrets.flags("generator"),
        ).wait_ready()
        yield Pair(trainer, generator, secrets, ckpt, work)
    finally:
        for p in (trainer, generator):
            if p is not None:
                p.stop()


def tiny_task() -> rollout_pb2.PromptTask:
    return rollout_pb2.PromptTask(
        task_id="direct",
        prompt_ids=[5, 6, 7],
        group_size=2,
        task_kind="arithmetic",
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, seed=1),
    )


# method -> (which server, the call, the roles that may make it). Allowed calls do harmless
# real work: an empty push, a fetch of nothing (already at the version), a checkpoint in the
# folder.
CALLS: dict[str, tuple[str, Callable[[grpc.Channel], object], set[str]]] = {
    "Generator/GetState": (
        "generator",
        lambda ch: generator_pb2_grpc.GeneratorStub(ch).GetState(generator_pb2.GetStateRequest(), timeout=30),
        set(ROLES),
    ),
    "Generator/Generate": (
        "generator",
        lambda ch: generator_pb2_grpc.GeneratorStub(ch).Generate(
            generator_pb2.GenerateRequest(task=tiny_task()), timeout=120
        ),
        {"admin", "trainer"},
    ),
    # No bearer token opens it, the trainer's included: the trainer signs its pushes (below).
    "Generator/PushWeights": (
        "generator",
        lambda ch: generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter([]), timeout=30),
        set(),
    ),
    "Trainer/GetState": (
        "trainer",
        lambda ch: trainer_pb2_grpc.TrainerStub(ch).GetState(trainer_pb2.TrainerStateRequest(), timeout=30),
        set(ROLES),
    ),
    "Trainer/FetchWeights": (
        "trainer",
        lambda ch: list(
            trainer_pb2_grpc.TrainerStub(ch).FetchWeights(trainer_pb2.FetchWeightsRequest(have_version=0), timeout=60)
        ),
        {"generator", "admin"},
    ),
    "Trainer/SaveCheckpoint": (
        "trainer",
        lambda ch: trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120),
        {"admin"},
    ),
}


def test_the_call_table_is_the_permission_table() -> None:
    assert {f"/rollstream.v1.{m}": allowed for m, (_, _, allowed) in CALLS.items()} == {
        m: set(r)
        for m, r in grpc_auth.PERMISSIONS.items()
        if m.split(".")[-1].split("/")[0] in ("Generator", "Trainer")
    }


@pytest.mark.parametrize("who", [*ROLES, "no token", "garbage token"])
def test_each_method_is_allowed_or_refused_by_role(pair: Pair, who: str) -> None:
    role = who if who in ROLES else None
    token = pair.secrets.tokens[who] if role else ("" if who == "no token" else credentials.new_secret())
    creds = ClientCredentials(token=token)
    got, want = {}, {}
    for method, (server, call, allowed) in CALLS.items():
        proc = pair.trainer if server == "trainer" else pair.generator
        with channel(proc.grpc_address, creds) as ch:
            got[method] = code_of(partial(call, ch))
        signed = f"/rollstream.v1.{method}" in grpc_auth.SIGNED_METHODS
        want[method] = UNAUTHENTICATED if role is None or signed else OK if role in allowed else DENIED
    assert got == want
    # Health stays open: probes carry no token.
    wait_healthy(pair.generator.grpc_address, timeout_s=10)


def version0_bits(model_dir: Path) -> dict[str, np.ndarray]:
    model, _ = modeling.load_model(model_dir)
    return modeling.model_bits(model)


def poisoned_anchor(bits: dict[str, np.ndarray], version: int) -> list[weights_pb2.WeightChunk]:
    poisoned = {name: b + np.uint16(1) for name, b in bits.items()}
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in poisoned.items()})
    payload = deltas.encode_anchor(poisoned, version, fingerprint)
    return list(
        weight_transfer.to_chunks(
            payload, deltas.PayloadInfo("anchor", version, version, fingerprint), chunk_bytes=64 * 1024
        )
    )


def push(address: str, creds: ClientCredentials | None, chunks, server_name: str = "") -> weights_pb2.PushResult:
    with channel(address, creds, server_name) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(chunks), timeout=60)


def signed_push(address: str, trainer_token: str, chunks: Iterable[weights_pb2.WeightChunk], header: weights_pb2.WeightHeader,
                tls: ClientCredentials | None = None, server_name: str = "") -> weights_pb2.PushResult:  # fmt: skip
    """What the trainer's publisher does: a nonce from the generator, signed with `header`
    under the trainer's push key, and no token (`tls`: TLS material only)."""
    with channel(address, tls, server_name) as ch:
        stub = generator_pb2_grpc.GeneratorStub(ch)
        nonce = stub.PushNonce(generator_pb2.PushNonceRequest(), timeout=30).nonce
        metadata = push_signing.PushSigner(trainer_token).metadata(nonce, header)
        return stub.PushWeights(iter(chunks), timeout=60, metadata=metadata)


def push_as_trainer(
    pair: Pair, chunks: Iterable[weights_pb2.WeightChunk], header: weights_pb2.WeightHeader
) -> weights_pb2.PushResult:
    return signed_push(pair.generator.grpc_address, pair.secrets.tokens["trainer"], chunks, header)


def test_push_nonce_proves_the_generator_and_its_address_to_anyone_and_signs_nothing_large(pair: Pair) -> None:
    table = grpc_auth.load_roles(pair.secrets.roles_file)
    assert table.generator_key is not None
    with channel(pair.generator.grpc_address) as ch:  # open: no token
        stub = generator_pb2_grpc.GeneratorStub(ch)
        answer = stub.PushNonce(generator_pb2.PushNonceRequest(challenge=b"c" * 16), timeout=30)
        assert answer.address == pair.generator.grpc_address  # what it registers
        assert push_signing.verify_proof(table.generator_key, b"c" * 16, answer.nonce, answer.address, answer.proof)
        assert not push_signing.verify_proof(table.generator_key, b"d" * 16, answer.nonce, answer.address, answer.proof)
        with pytest.raises(grpc.RpcError) as e:
            stub.PushNonce(
                generator_pb2.PushNonceRequest(challenge=b"c" * (push_signing.MAX_CHALLENGE_BYTES + 1)), timeout=30
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_poisoned_anchor_from_anyone_but_the_trainer_is_refused(pair: Pair, tiny_model_dir: Path) -> None:
    admin = pair.secrets.tokens["admin"]
    before = generator_state(pair.generator.grpc_address, sha=True, token=admin)
    anchor = poisoned_anchor(version0_bits(tiny_model_dir), version=7)
    for role in (None, "generator", "admin", "trainer"):  # a bearer token opens no push, the trainer's included
        with pytest.raises(grpc.RpcError) as e:
            push(pair.generator.grpc_address, pair.secrets.creds(role), anchor)
        assert e.value.code() == UNAUTHENTICATED
    after = generator_state(pair.generator.grpc_address, sha=True, token=admin)
    assert (after.weights_sha256, after.policy_version) == (before.weights_sha256, before.policy_version)
    assert "weights_applied" not in pair.generator.log()

    # The trainer's signature is what a push needs: this one lands (a version the trainer never
    # published), and the generator, with its own token, catches up from the trainer again.
    assert push_as_trainer(pair, anchor, anchor[0].header).applied
    want = trainer_state(pair.trainer.grpc_address, sha=True, token=admin)
    wait_for(
        lambda: (
            generator_state(pair.generator.grpc_address, sha=True, token=admin).weights_sha256 == want.weights_sha256
        ),
        60,
        "generator caught up from the trainer with its token",
        [pair.trainer, pair.generator],
    )
    assert "catch_up_failed" not in pair.generator.log()


def test_weights_are_not_fetched_without_the_right_role(pair: Pair) -> None:
    request = trainer_pb2.FetchWeightsRequest(have_version=-1)  # everything: the anchor
    for creds, code in [
        (None, UNAUTHENTICATED),
        (pair.secrets.creds("reward"), DENIED),
        (pair.secrets.creds("trainer"), DENIED),
    ]:
        with channel(pair.trainer.grpc_address, creds) as ch, pytest.raises(grpc.RpcError) as e:
            list(trainer_pb2_grpc.TrainerStub(ch).FetchWeights(request, timeout=60))
        assert e.value.code() == code


def test_checkpoints_stay_inside_the_checkpoint_folder(pair: Pair) -> None:
    outside = pair.work / "outside"
    outside.mkdir()
    (pair.checkpoint_dir / "link").symlink_to(outside, target_is_directory=True)

    def save(path: str, role: str = "admin") -> trainer_pb2.SaveCheckpointResult:
        with channel(pair.trainer.grpc_address, pair.secrets.creds(role)) as ch:
            return trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(path=path), timeout=120
            )

    for path in [
        str(outside / "ckpt"),
        "../escape",
        str(pair.checkpoint_dir / ".." / "escape"),
        "link/ckpt",
        "/tmp",
        ".",
    ]:
        with pytest.raises(grpc.RpcError) as e:
            save(path)
        assert e.value.code() == DENIED and "outside the checkpoint folder" in e.value.details(), path
    assert list(outside.iterdir()) == [] and not (pair.work / "escape").exists()
    with pytest.raises(grpc.RpcError) as e:
        save("manual", role="trainer")  # not even inside: the operator's call
    assert e.value.code() == DENIED

    result = save("manual")  # relative: inside the folder
    assert Path(result.path) == pair.checkpoint_dir.resolve() / "manual"
    assert checkpoint.load_state(Path(result.path)).version == result.version
    result = save(str(pair.checkpoint_dir / "nested" / "abs"))
    assert Path(result.path) == pair.checkpoint_dir.resolve() / "nested" / "abs"


class Counted:
    """Chunks handed to gRPC, counted as the client library takes them."""

    def __init__(self, first: weights_pb2.WeightChunk, then: int, chunk_bytes: int = 1 << 20):
        self.first, self.then, self.chunk = first, then, b"\x00" * chunk_bytes
        self.taken = 0

    def __iter__(self) -> Iterator[weights_pb2.WeightChunk]:
        self.taken += 1
        yield self.first
        for _ in range(self.then):
            self.taken += 1
            yield weights_pb2.WeightChunk(data=self.chunk)


def assert_still_serving(pair: Pair, sha: str) -> None:
    assert pair.generator.proc.poll() is None
    state = generator_state(pair.generator.grpc_address, sha=True, token=pair.secrets.tokens["admin"])
    assert state.weights_sha256 == sha


def test_a_push_sending_more_than_it_declares_is_cut_off(pair: Pair) -> None:
    sha = generator_state(pair.generator.grpc_address, sha=True, token=pair.secrets.tokens["admin"]).weights_sha256
    header = weights_pb2.WeightHeader(kind="anchor", version=9, total_bytes=1, sha256="0" * 64)
    stream = Counted(
        weights_pb2.WeightChunk(header=header, data=b"\x00" * (1 << 20)), then=360
    )  # 361 MiB behind a 1-byte header
    with pytest.raises(grpc.RpcError) as e:
        push_as_trainer(pair, stream, header)
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "sent more than the 1 bytes its header declares" in e.value.details()
    )
    assert stream.taken < 20, f"{stream.taken} MiB were taken from the stream"  # what was in flight, not 361 MiB
    assert_still_serving(pair, sha)


def test_a_header_above_max_weight_bytes_is_refused_at_the_first_chunk(pair: Pair) -> None:
    sha = generator_state(pair.generator.grpc_address, sha=True, token=pair.secrets.tokens["admin"]).weights_sha256
    header = weights_pb2.WeightHeader(kind="anchor", version=9, total_bytes=10**12, sha256="0" * 64)
    stream = Counted(weights_pb2.WeightChunk(header=header, data=b"\x00" * 1024), then=360)
    with pytest.raises(grpc.RpcError) as e:
        push_as_trainer(pair, stream, header)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_weight_bytes" in e.value.details()
    assert stream.taken < 20, stream.taken
    assert_still_serving(pair, sha)
    assert "weight_stream_refused" in pair.generator.log()


# -- TLS --------------------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["/usr/bin/openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> None:
    openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )


def make_leaf(folder: Path, ca: str, name: str) -> None:
    """A certificate for `name` signed by `ca`, naming only DNS:`name` (a role, as services
    are called by role whatever their address), usable as server and as client."""
    (folder / f"{name}.ext").write_text(
        f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=folder,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        cwd=folder,
    )


def tls_flags(folder: Path, role: str) -> list[str]:
    return [
        "--grpc-tls-cert-file",
        str(folder / f"{role}.pem"),
        "--grpc-tls-key-file",
        str(folder / f"{role}.key"),
        "--grpc-tls-ca-file",
        str(folder / "ca.pem"),
    ]


def test_mtls_refuses_clients_without_the_ca_or_a_certificate(
    redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tls = tmp_path / "tls"
    tls.mkdir()
    make_ca(tls, "ca")
    make_ca(tls, "rogue-ca")
    for role in ("trainer", "generator", "admin"):
        make_leaf(tls, "ca", role)
    make_leaf(tls, "rogue-ca", "intruder")
    pem = {name: (tls / f"{name}.pem").read_bytes() for name in ("ca", "admin", "intruder", "trainer")}
    key = {name: (tls / f"{name}.key").read_bytes() for name in ("admin", "intruder", "trainer")}
    secrets = write_secrets(tmp_path / "secrets")
    common = service_args(redis_url, run_name, tiny_model_dir)
    trainer = start_service(
        "trainer", tmp_path, *common, *TRAINER_ARGS, *secrets.flags("trainer"), *tls_flags(tls, "trainer")
    ).wait_ready()
    procs = [trainer]
    try:
        generator = start_service(
            "generator",
            tmp_path,
            *common,
            *GENERATOR_ARGS,
            "--trainer-address",
            trainer.grpc_address,
            *secrets.flags("generator"),
            *tls_flags(tls, "generator"),
        ).wait_ready()
        procs.append(generator)

        def state(creds: ClientCredentials | None, server_name: str = "trainer") -> trainer_pb2.TrainerState:
            with channel(trainer.grpc_address, creds, server_name) as ch:
                return trainer_pb2_grpc.TrainerStub(ch).GetState(
                    trainer_pb2.TrainerStateRequest(with_weights_sha256=True), timeout=10
                )

        admin = secrets.tokens["admin"]
        refused = {
            "plaintext": ClientCredentials(token=admin),
            "no CA (system roots)": ClientCredentials(
                token=admin, tls=True, cert_pem=pem["admin"], key_pem=key["admin"]
            ),
            "no client certificate": ClientCredentials(token=admin, tls=True, ca_pem=pem["ca"]),
            "certificate from another CA": ClientCredentials(
                token=admin, tls=True, ca_pem=pem["ca"], cert_pem=pem["intruder"], key_pem=key["intruder"]
            ),
        }
        for what, creds in refused.items():
            assert code_of(partial(state, creds)) == grpc.StatusCode.UNAVAILABLE, what
        mtls = {"tls": True, "ca_pem": pem["ca"], "cert_pem": pem["admin"], "key_pem": key["admin"]}
        # The server's certificate names its role, not 127.0.0.1: without the override the name check fails.
        assert (
            code_of(lambda: state(ClientCredentials(token=admin, **mtls), server_name=""))
            == grpc.StatusCode.UNAVAILABLE
        )
        # A certificate is no token: the role table still decides.
        assert code_of(lambda: state(ClientCredentials(**mtls))) == UNAUTHENTICATED
        want = state(ClientCredentials(token=admin, **mtls))
        assert want.version == 0 and want.weights_sha256

        # Service to service over mTLS: the trainer's identity pushes an anchor the trainer never
        # published; the generator catches up from the trainer with its own certificate and token.
        trainer_tls = ClientCredentials(tls=True, ca_pem=pem["ca"], cert_pem=pem["trainer"], key_pem=key["trainer"])
        anchor = poisoned_anchor(version0_bits(tiny_model_dir), version=7)
        assert signed_push(
            generator.grpc_address, secrets.tokens["trainer"], anchor, anchor[0].header, trainer_tls, "generator"
        ).applied

        def generator_sha() -> str:
            with channel(generator.grpc_address, ClientCredentials(token=admin, **mtls), "generator") as ch:
                return (
                    generator_pb2_grpc.GeneratorStub(ch)
                    .GetState(generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=10)
                    .weights_sha256
                )

        wait_for(lambda: generator_sha() == want.weights_sha256, 60, "generator caught up over mTLS", procs)
        assert "catch_up_failed" not in generator.log()
        assert "grpc_auth=on grpc_tls=mtls" in trainer.log()
    finally:
        for p in procs:
            p.stop()
