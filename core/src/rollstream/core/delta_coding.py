"""One tensor's part of a delta (deltas.py: the payload of such parts), encoded and decoded.

Per tensor the smallest of:
  positions: a packed bitmask (n/8 bytes) or delta-coded indices (uint32 gaps);
  values:    the new bf16 bits, or the ULP steps (new bits - base bits, int16 that wraps
             exactly): at RL learning rates most changes are a few ULPs, which compress
             better than the values themselves;
each part zstd-compressed when that is smaller, and the xxh3-64 hash of the new bits, which
decoding checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

ZSTD_LEVEL = 3


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


# Positions are uint32 gaps in the idx encoding (the mask has no such limit, but both are tried).
MAX_TENSOR_VALUES = 1 << 32


@dataclass(frozen=True)
class Changes:
    """What changed in the flattened elements [start, start + new.size) of a tensor, kept until
    the tensor's pieces cover it in a bit per value and 2 bytes per changed value: the changed
    positions as bits of the whole tensor's packed mask (its bytes [start // 8,
    ceil((start + new.size) / 8)), the bits outside the piece zero), their ULP steps from the
    base (the base's bits are not kept: the split layout overwrites them), and the piece's new
    bits (a view: the new values at the positions are read back from it once the tensor is
    encoded, and it is hashed)."""

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


_CHUNK = 1 << 23  # positions at a time (a multiple of 8): 8 MB of bools and 64 MB of int64 positions at most


def _whole_mask(size: int, pieces: list[Changes]) -> np.ndarray:
    """The packed mask of the changed positions of the tensor that `pieces` cover (n/8 bytes:
    29 MB for a 233M-value embedding, against 4 bytes per changed value as uint32 positions)."""
    mask = np.zeros((size + 7) // 8, dtype=np.uint8)
    for c in pieces:
        part = mask[c.start // 8 : c.start // 8 + c.mask.size]
        part |= c.mask  # a piece that starts or ends inside a byte shares it with its neighbour
    return mask


def _changed_positions(mask: np.ndarray, pieces: list[Changes]) -> Iterator[tuple[Changes, int, np.ndarray]]:
    """In order, for each piece a chunk of at most _CHUNK positions at a time: the piece, the
    chunk's first position in the tensor, and the changed positions in the chunk from there
    (int64): the int64 positions of the whole tensor (8 bytes per changed value) never exist."""
    for c in pieces:
        end = c.start + c.new.size
        for lo in range(c.start, end, _CHUNK):
            hi = min(end, lo + _CHUNK)
            # flatnonzero is 5x faster on bools than on uint8
            bits = np.unpackbits(mask[lo // 8 : (hi + 7) // 8]).view(bool)
            yield c, lo, np.flatnonzero(bits[lo % 8 : lo % 8 + hi - lo])


def _gaps_and_values(mask: np.ndarray, pieces: list[Changes], count: int) -> tuple[np.ndarray, np.ndarray]:
    """In one pass over the changed positions (finding them is most of the work), chunk by
    chunk into one buffer each: the idx encoding's uint32 gaps between successive changed
    positions, the first from position 0 (np.diff(positions, prepend=0)), and the new bits at
    those positions, read back from the pieces' new bits."""
    gaps = np.empty(count, dtype="<u4")
    values = np.empty(count, dtype="<u2")
    at, last = 0, 0
    for c, lo, local in _changed_positions(mask, pieces):
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
    (None: unchanged). Safe to run on several threads at once (zstd releases the GIL too, and
    the compressor is this call's own).

    Each candidate encoding is made, compressed and dropped unless it is the smallest so far
    (ties go to the first: mask before idx, bf16 before ulp), so beside what the pieces hold
    (the tensor's mask and 2 bytes per changed value) this holds at most the mask, one
    candidate's raw bytes (6 per changed value for idx and the bf16 values, made in one pass)
    and the compressed winners."""
    pieces = sorted(pieces, key=lambda c: c.start)
    count = sum(c.steps.size for c in pieces)
    if count == 0:
        return None
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    mask = _whole_mask(size, pieces)
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
    """One tensor's part of a delta, from its base and new bits (None: unchanged); its changes
    found a chunk at a time, as pieces (a bool and a uint16 per value of the whole tensor would
    be 3 bytes a value)."""
    flat_base, flat_new = base.reshape(-1), new.reshape(-1)
    pieces = [
        changes(lo, flat_base[lo : lo + _CHUNK], flat_new[lo : lo + _CHUNK]) for lo in range(0, flat_base.size, _CHUNK)
    ]
    return encode_changes(base.shape, base.size, pieces)


def finish_pieces(shape: tuple[int, ...], size: int, pieces: list[Future[Changes] | Changes]) -> Encoded | None:
    # On the encoder's pool, each piece's future was submitted before this call: it is
    # running or done, never queued behind this one.
    return encode_changes(shape, size, [p.result() if isinstance(p, Future) else p for p in pieces])


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
