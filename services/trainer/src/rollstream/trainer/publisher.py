"""Publishing policy versions: exact deltas, periodic anchors, pushes to every generator.

The publisher keeps the bits it last published (the base of the next delta), the latest
anchor and every delta since it, so a generator holding any version from that anchor on
(or nothing at all) can be brought to the current version by FetchWeights. With anchor_dir
they are files there, named by the store's chain.json (rollstream.core.weight_store), which
generators sharing that volume read for themselves.

Fan-out: nothing is done once per generator that can be done once per payload. A payload
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
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc
import numpy as np

from rollstream.core import deltas, weight_store, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel, rpc_error_text
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import push_signing
from rollstream.core.push_signing import PushSigner
from rollstream.trainer import relay
from rollstream.v1 import generator_pb2, weights_pb2


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
ANCHOR_FILE = "anchor.safetensors"  # in anchor_dir
DELTA_FILES = "delta-*.safetensors"  # in anchor_dir: the deltas since the anchor
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


class PayloadFile(weight_store.FileSlices):
    """A payload kept in a file instead of in memory: the anchor, which is read only when a
    generator catches up (at its start) yet is as large as the bf16 weights. Written to a
    temporary name, opened, then renamed over `path`: the file descriptor is always this
    payload's, a newer anchor (or a restarted trainer's) replaces the name while readers
    holding this one read on, and a trainer killed -9 leaves one file that its restart
    overwrites. Read with pread, so it is never mapped into the trainer's memory.

    `write` writes the payload into the open file, so that it need never be whole in memory
    (deltas.write_anchor)."""

    def __init__(self, path: Path, write: Callable[[BinaryIO], object]):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                write(f)
            self._fd = os.open(tmp, os.O_RDONLY)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not keep a partial anchor's space
            raise
        os.replace(tmp, path)
        self.path = path
        super().__init__(self._fd, os.fstat(self._fd).st_size)

    def unlink(self) -> None:
        """Remove the file if its name is still this payload's."""
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)  # absent when __init__ failed
        if fd is not None:
            os.close(fd)


class HashingWriter:
    """Hashes what is written through it: a file-held anchor gets its header (size, sha256)
    as it is written, not by reading its gigabytes back."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._size = 0
        self._f: BinaryIO | None = None

    def into(self, f: BinaryIO) -> "HashingWriter":
        self._f = f
        return self

    def write(self, data: bytes | memoryview) -> int:
        assert self._f is not None, "into() names the file first"
        self._sha.update(data)
        self._size += len(data) if isinstance(data, bytes) else data.nbytes
        return self._f.write(data)

    def header(self, info: deltas.PayloadInfo) -> weights_pb2.WeightHeader:
        return weight_transfer.header_of(info, self._size, self._sha.hexdigest())


class Published:
    """One encoded payload, as pushed and fetched, in memory or in a PayloadFile. Its header
    (sha256 of the payload) is made on first use, once, whatever the number of generators it
    goes to."""

    def __init__(self, info: deltas.PayloadInfo, payload: bytes | PayloadFile, header: weights_pb2.WeightHeader | None = None):
        """`header`: the payload's, when it was made already (the same bytes moved to a file)."""
        self.info = info
        self.payload = payload
        self._header = header
        self._header_lock = threading.Lock()

    def cached_header(self) -> weights_pb2.WeightHeader | None:
        with self._header_lock:
            return self._header

    def header(self) -> weights_pb2.WeightHeader:
        with self._header_lock:  # concurrent pushes wait for one hash instead of each hashing
            if self._header is None:
                self._header = weight_transfer.make_header(self.payload, self.info)
            return self._header

    def chunks(self) -> Iterator[weights_pb2.WeightChunk]:
        return weight_transfer.to_chunks(self.payload, self.info, header=self.header())

    def data(self) -> bytes:
        """The whole payload as bytes (read back from its file when it is in one)."""
        return self.payload if isinstance(self.payload, bytes) else self.payload[:]

    def wire_chunks(self) -> Iterable[bytes]:
        """The chunks as serialized WeightChunk messages, iterated once per stream. In memory:
        a list made once per push for every generator (not kept between pushes). In a file:
        read and serialized as each stream goes (FileWire), as a list would hold the weights."""
        if isinstance(self.payload, PayloadFile):
            return FileWire(self)
        return [c.SerializeToString() for c in self.chunks()]


class FileWire:
    """A file-held payload's serialized chunks: each iteration reads the file afresh, chunk by
    chunk (pread), so a stream holds only the chunks gRPC has not sent yet."""

    def __init__(self, published: Published):
        self._published = published

    def __iter__(self) -> Iterator[bytes]:
        return (c.SerializeToString() for c in self._published.chunks())


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


