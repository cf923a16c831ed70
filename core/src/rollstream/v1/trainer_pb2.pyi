from rollstream.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStateRequest(_message.Message):
    __slots__ = ("with_weights_sha256", "challenge")
    WITH_WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    with_weights_sha256: bool
    challenge: bytes
    def __init__(self, with_weights_sha256: _Optional[bool] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class TrainerState(_message.Message):
    __slots__ = ("version", "step", "model", "model_fingerprint", "groups_trained", "groups_stale", "generators", "weights_sha256", "signature")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_STALE_FIELD_NUMBER: _ClassVar[int]
    GENERATORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    model: str
    model_fingerprint: str
    groups_trained: int
    groups_stale: int
    generators: _containers.RepeatedScalarFieldContainer[str]
    weights_sha256: str
    signature: bytes
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., groups_trained: _Optional[int] = ..., groups_stale: _Optional[int] = ..., generators: _Optional[_Iterable[str]] = ..., weights_sha256: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("have_version", "model_fingerprint")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    model_fingerprint: str
    def __init__(self, have_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResult(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
