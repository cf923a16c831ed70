"""Weight sync payloads: anchors (all weights) and exact sparse deltas, as safetensors.

Weights are dicts of Hugging Face name -> uint16 numpy array of bf16 bit patterns (see
safetensors_io for why bits). A delta from `base_version` to `version` holds, per tensor
that changed, the changed positions and what to write there (delta_coding: how). Decoding
is exact given the base; a payload whose base or model does not match what the receiver
holds is refused. Each changed tensor also carries the xxh3-64 hash of its new bits, checked
after decoding: a corrupted part, or a base with the right version number but other contents
(a trainer restarted from scratch), is refused instead of silently producing wrong weights.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from rollstream.core import safetensors_io
from rollstream.core.delta_coding import (
    MAX_TENSOR_VALUES,
    Changes,
    Encoded,
    apply_tensor,
    changes,
    encode_tensor,
    finish_pieces,
)

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

FORMAT = "rollstream.weights"
FORMAT_VERSION = "1"

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


@dataclass
class _Partial:
    """A tensor of which some pieces were added (DeltaEncoder.add_piece)."""

    pieces: list[Future[Changes] | Changes] = field(default_factory=list)
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
    (add_piece then waits), so a slow encoder holds back the step instead of memory. The
    bound only absorbs bursts: once the encoder is the slower side the step goes at its pace
    whatever the bound, so it is small (64 MiB: 4 buckets of 32 MB fp32 masters' old bits)."""

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
        self._parts[name] = (
            self._executor.submit(encode_tensor, base, new) if self._executor else encode_tensor(base, new)
        )

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
            shape = self.base[name].shape
            self._parts[name] = (
                self._executor.submit(finish_pieces, shape, size, partial.pieces)
                if self._executor
                else finish_pieces(shape, size, partial.pieces)
            )

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
        info = PayloadInfo(
            kind=meta["kind"],
            base_version=int(meta["base_version"]),
            version=int(meta["version"]),
            fingerprint=meta["fingerprint"],
        )
    except (KeyError, ValueError) as e:
        raise DeltaError(f"payload metadata incomplete: {e}") from None
    if info.kind not in ("anchor", "delta"):
        raise DeltaError(f"unknown payload kind {info.kind!r}")
    return info, meta, arrays


def decode(
    payload: bytes | memoryview, held: Mapping[str, np.ndarray], held_version: int | None, fingerprint: str
) -> tuple[PayloadInfo, Weights]:
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
            raise DeltaError(
                f"{name}: value {i} is not finite (bf16 bits 0x{int(flat[i]):04X}); refusing weights from a diverged trainer"
            )
