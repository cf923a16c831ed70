from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightHeader(_message.Message):
    __slots__ = ("kind", "base_version", "version", "total_bytes", "sha256", "model_fingerprint")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    base_version: int
    version: int
    total_bytes: int
    sha256: str
    model_fingerprint: str
    def __init__(self, kind: _Optional[str] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("applied", "version", "error", "apply_seconds", "receive_seconds", "lock_wait_seconds", "decode_seconds", "load_seconds")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCK_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    error: str
    apply_seconds: float
    receive_seconds: float
    lock_wait_seconds: float
    decode_seconds: float
    load_seconds: float
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., apply_seconds: _Optional[float] = ..., receive_seconds: _Optional[float] = ..., lock_wait_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ...) -> None: ...
