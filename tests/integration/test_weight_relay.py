"""Pushes down the relay tree (trainer/fleet.py, generator/relay.py): the trainer sends each
payload to `fanout` generators, they forward it on, every generator serves the version
exactly, and a relay that is gone orphans its subtree only until the trainer's next round."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_weight_fanout import perturbed, served_sha, started_generators

from procs import ServiceProc
from rollstream.core import deltas, modeling
from rollstream.core.grpc_utils import channel
from rollstream.trainer.publisher import WeightPublisher
from rollstream.v1 import generator_pb2, generator_pb2_grpc


@pytest.fixture
def generators(redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[ServiceProc]]:
    yield from started_generators(5, redis_url, run_name, tiny_model_dir, tmp_path)


def test_a_push_goes_down_the_tree_and_around_a_dead_relay(generators: list[ServiceProc], tiny_model_dir: Path) -> None:
    model, _ = modeling.load_model(tiny_model_dir)
    bits = modeling.model_bits(model)
    publisher = WeightPublisher(bits, anchor_interval=100)
    addresses = [g.grpc_address for g in generators]
    try:
        bits = perturbed(bits, seed=1)
        published, _ = publisher.publish(bits)
        outcomes = publisher.fleet.push(addresses, published, timeout_s=120, fanout=2)
        assert [o.address for o in outcomes] == addresses
        assert all(o.applied and o.version == 1 for o in outcomes), [o.error for o in outcomes]
        # The tree, breadth first: the trainer sends to g0 and g1 only; g0 forwards to g2 and g3, g1 to g4.
        assert [o.via for o in outcomes] == ["", "", addresses[0], addresses[0], addresses[1]]
        for g in generators:
            assert served_sha(g) == (1, deltas.weights_sha256(bits))

        generators[1].stop()  # a relay gone: g4 below it is orphaned, then reached in a round of its own
        bits = perturbed(bits, seed=2)
        published, _ = publisher.publish(bits)
        outcomes = {o.address: o for o in publisher.fleet.push(addresses, published, timeout_s=120, fanout=2)}
        assert not outcomes[addresses[1]].applied
        for i in (0, 2, 3, 4):
            assert outcomes[addresses[i]].applied and outcomes[addresses[i]].version == 2, outcomes[addresses[i]].error
            assert served_sha(generators[i]) == (2, deltas.weights_sha256(bits))
        from_trainer = [a for a, o in outcomes.items() if o.via == "" and a != addresses[1]]
        assert len(from_trainer) + 1 <= 4  # payloads the trainer sent: g0, the dead g1, then g4's round
    finally:
        publisher.close()


def test_signed_pushes_down_the_tree_each_generator_checking_its_own_signature(
    redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With credentials: each generator accepts only the trainer's signature over a nonce it
    issued (core/push_signing.py), so the relays carry the signatures the trainer made for
    each generator below them, and every generator of a chain applies the push."""
    from test_grpc_auth_services import write_secrets

    from rollstream.core.grpc_auth import ClientCredentials, load_roles

    secrets = write_secrets(tmp_path / "secrets")
    running = started_generators(4, redis_url, run_name, tiny_model_dir, tmp_path, *secrets.flags("generator"))
    model, _ = modeling.load_model(tiny_model_dir)
    bits = modeling.model_bits(model)
    publisher = WeightPublisher(
        bits,
        anchor_interval=100,
        creds=ClientCredentials(token=secrets.tokens["trainer"]),
        generator_key=load_roles(secrets.roles_file).generator_key,
    )
    try:
        generators = next(running)
        addresses = [g.grpc_address for g in generators]
        bits = perturbed(bits, seed=1)
        published, _ = publisher.publish(bits)
        outcomes = publisher.fleet.push(addresses, published, timeout_s=120, fanout=1)  # a chain: g0 -> g1 -> g2 -> g3
        assert [o.via for o in outcomes] == ["", *addresses[:3]]
        assert all(o.applied and o.version == 1 for o in outcomes), [o.error for o in outcomes]
        creds = ClientCredentials(token=secrets.tokens["admin"])
        for g in generators:
            with channel(g.grpc_address, creds) as ch:
                state = generator_pb2_grpc.GeneratorStub(ch).GetState(
                    generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=30
                )
            assert (state.policy_version, state.weights_sha256) == (1, deltas.weights_sha256(bits))
    finally:
        publisher.close()
        running.close()  # stops the generators
