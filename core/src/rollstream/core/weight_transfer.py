"""Weight payloads over gRPC: a stream of WeightChunks, a header on each payload's first chunk.

Large payloads never travel as one message (gRPC's 4 MiB default, and memory spikes on
both sides): `to_chunks` cuts them, `from_chunks` reassembles and checks size and sha256,
so a truncated or corrupted transfer is refused before anything is decoded, and an
oversized one (declared, or sent beyond what was declared) is cut without being read on.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import grpc

from rollstream.core.deltas import DeltaError, PayloadInfo
from rollstream.v1 import weights_pb2

CHUNK_BYTES = 4 * 1024 * 1024
PUSH_METHOD = "/rollstream.v1.Generator/PushWeights"
# For callers that know no model size: above any model this system trains on one host.
DEFAULT_MAX_BYTES = 32 * 1024**3


def push_stream(ch: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Generator.PushWeights taking serialized WeightChunks as they are (no request
    serializer): a pusher serializes a payload's chunks once for every stream it sends them on."""
    return ch.stream_unary(
        PUSH_METHOD, request_serializer=None, response_deserializer=weights_pb2.PushResult.FromString
    )


class Leg(enum.Enum):
    """How a WatchedPush's wait ended."""

    ENDED = "ended"  # the call answered or failed: its future holds which
    STALLED = "stalled"  # the receiver took no chunk for the stall deadline: cancelled
    UNANSWERED = "unanswered"  # every chunk taken, no answer yet: the call goes on


class WatchedPush:
    """A PushWeights call watched for the receiver's progress (issue 42: a receiver that stops
    reading costs a short deadline, not the push's). gRPC takes the next chunk from `chunks`
    only once the one before was sent, and HTTP/2 flow control holds a send while the receiver
    reads nothing (a chunk or two in flight at most), so the time since gRPC last took a chunk
    is how long the receiver has taken nothing; time spent inside `chunks` (a relay waiting
    for its own stream) is not counted."""

    def __init__(
        self,
        push: grpc.StreamUnaryMultiCallable,
        chunks: Iterable[bytes],
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...] = (),
    ):
        self._chunks = iter(chunks)
        self._cond = threading.Condition()
        self._taken = time.monotonic()  # when gRPC last took a chunk (the call's start before any)
        self._pulling = False  # inside `chunks`: the sender's own wait
        self._sent_at: float | None = None  # every chunk taken
        self._ended = False
        self.future: grpc.Future = push.future(self, timeout=timeout_s, metadata=metadata)
        self.future.add_done_callback(self._end)

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        with self._cond:
            self._pulling = True
        try:
            return next(self._chunks)
        except StopIteration:
            self._chunks = iter(())  # the payload is no longer held for this call
            with self._cond:
                self._sent_at = time.monotonic()
            raise
        finally:
            with self._cond:
                self._pulling = False
                self._taken = time.monotonic()
                self._cond.notify_all()

    def _end(self, _: object) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, stall_s: float, answer_s: float) -> Leg:
        """Until the call ends (ENDED), the receiver takes no chunk for `stall_s` (STALLED: the
        call is cancelled), or `answer_s` passes after the last chunk was taken without an
        answer (UNANSWERED: the call goes on; its answer comes to `future`)."""
        with self._cond:
            while not self._ended:
                now = time.monotonic()
                if self._sent_at is not None:
                    left = self._sent_at + answer_s - now
                    if left <= 0:
                        return Leg.UNANSWERED
                elif self._pulling:
                    left = stall_s  # woken when the chunk comes
                elif (left := self._taken + stall_s - now) <= 0:
                    break
                self._cond.wait(left)
            else:
                return Leg.ENDED
        # Outside the lock: a done callback may run on this thread. False: it ended meanwhile.
        return Leg.STALLED if self.future.cancel() else Leg.ENDED


