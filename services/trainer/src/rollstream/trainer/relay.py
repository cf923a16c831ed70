"""The relay tree a push goes down (issue 30; docs/deploy.md, "Scaling out").

With `push_fanout = k` the trainer sends a payload to at most k generators; each forwards it
to at most k others as the chunks arrive (rollstream.generator.relay), so the trainer's
egress is k payloads whatever the number N of generators, and the last one is reached after
ceil(log_k N) hops of a chunk each. The tree is complete and breadth first: with the
generators in order g_0 .. g_{N-1}, the trainer pushes to g_0 .. g_{k-1}, and g_i forwards
to g_{k(i+1)} .. g_{k(i+1)+k-1}.

Every generator in the tree gets its own signature from the trainer, over a nonce it issued
(core/push_signing.py), carried to it in its parent's first chunk (`RelayTarget`): a relay
passes the trainer's word on, it cannot make its own. A relay that fails orphans its subtree,
which goes down a tree of its own with fresh nonces (RELAY_ROUNDS). A direct push (`direct`,
`push_one`) is the same leg to a tree of one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from rollstream.core import push_signing
from rollstream.trainer.push import (
    STALL_S,
    AddressBackoff,
    Metadata,
    PushCall,
    PushGate,
    PushOutcome,
    PushParts,
    Unanswered,
    Watch,
    sign_one,
)
from rollstream.v1 import weights_pb2

RELAY_ROUNDS = 3  # a tree, then one for its orphans, then one for theirs


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
    return [
        weights_pb2.RelayTarget(
            address=n.address, signature=signatures.get(n.address, ""), forward=targets(n.children, signatures)
        )
        for n in nodes
    ]


def height(node: Node) -> int:
    """The levels of `node`'s subtree (1: no children)."""
    return 1 + max((height(c) for c in node.children), default=0)


def push_down(
    pool: ThreadPoolExecutor, addresses: Sequence[str], parts: PushParts, timeout_s: float, fanout: int
) -> list[PushOutcome]:
    """The "relay" way: each round asks every generator's nonce at once, each within the nonce
    deadline, and pushes each root of the tree as soon as its own subtree has answered
    (push_subtree), so no subtree waits for another's stranger; orphans (a relay above them
    failed) go down a tree of their own in the next round."""
    outcomes: dict[str, PushOutcome] = {}
    pending = list(addresses)
    for _ in range(RELAY_ROUNDS):
        start = time.perf_counter()
        signing = {
            a: pool.submit(sign_one, parts.calls[a], a, parts.header, parts.gate, parts.nonce_timeout_s)
            for a in pending
        }
        futures = [
            pool.submit(push_subtree, root, fanout, signing, parts, start + timeout_s) for root in tree(pending, fanout)
        ]
        for o in (o for f in futures for o in f.result()):
            outcomes[o.address] = o
        pending = [a for a in pending if outcomes[a].orphaned]
        if not pending:
            break
    return list(outcomes.values())


def push_subtree(
    root: Node, fanout: int, signing: Mapping[str, Future[tuple[Metadata, str]]], parts: PushParts, deadline: float
) -> list[PushOutcome]:
    """`root`'s subtree once each of its nonces has come or timed out: those that answered, as
    a tree of their own (the first in tree order at its top), get the payload; those that did
    not are left out of this push, each an unreachable outcome."""
    start = time.perf_counter()
    signed = {a: signing[a].result() for a in root.addresses()}
    left_out = [
        PushOutcome(a, False, -1, why, time.perf_counter() - start, unreachable=True)
        for a, (_, why) in signed.items()
        if why
    ]
    metadata = {a: md for a, (md, why) in signed.items() if not why}
    if not metadata:
        return left_out
    answered = list(metadata)
    top = Node(answered[0], tree(answered[1:], fanout) if len(answered) > 1 else [])
    return [*left_out, *push_forwarding(top, metadata, parts, deadline - time.perf_counter())]


