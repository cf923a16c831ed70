from rollstream.v1 import rollout_pb2 as _rollout_pb2
from rollstream.v1 import weights_pb2 as _weights_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _rollout_pb2.PromptTask
    def __init__(self, task: _Optional[_Union[_rollout_pb2.PromptTask, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("with_weights_sha256",)
    WITH_WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    with_weights_sha256: bool
    def __init__(self, with_weights_sha256: _Optional[bool] = ...) -> None: ...

class GeneratorState(_message.Message):
    __slots__ = ("generator_id", "policy_version", "backend", "model", "groups_generated", "busy", "model_fingerprint", "weights_sha256", "weight_update_mode")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    policy_version: int
    backend: str
    model: str
    groups_generated: int
    busy: int
    model_fingerprint: str
    weights_sha256: str
    weight_update_mode: str
    def __init__(self, generator_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., backend: _Optional[str] = ..., model: _Optional[str] = ..., groups_generated: _Optional[int] = ..., busy: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., weight_update_mode: _Optional[str] = ...) -> None: ...

class PushNonceRequest(_message.Message):
    __slots__ = ("challenge",)
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    def __init__(self, challenge: _Optional[bytes] = ...) -> None: ...

class PushNonceResponse(_message.Message):
    __slots__ = ("nonce", "address", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    address: str
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., address: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...
