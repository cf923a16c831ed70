"""Pushing a published version to every generator: nonces, the relay tree, watched streams.

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

Authentication: no token goes to a generator (its address may come from a registry a lesser
role writes). Each push asks that generator for a one-time nonce, with a challenge; nothing is
pushed unless the answer carries a generator's proof (and, for a registry address, proves
that very address); the push then carries the trainer's signature over the nonce and the
payload's header (rollstream.core.push_signing): one unary call, one signature and one
verification per generator per push. A generator is counted as holding the version only with
its acknowledgement (its signature over that nonce and header), whoever reports it.

No member holds the others back (issue 42): a nonce is asked within nonce_timeout_s, down a
relay tree each root's subtree is pushed as soon as its own nonces are in, a stream that takes
no chunk for stall_s is cut, one that took every chunk is waited for stall_s per tree level and
then left to answer in the background (Watch, Unanswered), an address that failed is left out
a while (AddressBackoff), and the trainer pushes in the background (BackgroundPush), telling
pollers a version only once its push has ended.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import push_signing, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel, rpc_error_text
from rollstream.core.push_signing import PushSigner
from rollstream.trainer import relay
from rollstream.v1 import generator_pb2, weights_pb2

if TYPE_CHECKING:
    from rollstream.trainer.publisher import Published


@dataclass
class PushOutcome:
    address: str
    applied: bool
    version: int
    error: str
    seconds: float  # the whole push, as this side saw it
    # The generator's own account (PushResult), zero when it did not answer one: the stream
    # reassembled and checked, waiting for its weights lock, decoding, the engine's load.
    receive_s: float = 0.0
    lock_wait_s: float = 0.0
    decode_s: float = 0.0
    load_s: float = 0.0
    via: str = ""  # the relay that pushed it ("": the trainer itself)
    orphaned: bool = False  # never pushed to: a relay above it failed (RelayedPush.orphaned)
    unreachable: bool = False  # no nonce, a failed call, an unproven claim made, or backed off: AddressBackoff
    unproven: bool = False  # claimed applied without its acknowledgement (PushGate.believed)
    unanswered: bool = False  # sent whole, no answer when the push stopped waiting (Unanswered): neither applied nor failed

    @classmethod
    def of(cls, address: str, result: weights_pb2.PushResult, seconds: float) -> "PushOutcome":
        """A generator's own answer."""
        return cls(
            address, result.applied, result.version, result.error, seconds,
            receive_s=result.receive_seconds, lock_wait_s=result.lock_wait_seconds, decode_s=result.decode_seconds, load_s=result.load_seconds,
        )


log = logging.getLogger(__name__)
Metadata = tuple[tuple[str, str], ...]  # a call's gRPC metadata
MAX_PUSH_STREAMS = 64  # concurrent pushes; past ~16 generators the design relays instead
NONCE_METHOD = "/rollstream.v1.Generator/PushNonce"
NONCE_TIMEOUT_S = 3.0  # the trainer's push_nonce_timeout_s default
BACKOFF_FIRST_S = 10.0  # an address that failed is left out this long, twice as long at each failure after
BACKOFF_MAX_S = 300.0
BACKOFF_PER_COST = 10.0  # and at least this many times what the failure cost the push (its seconds)
BACKED_OFF = "backed off"  # how the outcome of an address left out begins
STALL_S = 5.0  # the trainer's push_stall_s default
UNANSWERED = "unanswered"  # how the outcome of a push that stopped waiting for an answer begins


