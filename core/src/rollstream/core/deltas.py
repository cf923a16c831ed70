"""Weight sync payloads: anchors (all weights) and exact sparse deltas, as safetensors.

Weights are dicts of Hugging Face name -> uint16 numpy array of bf16 bit patterns (see
safetensors_io for why bits). A delta from `base_version` to `version` holds, per tensor
that changed, the smallest of:
  positions: a packed bitmask (n/8 bytes) or delta-coded indices (uint32 gaps);
  values:    the new bf16 bits, or the ULP steps (new bits - base bits, int16 that wraps
             exactly): at RL learning rates most changes are a few ULPs, which compress
             better than the values themselves;
each part zstd-compressed when that is smaller. Decoding is exact given the base; a payload
whose base or model does not match what the receiver holds is refused. Each changed tensor
also carries the xxh3-64 hash of its new bits, checked after decoding: a corrupted part, or
a base with the right version number but other contents (a trainer restarted from scratch),
is refused instead of silently producing wrong weights.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash
import zstandard

from rollstream.core import safetensors_io

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

FORMAT = "rollstream.weights"
FORMAT_VERSION = "1"
ZSTD_LEVEL = 3
# Positions are uint32 gaps in the idx encoding (the mask has no such limit, but both are tried).
MAX_TENSOR_VALUES = 1 << 32
_CHUNK = 1 << 23  # positions at a time (a multiple of 8): 8 MB of bools and 64 MB of int64 positions at most

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


def write_anchor(
    f: SupportsWrite[bytes | memoryview], weights: Mapping[str, np.ndarray], version: int, fingerprint: str
) -> int:
    """encode_anchor's bytes, written to the binary file `f` tensor by tensor instead of
    returned whole (a 14B anchor is 29.6 GB); returns the bytes written."""
    return safetensors_io.dump_to(f, weights, _meta("anchor", version, version, fingerprint), bf16=set(weights))


def _maybe_zstd(raw: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[np.ndarray, bool]:
    """The bytes of `raw` (a C-contiguous little-endian array), zstd-compressed when that is
    smaller, as uint8: no copy of `raw` (zstd reads any buffer)."""
    packed = cctx.compress(raw)  # type: ignore[arg-type]  # a buffer; numpy's stubs say so from Python 3.12
    if len(packed) < raw.nbytes:
        return np.frombuffer(packed, dtype=np.uint8), True
    return raw.view(np.uint8), False


@dataclass(frozen=True)
class Encoded:
    info: dict
    pos: np.ndarray  # uint8
    val: np.ndarray  # uint8


@dataclass(frozen=True)
class Changes:
    """What changed in the flattened elements [start, start + new.size) of a tensor, kept until
    the tensor's pieces cover it, in a bit per value and 2 bytes per changed value: the changed
    positions as the piece's bytes of the tensor's packed mask (bits outside the piece zero),
    their ULP steps from the base (whose bits are not kept: the split layout overwrites them),
    and the piece's new bits (a view: read back at the positions, and hashed, once encoded)."""

    start: int
    mask: np.ndarray  # uint8
    steps: np.ndarray  # uint16
    new: np.ndarray  # flat


def changes(start: int, base: np.ndarray, new: np.ndarray) -> Changes:
    """Safe to run on several threads at once: numpy's comparisons release the GIL. Makes a
    bool per value of the piece (a bucket's part of a tensor, or _CHUNK) and int64 positions
    of its changes (gathering at them is faster than indexing with the bools)."""
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    lead = start % 8  # the piece's first bit in its first mask byte
    changed = np.zeros(lead + flat_new.size, dtype=bool)
    np.not_equal(flat_base, flat_new, out=changed[lead:])
    idx = np.flatnonzero(changed[lead:])
    steps = flat_new[idx] - flat_base[idx]  # uint16 arithmetic wraps: exactly invertible
    return Changes(start, np.packbits(changed), steps, flat_new)


