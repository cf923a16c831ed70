"""The fleet: the generators a trainer pushes to and the ways a payload leaves it for them.

Who they are is GeneratorDirectory's, asked again at every push (pods come and go: one that
joins gets the next delta, or catches up). The ways are WAYS, by name: "push", a stream from
the trainer to each, or "relay", down a tree (issue 30; docs/deploy.md, "Scaling out"); both
over what every push shares (push.py: nonces, signatures by core/push_signing.py, watched calls,
back-off). The trainer pushes in the background (BackgroundPush), telling pollers a version only
once its push has ended.

Nothing is done once per generator that can be done once per payload. A payload
is encoded once and its header (with the sha256 of the whole payload) made once; every
generator gets its own concurrent stream over a channel kept from one push to the next
(no connection, HTTP/2 or TLS handshake per step); the pool has a thread per generator up
to MAX_PUSH_STREAMS, so pushes do not queue behind each other in waves; the chunks are
serialized once per push and the same bytes go to every stream (gRPC is given them as they
are), so a stream costs the trainer gRPC's own send and no copy or protobuf encode of ours.
An anchor kept in a file (anchor_dir) is the exception: it is as large as the bf16 weights,
so it is written to its file tensor by tensor (hashed as it is written) and each stream
reads its chunks from the file as it sends them (the page cache serves the other streams);
it is never whole in the trainer's memory.

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
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import push_signing, redis_policy, run_keys
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.trainer.push import (
    NONCE_TIMEOUT_S,
    STALL_S,
    AddressBackoff,
    Metadata,
    PushCall,
    PushGate,
    PushOutcome,
    PushParts,
    Unanswered,
    Watch,
    push_call,
    sign_one,
)
from rollstream.v1 import weights_pb2

if TYPE_CHECKING:
    from rollstream.trainer.publisher import Published

log = logging.getLogger(__name__)
MAX_PUSH_STREAMS = 64  # concurrent pushes; past ~16 generators the design relays instead
RELAY_ROUNDS = 3  # a tree, then one for its orphans, then one for theirs


class DiscoveryError(ValueError):
    """A `host:port` that cannot be used (no port, bad port)."""


def split_host_port(target: str) -> tuple[str, int]:
    """ "host:port" or "[v6addr]:port" -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"{target!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def resolve_all(target: str) -> list[str]:
    """Every address `host` resolves to, as sorted, de-duplicated "addr:port" strings.

    IPv4 (A) and IPv6 (AAAA) both count; IPv6 comes back as "[addr]:port", which gRPC
    accepts. A name that does not resolve (no pod ready yet) gives []: the caller has
    nobody to push to this time, which is not an error.
    """
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = {
        f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
        for family, *_, sockaddr in infos
    }
    return sorted(addresses)


class GeneratorDirectory:
    """Where to push: the configured addresses plus whatever the DNS name resolves to now (a
    Kubernetes headless Service, clusterIP: None, has one A record per ready pod), else
    (neither configured) the live generators of the Redis registry (heartbeats)."""

    def __init__(self, configured: list[str], dns_name: str = ""):
        self.configured = configured
        self.dns_name = dns_name
        self.last: list[str] = list(configured)  # what GetState reports, without a Redis call

    @property
    def from_registry(self) -> bool:
        """Whether the addresses come from the Redis registry, which the `generator` user
        writes: then each generator must prove the address it is dialed at (PushGate)."""
        return not (self.configured or self.dns_name)

    def addresses(self, client: redis_policy.Client, keys: run_keys.RunKeys) -> list[str]:
        if self.configured or self.dns_name:
            resolved = resolve_all(self.dns_name) if self.dns_name else []
            self.last = sorted(set(self.configured) | set(resolved))
        else:
            # An empty address is a generator colocated with its trainer: nothing to push to.
            self.last = sorted(a for a in run_keys.live_generators(client, keys).values() if a)
        return self.last


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


# The ways a payload goes out to many generators, by name (as vLLM registers its weight-transfer
# engines): each is handed the pool, the addresses to reach, the push's shared parts, the
# deadline and the fan-out, and gives one outcome per address.
WAYS: dict[str, Callable[[ThreadPoolExecutor, Sequence[str], PushParts, float, int], list[PushOutcome]]] = {
    "push": direct,
    "relay": push_down,
}


