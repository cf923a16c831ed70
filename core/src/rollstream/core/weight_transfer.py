"""Weight payloads over gRPC: a stream of WeightChunks, a header on each payload's first chunk.

Large payloads never travel as one message (gRPC's 4 MiB default, and memory spikes on
both sides): `to_chunks` cuts them, `from_chunks` reassembles and checks size and sha256,
so a truncated or corrupted transfer is refused before anything is decoded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from rollstream.core.deltas import DeltaError, PayloadInfo
from rollstream.v1 import weights_pb2

CHUNK_BYTES = 4 * 1024 * 1024


def to_chunks(payload: bytes, info: PayloadInfo, chunk_bytes: int = CHUNK_BYTES) -> Iterator[weights_pb2.WeightChunk]:
    header = weights_pb2.WeightHeader(
        kind=info.kind,
        base_version=info.base_version,
        version=info.version,
        total_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        model_fingerprint=info.fingerprint,
    )
    view = memoryview(payload)
    yield weights_pb2.WeightChunk(header=header, data=bytes(view[:chunk_bytes]))
    for start in range(chunk_bytes, len(payload), chunk_bytes):
        yield weights_pb2.WeightChunk(data=bytes(view[start : start + chunk_bytes]))


def from_chunks(chunks: Iterable[weights_pb2.WeightChunk]) -> Iterator[tuple[weights_pb2.WeightHeader, bytes]]:
    """Yield (header, payload) per payload in the stream, each verified."""
    header: weights_pb2.WeightHeader | None = None
    parts: list[bytes] = []

    def finish() -> tuple[weights_pb2.WeightHeader, bytes]:
        assert header is not None
        payload = b"".join(parts)
        if len(payload) != header.total_bytes:
            raise DeltaError(f"payload for version {header.version} has {len(payload)} bytes, header says {header.total_bytes}")
        digest = hashlib.sha256(payload).hexdigest()
        if digest != header.sha256:
            raise DeltaError(f"payload for version {header.version} is corrupted (sha256 {digest[:12]} != {header.sha256[:12]})")
        return header, payload

    for chunk in chunks:
        if chunk.HasField("header"):
            if header is not None:
                yield finish()
            header, parts = chunk.header, []
        elif header is None:
            raise DeltaError("weight stream does not start with a header")
        parts.append(chunk.data)
    if header is not None:
        yield finish()