def push_forwarding(
    root: Node, metadata: Mapping[str, Metadata], parts: PushParts, timeout_s: float
) -> list[PushOutcome]:
    """The payload to `root`, its first chunk naming root's subtree (the relay tree below it)
    with each generator's signature in it; the outcomes of root and of every generator below
    it, each believed applied only with its own acknowledgement (PushGate.believed)."""
    gate, header = parts.gate, parts.header
    signatures = {a: dict(md).get(push_signing.METADATA_KEY, "") for a, md in metadata.items()}
    forward = targets(root.children, signatures)
    below = set(root.addresses()[1:])

    def chunks() -> Iterator[bytes]:
        it = iter(parts.wire)
        if not forward:  # a leaf: the chunks as they are
            yield from it
            return
        first = weights_pb2.WeightChunk.FromString(next(it))
        first.forward.extend(forward)
        yield first.SerializeToString()
        yield from it

    def orphans(why: str, addresses: Iterable[str]) -> list[PushOutcome]:
        return [
            PushOutcome(a, False, -1, f"not reached: {root.address} {why}", 0.0, orphaned=True)
            for a in sorted(addresses)
        ]

    def outcomes(result: weights_pb2.PushResult | None, error: str, seconds: float) -> list[PushOutcome]:
        if result is None:
            return [
                PushOutcome(root.address, False, -1, error, seconds, unreachable=True),
                *orphans("did not take the push", below),
            ]
        own = gate.believed(PushOutcome.of(root.address, result, seconds), metadata[root.address], header, result.ack)
        # Only root's subtree: a relay's report on any other generator is not its to make, and on
        # its own subtree it is believed only where that generator's acknowledgement says so.
        relayed = [
            gate.believed(
                PushOutcome(
                    r.address,
                    r.applied,
                    r.version if r.applied else -1,
                    r.error,
                    r.seconds,
                    via=r.via,
                    orphaned=r.orphaned,
                    unreachable=r.unreachable,
                ),
                metadata[r.address],
                header,
                r.ack,
            )
            for r in result.relayed
            if r.address in below
        ]
        # A relay that claimed an apply without the generator's acknowledgement is left out for a while.
        claimants = {o.via for o in relayed if o.unproven}
        reported = [dataclasses.replace(o, unreachable=True) if o.address in claimants else o for o in [own, *relayed]]
        # A relay that answered but reported nobody below it (it forwarded nothing: an older
        # generator, or one that crashed forwarding) orphans its subtree.
        return [*reported, *orphans("reported no outcome for it", below - {o.address for o in relayed})]

    return parts.watch.send(
        parts.calls[root.address],
        root.addresses(),
        height(root),
        chunks(),
        metadata[root.address],
        timeout_s,
        header.version,
        outcomes,
    )


def push_one(
    call: PushCall,
    address: str,
    wire: Iterable[bytes],
    header: weights_pb2.WeightHeader,
    gate: PushGate,
    nonce_timeout_s: float,
    timeout_s: float,
    watch: Watch | None = None,
) -> PushOutcome:
    """One payload to one generator: its nonce and proof (PushGate, within nonce_timeout_s),
    the signature, then the chunks (`wire`, iterated afresh by each stream), watched (`watch`;
    None: the defaults, with an Unanswered of its own). Every failure is an outcome, never an exception."""
    start = time.perf_counter()
    metadata, why = sign_one(call, address, header, gate, nonce_timeout_s)
    if why:
        return PushOutcome(address, False, -1, why, time.perf_counter() - start, unreachable=True)
    parts = PushParts(
        {address: call}, wire, header, gate, watch or Watch(STALL_S, Unanswered(AddressBackoff())), nonce_timeout_s
    )
    [outcome] = push_forwarding(Node(address), {address: metadata}, parts, timeout_s - (time.perf_counter() - start))
    return outcome


def direct(
    pool: ThreadPoolExecutor, addresses: Sequence[str], parts: PushParts, timeout_s: float, fanout: int
) -> list[PushOutcome]:
    """The "push" way: a stream from the trainer to every generator at once (`fanout` unused)."""
    p = parts
    futures = [
        pool.submit(push_one, p.calls[a], a, p.wire, p.header, p.gate, p.nonce_timeout_s, timeout_s, p.watch)
        for a in addresses
    ]
    return [f.result() for f in futures]
