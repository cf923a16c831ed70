"""Weight sync payloads: anchors (all weights) and exact sparse deltas, as safetensors.

Weights are dicts of Hugging Face name -> uint16 numpy array of bf16 bit patterns (see
safetensors_io for why bits). A delta from `base_version` to `version` holds, per tensor
that changed, the changed positions and what to write there. Per tensor it picks the
smallest of:
  positions: a packed bitmask (n/8 bytes) or delta-coded indices (uint32 gaps);
  values:    the new bf16 bits, or the ULP steps (new bits - base bits, int16 that wraps
             exactly): at RL learning rates most changes are a few ULPs, which compress
             better than the values themselves;
each part zstd-compressed when that is smaller. Decoding is exact given the base; a payload
whose base or model does not match what the receiver holds is refused. Each changed
tensor also carries the xxh3-64 hash of its new bits, checked after decoding: a corrupted
part, or a base with the right version number but other contents (a trainer restarted
from scratch), is refused instead of silently producing wrong weights.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard

from rollstream.core import safetensors_io

FORMAT = "rollstream.weights"
FORMAT_VERSION = "1"
ZSTD_LEVEL = 3

Weights = dict[str, np.ndarray]  # name -> uint16 bf16 bits


class DeltaError(ValueError):
    """A payload that must be refused: corrupt, for another model, or for another base."""


@dataclass
class PayloadInfo:
    kind: str  # "anchor" | "delta"
    base_version: int
    version: int
    fingerprint: str


@dataclass
class DeltaStats:
    changed_tensors: int = 0
    changed_values: int = 0
    total_values: int = 0
    nbytes: int = 0
    dense_bytes: int = 0
    encodings: dict[str, int] = field(default_factory=dict)

    @property
    def fraction_of_dense(self) -> float:
        return self.nbytes / self.dense_bytes if self.dense_bytes else 0.0


def model_fingerprint(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """Identifies the architecture (names and shapes): a delta for another model is refused."""
    h = hashlib.sha256()
    for name in sorted(shapes):
        h.update(f"{name}:{tuple(shapes[name])}\n".encode())
    return h.hexdigest()[:16]


def weights_sha256(weights: Mapping[str, np.ndarray]) -> str:
    """Content hash of a weight set (names sorted); equal hashes = bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).data)
    return h.hexdigest()


def _meta(kind: str, base_version: int, version: int, fingerprint: str, **extra: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "base_version": str(base_version),
        "version": str(version),
        "fingerprint": fingerprint,
        **extra,
    }


def encode_anchor(weights: Mapping[str, np.ndarray], version: int, fingerprint: str) -> bytes:
    """All weights as plain BF16 safetensors (loadable by any safetensors reader)."""
    return safetensors_io.dumps(dict(weights), _meta("anchor", version, version, fingerprint), bf16=set(weights))


def write_anchor(f: BinaryIO, weights: Mapping[str, np.ndarray], version: int, fingerprint: str) -> int:
    """encode_anchor's bytes, written to the binary file `f` tensor by tensor instead of
    returned whole (a 14B anchor is 29.6 GB); returns the bytes written."""
    return safetensors_io.dump_to(f, weights, _meta("anchor", version, version, fingerprint), bf16=set(weights))


def _bits_hash(bits: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(bits).data)


def _maybe_zstd(raw: bytes, cctx: zstandard.ZstdCompressor) -> tuple[bytes, bool]:
    packed = cctx.compress(raw)
    return (packed, True) if len(packed) < len(raw) else (raw, False)


@dataclass(frozen=True)
class _Encoded:
    info: dict
    pos: bytes
    val: bytes


@dataclass(frozen=True)
class _Changes:
    """What changed in one piece of a tensor: positions in the whole (flattened) tensor, the
    new bits there and their ULP steps from the base, and the piece's new bits (a view, for
    the tensor's hash)."""

    start: int
    idx: np.ndarray
    values: np.ndarray
    steps: np.ndarray
    new: np.ndarray


