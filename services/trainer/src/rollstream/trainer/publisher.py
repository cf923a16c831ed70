"""Publishing policy versions: each encoded once (an anchor or an exact delta) into the payload
every way out reads, and kept for catch-up.

A payload (Published) is in memory or in a file it is streamed to (PayloadFile), hashed once
whatever the number of generators it goes to, its chunks serialized once a push or read from its
file as each stream goes (FileWire); the encoding is rollstream.core.deltas'. The publisher keeps
the bits it last published (the base of the next delta), the latest anchor and every delta since
it, so a generator holding any version from that anchor on (or nothing at all) can be brought to
the current version by FetchWeights (servicer.py). With anchor_dir they are files there too, named
by the weight store's chain.json (StoreFiles: rollstream.core.weight_transfer). Pushing each version
to the generators is fleet.py's (Fleet, BackgroundPush).

While nobody reads a delta (Readers) the trainer encodes none: `skip` advances the version
and drops the chain, which would have a hole; `reanchor` starts a new one from the current
bits the moment a reader appears (docs/design-notes.md, "No delta while nobody reads it").
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import deltas, push_signing, run_keys, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.trainer.fleet import NONCE_TIMEOUT_S, STALL_S, BackgroundPush, Fleet
from rollstream.v1 import weights_pb2

log = logging.getLogger(__name__)
ANCHOR_FILE = "anchor.safetensors"  # in the store's directory
DELTA_FILES = "delta-*.safetensors"  # in the store's directory: the deltas since the anchor
# A FetchWeights makes its caller a reader this long: a generator polls every sync_interval_s
# (2 s), so it is seen again long before; the registry forgets a silent generator as late.
READER_GRACE_S = run_keys.GENERATOR_TTL_S
NO_READER = f"no reader: no configured push target, no registered generator with an address, no FetchWeights in {READER_GRACE_S:.0f} s"


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


class Readers:
    """Who may read the next version's delta, as the trainer last saw it. While nobody does, the
    trainer encodes no delta (Trainer.train_step); the version still advances. Conservative:
    a wrong skip costs an anchor when the reader shows up, a wrong encode only the encoder's
    time, so each of these counts as a reader:
    - configured push targets or a DNS name (GeneratorDirectory not from the registry),
      whatever they resolve to at the moment;
    - a live registry generator with an address: every standalone generator registers one
      (host:port or advertise_address), and a weight store's readers are such generators;
      only a colocated generator registers none (it samples the trainer's own weights);
    - a FetchWeights in the last READER_GRACE_S (a caller missing from the registry);
    - no look yet (a trainer before its loop's first look at the registry, or outside a loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._looked = False
        self._configured = False
        self._targets: list[str] = []
        self._fetched_at: float | None = None
        self._lock = threading.Lock()

    def saw(self, targets: Sequence[str], from_registry: bool) -> None:
        """The push targets now (the loop's look, after each step and at its start)."""
        with self._lock:
            self._looked, self._configured, self._targets = True, not from_registry, list(targets)

    def fetched(self) -> None:
        """A FetchWeights came."""
        with self._lock:
            self._fetched_at = self._clock()

    def reader(self) -> str:
        """Who reads, in words ("": nobody)."""
        with self._lock:
            if not self._looked:
                return "no look at the push targets yet"
            if self._configured:
                return "configured push targets (generators / generators_dns)"
            if self._targets:
                return (
                    f"registered generators: {', '.join(self._targets[:4])}{' ...' if len(self._targets) > 4 else ''}"
                )
            if self._fetched_at is not None and (ago := self._clock() - self._fetched_at) < READER_GRACE_S:
                return f"a FetchWeights {ago:.0f} s ago"
            return ""


class WeightPublisher:
    def __init__(
        self,
        bits: Mapping[str, np.ndarray],
        anchor_interval: int,
        version: int = 0,
        creds: ClientCredentials | None = None,
        encode_threads: int = 0,
        anchor_dir: Path | None = None,
        generator_key: Ed25519PublicKey | None = None,
        run: str = "",
        nonce_timeout_s: float = NONCE_TIMEOUT_S,
        stall_s: float = STALL_S,
    ):
        """`creds`: the trainer's token, which signs pushes and catch-up payloads and is
        never sent, and TLS material (Fleet); None: unsigned, in the clear (generators without
        grpc_auth_file). `encode_threads`: threads that
        encode a delta's tensors while the step still runs (0: on the caller's thread).
        `anchor_dir`: keep the anchor in a file there (PayloadFile), not in memory.
        `generator_key`, `nonce_timeout_s`, `stall_s`: how pushes check and watch generators
        (Fleet). `run`: what the catch-up signatures (FetchWeights, the store's chain.json) are
        bound to."""
        self.fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits.items()})
        self.anchor_interval = anchor_interval
        self.store = StoreFiles(anchor_dir) if anchor_dir is not None else None
        self._deltas: list[Published] = []  # since the anchor
        self._anchor: Published | None = None  # None: no chain (deltas skipped), until reanchor
        self.readers = Readers()
        # The push key signs what generators catch up from too (push_signing.TrainerSigner).
        self.catch_up_signer = (
            push_signing.TrainerSigner(creds.token, run) if creds is not None and creds.token else None
        )
        self.fleet = Fleet(creds, generator_key, nonce_timeout_s, stall_s)
        self.pushes = BackgroundPush(version)
        self._lock = threading.Lock()
        self._encode_pool = (
            ThreadPoolExecutor(max_workers=encode_threads, thread_name_prefix="delta") if encode_threads else None
        )
        self._set_anchor(dict(bits), version)

    @property
    def version(self) -> int:
        return self._version

    def bits(self) -> dict[str, np.ndarray]:
        return self._bits

    @property
    def has_chain(self) -> bool:
        """Whether an anchor and every delta since it reach the current version (False once a
        version was published without a delta: `skip`)."""
        with self._lock:
            return self._anchor is not None

    def reanchor(self) -> Published:
        """A new chain from the bits published now: their anchor (filed with chain.json as any
        anchor), no deltas; the next delta is encoded from these bits. Under the trainer's
        weights lock: in the split master layout the bits are the masters' views, which a step
        rewrites in place."""
        self._set_anchor(dict(self._bits), self._version)
        with self._lock:
            assert self._anchor is not None
            return self._anchor

    def skip(self, new_bits: Mapping[str, np.ndarray]) -> deltas.DeltaStats:
        """The next version, published without a delta (nobody reads it: Readers). The chain
        would now have a hole, so it goes, chain.json first: while deltas are skipped the
        store holds no chain (a reader finds "no chain yet" and asks the trainer or waits,
        never applies a version older than the trainer's as the newest), and catch-up needs
        `reanchor` first. Returns the stats of an empty delta (nbytes 0)."""
        with self._lock:
            dropped = [self._anchor, *self._deltas] if self._anchor is not None else []
            self._bits = dict(new_bits)
            self._version += 1
            self._anchor, self._deltas = None, []
        if dropped:
            self._write_manifest()  # no chain: chain.json removed before its files
            unlink_files(dropped)
        values = sum(b.size for b in self._bits.values())
        return deltas.DeltaStats(total_values=values, dense_bytes=2 * values)

    def _set_anchor(self, bits: dict[str, np.ndarray], version: int) -> None:
        info = deltas.PayloadInfo("anchor", version, version, self.fingerprint)
        hashing = HashingWriter()  # streamed to its file: no anchor bytes in memory
        filed = (
            self.store.file(
                info,
                lambda f: deltas.write_anchor(hashing.into(f), bits, version, self.fingerprint),
                lambda: hashing.header(info),
            )
            if self.store
            else None
        )
        anchor = filed or Published(info, deltas.encode_anchor(bits, version, self.fingerprint))
        with self._lock:
            self._bits = bits
            self._version = version
            self._anchor = anchor
            replaced, self._deltas = self._deltas, []
        self._write_manifest()
        unlink_files(replaced)

    def begin_delta(self) -> deltas.DeltaEncoder:
        """An encoder for the next version's delta, to be fed tensor by tensor as the step
        produces them (HostAdamW.step's on_piece) and handed to publish()."""
        return deltas.DeltaEncoder(
            self._bits, self._version, self._version + 1, self.fingerprint, executor=self._encode_pool
        )

    def publish(
        self, new_bits: Mapping[str, np.ndarray], encoder: deltas.DeltaEncoder | None = None
    ) -> tuple[Published, deltas.DeltaStats]:
        """Encode the delta from the last published version (the tensors not yet given to
        `encoder`, from begin_delta, are added now); every anchor_interval versions also
        start a new anchor (older deltas are then no longer needed). With anchor_dir the delta
        goes to its file and the store's chain before it is returned for pushing, so a
        generator the push misses finds it there; the chain keeps only the file (up to
        anchor_interval deltas of 2-6 % of the bf16 weights each would otherwise sit in the
        trainer's memory, issue 28) and the bytes returned live as long as the push."""
        base = self._version
        if not self.has_chain:  # the base's bits may be gone (rewritten in place): nothing to anchor the delta on
            raise deltas.DeltaError(
                f"no chain reaches version {base} (deltas were skipped): reanchor before publishing a delta"
            )
        if encoder is None:
            encoder = self.begin_delta()
        elif encoder.base_version != base or encoder.base is not self._bits:
            raise deltas.DeltaError(
                f"the encoder's base is version {encoder.base_version}, the last published is {base}"
            )
        for name in sorted(new_bits):
            if name not in encoder:
                encoder.add(name, new_bits[name])
        payload, stats = encoder.finish()
        delta = Published(deltas.PayloadInfo("delta", base, base + 1, self.fingerprint), payload)
        if (base + 1) % self.anchor_interval == 0:
            self._set_anchor(dict(new_bits), base + 1)
            return delta, stats
        kept = (self.store.file(delta.info, lambda f: f.write(payload), delta.header) if self.store else None) or delta
        with self._lock:
            self._bits = dict(new_bits)
            self._version = base + 1
            self._deltas.append(kept)
        self._write_manifest()
        return delta, stats

    def _write_manifest(self) -> None:
        """The store's chain.json for the anchor and deltas now kept (StoreFiles)."""
        if self.store is None:
            return
        with self._lock:
            kept = [self._anchor, *self._deltas] if self._anchor is not None else []
        self.store.write_manifest(kept, self._signature)

    def check_fingerprint(self, fingerprint: str) -> None:
        """Raises DeltaError when a caller's model (its fingerprint; "": not said) is not this one."""
        if fingerprint and fingerprint != self.fingerprint:
            raise deltas.DeltaError(f"generator model {fingerprint} is not the trainer's {self.fingerprint}")

    def catch_up_payloads(self, have_version: int, fingerprint: str) -> list[Published]:
        """What a generator holding `have_version` (-1: nothing) needs, in order."""
        self.check_fingerprint(fingerprint)
        with self._lock:
            anchor, chain = self._anchor, list(self._deltas)
        if anchor is None:
            raise deltas.DeltaError(f"no chain reaches version {self._version} yet (deltas were skipped): try again")
        return weight_transfer.catch_up_chain(have_version, anchor, chain, lambda p: p.info)

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

    def close(self) -> None:
        self.pushes.wait()  # bounded by the nonce and stall deadlines (Watch); calls still open are cancelled below
        if self.store is not None:  # the chain first: no generator reads files that are going
            self.store.withdraw()
        unlink_files([p for p in [self._anchor, *self._deltas] if p is not None])
        self.fleet.close()