class AddressBackoff:
    """Addresses whose last push failed (no nonce in time, a refused or broken call, a relay's
    claim for it without its acknowledgement), left out of pushes for a while: BACKOFF_FIRST_S,
    doubled at each failure in a row up to BACKOFF_MAX_S, and at least BACKOFF_PER_COST times
    what the failure took (one that took a nonce and then held its stream until push_timeout_s,
    120 s, is left out 20 minutes, not 10 s). A stranger in the registry costs one nonce
    deadline, then one more every few minutes at most, never one a step; a generator left out
    catches up by itself (FetchWeights or the store), as one the push missed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._until: dict[str, tuple[float, float]] = {}  # address -> (left out until, its last wait)
        self._lock = threading.Lock()

    def split(self, addresses: Sequence[str]) -> tuple[list[str], list[PushOutcome]]:
        """The addresses to push to now, and an outcome for each one left out."""
        now = self._clock()
        with self._lock:
            waiting = {a: until - now for a in addresses if (until := self._until.get(a, (0.0, 0.0))[0]) > now}
        left_out = [PushOutcome(a, False, -1, f"{BACKED_OFF}: its last push failed; tried again in {s:.0f} s", 0.0, unreachable=True) for a, s in waiting.items()]
        return [a for a in addresses if a not in waiting], left_out

    def update(self, outcomes: Iterable[PushOutcome], keep: Sequence[str] | None = None) -> None:
        """Back off the addresses that failed, forget those that answered, and any no longer in `keep`
        (the addresses pushed to: the table is never larger than the registry). An unanswered
        outcome is neither: its answer is counted when it comes (Unanswered)."""
        now = self._clock()
        with self._lock:
            for o in outcomes:
                if o.unanswered:
                    continue
                if not o.unreachable:
                    self._until.pop(o.address, None)
                elif not o.orphaned:
                    last = self._until.get(o.address, (0.0, 0.0))[1]
                    wait = max(min(BACKOFF_MAX_S, 2 * last) if last else BACKOFF_FIRST_S, BACKOFF_PER_COST * o.seconds)
                    self._until[o.address] = (now + wait, wait)
            if keep is None:
                return
            kept = set(keep)
            for gone in [a for a in self._until if a not in kept]:
                del self._until[gone]

    def backed_off(self) -> list[str]:
        now = self._clock()
        with self._lock:
            return sorted(a for a, (until, _) in self._until.items() if until > now)


class Unanswered:
    """Calls whose payload went out whole but whose answer had not come when the push stopped
    waiting (stall_s after the last chunk, per level of a relay tree): a generator applying
    slowly (its weights lock held by a batch being sampled) or one that never answers. The
    push ends without them. Their addresses are left out of the next pushes while the call is
    open, so the trainer never has two pushes open at a generator (no version overtakes
    another there) and a silent one costs one wait, not one a step; the answer, when it comes,
    is counted by AddressBackoff as any outcome (a call that fails at push_timeout_s leaves
    its address out ten times that)."""

    def __init__(self, backoff: AddressBackoff):
        self._backoff = backoff
        self._open: dict[str, int] = {}  # address -> the version its open call pushes
        self._lock = threading.Lock()

    def split(self, addresses: Sequence[str]) -> tuple[list[str], list[PushOutcome]]:
        """The addresses with no call open, and an outcome for each one that has."""
        with self._lock:
            busy = {a: self._open[a] for a in addresses if a in self._open}
        left_out = [PushOutcome(a, False, -1, f"{UNANSWERED}: its push of version {v} is not answered yet", 0.0, unanswered=True) for a, v in busy.items()]
        return [a for a in addresses if a not in busy], left_out

    def open(self) -> dict[str, int]:
        with self._lock:
            return dict(self._open)

    def hold(self, addresses: Sequence[str], version: int, future: grpc.Future, outcomes: Callable[[], list[PushOutcome]]) -> None:
        """`addresses` (a generator, or a relay and its subtree) are open until `future` ends;
        then `outcomes` are counted."""
        with self._lock:
            for a in addresses:
                self._open[a] = version
        future.add_done_callback(lambda _: self._answered(addresses, version, outcomes))

    def _answered(self, addresses: Sequence[str], version: int, outcomes: Callable[[], list[PushOutcome]]) -> None:
        done = outcomes()
        self._backoff.update(done)
        with self._lock:
            for a in addresses:
                self._open.pop(a, None)
        for o in done:
            log.info("push_answered_late: %s version %d applied=%s %s", o.address, version, o.applied, o.error)


@dataclass(frozen=True)
class PushCall:
    """One generator's PushWeights (taking serialized chunks as they are) and, when pushes are
    signed, its PushNonce."""

    push: grpc.StreamUnaryMultiCallable
    nonce: grpc.UnaryUnaryMultiCallable


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
        except Exception:  # noqa: BLE001 - never expected (failures are outcomes); the version is over all the same
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
        self, creds: ClientCredentials | None = None, generator_key: Ed25519PublicKey | None = None, nonce_timeout_s: float = NONCE_TIMEOUT_S,
        stall_s: float = STALL_S,
    ):
        self.signer = PushSigner(creds.token) if creds is not None and creds.token else None
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
        self, addresses: Sequence[str], published: Published, timeout_s: float, from_registry: bool = False, fanout: int = 0
    ) -> list[PushOutcome]:
        """Push one payload to every generator concurrently (each as a stream of chunks).
        `from_registry`: the addresses come from the generator registry, which a lesser role
        writes, so each generator must prove the address it was dialed at. `fanout` >= 1 with
        more generators than that: down a relay tree (relay.py), the trainer sending to
        `fanout` of them only; one outcome per address either way. Each nonce is asked within
        nonce_timeout_s, not `timeout_s`; an address that failed is left out while it is backed
        off (AddressBackoff), counted as not applied: it catches up by itself."""
        wire = published.wire_chunks()  # hashed here, once; serialized once too unless in a file
        calls = self._calls(addresses)
        header = published.header()
        gate = PushGate(self.signer, self.generator_key, from_registry)
        live, skipped = self.backoff.split(addresses)
        live, busy = self.unanswered.split(live)
        watch = Watch(self.stall_s, self.unanswered)
        if fanout < 1 or len(live) <= fanout:
            futures = [self._pool.submit(push_one, calls[a], a, wire, header, gate, self.nonce_timeout_s, timeout_s, watch) for a in live]
            done = [f.result() for f in futures]
        else:
            outcomes: dict[str, PushOutcome] = {}
            pending = list(live)
            for _ in range(RELAY_ROUNDS):
                for o in self._relay_round(pending, calls, wire, header, gate, timeout_s, fanout, watch):
                    outcomes[o.address] = o
                # Orphans (a relay above them failed) go down a tree of their own, with fresh nonces.
                pending = [a for a in pending if outcomes[a].orphaned]
                if not pending:
                    break
            done = list(outcomes.values())
        self.backoff.update(done, keep=addresses)
        by_address = {o.address: o for o in [*skipped, *busy, *done]}
        return [by_address[a] for a in addresses]

    def _relay_round(
        self, addresses: Sequence[str], calls: Mapping[str, PushCall], wire: Iterable[bytes], header: weights_pb2.WeightHeader, gate: PushGate,
        timeout_s: float, fanout: int, watch: Watch,
    ) -> list[PushOutcome]:
        """Every generator's nonce asked at once, each within nonce_timeout_s; each root of the
        tree pushed to as soon as its own subtree has answered (push_subtree), so no subtree
        waits for another's stranger."""
        start = time.perf_counter()
        signing = {a: self._pool.submit(sign_one, calls[a], a, header, gate, self.nonce_timeout_s) for a in addresses}
        futures = [
            self._pool.submit(push_subtree, root, fanout, signing, calls, wire, gate, header, start + timeout_s, watch) for root in relay.tree(list(addresses), fanout)
        ]
        return [o for f in futures for o in f.result()]

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


