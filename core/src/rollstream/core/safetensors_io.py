"""Minimal safetensors reader/writer over numpy arrays, with bf16 as raw uint16 bits.

numpy has no bfloat16, and the weight path never needs bf16 arithmetic: it moves and
compares bit patterns. So bf16 tensors are uint16 arrays here, written with dtype "BF16"
so the files load as ordinary bf16 tensors anywhere (`safetensors.torch.load`). The
format: 8-byte little-endian header length, a JSON header, then the tensor bytes.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from _typeshed import SupportsWrite  # what a writer needs here: a file, or anything with write()

_NUMPY_BY_DTYPE = {
    "BF16": np.uint16,  # bit patterns
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "I64": np.int64,
    "U64": np.uint64,
}
_DTYPE_BY_NUMPY = {np.dtype(v): k for k, v in _NUMPY_BY_DTYPE.items() if k != "BF16"}

MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


def dumps(
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    bf16: frozenset[str] | set[str] = frozenset(),
) -> bytes:
    """Serialise `tensors`; names in `bf16` are uint16 arrays written as BF16."""
    # Byte views of the arrays, not .tobytes() copies: the join is then the only copy, so an
    # in-memory anchor (2 bytes per parameter) peaks at the payload once, not twice.
    return b"".join([_header(tensors, metadata, bf16), *(_data(array) for array in tensors.values())])


def dumps_taking(
    tensors: dict[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    bf16: frozenset[str] | set[str] = frozenset(),
) -> bytes:
    """What `dumps` returns, taking each tensor out of `tensors` once its bytes are copied: one
    that nothing else holds is freed then, so the payload and its tensors are never both whole
    in memory (a delta's encoded parts are as large as the payload they make). `tensors` is
    empty after."""
    out = io.BytesIO()  # grows in place as it is written; getvalue() hands over that buffer, no copy
    out.write(_header(tensors, metadata, bf16))
    while tensors:
        out.write(_data(tensors.pop(next(iter(tensors)))))
    return out.getvalue()


def dump_to(
    f: SupportsWrite[bytes | memoryview],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    bf16: frozenset[str] | set[str] = frozenset(),
) -> int:
    """Write what `dumps` returns to the binary file `f`, tensor by tensor: the payload is never
    whole in memory (a 14B anchor is 29.6 GB). Returns the number of bytes written. Every
    tensor is checked before the first byte is written."""
    head = _header(tensors, metadata, bf16)
    f.write(head)
    written = len(head)
    for array in tensors.values():
        data = _data(array)  # a view, or one tensor's copy when it is not C-ordered little-endian
        f.write(data)
        written += data.nbytes
    return written


def _header(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None, bf16: frozenset[str] | set[str]
) -> bytes:
    """The 8-byte length and the JSON header, padded: made from shapes and dtypes alone."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, array in tensors.items():
        array = np.asarray(array)  # no copy: only its dtype and shape are read here
        nbytes = array.size * array.dtype.itemsize
        header[name] = {
            "dtype": _dtype_name(name, array, bf16),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data start to 8 bytes
    return struct.pack("<Q", len(head)) + head


def _dtype_name(name: str, array: np.ndarray, bf16: frozenset[str] | set[str]) -> str:
    if name in bf16:
        if array.dtype != np.uint16:
            raise SafetensorsError(f"{name}: bf16 tensors must be uint16 bit patterns, got {array.dtype}")
        return "BF16"
    dtype = _DTYPE_BY_NUMPY.get(array.dtype.newbyteorder("=") if array.dtype.byteorder == ">" else array.dtype, "")
    if not dtype:
        raise SafetensorsError(f"{name}: dtype {array.dtype} is not supported")
    return dtype


def _data(array: np.ndarray) -> memoryview:
    """A tensor's bytes as written: C order, little-endian; a view when it already is."""
    array = np.asarray(array, order="C")  # not ascontiguousarray: it turns 0-d into 1-d
    return memoryview(array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # a buffer; numpy's stubs say so from Python 3.12


def loads(buf: bytes | memoryview) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Parse a safetensors payload; arrays are read-only views into `buf` (BF16 -> uint16)."""
    view = memoryview(buf)
    if len(view) < 8:
        raise SafetensorsError("payload shorter than the 8-byte header length")
    (head_len,) = struct.unpack("<Q", view[:8])
    if head_len > MAX_HEADER_BYTES or 8 + head_len > len(view):
        raise SafetensorsError(f"header length {head_len} does not fit a payload of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data = view[8 + head_len :]
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = _NUMPY_BY_DTYPE[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{name}: bad header entry {info!r} ({e})") from None
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= start <= end <= len(data) or end - start != count * np.dtype(dtype).itemsize:
            raise SafetensorsError(
                f"{name}: data_offsets {start}..{end} do not match shape {shape} {info['dtype']} in {len(data)} bytes"
            )
        arrays[name] = np.frombuffer(data[start:end], dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    return dict(metadata), arrays