def _gaps_and_values(mask: np.ndarray, pieces: list[Changes], count: int) -> tuple[np.ndarray, np.ndarray]:
    """In one pass over the changed positions (finding them is most of the work), _CHUNK at a
    time (the whole tensor's int64 positions, 8 bytes a change, never exist): the idx encoding's
    uint32 gaps between successive changed positions, the first from position 0
    (np.diff(positions, prepend=0)), and the new bits there, read back from the pieces'."""
    gaps = np.empty(count, dtype="<u4")
    values = np.empty(count, dtype="<u2")
    at, last = 0, 0
    for c in pieces:
        for lo in range(c.start, c.start + c.new.size, _CHUNK):
            hi = min(c.start + c.new.size, lo + _CHUNK)
            bits = np.unpackbits(mask[lo // 8 : (hi + 7) // 8]).view(bool)  # flatnonzero: 5x faster on bools
            local = np.flatnonzero(bits[lo % 8 : lo % 8 + hi - lo])
            if local.size == 0:
                continue
            out = gaps[at : at + local.size]
            out[0] = lo + int(local[0]) - last  # from the previous chunk's (or piece's) last position
            np.subtract(local[1:], local[:-1], out=out[1:], casting="unsafe")  # < MAX_TENSOR_VALUES: fits
            last = lo + int(local[-1])
            np.take(c.new, local + (lo - c.start), out=values[at : at + local.size])
            at += local.size
    return gaps, values


def encode_changes(shape: tuple[int, ...], size: int, pieces: list[Changes]) -> Encoded | None:
    """One tensor's part of a delta from the changes of its pieces, which cover it exactly
    (None: unchanged); safe on several threads at once (zstd releases the GIL, the compressor
    is this call's own). Each candidate encoding is made, compressed and dropped unless it is
    the smallest so far (ties go to the first: mask before idx, bf16 before ulp), so beside
    the pieces this holds at most the mask, one candidate's raw bytes (6 per changed value for
    idx and the bf16 values, made in one pass) and the compressed winners."""
    pieces = sorted(pieces, key=lambda c: c.start)
    count = sum(c.steps.size for c in pieces)
    if count == 0:
        return None
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    # The tensor's packed mask: n/8 bytes (29 MB for a 233M-value embedding; uint32 positions: 4 a change)
    mask = np.zeros((size + 7) // 8, dtype=np.uint8)
    for c in pieces:
        part = mask[c.start // 8 : c.start // 8 + c.mask.size]
        part |= c.mask  # a piece that starts or ends inside a byte shares it with its neighbour
    pos_kind, (pos, pos_z) = "mask", _maybe_zstd(mask, cctx)
    raw_gaps, raw_values = _gaps_and_values(mask, pieces, count)
    del mask
    gaps, gaps_z = _maybe_zstd(raw_gaps, cctx)
    del raw_gaps
    if gaps.size < pos.size:
        pos_kind, pos, pos_z = "idx", gaps, gaps_z
    del gaps
    val_kind, (val, val_z) = "bf16", _maybe_zstd(raw_values, cctx)
    del raw_values
    steps, steps_z = _maybe_zstd(np.concatenate([c.steps for c in pieces]).astype("<u2", copy=False), cctx)
    if steps.size < val.size:
        val_kind, val, val_z = "ulp", steps, steps_z
    del steps
    hasher = xxhash.xxh3_64()
    for c in pieces:
        hasher.update(np.ascontiguousarray(c.new).data)
    info = {
        "shape": list(shape),
        "count": count,
        "pos": pos_kind,
        "pos_zstd": pos_z,
        "val": val_kind,
        "val_zstd": val_z,
        "xxh3": hasher.hexdigest(),
    }
    return Encoded(info, pos, val)


def encode_tensor(base: np.ndarray, new: np.ndarray) -> Encoded | None:
    """One tensor's part of a delta from its base and new bits (None: unchanged), its changes found
    _CHUNK values at a time (a bool and a uint16 per value of the whole tensor: 3 bytes a value)."""
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    pieces = [
        changes(lo, flat_base[lo : lo + _CHUNK], flat_new[lo : lo + _CHUNK]) for lo in range(0, flat_base.size, _CHUNK)
    ]
    return encode_changes(base.shape, base.size, pieces)


def finish_pieces(shape: tuple[int, ...], size: int, pieces: list[Future[Changes] | Changes]) -> Encoded | None:
    # On the encoder's pool each piece's future was submitted before this call: running or done, not behind it.
    return encode_changes(shape, size, [p.result() if isinstance(p, Future) else p for p in pieces])


@dataclass
class _Partial:  # a tensor of which some pieces were added (DeltaEncoder.add_piece)
    pieces: list[Future[Changes] | Changes] = field(default_factory=list)
    covered: int = 0


class DeltaEncoder:
    """An exact delta from `base` built as the new bits become final: a tensor at a time
    (`add`), or a piece of a tensor at a time with that piece's base bits (`add_piece`, which
    the trainer's optimizer calls as it steps each bucket: HostAdamW.step's `on_piece`). So
    the delta is encoded while the step still runs, on `executor`'s threads when one is
    given, and a layout that overwrites the previous version in place hands over each
    piece's old bits just before. The payload is the same bytes whatever the order of the
    calls, the pieces or the number of threads (tensors go in by name).

    The `new` arrays given must not change until `finish` returns. Old bits given to
    add_piece are the encoder's: at most `max_pending_bytes` of them wait for a thread
    (add_piece then waits), so a slow encoder holds back the step instead of memory. The
    bound only absorbs bursts, so it is small (64 MiB: 4 buckets of 32 MB fp32 masters' old bits)."""

    def __init__(
        self,
        base: Mapping[str, np.ndarray],
        base_version: int,
        version: int,
        fingerprint: str,
        executor: Executor | None = None,
        max_pending_bytes: int = 64 << 20,
    ):
        self.base = base
        self.base_version, self.version, self.fingerprint = base_version, version, fingerprint
        self._executor = executor
        self._parts: dict[str, Future[Encoded | None] | Encoded | None] = {}
        self._partial: dict[str, _Partial] = {}
        self._max_pending = max_pending_bytes
        self._pending: collections.deque[tuple[Future[Changes], int]] = collections.deque()
        self._pending_bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self._parts or name in self._partial

    def _base_of(self, name: str) -> np.ndarray:
        if name not in self.base:
            raise DeltaError(f"{name} is not a tensor of the base weights")
        if name in self._parts:
            raise DeltaError(f"{name} was added twice")
        if self.base[name].size > MAX_TENSOR_VALUES:
            raise DeltaError(
                f"{name} has {self.base[name].size} values: a delta's positions are uint32, at most {MAX_TENSOR_VALUES} values a tensor"
            )
        return self.base[name]

    def add(self, name: str, new: np.ndarray) -> None:
        base = self._base_of(name)
        if name in self._partial:
            raise DeltaError(f"{name} was added twice")
        if base.shape != new.shape:
            raise DeltaError(f"{name}: shape {base.shape} != {new.shape}")
        self._encode(name, encode_tensor, base, new)

    def add_piece(self, name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        """The flattened elements [start, start + new.size) of tensor `name`: `old` are their
        bits in the base, `new` now. The tensor is encoded once its pieces cover it."""
        size = self._base_of(name).size
        if old.shape != new.shape or start < 0 or start + new.size > size:
            raise DeltaError(f"{name}: piece [{start}, {start + new.size}) of {size} values with {old.size} old bits")
        partial = self._partial.setdefault(name, _Partial())
        if partial.covered + new.size > size:
            raise DeltaError(
                f"{name}: pieces would cover {partial.covered + new.size} of {size} values (one added twice)"
            )
        partial.covered += new.size
        if self._executor is None:
            partial.pieces.append(changes(start, old, new))
        else:
            self._wait_for_room(old.nbytes)
            future = self._executor.submit(changes, start, old, new)
            self._pending.append((future, old.nbytes))
            self._pending_bytes += old.nbytes
            partial.pieces.append(future)
        if partial.covered == size:
            del self._partial[name]
            self._encode(name, finish_pieces, self.base[name].shape, size, partial.pieces)

    def _encode(self, name: str, encode: Callable[..., Encoded | None], *args: object) -> None:
        self._parts[name] = self._executor.submit(encode, *args) if self._executor else encode(*args)

    def _wait_for_room(self, nbytes: int) -> None:
        while self._pending and (self._pending_bytes + nbytes > self._max_pending or self._pending[0][0].done()):
            future, held = self._pending.popleft()
            future.result()
            self._pending_bytes -= held

    def finish(self) -> tuple[bytes, DeltaStats]:
        """The payload, once every tensor of the base was added. The encoder lets go of each
        tensor's part as it is copied into the payload (so the two are not whole at once):
        finish once."""
        if self._partial:
            name, partial = next(iter(self._partial.items()))
            raise DeltaError(f"{name}: pieces cover {partial.covered} of {self.base[name].size} values")
        if self._parts.keys() != self.base.keys():
            raise DeltaError(f"weight names differ: {sorted(set(self.base) ^ set(self._parts))[:5]}")
        stats = DeltaStats()
        arrays: dict[str, np.ndarray] = {}
        infos: dict[str, dict] = {}
        for name in sorted(self.base):
            part = self._parts.pop(name)  # `arrays` the only holder of its bytes: dumps_taking frees them
            encoded = part.result() if isinstance(part, Future) else part
            size = self.base[name].size
            stats.total_values += size
            stats.dense_bytes += size * 2
            if encoded is None:
                continue
            infos[name] = encoded.info
            arrays[f"{name}::pos"] = encoded.pos
            arrays[f"{name}::val"] = encoded.val
            stats.changed_tensors += 1
            stats.changed_values += encoded.info["count"]
            key = f"{encoded.info['pos']}+{encoded.info['val']}"
            stats.encodings[key] = stats.encodings.get(key, 0) + 1
        # Every piece's tensor is encoded by now: the changes their futures hold go before the payload is made.
        self._pending.clear()
        self._pending_bytes = 0
        meta = _meta(
            "delta", self.base_version, self.version, self.fingerprint, tensors=json.dumps(infos, separators=(",", ":"))
        )
        payload = safetensors_io.dumps_taking(arrays, meta)
        stats.nbytes = len(payload)
        return payload, stats


def encode_delta(
    base: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], base_version: int, version: int, fingerprint: str
) -> tuple[bytes, DeltaStats]:
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
        raise DeltaError(
            f"not a {FORMAT} v{FORMAT_VERSION} payload (format={meta.get('format')!r}, version={meta.get('format_version')!r})"
        )
    try:
        info = PayloadInfo(meta["kind"], int(meta["base_version"]), int(meta["version"]), meta["fingerprint"])
    except (KeyError, ValueError) as e:
        raise DeltaError(f"payload metadata incomplete: {e}") from None
    if info.kind not in ("anchor", "delta"):
        raise DeltaError(f"unknown payload kind {info.kind!r}")
    return info, meta, arrays


def decode(
    payload: bytes | memoryview, held: Mapping[str, np.ndarray], held_version: int | None, fingerprint: str
) -> tuple[PayloadInfo, Weights]:
    """Decode a payload against the weights held; returns the tensors to replace. Nothing in
    `held` is modified, so a refused payload leaves the receiver as it was. `held_version=None`:
    the receiver holds nothing it trusts (accepts anchors only). Every tensor returned is
    finite: a payload carrying a bf16 NaN or inf is refused."""
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
        raise DeltaError(
            f"delta base is version {info.base_version}, this holds version {held_version}: fetch anchor + deltas"
        )
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
            out[name] = apply_tensor(base, t, arrays[f"{name}::pos"], arrays[f"{name}::val"], dctx)
        except (KeyError, TypeError, ValueError, zstandard.ZstdError) as e:
            raise DeltaError(f"{name}: corrupt delta ({e})") from None
        # The hash above proves these are the trainer's bits, not that the trainer was sane.
        _refuse_nonfinite(name, out[name])
    return info, out


def apply_tensor(
    base: np.ndarray, t: dict, pos: np.ndarray, val: np.ndarray, dctx: zstandard.ZstdDecompressor
) -> np.ndarray:
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
    if xxhash.xxh3_64_hexdigest(new.data) != t["xxh3"]:  # new: a fresh copy, C-ordered
        raise ValueError("decoded weights do not hash to the trainer's (corrupted part, or a different base)")
    return new.reshape(base.shape)


def _refuse_nonfinite(name: str, bits: np.ndarray, chunk: int = 1 << 20) -> None:
    """Raise DeltaError if any bf16 value is NaN or +-inf (exponent bits all ones): a trainer
    whose loss diverged publishes such weights with a valid hash, and a generator that applied
    them would sample garbage (or crash) for every task after. In chunks with one reused
    buffer: ~30 ms for 135M values, where whole-array temporaries take ~120 ms."""
    flat = bits.reshape(-1)
    buf = np.empty(min(chunk, flat.size), dtype=np.uint16)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        masked = buf[: part.size]
        np.bitwise_and(part, 0x7F80, out=masked)
        hits = masked == 0x7F80
        if hits.any():
            i = start + int(np.argmax(hits))
            raise DeltaError(
                f"{name}: value {i} is not finite (bf16 bits 0x{int(flat[i]):04X}); refusing weights from a diverged trainer"
            )