class BackgroundPush:
    """The step's push on a thread of its own: the loop commits a step, hands its payload over
    and trains the next one while it goes out. Pushes stay ordered and one is in flight at a
    time (`start` waits for the one before), so at most two payloads are held: the one going
    out and the one the step just made. A push ends once every generator has answered, been
    cut, or taken every chunk and not answered within the stall deadline (Watch): a call
    still open then holds no payload, only its address out of the next pushes (Unanswered). `version`: the newest version whose push has ended,
    all that pollers are told and served (the trainer's GetState and FetchWeights): a
    generator being pushed a version never fetches it too, and one the push missed fetches it
    once the push is over."""

    def __init__(self, version: int):
        self._version = version
        self._thread: threading.Thread | None = None
        self._ended: list[PushOutcome] = []  # the last push's outcomes, until `wait` hands them over
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def reached(self, version: int) -> None:
        """`version` may be told and served now (pushed to no one: a replayed step, an anchor pushed at once)."""
        with self._lock:
            self._version = version

    def start(self, version: int, push: Callable[[], list[PushOutcome]]) -> list[PushOutcome]:
        """Wait for the push in flight, then start `push` (of `version`); the outcomes of the one
        waited for ([] if none or handed over already)."""
        before = self.wait()
        self._thread = threading.Thread(target=self._run, args=(version, push), name=f"push-v{version}", daemon=True)
        self._thread.start()
        return before

    def _run(self, version: int, push: Callable[[], list[PushOutcome]]) -> None:
        outcomes: list[PushOutcome] = []
        try:
            outcomes = push()
        except Exception:  # never expected (failures are outcomes); the version is over all the same
            log.exception("push_failed: version %d", version)
        with self._lock:
            self._version = version
            self._ended = outcomes

    def wait(self) -> list[PushOutcome]:
        """Wait for the push in flight; its outcomes, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            ended, self._ended = self._ended, []
        return ended


class Fleet:
    """The generators a trainer pushes to: a channel to each kept from one push to the next, a
    thread per stream (up to MAX_PUSH_STREAMS), the addresses backed off and the calls left
    unanswered. `creds`: the trainer's token, which signs pushes and is never sent (generators
    accept PushWeights by the trainer's signature only), and TLS material; None pushes
    unsigned in the clear (generators without grpc_auth_file). `generator_key`:
    roles.json's generator_proof_key; with it, nothing is pushed to an address whose PushNonce
    answer does not prove a generator's token, and no generator is believed to have applied a
    push without its acknowledgement. `nonce_timeout_s`: how long a generator has to answer
    PushNonce before it is left out of that push. `stall_s`: how long a push waits for a
    generator that takes no chunk (then it is cut and backed off), and for its answer once it
    has every chunk (then the push ends without it: Unanswered)."""

    def __init__(
        self,
        creds: ClientCredentials | None = None,
        generator_key: Ed25519PublicKey | None = None,
        nonce_timeout_s: float = NONCE_TIMEOUT_S,
        stall_s: float = STALL_S,
    ):
        self.signer = push_signing.PushSigner(creds.token) if creds is not None and creds.token else None
        self.creds = dataclasses.replace(creds, token="") if creds is not None else None
        self.generator_key = generator_key
        self.nonce_timeout_s = nonce_timeout_s
        self.stall_s = stall_s
        self.backoff = AddressBackoff()
        self.unanswered = Unanswered(self.backoff)
        self._pool = ThreadPoolExecutor(max_workers=MAX_PUSH_STREAMS, thread_name_prefix="push")
        self._channels: dict[str, grpc.Channel] = {}  # by address, kept between pushes
        self._channels_lock = threading.Lock()

    def push(
        self,
        addresses: Sequence[str],
        published: Published,
        timeout_s: float,
        from_registry: bool = False,
        fanout: int = 0,
    ) -> list[PushOutcome]:
        """Push one payload to every generator concurrently (each as a stream of chunks).
        `from_registry`: the addresses come from the generator registry, which a lesser role
        writes, so each generator must prove the address it was dialed at. `fanout` >= 1 with
        more generators than that: down a relay tree (push_down), the trainer sending to
        `fanout` of them only; one outcome per address either way. Each nonce is asked within
        nonce_timeout_s, not `timeout_s`; an address that failed is left out while it is backed
        off (AddressBackoff), counted as not applied: it catches up by itself."""
        wire = published.wire_chunks()  # hashed here, once; serialized once too unless in a file
        calls = self._calls(addresses)
        gate = PushGate(self.signer, self.generator_key, from_registry)
        live, skipped = self.backoff.split(addresses)
        live, busy = self.unanswered.split(live)
        parts = PushParts(
            calls, wire, published.header(), gate, Watch(self.stall_s, self.unanswered), self.nonce_timeout_s
        )
        done = WAYS["relay" if 1 <= fanout < len(live) else "push"](self._pool, live, parts, timeout_s, fanout)
        self.backoff.update(done, keep=addresses)
        by_address = {o.address: o for o in [*skipped, *busy, *done]}
        return [by_address[a] for a in addresses]

    def _calls(self, addresses: Sequence[str]) -> dict[str, PushCall]:
        """PushWeights over the kept channels, taking serialized chunks as they are (no
        request serializer). Channels to addresses no longer pushed to are closed
        (generators come and go with discovery); a kept channel reconnects by itself when
        its generator restarts at the same address."""
        with self._channels_lock:
            for gone in set(self._channels) - set(addresses):
                self._channels.pop(gone).close()
            for a in addresses:
                if a not in self._channels:
                    self._channels[a] = channel(a, self.creds, server_name="generator")
            return {a: push_call(self._channels[a]) for a in addresses}

    def close(self) -> None:
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)
