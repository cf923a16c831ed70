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

import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

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


def _encode_tensor(base: np.ndarray, new: np.ndarray) -> _Encoded | None:
    """One tensor's part of a delta (None: unchanged). Safe to run on several threads at
    once: numpy's comparisons and zstd release the GIL, and the compressor is its own."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    flat_base = base.reshape(-1)
    flat_new = new.reshape(-1)
    changed = flat_base != flat_new
    idx = np.flatnonzero(changed)
    if idx.size == 0:
        return None
    mask_raw = np.packbits(changed).tobytes()
    gaps_raw = np.diff(idx, prepend=0).astype("<u4").tobytes()
    pos_options = [("mask", *_maybe_zstd(mask_raw, cctx)), ("idx", *_maybe_zstd(gaps_raw, cctx))]
    pos_kind, pos_bytes, pos_z = min(pos_options, key=lambda o: len(o[1]))
    values = flat_new[idx]
    steps = values - flat_base[idx]  # uint16 arithmetic wraps: exactly invertible
    val_options = [("bf16", *_maybe_zstd(values.astype("<u2").tobytes(), cctx)), ("ulp", *_maybe_zstd(steps.astype("<u2").tobytes(), cctx))]
    val_kind, val_bytes, val_z = min(val_options, key=lambda o: len(o[1]))
    info = {
        "shape": list(base.shape), "count": int(idx.size), "pos": pos_kind, "pos_zstd": pos_z, "val": val_kind, "val_zstd": val_z,
        "xxh3": _bits_hash(new),
    }
    return _Encoded(info, pos_bytes, val_bytes)


class DeltaEncoder:
    """An exact delta from `base` built one tensor at a time, as each tensor's new bits
    become final. The trainer's optimizer hands a tensor over as soon as the last bucket
    holding it is stepped (HostAdamW.step's `on_tensor`), so the delta is encoded while the
    step still runs, and on `executor`'s threads when one is given, instead of in one pass
    over every tensor after the step. The payload is the same bytes whatever the order of
    `add` calls or the number of threads (tensors go in by name).

    The arrays given to `add` must not change until `finish` returns."""

    def __init__(self, base: Mapping[str, np.ndarray], base_version: int, version: int, fingerprint: str, executor: Executor | None = None):
        self.base = base
        self.base_version, self.version, self.fingerprint = base_version, version, fingerprint
        self._executor = executor
        self._parts: dict[str, Future[_Encoded | None] | _Encoded | None] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def add(self, name: str, new: np.ndarray) -> None:
        if name not in self.base:
            raise DeltaError(f"{name} is not a tensor of the base weights")
        if name in self._parts:
            raise DeltaError(f"{name} was added twice")
        base = self.base[name]
        if base.shape != new.shape:
            raise DeltaError(f"{name}: shape {base.shape} != {new.shape}")
        self._parts[name] = self._executor.submit(_encode_tensor, base, new) if self._executor else _encode_tensor(base, new)

    def finish(self) -> tuple[bytes, DeltaStats]:
        """The payload, once every tensor of the base was added."""
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