def _changes(start: int, base: np.ndarray, new: np.ndarray) -> _Changes:
    """Safe to run on several threads at once: numpy's comparisons release the GIL."""
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    idx = np.flatnonzero(flat_base != flat_new)
    values = flat_new[idx]
    steps = values - flat_base[idx]  # uint16 arithmetic wraps: exactly invertible
    return _Changes(start, idx + start, values, steps, flat_new)


_MASK_CHUNK = 1 << 23  # positions per packbits call (a multiple of 8): 8 MB of bools at most


def _packed_mask(idx: np.ndarray, size: int) -> bytes:
    """np.packbits of the bool vector that is True at the sorted positions `idx`, without
    making the whole vector (for a 778M-value embedding that would be 778 MB)."""
    out = bytearray()
    chunk = np.zeros(min(size, _MASK_CHUNK), dtype=bool)
    for start in range(0, size, _MASK_CHUNK):
        end = min(size, start + _MASK_CHUNK)
        lo, hi = np.searchsorted(idx, [start, end])
        part = chunk[: end - start]
        part[:] = False
        part[idx[lo:hi] - start] = True
        out += np.packbits(part).tobytes()
    return bytes(out)


def _encode_changes(shape: tuple[int, ...], size: int, pieces: list[_Changes]) -> _Encoded | None:
    """One tensor's part of a delta from the changes of its pieces, which cover it exactly
    (None: unchanged). Safe to run on several threads at once (zstd releases the GIL too, and
    the compressor is this call's own)."""
    pieces = sorted(pieces, key=lambda c: c.start)
    idx = np.concatenate([c.idx for c in pieces])
    if idx.size == 0:
        return None
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    gaps_raw = np.diff(idx, prepend=0).astype("<u4").tobytes()
    pos_options = [("mask", *_maybe_zstd(_packed_mask(idx, size), cctx)), ("idx", *_maybe_zstd(gaps_raw, cctx))]
    pos_kind, pos_bytes, pos_z = min(pos_options, key=lambda o: len(o[1]))
    values = np.concatenate([c.values for c in pieces]).astype("<u2").tobytes()
    steps = np.concatenate([c.steps for c in pieces]).astype("<u2").tobytes()
    val_options = [("bf16", *_maybe_zstd(values, cctx)), ("ulp", *_maybe_zstd(steps, cctx))]
    val_kind, val_bytes, val_z = min(val_options, key=lambda o: len(o[1]))
    hasher = xxhash.xxh3_64()
    for c in pieces:
        hasher.update(np.ascontiguousarray(c.new).data)
    info = {"shape": list(shape), "count": int(idx.size), "pos": pos_kind, "pos_zstd": pos_z, "val": val_kind, "val_zstd": val_z, "xxh3": hasher.hexdigest()}
    return _Encoded(info, pos_bytes, val_bytes)


def _encode_tensor(base: np.ndarray, new: np.ndarray) -> _Encoded | None:
    """One tensor's part of a delta, from its base and new bits (None: unchanged)."""
    return _encode_changes(base.shape, base.size, [_changes(0, base, new)])


def _finish_pieces(shape: tuple[int, ...], size: int, pieces: list[Future[_Changes] | _Changes]) -> _Encoded | None:
    # On the encoder's pool, each piece's future was submitted before this call: it is
    # running or done, never queued behind this one.
    return _encode_changes(shape, size, [p.result() if isinstance(p, Future) else p for p in pieces])


@dataclass
class _Partial:
    """A tensor of which some pieces were added (DeltaEncoder.add_piece)."""

    pieces: list[Future[_Changes] | _Changes] = field(default_factory=list)
    covered: int = 0