class WeightPublisher:
    def __init__(
        self, bits: Mapping[str, np.ndarray], anchor_interval: int, version: int = 0, creds: ClientCredentials | None = None,
        encode_threads: int = 0, anchor_dir: Path | None = None, generator_key: Ed25519PublicKey | None = None, run: str = "",
        nonce_timeout_s: float = NONCE_TIMEOUT_S, stall_s: float = STALL_S,
    ):
        """`creds`: the trainer's token, which signs pushes and is never sent (generators
        accept PushWeights by the trainer's signature only), and TLS material; None pushes
        unsigned in the clear (generators without grpc_auth_file). `encode_threads`: threads that
        encode a delta's tensors while the step still runs (0: on the caller's thread).
        `anchor_dir`: keep the anchor in a file there (PayloadFile), not in memory.
        `generator_key`: roles.json's generator_proof_key; with it, nothing is pushed to an
        address whose PushNonce answer does not prove a generator's token, and no generator is
        believed to have applied a push without its acknowledgement. `nonce_timeout_s`: how
        long a generator has to answer PushNonce before it is left out of that push. `stall_s`: how
        long a push waits for a generator that takes no chunk (then it is cut and backed off), and
        for its answer once it has every chunk (then the push ends without it: Unanswered). `run`: what the
        catch-up signatures (FetchWeights, the store's chain.json) are bound to."""
        self.fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits.items()})
        self.anchor_interval = anchor_interval
        self.anchor_dir = anchor_dir
        if anchor_dir is not None:
            try:
                anchor_dir.mkdir(parents=True, exist_ok=True)
                # A write cut short by a kill; the chain of a trainer that was killed (its
                # manifest first: no generator reads a chain whose files are going).
                (anchor_dir / weight_store.MANIFEST).unlink(missing_ok=True)
                for stale in [*anchor_dir.glob(".*.tmp"), *anchor_dir.glob(DELTA_FILES)]:
                    stale.unlink(missing_ok=True)
            except OSError as e:  # then every anchor stays in memory (_set_anchor says so)
                log.warning("anchor_dir_unusable: %s: %s", anchor_dir, e)
        self._deltas: list[Published] = []  # since the anchor
        self.signer = PushSigner(creds.token) if creds is not None and creds.token else None
        # The same key signs what generators catch up from (push_signing.TrainerSigner).
        self.catch_up_signer = push_signing.TrainerSigner(creds.token, run) if creds is not None and creds.token else None
        self.creds = dataclasses.replace(creds, token="") if creds is not None else None
        self.generator_key = generator_key
        self.nonce_timeout_s = nonce_timeout_s
        self.stall_s = stall_s
        self.backoff = AddressBackoff()
        self.unanswered = Unanswered(self.backoff)
        self.pushes = BackgroundPush(version)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=MAX_PUSH_STREAMS, thread_name_prefix="push")
        self._channels: dict[str, grpc.Channel] = {}  # by address, kept between pushes
        self._channels_lock = threading.Lock()
        self._encode_pool = ThreadPoolExecutor(max_workers=encode_threads, thread_name_prefix="delta") if encode_threads else None
        self._set_anchor(dict(bits), version)

    @property
    def version(self) -> int:
        return self._version

    def bits(self) -> dict[str, np.ndarray]:
        return self._bits

    def _set_anchor(self, bits: dict[str, np.ndarray], version: int) -> None:
        info = deltas.PayloadInfo("anchor", version, version, self.fingerprint)
        anchor: Published | None = None
        if self.anchor_dir is not None:  # streamed to its file: no anchor bytes in memory
            try:
                hashing = HashingWriter()
                payload = PayloadFile(self.anchor_dir / ANCHOR_FILE, lambda f: deltas.write_anchor(hashing.into(f), bits, version, self.fingerprint))
                anchor = Published(info, payload, header=hashing.header(info))
            except OSError as e:  # a full or failing disk must not stop training: keep it in memory
                log.warning("anchor_in_memory: cannot write the anchor to %s (%s); keeping version %d in memory", self.anchor_dir, e, version)
        if anchor is None:
            anchor = Published(info, deltas.encode_anchor(bits, version, self.fingerprint))
        with self._lock:
            self._bits = bits
            self._version = version
            self._anchor = anchor
            replaced, self._deltas = self._deltas, []
        self._write_manifest()
        _unlink_files(replaced)

    def begin_delta(self) -> deltas.DeltaEncoder:
        """An encoder for the next version's delta, to be fed tensor by tensor as the step
        produces them (HostAdamW.step's on_piece) and handed to publish()."""
        return deltas.DeltaEncoder(self._bits, self._version, self._version + 1, self.fingerprint, executor=self._encode_pool)

    def publish(self, new_bits: Mapping[str, np.ndarray], encoder: deltas.DeltaEncoder | None = None) -> tuple[Published, deltas.DeltaStats]:
        """Encode the delta from the last published version (the tensors not yet given to
        `encoder`, from begin_delta, are added now); every anchor_interval versions also
        start a new anchor (older deltas are then no longer needed). With anchor_dir the delta
        goes to its file and the store's chain before it is returned for pushing, so a
        generator the push misses finds it there; the chain keeps only the file (up to
        anchor_interval deltas of 2-6 % of the bf16 weights each would otherwise sit in the
        trainer's memory, issue 28) and the bytes returned live as long as the push."""
        base = self._version
        if encoder is None:
            encoder = self.begin_delta()
        elif encoder.base_version != base or encoder.base is not self._bits:
            raise deltas.DeltaError(f"the encoder's base is version {encoder.base_version}, the last published is {base}")
        for name in sorted(new_bits):
            if name not in encoder:
                encoder.add(name, new_bits[name])
        payload, stats = encoder.finish()
        delta = Published(deltas.PayloadInfo("delta", base, base + 1, self.fingerprint), payload)
        if (base + 1) % self.anchor_interval == 0:
            self._set_anchor(dict(new_bits), base + 1)
            return delta, stats
        kept = delta
        if self.anchor_dir is not None:
            try:
                filed = PayloadFile(self.anchor_dir / f"delta-{base + 1:08d}.safetensors", lambda f: f.write(payload))
                kept = Published(delta.info, filed, header=delta.header())
            except OSError as e:  # a full disk keeps it in memory, as for the anchor
                log.warning("delta_in_memory: cannot write version %d's delta to %s (%s)", base + 1, self.anchor_dir, e)
        with self._lock:
            self._bits = dict(new_bits)
            self._version = base + 1
            self._deltas.append(kept)
        self._write_manifest()
        return delta, stats

    def _write_manifest(self) -> None:
        """The store's chain.json for the anchor and deltas now kept, where every one of them
        is in a file (one kept in memory, for a disk that failed, is served by FetchWeights
        only: the chain stays at the last version the files reach)."""
        if self.anchor_dir is None:
            return
        with self._lock:
            kept = [self._anchor, *self._deltas]
        files: list[weight_store.StoredPayload] = []
        for p in kept:
            if not isinstance(p.payload, PayloadFile):
                break
            files.append(weight_store.StoredPayload(p.payload.path.name, p.header(), self._signature(p.header())))
        try:
            if files:
                weight_store.write_manifest(self.anchor_dir, files[0], files[1:])
            else:  # an anchor in memory: no chain, so generators ask the trainer at once
                (self.anchor_dir / weight_store.MANIFEST).unlink(missing_ok=True)
        except OSError as e:
            log.warning("weight_store_not_updated: cannot write %s in %s (%s)", weight_store.MANIFEST, self.anchor_dir, e)

    def catch_up_payloads(self, have_version: int, fingerprint: str) -> list[Published]:
        """What a generator holding `have_version` (-1: nothing) needs, in order."""
        if fingerprint and fingerprint != self.fingerprint:
            raise deltas.DeltaError(f"generator model {fingerprint} is not the trainer's {self.fingerprint}")
        with self._lock:
            anchor, chain = self._anchor, list(self._deltas)
        return weight_store.catch_up_chain(have_version, anchor, chain, lambda p: p.info)

    def catch_up_chunks(self, payloads: Sequence[Published]) -> Iterator[weights_pb2.WeightChunk]:
        """FetchWeights' stream for `payloads`: each payload's first chunk with the trainer's
        signature over the run and its header."""
        for p in payloads:
            chunks = p.chunks()
            first = next(chunks)
            first.signature = self._signature(first.header)
            yield first
            yield from chunks

    def _signature(self, header: weights_pb2.WeightHeader) -> bytes:
        return self.catch_up_signer.payload(header) if self.catch_up_signer is not None else b""

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
        self.pushes.wait()  # bounded by the nonce and stall deadlines (Watch); calls still open are cancelled below
        if self.anchor_dir is not None:  # the chain first: no generator reads files that are going
            (self.anchor_dir / weight_store.MANIFEST).unlink(missing_ok=True)
        _unlink_files([self._anchor, *self._deltas])
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)


def _unlink_files(payloads: Sequence[Published]) -> None:
    """Remove the files of payloads no longer served (a fetch in progress reads on: it holds
    the file open)."""
    for p in payloads:
        if isinstance(p.payload, PayloadFile):
            p.payload.unlink()


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
