"""rollstream.core.weight_transfer.from_chunks is bounded: a header declaring more than the
receiver accepts is refused as it arrives, and a payload sending more than its header
declared is cut at the chunk that overruns; neither reads one chunk further."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from rollstream.core import weight_transfer
from rollstream.core.deltas import DeltaError, PayloadInfo
from rollstream.core.weight_transfer import PayloadOverrun, PayloadTooLarge
from rollstream.v1 import weights_pb2


class Counted:
    """An iterator over chunks that counts how many were taken from it."""

    def __init__(self, chunks: list[weights_pb2.WeightChunk]):
        self._chunks = chunks
        self.taken = 0

    def __iter__(self) -> Iterator[weights_pb2.WeightChunk]:
        for c in self._chunks:
            self.taken += 1
            yield c


def header(total_bytes: int, version: int = 1, sha: str = "") -> weights_pb2.WeightHeader:
    return weights_pb2.WeightHeader(kind="anchor", version=version, total_bytes=total_bytes, sha256=sha)


def payload_chunks(payload: bytes, version: int, chunk_bytes: int = 100) -> list[weights_pb2.WeightChunk]:
    return list(
        weight_transfer.to_chunks(payload, PayloadInfo("anchor", version, version, "fp"), chunk_bytes=chunk_bytes)
    )


def test_payloads_up_to_the_limit_pass() -> None:
    payload = bytes(range(256)) * 4
    stream = payload_chunks(payload, 1) + payload_chunks(payload[:500], 2)
    out = list(weight_transfer.from_chunks(stream, max_bytes=len(payload)))  # the limit is per payload
    assert [p for _, p in out] == [payload, payload[:500]]


def test_a_header_above_the_limit_is_refused_before_anything_else_is_read() -> None:
    stream = Counted(
        [weights_pb2.WeightChunk(header=header(10**12), data=b"x" * 10)]
        + [weights_pb2.WeightChunk(data=b"x" * 10)] * 50
    )
    with pytest.raises(PayloadTooLarge, match="declares 1000000000000 bytes, more than the 1000 accepted"):
        list(weight_transfer.from_chunks(stream, max_bytes=1000))
    assert stream.taken == 1


def test_a_later_payload_above_the_limit_is_refused_at_its_header() -> None:
    first = payload_chunks(b"a" * 300, 1)
    stream = Counted(
        first + [weights_pb2.WeightChunk(header=header(5000, version=2))] + [weights_pb2.WeightChunk(data=b"x")] * 10
    )
    out = weight_transfer.from_chunks(stream, max_bytes=1000)
    assert next(out)[1] == b"a" * 300
    with pytest.raises(PayloadTooLarge):
        next(out)
    assert stream.taken == len(first) + 1


def test_a_payload_sending_more_than_declared_is_cut_at_once() -> None:
    # Declares 1 byte, sends 10 chunks of 1 KiB: the first chunk already overruns.
    stream = Counted(
        [weights_pb2.WeightChunk(header=header(1), data=b"x" * 1024)] + [weights_pb2.WeightChunk(data=b"x" * 1024)] * 9
    )
    with pytest.raises(PayloadOverrun, match="sent more than the 1 bytes its header declares"):
        list(weight_transfer.from_chunks(stream, max_bytes=1 << 30))
    assert stream.taken == 1
    # Declares 250, the third chunk of 100 overruns it.
    chunks = payload_chunks(b"b" * 300, 1)
    chunks[0].header.total_bytes = 250
    stream = Counted(chunks + [weights_pb2.WeightChunk(data=b"x")] * 5)
    with pytest.raises(PayloadOverrun):
        list(weight_transfer.from_chunks(stream, max_bytes=1 << 30))
    assert stream.taken == 3


def test_refusals_are_delta_errors_and_short_payloads_still_are_too() -> None:
    assert issubclass(PayloadTooLarge, DeltaError) and issubclass(PayloadOverrun, DeltaError)
    payload = b"c" * 300
    chunks = payload_chunks(payload, 1)[:-1]
    with pytest.raises(DeltaError, match="has 200 bytes, header says 300") as e:
        list(weight_transfer.from_chunks(chunks, max_bytes=1000))
    assert not isinstance(e.value, weight_transfer.TransferRefused)
    assert chunks[0].header.sha256 == hashlib.sha256(payload).hexdigest()


def test_auto_limit_fits_an_anchor_and_a_dense_delta() -> None:
    dense = 270 * 1024**2  # SmolLM2-135M in bf16
    limit = weight_transfer.payload_limit(dense)
    assert limit == dense * 5 // 4 + 64 * 1024**2
    # A delta changing every value: 2-byte values plus a bitmask (n/8 bytes), uncompressed.
    assert dense + dense // 16 < limit