class Payload(Protocol):
    """What a payload must offer to be chunked and hashed: bytes, or something sized whose
    slices are bytes (the trainer's anchor kept in a file, read piece by piece)."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice, /) -> bytes: ...


def _view(payload: bytes | Payload) -> memoryview | Payload:
    return memoryview(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else payload


def make_header(
    payload: bytes | Payload, info: PayloadInfo, chunk_bytes: int = CHUNK_BYTES
) -> weights_pb2.WeightHeader:
    """A payload's header: its kind, versions, size, fingerprint and sha256. A sender pushing
    one payload to many receivers makes it once (the hash is the costly part: ~2 s per GB).
    A payload that is not in memory is hashed `chunk_bytes` at a time."""
    view = _view(payload)
    digest = hashlib.sha256()
    for start in range(0, len(payload), chunk_bytes):
        digest.update(view[start : start + chunk_bytes])
    return header_of(info, len(payload), digest.hexdigest())


def header_of(info: PayloadInfo, total_bytes: int, sha256: str) -> weights_pb2.WeightHeader:
    """The header of a payload of `total_bytes` whose sha256 is known (make_header, or a
    writer that hashed it on the way: the trainer's file-held anchor)."""
    return weights_pb2.WeightHeader(
        kind=info.kind,
        base_version=info.base_version,
        version=info.version,
        total_bytes=total_bytes,
        sha256=sha256,
        model_fingerprint=info.fingerprint,
    )


def to_chunks(
    payload: bytes | Payload,
    info: PayloadInfo,
    chunk_bytes: int = CHUNK_BYTES,
    header: weights_pb2.WeightHeader | None = None,
) -> Iterator[weights_pb2.WeightChunk]:
    """The payload as a stream of chunks, its header on the first; `header`: one made
    earlier by make_header for this payload (else it is made here)."""
    header = header if header is not None else make_header(payload, info)
    view = _view(payload)
    yield weights_pb2.WeightChunk(header=header, data=bytes(view[:chunk_bytes]))
    for start in range(chunk_bytes, len(payload), chunk_bytes):
        yield weights_pb2.WeightChunk(data=bytes(view[start : start + chunk_bytes]))


def payload_limit(dense_bytes: int) -> int:
    """The largest payload worth accepting for a model whose bf16 weights take `dense_bytes`.
    An anchor is those bytes plus a safetensors header; a delta is at most about 1.06x them
    (positions as a bitmask, n/8 bytes, beside 2-byte values; see deltas) plus a JSON index.
    1.25x + 64 MiB covers both with room, and still refuses a stream sized for another model
    or for exhausting memory before any of it is read."""
    return dense_bytes * 5 // 4 + 64 * 1024 * 1024


class TransferRefused(DeltaError):
    """The stream breaks the transfer's own size rules: it is cut where it is (not read on)
    and the receiver answers with an error status, not with a sync outcome."""


class PayloadTooLarge(TransferRefused):
    """A header declares more bytes than the receiver accepts."""


class PayloadOverrun(TransferRefused):
    """A payload carries more bytes than its header declared."""


class _Assembly:
    """One payload being received: its header, the chunks so far, and their running hash."""

    def __init__(self, header: weights_pb2.WeightHeader, max_bytes: int):
        if header.total_bytes > max_bytes:
            raise PayloadTooLarge(
                f"payload for version {header.version} declares {header.total_bytes} bytes, more than the {max_bytes} accepted (max_weight_bytes)"
            )
        self.header = header
        self.parts: list[bytes] = []
        self.received = 0
        self.sha = hashlib.sha256()

    def add(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.header.total_bytes:
            raise PayloadOverrun(
                f"payload for version {self.header.version} sent more than the {self.header.total_bytes} bytes its header declares; stream cut"
            )
        self.sha.update(data)
        self.parts.append(data)

    def finish(self) -> tuple[weights_pb2.WeightHeader, bytes]:
        h = self.header
        if self.received != h.total_bytes:
            raise DeltaError(f"payload for version {h.version} has {self.received} bytes, header says {h.total_bytes}")
        digest = self.sha.hexdigest()
        if digest != h.sha256:
            raise DeltaError(f"payload for version {h.version} is corrupted (sha256 {digest[:12]} != {h.sha256[:12]})")
        payload = b"".join(self.parts)
        self.parts = []  # the chunks are not needed again: hold the payload once while it is applied
        return h, payload


def from_chunks(
    chunks: Iterable[weights_pb2.WeightChunk], max_bytes: int = DEFAULT_MAX_BYTES
) -> Iterator[tuple[weights_pb2.WeightHeader, bytes]]:
    """Yield (header, payload) per payload in the stream, each verified.

    Bounded per payload: a header declaring more than `max_bytes` is refused as it arrives
    (PayloadTooLarge), and a payload sending more than its header declared is cut at the
    chunk that overruns (PayloadOverrun); in both cases nothing more is read from `chunks`.
    So a sender makes the receiver hold at most min(declared, max_bytes) plus one message."""
    current: _Assembly | None = None
    for chunk in chunks:
        if chunk.HasField("header"):
            if current is not None:
                yield current.finish()
            current = _Assembly(chunk.header, max_bytes)
        elif current is None:
            raise DeltaError("weight stream does not start with a header")
        current.add(chunk.data)
    if current is not None:
        yield current.finish()
