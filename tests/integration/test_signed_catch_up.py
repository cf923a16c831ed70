"""Catch-up is signed and supervised (issue 42), with real generator processes that know the
trainer's key (roles.json's trainer_push_key):

- whatever answers at the trainer's address (here a gRPC server in this process, without the
  trainer's token) cannot make a generator apply anything: an unsigned GetState, an all-zero
  anchor unsigned, signed by another key, or under a real signed header with other bytes are
  refused and the weights stay bit for bit; a replayed older chain of the trainer's own does
  not take the generator back, while the trainer's signed word that it resumed from an older
  version does;
- the weight store the same: a chain.json entry stripped of its signature or a payload
  swapped under its signed header are refused, and an older signed chain put back does not
  take the generator back;
- a store file that cannot be read (replaced by a directory: pread fails with EISDIR, the
  same OSError path as EIO or NFS's ESTALE) no longer ends the sync thread: it keeps trying,
  readiness is red while the generator is behind, and it catches up once the file is back.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from test_grpc_auth_services import Secrets, write_secrets
from test_weight_fanout import perturbed

from helpers import wait_for
from procs import ServiceProc, generator_state, start_service
from rollstream.core import deltas, modeling, push_signing, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.trainer.publisher import WeightPublisher
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc, weights_pb2

Chunks = list[weights_pb2.WeightChunk]


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    """Answers at the trainer's address: GetState with `version`, signed by `state_signer`
    when there is one (a squatter relaying the real trainer's answer to our challenge), and
    FetchWeights with whatever `fetch` gives for the request."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.version = 0
        self.state_signer: push_signing.TrainerSigner | None = None
        self.fetch: Callable[[trainer_pb2.FetchWeightsRequest], Chunks] = lambda _request: []

    def GetState(
        self, request: trainer_pb2.TrainerStateRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerState:
        signer = self.state_signer
        signature = signer.state(request.challenge, self.version, self.fingerprint) if signer is not None else b""
        return trainer_pb2.TrainerState(version=self.version, model_fingerprint=self.fingerprint, signature=signature)

    def FetchWeights(
        self, request: trainer_pb2.FetchWeightsRequest, context: grpc.ServicerContext
    ) -> Iterator[weights_pb2.WeightChunk]:
        yield from self.fetch(request)


@dataclass
class Setup:
    secrets: Secrets
    run: str
    bits: dict[str, np.ndarray]
    fingerprint: str
    work: Path

    def trainer_creds(self) -> ClientCredentials:
        return ClientCredentials(token=self.secrets.tokens["trainer"])

    def held(self, gen: ServiceProc) -> tuple[int, str]:
        s = generator_state(gen.grpc_address, sha=True, token=self.secrets.tokens["admin"])
        return s.policy_version, s.weights_sha256


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    work = tmp_path_factory.mktemp("signed")
    model, _ = modeling.load_model(tiny_model_dir)
    bits = modeling.model_bits(model)
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits.items()})
    return Setup(write_secrets(work / "secrets"), "t" + uuid.uuid4().hex[:10], bits, fingerprint, work)


def start_generator(setup: Setup, redis: EmbeddedRedis, model: Path, name: str, *flags: str) -> ServiceProc:
    return start_service(
        "generator",
        setup.work / name,
        "--redis-url",
        redis.url,
        "--run",
        setup.run,
        "--model",
        str(model),
        "--threads",
        "1",
        "--block-ms",
        "100",
        "--sync-interval-s",
        "0.5",
        "--max-inflight-groups",
        "1",
        *setup.secrets.flags("generator"),
        *flags,
    ).wait_ready()


def anchor_chunks(
    bits: dict[str, np.ndarray], version: int, fingerprint: str, sign: push_signing.TrainerSigner | None = None
) -> Chunks:
    """An anchor as FetchWeights streams it, signed by `sign` (None: unsigned)."""
    payload = deltas.encode_anchor(bits, version, fingerprint)
    chunks = list(
        weight_transfer.to_chunks(
            payload, deltas.PayloadInfo("anchor", version, version, fingerprint), chunk_bytes=64 * 1024
        )
    )
    chunks[0].signature = sign.payload(chunks[0].header) if sign is not None else b""
    return chunks


def count(gen: ServiceProc, text: str) -> int:
    return gen.log().count(text)


