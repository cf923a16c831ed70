from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_new_tokens", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class PromptTask(_message.Message):
    __slots__ = ("task_id", "messages", "prompt_ids", "answer", "metadata_json", "group_size", "sampling", "fed_at_version", "task_kind", "eval")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_KIND_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    answer: str
    metadata_json: str
    group_size: int
    sampling: SamplingParams
    fed_at_version: int
    task_kind: str
    eval: bool
    def __init__(self, task_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., fed_at_version: _Optional[int] = ..., task_kind: _Optional[str] = ..., eval: _Optional[bool] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("name", "value", "weight", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    weight: float
    status: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., weight: _Optional[float] = ..., status: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "behaviour_logprobs", "versions", "text", "finish_reason", "reward", "reward_components", "ref_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    text: str
    finish_reason: str
    reward: float
    reward_components: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    ref_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., ref_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "task_id", "policy_version", "prompt_ids", "completions", "answer", "metadata_json", "task_kind", "generator_id", "scored", "has_ref_logprobs", "created_at", "group_size", "eval")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    HAS_REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task_id: str
    policy_version: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    answer: str
    metadata_json: str
    task_kind: str
    generator_id: str
    scored: bool
    has_ref_logprobs: bool
    created_at: float
    group_size: int
    eval: bool
    def __init__(self, group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., task_kind: _Optional[str] = ..., generator_id: _Optional[str] = ..., scored: _Optional[bool] = ..., has_ref_logprobs: _Optional[bool] = ..., created_at: _Optional[float] = ..., group_size: _Optional[int] = ..., eval: _Optional[bool] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("source_stream", "source_id", "consumer_group", "consumer", "reason", "deliveries", "original_fields", "dead_at")
    class OriginalFieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SOURCE_STREAM_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_FIELDS_FIELD_NUMBER: _ClassVar[int]
    DEAD_AT_FIELD_NUMBER: _ClassVar[int]
    source_stream: str
    source_id: str
    consumer_group: str
    consumer: str
    reason: str
    deliveries: int
    original_fields: _containers.ScalarMap[str, bytes]
    dead_at: float
    def __init__(self, source_stream: _Optional[str] = ..., source_id: _Optional[str] = ..., consumer_group: _Optional[str] = ..., consumer: _Optional[str] = ..., reason: _Optional[str] = ..., deliveries: _Optional[int] = ..., original_fields: _Optional[_Mapping[str, bytes]] = ..., dead_at: _Optional[float] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "version", "groups", "completions", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy", "stale_dropped", "tokens", "step_seconds", "train_tokens_per_s", "delta_bytes", "dense_bytes", "mean_staleness", "grad_norm", "time", "zero_variance_groups")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ZERO_VARIANCE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    groups: int
    completions: int
    reward_mean: float
    reward_std: float
    loss: float
    kl: float
    clip_fraction: float
    entropy: float
    stale_dropped: int
    tokens: int
    step_seconds: float
    train_tokens_per_s: float
    delta_bytes: int
    dense_bytes: int
    mean_staleness: float
    grad_norm: float
    time: float
    zero_variance_groups: int
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., groups: _Optional[int] = ..., completions: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., loss: _Optional[float] = ..., kl: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., entropy: _Optional[float] = ..., stale_dropped: _Optional[int] = ..., tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., train_tokens_per_s: _Optional[float] = ..., delta_bytes: _Optional[int] = ..., dense_bytes: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., grad_norm: _Optional[float] = ..., time: _Optional[float] = ..., zero_variance_groups: _Optional[int] = ...) -> None: ...

class EvalMetrics(_message.Message):
    __slots__ = ("step", "version", "version_max", "prompts", "prompts_fed", "samples", "reward_mean", "accuracy", "pass_at_k", "completion_tokens", "time")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_MAX_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_K_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    version_max: int
    prompts: int
    prompts_fed: int
    samples: int
    reward_mean: float
    accuracy: float
    pass_at_k: float
    completion_tokens: float
    time: float
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., version_max: _Optional[int] = ..., prompts: _Optional[int] = ..., prompts_fed: _Optional[int] = ..., samples: _Optional[int] = ..., reward_mean: _Optional[float] = ..., accuracy: _Optional[float] = ..., pass_at_k: _Optional[float] = ..., completion_tokens: _Optional[float] = ..., time: _Optional[float] = ...) -> None: ...
