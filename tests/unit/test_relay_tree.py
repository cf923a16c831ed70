"""The relay tree (trainer/fleet.py): complete, breadth first, every generator once, at most
`fanout` children each, depth ceil(log_fanout N)."""

from __future__ import annotations

import pytest

from rollstream.trainer import fleet


def depth(nodes: list[fleet.Node]) -> int:
    return 1 + max((depth(n.children) for n in nodes), default=0) if nodes else 0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 32, 64])
@pytest.mark.parametrize("fanout", [1, 2, 3, 4])
def test_every_generator_once_and_no_more_than_fanout_children(n: int, fanout: int) -> None:
    addresses = [f"g{i}:1" for i in range(n)]
    roots = fleet.tree(addresses, fanout)
    assert len(roots) == min(n, fanout)
    reached = [a for r in roots for a in r.addresses()]
    assert sorted(reached) == sorted(addresses)

    def widths(nodes: list[fleet.Node]) -> list[int]:
        return [len(x.children) for x in nodes] + [w for x in nodes for w in widths(x.children)]

    assert max(widths(roots)) <= fanout
    # Complete: levels 1..d (the trainer is level 0) hold fanout + fanout^2 + ... + fanout^d,
    # and d is the least that holds N.
    levels, room = 0, 0
    while room < n:
        levels += 1
        room += fanout**levels
    assert depth(roots) == levels


def test_targets_carry_each_generator_s_own_signature() -> None:
    roots = fleet.tree(["a", "b", "c", "d"], 2)
    (a, b) = fleet.targets(roots, {"a": "sa", "b": "sb", "c": "sc"})
    assert (a.address, a.signature, [t.address for t in a.forward]) == ("a", "sa", ["c", "d"])
    assert [(t.address, t.signature) for t in a.forward] == [("c", "sc"), ("d", "")]
    assert b.forward == []


def test_a_fanout_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fanout"):
        fleet.tree(["a"], 0)


def test_a_push_naming_more_targets_than_any_fanout_is_refused_before_forwarding() -> None:
    """A generator starts a thread per target: a first chunk naming more than the trainer's
    largest fanout is refused as a malformed stream, and nothing is forwarded."""
    from rollstream.core.grpc_auth import ClientCredentials
    from rollstream.core.weight_transfer import TransferRefused
    from rollstream.generator.relay import MAX_TARGETS, PeerChannels, RelayedStream
    from rollstream.v1 import weights_pb2

    first = weights_pb2.WeightChunk(
        forward=[weights_pb2.RelayTarget(address=f"127.0.0.1:{i + 1}") for i in range(MAX_TARGETS + 1)]
    )
    stream = RelayedStream(iter([first]), "127.0.0.1:9", PeerChannels(ClientCredentials()))
    with pytest.raises(TransferRefused, match=f"{MAX_TARGETS + 1} targets"):
        list(stream)
    assert stream.finish(read_rest=False) == []