def push_call(ch: grpc.Channel) -> PushCall:
    return PushCall(
        push=weight_transfer.push_stream(ch),
        nonce=ch.unary_unary(NONCE_METHOD, request_serializer=generator_pb2.PushNonceRequest.SerializeToString,
                             response_deserializer=generator_pb2.PushNonceResponse.FromString),
    )  # fmt: skip


class NotAGenerator(Exception):
    """The address's PushNonce answer proves no generator (or another address): push nothing."""


@dataclass(frozen=True)
class PushGate:
    """What a push checks and signs: `signer` (the trainer's key; None: unsigned, for
    generators without auth), `generator_key` (None: no proof asked) and whether the address
    itself must be proven (registry addresses)."""

    signer: PushSigner | None
    generator_key: Ed25519PublicKey | None = None
    prove_address: bool = False

    def metadata(self, call: PushCall, address: str, header: weights_pb2.WeightHeader, timeout_s: float) -> Metadata:
        if self.signer is None:
            return ()
        challenge = os.urandom(push_signing.CHALLENGE_BYTES)
        answer = call.nonce(generator_pb2.PushNonceRequest(challenge=challenge), timeout=timeout_s)
        if self.generator_key is not None:
            if not push_signing.verify_proof(self.generator_key, challenge, answer.nonce, answer.address, answer.proof):
                raise NotAGenerator(f"{address} gave no proof of the generator's key: not pushing there")
            if self.prove_address and answer.address != address:
                raise NotAGenerator(f"registered as {address}, but the generator answering there is {answer.address!r}: not pushing there")
        return self.signer.metadata(answer.nonce, header)

    def believed(self, outcome: PushOutcome, metadata: Metadata, header: weights_pb2.WeightHeader, ack: bytes) -> PushOutcome:
        """`outcome` as the trainer counts it: applied only with the generator's acknowledgement
        over the nonce the trainer signed for it (when pushes are signed and the generator key
        known; else there is nothing to check it with). A claim without one counts as not
        reached: the generator catches up by itself, and whoever made the claim (the generator
        itself, or the relay it came `via`: push_forwarding) is backed off."""
        if not outcome.applied or self.signer is None or self.generator_key is None:
            return outcome
        signed = push_signing.parse_signature(metadata)
        if signed is not None and push_signing.verify_ack(self.generator_key, signed[0], header, ack):
            return outcome
        why = f"not reached: applied on {outcome.via or 'its own'} word, without its acknowledgement"
        log.warning("push_claim_unproven: %s: %s", outcome.address, why)
        return dataclasses.replace(outcome, applied=False, version=-1, error=why, unreachable=not outcome.via, unproven=True)