def test_only_the_trainers_signed_weights_are_fetched_and_never_backwards(
    setup: Setup, redis_server: EmbeddedRedis, tiny_model_dir: Path
) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="rs-fake-", dir="/tmp"))  # a unix socket's path is short
    fake = FakeTrainer(setup.fingerprint)
    fake.state_signer = push_signing.TrainerSigner(setup.secrets.tokens["trainer"], setup.run)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trainer_pb2_grpc.add_TrainerServicer_to_server(fake, server)
    address = f"unix:{socket_dir}/trainer.sock"
    assert server.add_insecure_port(address)
    server.start()
    publisher = WeightPublisher(setup.bits, anchor_interval=100, creds=setup.trainer_creds(), run=setup.run)
    anchor = publisher.catch_up_payloads(-1, "")[0]
    gen = None
    try:
        gen = start_generator(setup, redis_server, tiny_model_dir, "fetching", "--trainer-address", address)
        start = setup.held(gen)
        assert start[0] == 0
        zeros = {name: np.zeros_like(b) for name, b in setup.bits.items()}

        def refused(what: str, reason: str, chunks: Chunks, signed_state: bool = True) -> None:
            before = count(gen, reason)
            fake.state_signer = (
                push_signing.TrainerSigner(setup.secrets.tokens["trainer"], setup.run) if signed_state else None
            )
            fake.version, fake.fetch = 7, lambda _request: chunks
            wait_for(lambda: count(gen, reason) > before, 120, f"{what} refused ({reason})", [gen])
            assert setup.held(gen) == start, what
            assert "weights_applied" not in gen.log(), what

        # A squatter's own answers: no signature at all on the version claim.
        refused(
            "an unsigned GetState",
            "trainer_state_refused",
            anchor_chunks(zeros, 7, setup.fingerprint),
            signed_state=False,
        )
        # The real trainer's signed GetState relayed, and an all-zero anchor: unsigned, signed
        # by another key (the generator's token's), or the real signed header over zero bytes.
        refused("an unsigned all-zero anchor", "reason=unsigned", anchor_chunks(zeros, 7, setup.fingerprint))
        other = push_signing.TrainerSigner(setup.secrets.tokens["generator"], setup.run)
        refused(
            "an anchor signed by another key",
            "its signature is not the trainer's",
            anchor_chunks(zeros, 7, setup.fingerprint, other),
        )
        [first, *_] = publisher.catch_up_chunks([anchor])  # the trainer's signed anchor
        swapped = weights_pb2.WeightChunk(
            header=first.header, signature=first.signature, data=bytes(first.header.total_bytes)
        )
        refused("zero bytes under the trainer's signed header", "corrupted", [swapped])

        # The trainer's own chain, signed as its FetchWeights signs it: versions 1..5, fetched
        # and applied exactly.
        history = [setup.bits]
        chain = []
        for version in range(1, 6):
            history.append(perturbed(history[-1], seed=version))
            chain.append(publisher.publish(history[-1])[0])
        old_chain = list(publisher.catch_up_chunks([anchor, *chain[:2]]))  # anchor 0, deltas 1-2

        def fetch(request: trainer_pb2.FetchWeightsRequest) -> Chunks:
            return list(
                publisher.catch_up_chunks(
                    weight_transfer.catch_up_chain(request.have_version, anchor, chain, lambda p: p.info)
                )
            )

        fake.fetch = fetch
        fake.version = 5
        want = (5, deltas.weights_sha256(history[5]))
        wait_for(lambda: setup.held(gen) == want, 120, "the trainer's signed chain to version 5 applied", [gen])

        # Replayed: the trainer's older chain, signed, while the trainer says 6: not applied.
        before = count(gen, "would take this generator back")
        fake.fetch = lambda _request: old_chain
        fake.version = 6
        wait_for(
            lambda: count(gen, "would take this generator back") > before, 120, "a replayed older chain refused", [gen]
        )
        assert setup.held(gen) == want
        # The trainer's own signed word that it is at 2 (resumed from an older checkpoint): the
        # same chain is what it sends then, and is applied.
        fake.version = 2
        wait_for(
            lambda: setup.held(gen) == (2, deltas.weights_sha256(history[2])),
            120,
            "the signed rollback to version 2",
            [gen],
        )
    finally:
        if gen is not None:
            gen.stop()
        server.stop(grace=None)
        publisher.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def readiness(gen: ServiceProc) -> tuple[int, str]:
    r = httpx.get(f"http://127.0.0.1:{gen.http_port}/readyz", timeout=10)
    return r.status_code, r.text