class DeltaEncoder:
    """An exact delta from `base` built as the new bits become final: a tensor at a time
    (`add`), or a piece of a tensor at a time with that piece's base bits (`add_piece`, which
    the trainer's optimizer calls as it steps each bucket: HostAdamW.step's `on_piece`). So
    the delta is encoded while the step still runs, on `executor`'s threads when one is
    given, instead of in one pass over every tensor after the step; and a layout that
    overwrites the previous version in place hands over each piece's old bits just before.
    The payload is the same bytes whatever the order of the calls, the pieces or the number
    of threads (tensors go in by name).

    The `new` arrays given must not change until `finish` returns. Old bits given to
    add_piece are the encoder's: at most `max_pending_bytes` of them wait for a thread
    (add_piece then waits), so a slow encoder holds back the step instead of memory."""

    def __init__(
        self, base: Mapping[str, np.ndarray], base_version: int, version: int, fingerprint: str, executor: Executor | None = None,
        max_pending_bytes: int = 256 << 20,
    ):
        self.base = base
        self.base_version, self.version, self.fingerprint = base_version, version, fingerprint
        self._executor = executor
        self._parts: dict[str, Future[_Encoded | None] | _Encoded | None] = {}
        self._partial: dict[str, _Partial] = {}
        self._max_pending = max_pending_bytes
        self._pending: collections.deque[tuple[Future[_Changes], int]] = collections.deque()
        self._pending_bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self._parts or name in self._partial

    def _base_of(self, name: str) -> np.ndarray:
        if name not in self.base:
            raise DeltaError(f"{name} is not a tensor of the base weights")
        if name in self._parts:
            raise DeltaError(f"{name} was added twice")
        return self.base[name]

    def add(self, name: str, new: np.ndarray) -> None:
        base = self._base_of(name)
        if name in self._partial:
            raise DeltaError(f"{name} was added twice")
        if base.shape != new.shape:
            raise DeltaError(f"{name}: shape {base.shape} != {new.shape}")
        self._parts[name] = self._executor.submit(_encode_tensor, base, new) if self._executor else _encode_tensor(base, new)

    def add_piece(self, name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        """The flattened elements [start, start + new.size) of tensor `name`: `old` are their
        bits in the base, `new` now. The tensor is encoded once its pieces cover it."""
        size = self._base_of(name).size
        if old.shape != new.shape or start < 0 or start + new.size > size:
            raise DeltaError(f"{name}: piece [{start}, {start + new.size}) of {size} values with {old.size} old bits")
        partial = self._partial.setdefault(name, _Partial())
        if partial.covered + new.size > size:
            raise DeltaError(f"{name}: pieces would cover {partial.covered + new.size} of {size} values (one added twice)")
        partial.covered += new.size
        if self._executor is None:
            partial.pieces.append(_changes(start, old, new))
        else:
            self._wait_for_room(old.nbytes)
            future = self._executor.submit(_changes, start, old, new)
            self._pending.append((future, old.nbytes))
            self._pending_bytes += old.nbytes
            partial.pieces.append(future)
        if partial.covered == size:
            del self._partial[name]
            shape = self.base[name].shape
            self._parts[name] = self._executor.submit(_finish_pieces, shape, size, partial.pieces) if self._executor else _finish_pieces(shape, size, partial.pieces)

    def _wait_for_room(self, nbytes: int) -> None:
        while self._pending and (self._pending_bytes + nbytes > self._max_pending or self._pending[0][0].done()):
            future, held = self._pending.popleft()
            future.result()
            self._pending_bytes -= held

    def finish(self) -> tuple[bytes, DeltaStats]:
        """The payload, once every tensor of the base was added."""
        if self._partial:
            name, partial = next(iter(self._partial.items()))
            raise DeltaError(f"{name}: pieces cover {partial.covered} of {self.base[name].size} values")
        if self._parts.keys() != self.base.keys():
            raise DeltaError(f"weight names differ: {sorted(set(self.base) ^ set(self._parts))[:5]}")
        stats = DeltaStats()
        arrays: dict[str, np.ndarray] = {}
        infos: dict[str, dict] = {}
        for name in sorted(self.base):
            part = self._parts[name]
            encoded = part.result() if isinstance(part, Future) else part
            size = self.base[name].size
            stats.total_values += size
            stats.dense_bytes += size * 2
            if encoded is None:
                continue
            infos[name] = encoded.info
            arrays[f"{name}::pos"] = np.frombuffer(encoded.pos, dtype=np.uint8)
            arrays[f"{name}::val"] = np.frombuffer(encoded.val, dtype=np.uint8)
            stats.changed_tensors += 1
            stats.changed_values += encoded.info["count"]
            key = f"{encoded.info['pos']}+{encoded.info['val']}"
            stats.encodings[key] = stats.encodings.get(key, 0) + 1
        meta = _meta("delta", self.base_version, self.version, self.fingerprint, tensors=json.dumps(infos, separators=(",", ":")))
        payload = safetensors_io.dumps(arrays, meta)
        stats.nbytes = len(payload)
        return payload, stats


def encode_delta(base: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], base_version: int, version: int, fingerprint: str) -> tuple[bytes, DeltaStats]:
    """Exact delta turning `base` into `new` (same names and shapes)."""
    if base.keys() != new.keys():
        raise DeltaError(f"weight names differ: {sorted(set(base) ^ set(new))[:5]}")
    encoder = DeltaEncoder(base, base_version, version, fingerprint)
    for name in sorted(base):
        encoder.add(name, new[name])
    return encoder.finish()