RELAY_ROUNDS = 3  # a tree, then one for its orphans, then one for theirs


def sign_one(call: PushCall, address: str, header: weights_pb2.WeightHeader, gate: PushGate, nonce_timeout_s: float) -> tuple[Metadata, str]:
    """The push's metadata for `address` (its nonce and the trainer's signature; () unsigned)
    and "", or () and why nothing may be pushed there."""
    try:
        return gate.metadata(call, address, header, nonce_timeout_s), ""
    except grpc.RpcError as e:
        return (), f"no nonce: {rpc_error_text(e)}"
    except NotAGenerator as e:
        log.warning("push_refused_not_a_generator: %s", e)
        return (), str(e)


def push_subtree(
    root: relay.Node, fanout: int, signing: Mapping[str, Future[tuple[Metadata, str]]], calls: Mapping[str, PushCall], wire: Iterable[bytes],
    gate: PushGate, header: weights_pb2.WeightHeader, deadline: float, watch: Watch,
) -> list[PushOutcome]:
    """`root`'s subtree once each of its nonces has come or timed out: those that answered, as
    a tree of their own (the first in tree order at its top), get the payload; those that did
    not are left out of this push, each an unreachable outcome."""
    start = time.perf_counter()
    signed = {a: signing[a].result() for a in root.addresses()}
    left_out = [PushOutcome(a, False, -1, why, time.perf_counter() - start, unreachable=True) for a, (_, why) in signed.items() if why]
    metadata = {a: md for a, (md, why) in signed.items() if not why}
    if not metadata:
        return left_out
    answered = list(metadata)
    top = relay.Node(answered[0], relay.tree(answered[1:], fanout) if len(answered) > 1 else [])
    return [*left_out, *push_forwarding(calls[top.address], top, wire, metadata, gate, header, deadline - time.perf_counter(), watch)]


@dataclass(frozen=True)
class Watch:
    """How a push watches its calls (weight_transfer.WatchedPush): cut after `stall_s` without
    a chunk taken, and no longer waited for `stall_s` per level of the tree below it after its
    last chunk (`unanswered` then holds it)."""

    stall_s: float
    unanswered: Unanswered

    def send(
        self, call: PushCall, root: relay.Node, chunks: Iterable[bytes], metadata: Metadata, timeout_s: float, version: int,
        outcomes: Callable[[weights_pb2.PushResult | None, str, float], list[PushOutcome]],
    ) -> list[PushOutcome]:
        """`chunks` to `root` (with its subtree named in them), then `outcomes` of its answer
        (None and why: a failed or stalled call) and the seconds it took; or, past the wait for
        its answer, an unanswered outcome for each address of the subtree."""
        start = time.perf_counter()
        leg = weight_transfer.WatchedPush(call.push, chunks, max(1.0, timeout_s), metadata)
        ended = leg.wait(self.stall_s, self.stall_s * height(root))
        if ended is weight_transfer.Leg.STALLED:
            return outcomes(None, f"stalled: took no chunk for {self.stall_s:g} s", time.perf_counter() - start)

        def answer() -> list[PushOutcome]:
            try:
                return outcomes(leg.future.result(), "", time.perf_counter() - start)
            except grpc.RpcError as e:
                return outcomes(None, rpc_error_text(e), time.perf_counter() - start)
            except grpc.FutureCancelledError:
                return outcomes(None, "cancelled", time.perf_counter() - start)

        if ended is weight_transfer.Leg.ENDED:
            return answer()
        addresses = root.addresses()
        self.unanswered.hold(addresses, version, leg.future, answer)
        why = f"{UNANSWERED}: sent whole, no answer within {self.stall_s * height(root):g} s; counted when it comes"
        return [PushOutcome(a, False, -1, why, time.perf_counter() - start, via="" if a == root.address else root.address, unanswered=True) for a in addresses]


