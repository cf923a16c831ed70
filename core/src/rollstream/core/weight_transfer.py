"""Weight payloads in transit: streams of WeightChunks over gRPC, and the weight store's files.

Large payloads never travel as one message (gRPC's 4 MiB default, and memory spikes on
both sides): `to_chunks` cuts them, `from_chunks` reassembles and checks size and sha256,
so a truncated or corrupted transfer is refused before anything is decoded, and an
oversized one (declared, or sent beyond what was declared) is cut without being read on.
The weight store's files are read back as the same stream (`store_chunks`), so a generator
catching up from them checks what it reads as it checks a push or a FetchWeights answer.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
from google.protobuf import json_format

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


class FileSlices:
    """The first `size` bytes of an open file, read in contiguous slices with pread (never
    mapped into memory): a Payload to_chunks reads. The store's files here; the trainer's
    file-held anchor (publisher.PayloadFile) too."""

    def __init__(self, fd: int, size: int):
        self._fd = fd
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(self._size)
        if step != 1:
            raise ValueError("a payload file is read in contiguous slices")
        return os.pread(self._fd, max(0, stop - start), start)


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


# -- the weight store ---------------------------------------------------------------------
# The trainer's anchor and every delta since it, as files in one directory (the trainer's
# `anchor_dir`) with a manifest naming them and their headers. Where that directory is a
# volume the generators mount too (their `weight_store`), a generator that missed a version
# reads what it lacks from the files instead of asking the trainer for it: catching up costs
# the trainer nothing, however many generators fall behind at once (docs/deploy.md, "Scaling
# out"). The trainer writes each payload under a temporary name and renames it into place,
# then rewrites chain.json the same way, so a reader sees either the old chain or the new
# one, each whole. A payload file a newer chain has replaced may vanish or change under a
# reader between chain.json and the file: its header's size and sha256 catch that, and the
# reader tries again at its next sync. A read that fails (EIO, or ESTALE from NFS when the
# trainer replaced a file the reader holds) is StoreUnreadable too, never an OSError. Each
# entry carries the trainer's signature over the run and its header
# (push_signing.payload_text): whoever else can write the volume cannot make a generator that
# knows the trainer's key apply anything (generator/catch_up.py checks it).

MANIFEST = "chain.json"
STORE_FORMAT = "rollstream-weight-store/1"

T = TypeVar("T")


class StoreUnreadable(DeltaError):
    """The store has no chain yet, or one that is not this format: catch up another way or later."""


@dataclass(frozen=True)
class StoredPayload:
    """A payload file of the store, by its name in the directory, and its header."""

    file: str
    header: weights_pb2.WeightHeader
    signature: bytes = b""  # the trainer's, over the run and header; b"": unsigned

    @property
    def info(self) -> PayloadInfo:
        h = self.header
        return PayloadInfo(h.kind, h.base_version, h.version, h.model_fingerprint)


def catch_up_chain(have_version: int, anchor: T, chain: Sequence[T], info: Callable[[T], PayloadInfo]) -> list[T]:
    """What a holder of `have_version` (-1: nothing) needs of an anchor and the deltas after
    it, in order: the deltas from its version on when it holds one the chain reaches, else the
    anchor and every delta. Older than the anchor, nothing held, or *ahead* of the chain (the
    weights of an earlier run of a trainer that restarted from scratch) all start over from
    the anchor. The trainer's FetchWeights and a generator reading the store both choose so."""
    current = info(chain[-1]).version if chain else info(anchor).version
    if info(anchor).version <= have_version <= current:
        return [d for d in chain if info(d).base_version >= have_version]
    return [anchor, *chain]


def write_manifest(directory: Path, anchor: StoredPayload, chain: Sequence[StoredPayload]) -> None:
    """chain.json for `anchor` and the deltas after it, replaced whole (a temporary name, then
    a rename). Its payload files must be in place already."""
    body = {
        "format": STORE_FORMAT,
        "payloads": [
            {
                "file": p.file,
                "header": json_format.MessageToDict(p.header, preserving_proto_field_name=True),
                "signature": p.signature.hex(),
            }
            for p in (anchor, *chain)
        ],
    }
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> tuple[StoredPayload, list[StoredPayload]]:
    """The anchor and the deltas after it that chain.json names. Raises StoreUnreadable when
    there is none yet or it is not a chain (the reason named)."""
    path = directory / MANIFEST
    try:
        body = json.loads(path.read_text())
        if body.get("format") != STORE_FORMAT:
            raise StoreUnreadable(f"{path}: format {body.get('format')!r}, not {STORE_FORMAT!r}")
        payloads = [
            StoredPayload(
                _file_name(p["file"]),
                json_format.ParseDict(p["header"], weights_pb2.WeightHeader()),
                bytes.fromhex(p.get("signature", "")),
            )
            for p in body["payloads"]
        ]
    except FileNotFoundError as e:
        raise StoreUnreadable(
            f"{path}: no chain yet (the trainer writes it with its first version, and not while nobody reads deltas)"
        ) from e
    except (OSError, ValueError, KeyError, TypeError, AttributeError, json_format.ParseError) as e:
        raise StoreUnreadable(f"{path}: not a weight chain: {e}") from e
    if not payloads or payloads[0].header.kind != "anchor" or any(p.header.kind != "delta" for p in payloads[1:]):
        raise StoreUnreadable(f"{path}: a chain is an anchor, then deltas: {[p.header.kind for p in payloads]}")
    return payloads[0], payloads[1:]


def _file_name(name: object) -> str:
    """A payload's file name as chain.json gives it: a plain name in the store's directory
    (never a path elsewhere, whoever wrote the manifest)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"payload file {name!r} is not a plain file name")
    return name


def store_chunks(directory: Path, payloads: Sequence[StoredPayload]) -> Iterator[weights_pb2.WeightChunk]:
    """The payloads as the chunk stream a FetchWeights answer would be: each file read as it
    is sent, under its stored header, so from_chunks checks its size and sha256 as for any
    transfer, its signature on its first chunk as FetchWeights sends it. A file that has
    vanished or cannot be read raises StoreUnreadable; one whose length is not its header's
    is streamed at its header's length (from_chunks then refuses it)."""
    for p in payloads:
        try:
            fd = os.open(directory / p.file, os.O_RDONLY)
        except OSError as e:
            raise StoreUnreadable(f"{directory / p.file}: {e.strerror} (a newer chain replaced it?)") from e
        try:
            for chunk in to_chunks(FileSlices(fd, p.header.total_bytes), p.info, header=p.header):
                if chunk.HasField("header"):
                    chunk.signature = p.signature
                yield chunk
        except OSError as e:  # EIO, ESTALE, EISDIR...: this sync fails, the next one reads again
            raise StoreUnreadable(f"{directory / p.file}: read failed: {e.strerror or e}") from e
        finally:
            os.close(fd)
