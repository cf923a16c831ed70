"""The weight store: the trainer's anchor and every delta since it, as files in one directory
(the trainer's `anchor_dir`) with a manifest naming them and their headers. Where that
directory is a volume the generators mount too (their `weight_store`), a generator that
missed a version reads what it lacks from the files instead of asking the trainer for it:
catching up costs the trainer nothing, however many generators fall behind at once
(docs/deploy.md, "Scaling out").

Layout: `chain.json` plus the payload files it names. The trainer writes each payload under
a temporary name and renames it into place, then rewrites chain.json the same way, so a
reader sees either the old chain or the new one, each whole. A payload file a newer chain
has replaced may vanish or change under a reader between chain.json and the file: the
header's size and sha256 (the same header a pushed payload carries) catch that, and the
reader tries again at its next sync. A read that fails (EIO, or ESTALE from NFS when the
trainer replaced a file the reader holds) is StoreUnreadable too, never an OSError.

Each entry carries the trainer's signature over the run and its header
(push_signing.payload_text): whoever else can write the volume cannot make a generator that
knows the trainer's key apply anything (generator.Generator.check_catch_up).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from google.protobuf import json_format

from rollstream.core import weight_transfer
from rollstream.core.deltas import DeltaError, PayloadInfo
from rollstream.v1 import weights_pb2

MANIFEST = "chain.json"
FORMAT = "rollstream-weight-store/1"

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
        "format": FORMAT,
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
        if body.get("format") != FORMAT:
            raise StoreUnreadable(f"{path}: format {body.get('format')!r}, not {FORMAT!r}")
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


class FileSlices:
    """The first `size` bytes of an open file, read in contiguous slices with pread (never
    mapped into memory): a payload as weight_transfer.to_chunks reads it. The store's files
    here; the trainer's file-held anchor (publisher.PayloadFile) too."""

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


def chunks(directory: Path, payloads: Sequence[StoredPayload]) -> Iterator[weights_pb2.WeightChunk]:
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
            for chunk in weight_transfer.to_chunks(FileSlices(fd, p.header.total_bytes), p.info, header=p.header):
                if chunk.HasField("header"):
                    chunk.signature = p.signature
                yield chunk
        except OSError as e:  # EIO, ESTALE, EISDIR...: this sync fails, the next one reads again
            raise StoreUnreadable(f"{directory / p.file}: read failed: {e.strerror or e}") from e
        finally:
            os.close(fd)
