"""The relay tree a push goes down (issue 30; docs/deploy.md, "Scaling out").

With `push_fanout = k` the trainer sends a payload to at most k generators; each forwards it
to at most k others as the chunks arrive (rollstream.generator.relay), so the trainer's
egress is k payloads whatever the number N of generators, and the last one is reached after
ceil(log_k N) hops of a chunk each. The tree is complete and breadth first: with the
generators in order g_0 .. g_{N-1}, the trainer pushes to g_0 .. g_{k-1}, and g_i forwards
to g_{k(i+1)} .. g_{k(i+1)+k-1}.

Every generator in the tree gets its own signature from the trainer, over a nonce it issued
(core/push_signing.py), carried to it in its parent's first chunk (`RelayTarget`): a relay
passes the trainer's word on, it cannot make its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollstream.v1 import weights_pb2


@dataclass
class Node:
    address: str
    children: list["Node"] = field(default_factory=list)

    def addresses(self) -> list[str]:
        """This node's address and every one below it."""
        return [self.address, *(a for c in self.children for a in c.addresses())]


def tree(addresses: Sequence[str], fanout: int) -> list[Node]:
    """The roots the trainer pushes to; every node has at most `fanout` children."""
    if fanout < 1:
        raise ValueError(f"fanout must be at least 1, not {fanout}")
    nodes = [Node(a) for a in addresses]
    for i, node in enumerate(nodes):
        node.children = nodes[fanout * (i + 1) : fanout * (i + 2)]
    return nodes[:fanout]


def targets(nodes: Sequence[Node], signatures: Mapping[str, str]) -> list[weights_pb2.RelayTarget]:
    """`nodes` as the `forward` of a first chunk, each with its signature and subtree."""
    return [weights_pb2.RelayTarget(address=n.address, signature=signatures.get(n.address, ""), forward=targets(n.children, signatures)) for n in nodes]