@contextlib.contextmanager
def stopped(gen: ServiceProc) -> Iterator[None]:
    """The generator stopped (SIGSTOP) while the store is changed under it, so that it cannot
    read the good files first."""
    gen.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        gen.proc.send_signal(signal.SIGCONT)


def test_the_store_is_signed_and_an_unreadable_file_does_not_end_catch_up(
    setup: Setup, redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    publisher = WeightPublisher(
        setup.bits, anchor_interval=100, anchor_dir=store, creds=setup.trainer_creds(), run=setup.run
    )
    gen = None
    try:
        # Store only (no trainer address), and ready only while at the store's version.
        gen = start_generator(
            setup, redis_server, tiny_model_dir, "store", "--weight-store", str(store), "--max-staleness", "0"
        )
        history = [setup.bits]

        def publish() -> int:
            history.append(perturbed(history[-1], seed=len(history)))
            publisher.publish(history[-1])
            return len(history) - 1

        def serves(version: int) -> bool:
            return setup.held(gen) == (version, deltas.weights_sha256(history[version]))

        for _ in range(2):
            publish()
        wait_for(lambda: serves(2), 120, "version 2 from the signed store", [gen])
        snapshot = tmp_path / "v2"
        shutil.copytree(store, snapshot)  # the trainer's own signed chain at version 2

        # Version 3's entry stripped of its signature, then its file swapped for version 2's
        # delta (a real payload, its header rewritten to match, the signature kept): refused.
        manifest = store / weight_transfer.MANIFEST
        with stopped(gen):
            publish()
            signed = manifest.read_text()
            anchor, chain = weight_transfer.read_manifest(store)
            stripped = [*chain[:-1], weight_transfer.StoredPayload(chain[-1].file, chain[-1].header)]
            weight_transfer.write_manifest(store, anchor, stripped)
        wait_for(lambda: "reason=unsigned" in gen.log(), 120, "an unsigned store entry refused", [gen])
        assert readiness(gen)[0] == 200  # an unsigned chain claims no version: not behind anything
        assert serves(2)
        delta3 = store / chain[-1].file
        good3 = delta3.read_bytes()
        with stopped(gen):
            old = (snapshot / chain[-2].file).read_bytes()  # version 2's delta: not version 3's
            delta3.write_bytes(old)
            h = weights_pb2.WeightHeader()
            h.CopyFrom(chain[-1].header)
            h.total_bytes, h.sha256 = len(old), weight_transfer.make_header(old, chain[-1].info).sha256
            weight_transfer.write_manifest(
                store, anchor, [*chain[:-1], weight_transfer.StoredPayload(chain[-1].file, h, chain[-1].signature)]
            )
        wait_for(
            lambda: "its signature is not the trainer's" in gen.log(), 120, "a swapped store payload refused", [gen]
        )
        assert serves(2)
        delta3.write_bytes(good3)
        manifest.write_text(signed)
        wait_for(lambda: serves(3), 120, "version 3 once the signed chain is back", [gen])

        # Version 4's file unreadable: a directory where it was (pread: EISDIR).
        with stopped(gen):
            publish()
            delta4 = store / weight_transfer.read_manifest(store)[1][-1].file
            kept = tmp_path / "delta4"
            delta4.rename(kept)
            delta4.mkdir()
        # Each attempt logs it twice (store_catch_up_failed, catch_up_failed): two attempts.
        wait_for(lambda: count(gen, "read failed") >= 4, 120, "two failed reads: the sync thread lives on", [gen])
        status, text = readiness(gen)
        assert status == 503 and "behind the trainer" in text and "read failed" in text, text
        assert serves(3)
        delta4.rmdir()
        kept.rename(delta4)
        wait_for(lambda: serves(4), 120, "version 4 once the file is back", [gen])
        wait_for(lambda: readiness(gen)[0] == 200, 120, "ready again once caught up", [gen])

        # The trainer's older signed chain put back whole: it does not take the generator back.
        before = count(gen, "would take this generator back")
        with stopped(gen):
            manifest.unlink()
            for f in snapshot.iterdir():
                shutil.copy(f, store / f.name)
        wait_for(
            lambda: count(gen, "would take this generator back") > before,
            120,
            "a replayed older store chain refused",
            [gen],
        )
        assert serves(4)
    finally:
        if gen is not None:
            gen.stop()
        publisher.close()
