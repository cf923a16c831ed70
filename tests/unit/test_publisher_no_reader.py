"""No delta while nobody reads it (issue 44, item 2): a trainer whose push targets are none
(a colocated run: its generator registers no address) and whom nobody asked for weights
encodes no delta and files no chain, yet its versions advance; the moment a reader appears
(a registered address, or a FetchWeights over real gRPC) it writes the anchor of the current
bits, under its weights lock, and encodes deltas from there. A generator's decode of that
anchor and the deltas after it (from the weight store's files, or from FetchWeights) gives
the trainer's bits exactly, in the split master layout whose bits the step rewrites in place."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from rollstream.core import deltas, weight_transfer
from rollstream.core.config import load_settings
from rollstream.core.grpc_utils import channel
from rollstream.core.service import ServiceHost
from rollstream.generator.generator import HostWeights
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.fleet import GeneratorDirectory
from rollstream.trainer.publisher import READER_GRACE_S, Readers
from rollstream.trainer.servicer import CheckpointRequests, TrainerServicer
from rollstream.trainer.trainer import Trainer
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc, weights_pb2
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_trainer(model_dir: Path, anchor_dir: Path) -> tuple[Trainer, ServiceHost]:
    settings = load_settings(
        TrainerSettings,
        [],
        model=str(model_dir),
        lr=1e-2,
        max_new_tokens=6,
        anchor_dir=str(anchor_dir),
        anchor_interval=100,
        master_layout="split",
    )
    host = ServiceHost("trainer", settings)
    return Trainer(settings, host), host


def copied(bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: b.copy() for n, b in bits.items()}


def apply(held: HostWeights, chunks: Iterable[weights_pb2.WeightChunk]) -> list[weights_pb2.WeightHeader]:
    """Apply a chunk stream as a generator does (reassembled, size and sha256 checked, decoded
    against what it holds); the headers applied."""
    headers = []
    for header, payload in weight_transfer.from_chunks(chunks, 1 << 30):
        info, touched = held.decode(payload)
        held.commit(info, touched)
        headers.append(header)
    return headers


def counted(host: ServiceHost, name: str) -> float | None:
    return host.registry.get_sample_value(f"rollstream_trainer_{name}_total")


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_what_counts_as_a_reader() -> None:
    now = [100.0]
    readers = Readers(clock=lambda: now[0])
    assert readers.reader() == "no look at the push targets yet"  # a trainer outside a loop encodes
    readers.saw([], from_registry=True)
    assert readers.reader() == ""  # only colocated generators (no address) registered
    readers.saw(["10.0.0.5:50051"], from_registry=True)
    assert "10.0.0.5:50051" in readers.reader()
    readers.saw([], from_registry=False)  # configured addresses or a DNS name: always, even resolving to none now
    assert readers.reader().startswith("configured")
    readers.saw([], from_registry=True)
    readers.fetched()
    now[0] += READER_GRACE_S - 1
    assert "FetchWeights" in readers.reader()
    now[0] += 2
    assert readers.reader() == ""


def test_skipped_then_a_registered_reader_then_deltas_from_the_new_anchor(tiny_model_dir: Path, tmp_path: Path) -> None:
    anchor_dir = tmp_path / "anchor"
    trainer, host = make_trainer(tiny_model_dir, anchor_dir)
    try:
        pub = trainer.publisher
        assert (anchor_dir / weight_transfer.MANIFEST).exists()  # version 0's anchor, as before
        pub.readers.saw([], from_registry=True)
        for step in (1, 2):
            before = copied(pub.bits())
            _, published, stats = trainer.train_step(scored_groups(step, 2))
            assert (
                published is None
                and stats.nbytes == 0
                and stats.dense_bytes > 0
                and trainer.last_skipped == "no reader"
            )
            trainer.optimizer.wait()  # with no delta the update goes on after the step (the overlapped step): its bits once it ends
            assert not same(before, pub.bits()), "the weights never moved: the test would prove nothing"
        assert trainer.version == 2 and not pub.has_chain
        # No chain, no files: a reader of the store finds "no chain yet", never an old version as the newest.
        assert sorted(p.name for p in anchor_dir.iterdir()) == []
        with pytest.raises(weight_transfer.StoreUnreadable, match="no chain yet"):
            weight_transfer.read_manifest(anchor_dir)
        with pytest.raises(deltas.DeltaError, match="no chain"):
            pub.catch_up_payloads(-1, "")
        assert counted(host, "deltas_skipped") == 2 and counted(host, "reanchors") == 0
        at_2 = copied(pub.bits())

        # A generator registers with an address: the next step anchors version 2 first (from
        # the bits before the step rewrites them in place), then encodes 2 -> 3.
        pub.readers.saw(["127.0.0.1:9"], from_registry=True)
        for step in (3, 4, 5):
            _, published, stats = trainer.train_step(scored_groups(step, 2))
            assert (
                published is not None
                and published.info.kind == "delta"
                and stats.nbytes > 0
                and trainer.last_skipped == ""
            )
            assert trainer.last_reanchor == (
                "registered generators: 127.0.0.1:9" if step == 3 else ""
            )  # the step log's `reanchored`
        assert counted(host, "reanchors") == 1

        # A generator holding nothing reads the store: anchor 2, deltas 3..5.
        anchor, chain = weight_transfer.read_manifest(anchor_dir)
        assert [(p.info.kind, p.info.version) for p in [anchor, *chain]] == [
            ("anchor", 2),
            ("delta", 3),
            ("delta", 4),
            ("delta", 5),
        ]
        held = HostWeights({n: np.zeros_like(b) for n, b in at_2.items()}, None)
        apply(held, weight_transfer.store_chunks(anchor_dir, [anchor]))
        assert held.version == 2 and same(held.bits, at_2)
        apply(held, weight_transfer.store_chunks(anchor_dir, chain))
        assert held.version == 5 == trainer.version
        assert same(held.bits, pub.bits())
        assert deltas.weights_sha256(held.bits) == deltas.weights_sha256(pub.bits())

        # Nobody again: the chain goes at the next step (chain.json first), and the version goes on.
        pub.readers.saw([], from_registry=True)
        _, published, _ = trainer.train_step(scored_groups(6, 2))
        assert published is None and trainer.version == 6 and not (anchor_dir / weight_transfer.MANIFEST).exists()
        assert not list(anchor_dir.glob("*.safetensors"))
    finally:
        trainer.close()
        host.close()


def fetch(address: str, have: int) -> Iterator[weights_pb2.WeightChunk]:
    with channel(address) as ch:
        yield from trainer_pb2_grpc.TrainerStub(ch).FetchWeights(
            trainer_pb2.FetchWeightsRequest(have_version=have), timeout=120
        )


def test_fetch_weights_after_skipped_deltas_gets_the_current_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    """FetchWeights over real gRPC (the trainer's own servicer) after skipped deltas: the anchor
    of the current version, written for it; then deltas again, and a second fetch gets them."""
    trainer, host = make_trainer(tiny_model_dir, tmp_path / "anchor")
    socket_dir = Path(tempfile.mkdtemp(prefix="rs-nd-", dir="/tmp"))  # a unix socket's path is short
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trainer_pb2_grpc.add_TrainerServicer_to_server(
        TrainerServicer(trainer, GeneratorDirectory([]), CheckpointRequests()), server
    )
    address = f"unix:{socket_dir}/trainer.sock"
    assert server.add_insecure_port(address)
    server.start()
    try:
        pub = trainer.publisher
        at_0 = copied(pub.bits())
        pub.readers.saw([], from_registry=True)
        for step in (1, 2, 3):
            assert trainer.train_step(scored_groups(step, 2))[1] is None
        pub.pushes.reached(trainer.version)  # as the loop does after a skipped step
        # A generator that held version 0, before the deltas were skipped: it gets the anchor of 3.
        held = HostWeights(at_0, 0)
        headers = apply(held, fetch(address, 0))
        assert [(h.kind, h.version) for h in headers] == [("anchor", 3)]
        state = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(address)).GetState(
            trainer_pb2.TrainerStateRequest(with_weights_sha256=True), timeout=60
        )
        assert held.version == state.version == 3 and deltas.weights_sha256(held.bits) == state.weights_sha256
        assert counted(host, "reanchors") == 1 and "FetchWeights" in pub.readers.reader()

        # The fetcher is a reader for READER_GRACE_S: the next steps encode deltas, and it fetches them.
        for step in (4, 5):
            _, published, _ = trainer.train_step(scored_groups(step, 2))
            assert published is not None
        pub.pushes.reached(trainer.version)
        headers = apply(held, fetch(address, held.version))
        assert [(h.kind, h.version) for h in headers] == [("delta", 4), ("delta", 5)]
        assert same(held.bits, pub.bits()) and counted(host, "reanchors") == 1
    finally:
        server.stop(grace=None)
        trainer.close()
        host.close()