def height(node: relay.Node) -> int:
    """The levels of `node`'s subtree (1: no children)."""
    return 1 + max((height(c) for c in node.children), default=0)


def push_forwarding(
    call: PushCall, root: relay.Node, wire: Iterable[bytes], metadata: Mapping[str, Metadata], gate: PushGate, header: weights_pb2.WeightHeader,
    timeout_s: float, watch: Watch,
) -> list[PushOutcome]:
    """The payload to `root`, its first chunk naming root's subtree (the relay tree below it)
    with each generator's signature in it; the outcomes of root and of every generator below
    it, each believed applied only with its own acknowledgement (PushGate.believed)."""
    signatures = {a: dict(md).get(push_signing.METADATA_KEY, "") for a, md in metadata.items()}
    forward = relay.targets(root.children, signatures)
    below = set(root.addresses()[1:])

    def chunks() -> Iterator[bytes]:
        it = iter(wire)
        first = weights_pb2.WeightChunk.FromString(next(it))
        first.forward.extend(forward)
        yield first.SerializeToString()
        yield from it

    def orphans(why: str, addresses: Iterable[str]) -> list[PushOutcome]:
        return [PushOutcome(a, False, -1, f"not reached: {root.address} {why}", 0.0, orphaned=True) for a in sorted(addresses)]

    def outcomes(result: weights_pb2.PushResult | None, error: str, seconds: float) -> list[PushOutcome]:
        if result is None:
            return [PushOutcome(root.address, False, -1, error, seconds, unreachable=True), *orphans("did not take the push", below)]
        own = gate.believed(PushOutcome.of(root.address, result, seconds), metadata[root.address], header, result.ack)
        # Only root's subtree: a relay's report on any other generator is not its to make, and on
        # its own subtree it is believed only where that generator's acknowledgement says so.
        relayed = [
            gate.believed(
                PushOutcome(r.address, r.applied, r.version if r.applied else -1, r.error, r.seconds, via=r.via, orphaned=r.orphaned, unreachable=r.unreachable),
                metadata[r.address], header, r.ack,
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

    return watch.send(call, root, chunks(), metadata[root.address], timeout_s, header.version, outcomes)


def push_one(
    call: PushCall, address: str, wire: Iterable[bytes], header: weights_pb2.WeightHeader, gate: PushGate, nonce_timeout_s: float, timeout_s: float,
    watch: Watch | None = None,
) -> PushOutcome:
    """One payload to one generator: its nonce and proof (PushGate, within nonce_timeout_s),
    the signature, then the chunks (`wire`, iterated afresh by each stream), watched (`watch`;
    None: the defaults, with an Unanswered of its own). Every failure is an outcome, never an exception."""
    start = time.perf_counter()
    metadata, why = sign_one(call, address, header, gate, nonce_timeout_s)
    if why:
        return PushOutcome(address, False, -1, why, time.perf_counter() - start, unreachable=True)
    if watch is None:
        watch = Watch(STALL_S, Unanswered(AddressBackoff()))

    def outcomes(result: weights_pb2.PushResult | None, error: str, seconds: float) -> list[PushOutcome]:
        if result is None:
            return [PushOutcome(address, False, -1, error, seconds, unreachable=True)]
        return [gate.believed(PushOutcome.of(address, result, seconds), metadata, header, result.ack)]

    [outcome] = watch.send(call, relay.Node(address), iter(wire), metadata, timeout_s - (time.perf_counter() - start), header.version, outcomes)
    return outcome