def read_info(payload: bytes | memoryview) -> tuple[PayloadInfo, dict[str, str], dict[str, np.ndarray]]:
    try:
        meta, arrays = safetensors_io.loads(payload)
    except safetensors_io.SafetensorsError as e:
        raise DeltaError(f"not a valid safetensors payload: {e}") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise DeltaError(f"not a {FORMAT} v{FORMAT_VERSION} payload (format={meta.get('format')!r}, version={meta.get('format_version')!r})")
    try:
        info = PayloadInfo(kind=meta["kind"], base_version=int(meta["base_version"]), version=int(meta["version"]), fingerprint=meta["fingerprint"])
    except (KeyError, ValueError) as e:
        raise DeltaError(f"payload metadata incomplete: {e}") from None
    if info.kind not in ("anchor", "delta"):
        raise DeltaError(f"unknown payload kind {info.kind!r}")
    return info, meta, arrays


def decode(payload: bytes | memoryview, held: Mapping[str, np.ndarray], held_version: int | None, fingerprint: str) -> tuple[PayloadInfo, Weights]:
    """Decode a payload against the weights held; returns the tensors to replace.

    Nothing in `held` is modified, so a refused payload leaves the receiver as it was.
    `held_version=None` means the receiver holds nothing it trusts (accepts anchors only).
    Every tensor returned is finite: a payload carrying a bf16 NaN or inf is refused.
    """
    info, meta, arrays = read_info(payload)
    if info.fingerprint != fingerprint:
        raise DeltaError(f"payload is for model {info.fingerprint}, this one is {fingerprint}")
    if info.kind == "anchor":
        if set(arrays) != set(held):
            missing = sorted(set(held) - set(arrays))[:3]
            extra = sorted(set(arrays) - set(held))[:3]
            raise DeltaError(f"anchor tensors differ from the model (missing {missing}, unexpected {extra})")
        for name, array in arrays.items():
            if array.shape != held[name].shape or array.dtype != np.uint16:
                raise DeltaError(f"anchor {name}: {array.dtype}{array.shape} != bf16{held[name].shape}")
            _refuse_nonfinite(f"anchor {name}", array)
        return info, {name: array.copy() for name, array in arrays.items()}
    if held_version is None or info.base_version != held_version:
        raise DeltaError(f"delta base is version {info.base_version}, this holds version {held_version}: fetch anchor + deltas")
    if info.version <= info.base_version:
        raise DeltaError(f"delta goes backwards: {info.base_version} -> {info.version}")
    try:
        infos = json.loads(meta["tensors"])
    except (KeyError, ValueError, RecursionError) as e:
        raise DeltaError(f"delta has no valid tensor table: {e}") from None
    if not isinstance(infos, dict):
        raise DeltaError(f"delta tensor table is a JSON {type(infos).__name__}, not an object")
    dctx = zstandard.ZstdDecompressor()
    out: Weights = {}
    for name, t in infos.items():
        if name not in held:
            raise DeltaError(f"delta touches unknown tensor {name}")
        base = held[name]
        if not isinstance(t, dict):
            raise DeltaError(f"{name}: delta entry {str(t)[:80]} is not an object")
        if list(base.shape) != t.get("shape"):
            raise DeltaError(f"{name}: delta shape {str(t.get('shape'))[:80]} != held {list(base.shape)}")
        try:
            out[name] = _apply_tensor(base, t, arrays[f"{name}::pos"], arrays[f"{name}::val"], dctx)
        except (KeyError, TypeError, ValueError, zstandard.ZstdError) as e:
            raise DeltaError(f"{name}: corrupt delta ({e})") from None
        # The hash above proves these are the trainer's bits, not that the trainer was sane.
        _refuse_nonfinite(name, out[name])
    return info, out


