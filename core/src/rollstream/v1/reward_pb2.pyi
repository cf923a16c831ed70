from rollstream.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("group_id", "completion_index", "task_kind", "prompt", "completion", "answer", "metadata_json", "num_tokens", "finish_reason")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_INDEX_FIELD_NUMBER: _ClassVar[int]
    TASK_KIND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    completion_index: int
    task_kind: str
    prompt: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.ChatMessage]
    completion: str
    answer: str
    metadata_json: str
    num_tokens: int
    finish_reason: str
    def __init__(self, group_id: _Optional[str] = ..., completion_index: _Optional[int] = ..., task_kind: _Optional[str] = ..., prompt: _Optional[_Iterable[_Union[_rollout_pb2.ChatMessage, _Mapping]]] = ..., completion: _Optional[str] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., num_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("reward", "components")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.RewardComponent]
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Iterable[_Union[_rollout_pb2.RewardComponent, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ...) -> None: ...
