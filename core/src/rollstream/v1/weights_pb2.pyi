from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
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
    __slots__ = ("header", "data", "forward", "signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    data: bytes
    forward: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    signature: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., forward: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RelayTarget(_message.Message):
    __slots__ = ("address", "signature", "forward")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    address: str
    signature: str
    forward: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    def __init__(self, address: _Optional[str] = ..., signature: _Optional[str] = ..., forward: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ...) -> None: ...

class RelayedPush(_message.Message):
    __slots__ = ("address", "applied", "version", "error", "seconds", "via", "orphaned", "ack", "unreachable")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    applied: bool
    version: int
    error: str
    seconds: float
    via: str
    orphaned: bool
    ack: bytes
    unreachable: bool
    def __init__(self, address: _Optional[str] = ..., applied: _Optional[bool] = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., via: _Optional[str] = ..., orphaned: _Optional[bool] = ..., ack: _Optional[bytes] = ..., unreachable: _Optional[bool] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("applied", "version", "error", "apply_seconds", "receive_seconds", "lock_wait_seconds", "decode_seconds", "load_seconds", "relayed", "ack")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCK_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    error: str
    apply_seconds: float
    receive_seconds: float
    lock_wait_seconds: float
    decode_seconds: float
    load_seconds: float
    relayed: _containers.RepeatedCompositeFieldContainer[RelayedPush]
    ack: bytes
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., apply_seconds: _Optional[float] = ..., receive_seconds: _Optional[float] = ..., lock_wait_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., relayed: _Optional[_Iterable[_Union[RelayedPush, _Mapping]]] = ..., ack: _Optional[bytes] = ...) -> None: ...
