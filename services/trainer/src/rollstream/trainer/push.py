"""What every push of a payload shares: its outcomes, its nonces and signatures (PushGate), how
its calls are watched (Watch), the addresses left out (AddressBackoff, Unanswered). Pushing it
down a tree of generators (a direct push: a tree of one) is fleet.py's.

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
then left to answer in the background (Watch, Unanswered), and an address that failed is left
out a while (AddressBackoff).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import push_signing, weight_transfer
from rollstream.core.grpc_utils import rpc_error_text
from rollstream.core.push_signing import PushSigner
from rollstream.v1 import generator_pb2, weights_pb2

log = logging.getLogger(__name__)
Metadata = tuple[tuple[str, str], ...]  # a call's gRPC metadata
NONCE_METHOD = "/rollstream.v1.Generator/PushNonce"
NONCE_TIMEOUT_S = 3.0  # the trainer's push_nonce_timeout_s default
BACKOFF_FIRST_S = 10.0  # an address that failed is left out this long, twice as long at each failure after
BACKOFF_MAX_S = 300.0
BACKOFF_PER_COST = 10.0  # and at least this many times what the failure cost the push (its seconds)
BACKED_OFF = "backed off"  # how the outcome of an address left out begins
STALL_S = 5.0  # the trainer's push_stall_s default
UNANSWERED = "unanswered"  # how the outcome of a push that stopped waiting for an answer begins


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
    unanswered: bool = (
        False  # sent whole, no answer when the push stopped waiting (Unanswered): neither applied nor failed
    )

    @classmethod
    def of(cls, address: str, result: weights_pb2.PushResult, seconds: float) -> "PushOutcome":
        """A generator's own answer."""
        return cls(
            address,
            result.applied,
            result.version,
            result.error,
            seconds,
            receive_s=result.receive_seconds,
            lock_wait_s=result.lock_wait_seconds,
            decode_s=result.decode_seconds,
            load_s=result.load_seconds,
        )


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
        left_out = [
            PushOutcome(
                a, False, -1, f"{BACKED_OFF}: its last push failed; tried again in {s:.0f} s", 0.0, unreachable=True
            )
            for a, s in waiting.items()
        ]
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
        left_out = [
            PushOutcome(
                a, False, -1, f"{UNANSWERED}: its push of version {v} is not answered yet", 0.0, unanswered=True
            )
            for a, v in busy.items()
        ]
        return [a for a in addresses if a not in busy], left_out

    def open(self) -> dict[str, int]:
        with self._lock:
            return dict(self._open)

    def hold(
        self, addresses: Sequence[str], version: int, future: grpc.Future, outcomes: Callable[[], list[PushOutcome]]
    ) -> None:
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
                raise NotAGenerator(
                    f"registered as {address}, but the generator answering there is {answer.address!r}: not pushing there"
                )
        return self.signer.metadata(answer.nonce, header)

    def believed(
        self, outcome: PushOutcome, metadata: Metadata, header: weights_pb2.WeightHeader, ack: bytes
    ) -> PushOutcome:
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
        return dataclasses.replace(
            outcome, applied=False, version=-1, error=why, unreachable=not outcome.via, unproven=True
        )


def sign_one(
    call: PushCall, address: str, header: weights_pb2.WeightHeader, gate: PushGate, nonce_timeout_s: float
) -> tuple[Metadata, str]:
    """The push's metadata for `address` (its nonce and the trainer's signature; () unsigned)
    and "", or () and why nothing may be pushed there."""
    try:
        return gate.metadata(call, address, header, nonce_timeout_s), ""
    except grpc.RpcError as e:
        return (), f"no nonce: {rpc_error_text(e)}"
    except NotAGenerator as e:
        log.warning("push_refused_not_a_generator: %s", e)
        return (), str(e)


@dataclass(frozen=True)
class Watch:
    """How a push watches its calls (weight_transfer.WatchedPush): cut after `stall_s` without
    a chunk taken, and no longer waited for `stall_s` per level of the tree below it after its
    last chunk (`unanswered` then holds it)."""

    stall_s: float
    unanswered: Unanswered

    def send(
        self,
        call: PushCall,
        subtree: Sequence[str],
        levels: int,
        chunks: Iterable[bytes],
        metadata: Metadata,
        timeout_s: float,
        version: int,
        outcomes: Callable[[weights_pb2.PushResult | None, str, float], list[PushOutcome]],
    ) -> list[PushOutcome]:
        """`chunks` to `subtree[0]` (with the rest of its subtree, `levels` deep, named in them), then
        `outcomes` of its answer (None and why: a failed or stalled call) and the seconds it took;
        or, past the wait for its answer, an unanswered outcome for each address of the subtree."""
        start = time.perf_counter()
        leg = weight_transfer.WatchedPush(call.push, chunks, max(1.0, timeout_s), metadata)
        ended = leg.wait(self.stall_s, self.stall_s * levels)
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
        self.unanswered.hold(subtree, version, leg.future, answer)
        why = f"{UNANSWERED}: sent whole, no answer within {self.stall_s * levels:g} s; counted when it comes"
        return [
            PushOutcome(
                a,
                False,
                -1,
                why,
                time.perf_counter() - start,
                via="" if a == subtree[0] else subtree[0],
                unanswered=True,
            )
            for a in subtree
        ]


@dataclass(frozen=True)
class PushParts:
    """What every stream of one push shares: the calls by address, the serialized chunks, the
    payload's header, the gate that signs and checks, the watch, and the nonce deadline."""

    calls: Mapping[str, PushCall]
    wire: Iterable[bytes]
    header: weights_pb2.WeightHeader
    gate: PushGate
    watch: Watch
    nonce_timeout_s: float
