"""The trainer's WeightPublisher pushing to several real generator processes: every one
applies each version exactly, reports where its time went (PushResult's stages), and the
publisher keeps one channel per generator it still pushes to."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from helpers import wait_for
from procs import ServiceProc, start_service
from rollstream.core import deltas, modeling
from rollstream.core.grpc_utils import channel
from rollstream.trainer.publisher import WeightPublisher
from rollstream.v1 import generator_pb2, generator_pb2_grpc


def started_generators(
    n: int, redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path, *flags: str
) -> Iterator[list[ServiceProc]]:
    """n generator processes on the tiny model, ready; stopped on the way out."""
    procs = [
        start_service(
            "generator",
            tmp_path / f"g{i}",
            "--redis-url",
            redis_url,
            "--run",
            run_name,
            "--model",
            str(tiny_model_dir),
            "--threads",
            "1",
            "--generator-id",
            f"g{i}",
            *flags,
        )
        for i in range(n)
    ]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def generators(redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[ServiceProc]]:
    yield from started_generators(3, redis_url, run_name, tiny_model_dir, tmp_path)


def perturbed(bits: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: b + (rng.random(b.shape) < 0.05).astype(np.uint16) for name, b in bits.items()}


def served_sha(gen: ServiceProc) -> tuple[int, str]:
    with channel(gen.grpc_address) as ch:
        s = generator_pb2_grpc.GeneratorStub(ch).GetState(
            generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=30
        )
    return s.policy_version, s.weights_sha256


def test_one_encode_pushed_to_every_generator(generators: list[ServiceProc], tiny_model_dir: Path) -> None:
    model, _ = modeling.load_model(tiny_model_dir)
    bits = modeling.model_bits(model)
    publisher = WeightPublisher(bits, anchor_interval=100)
    addresses = [g.grpc_address for g in generators]
    try:
        for version in (1, 2):
            bits = perturbed(bits, seed=version)
            published, _ = publisher.publish(bits)
            outcomes = publisher.fleet.push(addresses, published, timeout_s=120)
            assert [o.address for o in outcomes] == addresses
            for o in outcomes:
                assert o.applied and o.version == version, o.error
                # The generator's own account of the push: every stage ran, inside the round trip.
                assert o.receive_s > 0 and o.decode_s > 0 and o.load_s > 0 and o.lock_wait_s >= 0
                assert o.receive_s + o.lock_wait_s + o.decode_s + o.load_s <= o.seconds
            for g in generators:
                assert served_sha(g) == (version, deltas.weights_sha256(bits))
        # One channel per generator, kept between pushes; a generator no longer pushed to
        # loses its channel.
        assert sorted(publisher.fleet._channels) == sorted(addresses)
        bits = perturbed(bits, seed=3)
        published, _ = publisher.publish(bits)
        outcomes = publisher.fleet.push(addresses[:2], published, timeout_s=120)
        assert all(o.applied for o in outcomes)
        assert sorted(publisher.fleet._channels) == sorted(addresses[:2])
        # The third generator missed version 3: it refuses version 4's delta (and would catch up).
        bits = perturbed(bits, seed=4)
        published, _ = publisher.publish(bits)
        late = publisher.fleet.push(addresses[2:], published, timeout_s=120)[0]
        assert not late.applied and "base is version 3" in late.error
    finally:
        publisher.close()


def test_a_generator_the_pushes_miss_catches_up_from_the_weight_store(
    redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two real generators share the trainer's anchor_dir as their weight_store and have no
    trainer address at all: one is pushed every version, the other none, and it still
    serves every version exactly, across an anchor, read from the files; a delta file
    corrupted on the volume is refused (sha256) and the generator serves on, then catches up
    once the chain is whole again."""
    store = tmp_path / "store"
    model, _ = modeling.load_model(tiny_model_dir)
    bits = modeling.model_bits(model)
    publisher = WeightPublisher(bits, anchor_interval=3, anchor_dir=store)
    started = started_generators(
        2, redis_url, run_name, tiny_model_dir, tmp_path, "--weight-store", str(store), "--sync-interval-s", "0.5"
    )
    pushed, missed = next(started)
    try:
        for version in (1, 2, 3, 4):  # 3 is an anchor: 4's delta is over it
            bits = perturbed(bits, seed=version)
            published, _ = publisher.publish(bits)
            [outcome] = publisher.fleet.push([pushed.grpc_address], published, timeout_s=120)
            assert outcome.applied and outcome.version == version, outcome.error
            expected = (version, deltas.weights_sha256(bits))
            wait_for(
                lambda: served_sha(missed) == expected,
                120,
                f"the missed generator serving version {version} from the store",
                [missed],
            )
            assert served_sha(pushed) == expected
        assert "source=store" in missed.log()
        # Version 5's file corrupted on the volume (the generator stopped meanwhile, so that it
        # cannot read the good file first): refused, the generator serves 4 on.
        missed.proc.send_signal(signal.SIGSTOP)
        try:
            bits = perturbed(bits, seed=5)
            publisher.publish(bits)
            delta_file = store / "delta-00000005.safetensors"
            good = delta_file.read_bytes()
            delta_file.write_bytes(good[:100] + bytes(len(good) - 100))
        finally:
            missed.proc.send_signal(signal.SIGCONT)
        wait_for(
            lambda: "store_catch_up_failed" in missed.log() and "corrupted" in missed.log(),
            120,
            "the corrupted delta refused",
            [missed],
        )
        assert served_sha(missed)[0] == 4
        delta_file.write_bytes(good)
        wait_for(
            lambda: served_sha(missed) == (5, deltas.weights_sha256(bits)),
            120,
            "version 5 once the file is whole",
            [missed],
        )
    finally:
        publisher.close()
        started.close()