def _refuse_nonfinite(name: str, bits: np.ndarray, chunk: int = 1 << 20) -> None:
    """Raise DeltaError if any bf16 value is NaN or +-inf (exponent bits all ones).

    A trainer whose loss diverged publishes such weights with a valid hash; a generator
    that applied them would sample garbage (or crash) for every task after. In chunks with
    one reused buffer: ~30 ms for 135M values, where whole-array temporaries take ~120 ms.
    """
    flat = bits.reshape(-1)
    buf = np.empty(min(chunk, flat.size), dtype=np.uint16)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        masked = buf[: part.size]
        np.bitwise_and(part, 0x7F80, out=masked)
        hits = masked == 0x7F80
        if hits.any():
            i = start + int(np.argmax(hits))
            raise DeltaError(f"{name}: value {i} is not finite (bf16 bits 0x{int(flat[i]):04X}); refusing weights from a diverged trainer")


def _apply_tensor(base: np.ndarray, t: dict, pos: np.ndarray, val: np.ndarray, dctx: zstandard.ZstdDecompressor) -> np.ndarray:
    count = int(t["count"])
    pos_raw = dctx.decompress(pos.tobytes()) if t["pos_zstd"] else pos.tobytes()
    val_raw = dctx.decompress(val.tobytes()) if t["val_zstd"] else val.tobytes()
    flat = base.reshape(-1)
    if t["pos"] == "mask":
        mask = np.unpackbits(np.frombuffer(pos_raw, dtype=np.uint8), count=flat.size).astype(bool)
        idx = np.flatnonzero(mask)
    elif t["pos"] == "idx":
        idx = np.cumsum(np.frombuffer(pos_raw, dtype="<u4").astype(np.int64))
    else:
        raise ValueError(f"unknown position encoding {t['pos']!r}")
    values = np.frombuffer(val_raw, dtype="<u2")
    if idx.size != count or values.size != count or (count and (idx[-1] >= flat.size or idx[0] < 0)):
        raise ValueError(f"{idx.size} positions / {values.size} values for count {count} in {flat.size}")
    new = flat.copy()
    if t["val"] == "bf16":
        new[idx] = values
    elif t["val"] == "ulp":
        new[idx] = flat[idx] + values  # uint16 wrap-around inverts the encoder's subtraction
    else:
        raise ValueError(f"unknown value encoding {t['val']!r}")
    if _bits_hash(new) != t["xxh3"]:
        raise ValueError("decoded weights do not hash to the trainer's (corrupted part, or a different base)")
    return new.reshape(base.shape)
