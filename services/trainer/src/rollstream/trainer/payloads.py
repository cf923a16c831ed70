"""One encoded weight payload (an anchor or a delta) as it is pushed, fetched and filed:
in memory, or in a file it is streamed to (PayloadFile), hashed once whatever the number of
generators it goes to (Published), its chunks serialized once a push (or read from its file
as each stream goes: FileWire). The encoding itself is rollstream.core.deltas'; the files
and chain.json of the weight store (rollstream.core.weight_store) are StoreFiles'.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from rollstream.core import deltas, weight_transfer
from rollstream.v1 import weights_pb2

log = logging.getLogger(__name__)
ANCHOR_FILE = "anchor.safetensors"  # in the store's directory
DELTA_FILES = "delta-*.safetensors"  # in the store's directory: the deltas since the anchor


class PayloadFile(weight_transfer.FileSlices):
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

    def __init__(
        self, info: deltas.PayloadInfo, payload: bytes | PayloadFile, header: weights_pb2.WeightHeader | None = None
    ):
        """`header`: the payload's, when it was made already (the same bytes moved to a file)."""
        self.info = info
        self.payload = payload
        self._header = header
        self._header_lock = threading.Lock()

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


def unlink_files(payloads: Sequence[Published]) -> None:
    """Remove the files of payloads no longer served (a fetch in progress reads on: it holds
    the file open)."""
    for p in payloads:
        if isinstance(p.payload, PayloadFile):
            p.payload.unlink()


class StoreFiles:
    """The trainer's side of the weight store: the anchor and the deltas since it as files in
    `directory`, named by its chain.json, which generators sharing that volume read for
    themselves. A disk that fails never stops training: a payload it cannot take stays in
    memory (FetchWeights serves it) and the chain stays at the last version the files reach."""

    def __init__(self, directory: Path):
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # A write cut short by a kill; the chain of a trainer that was killed (its
            # manifest first: no generator reads a chain whose files are going).
            self.withdraw()
            for stale in [*directory.glob(".*.tmp"), *directory.glob(DELTA_FILES)]:
                stale.unlink(missing_ok=True)
        except OSError as e:  # then every payload stays in memory (`file` says so)
            log.warning("anchor_dir_unusable: %s: %s", directory, e)

    def file(
        self,
        info: deltas.PayloadInfo,
        write: Callable[[BinaryIO], object],
        header: Callable[[], weights_pb2.WeightHeader],
    ) -> Published | None:
        """The payload `write` writes, in its file (header: made once it is written), or None
        when the disk refuses it (logged; the caller keeps it in memory)."""
        name = ANCHOR_FILE if info.kind == "anchor" else f"delta-{info.version:08d}.safetensors"
        try:
            return Published(info, PayloadFile(self.directory / name, write), header=header())
        except OSError as e:
            log.warning(
                "%s_in_memory: cannot write version %d's %s to %s (%s); keeping it in memory",
                info.kind,
                info.version,
                info.kind,
                self.directory,
                e,
            )
            return None

    def write_manifest(self, kept: Sequence[Published], signature: Callable[[weights_pb2.WeightHeader], bytes]) -> None:
        """chain.json for `kept` (the anchor and deltas since it), up to the first that is in
        memory (a disk that failed): that one and those after it are served by FetchWeights only."""
        files: list[weight_transfer.StoredPayload] = []
        for p in kept:
            if not isinstance(p.payload, PayloadFile):
                break
            files.append(weight_transfer.StoredPayload(p.payload.path.name, p.header(), signature(p.header())))
        try:
            if files:
                weight_transfer.write_manifest(self.directory, files[0], files[1:])
            else:  # no chain, or an anchor in memory: generators ask the trainer at once
                self.withdraw()
        except OSError as e:
            log.warning(
                "weight_store_not_updated: cannot write %s in %s (%s)", weight_transfer.MANIFEST, self.directory, e
            )

    def withdraw(self) -> None:
        """No chain.json: no generator reads a chain whose files are going."""
        (self.directory / weight_transfer.MANIFEST).unlink(missing_ok=True)
