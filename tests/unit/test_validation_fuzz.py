"""Property tests of the stream boundary: rollstream.core.validation (decode and the checks).

Two properties, over inputs drawn to include NaN, +-inf, huge ints, out-of-vocab ids,
mismatched lengths, corrupt bytes and bad JSON:
  - 0 crashes: decoding and checking raise EntryError or nothing, never another exception;
  - 0 wrongly trained (and 0 wrongly refused): a message passes its check exactly when an
    independent oracle (plain loops over the message, below) says every rule holds.
Deterministic (derandomize=True, no example database): 10,200 cases in the default run.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, configuration, given, settings
from hypothesis import strategies as st

from rollstream.core import validation
from rollstream.core.validation import (
    CHAT_ROLES,
    LOGPROB_SLACK,
    EntryError,
    Limits,
    check_group,
    check_metrics,
    check_task,
)
from rollstream.v1 import rollout_pb2


@pytest.fixture(autouse=True, scope="module")
def _hypothesis_home(tmp_path_factory: pytest.TempPathFactory):
    """Hypothesis caches what it reads from the source under ./.hypothesis even without an
    example database; keep that out of the working tree."""
    configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    configuration.set_hypothesis_home_dir(None)


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Small limits, so the bounds are reached by small messages; a second set with nothing known.
LIMITS = Limits(
    vocab_size=50,
    max_group_size=5,
    max_new_tokens=6,
    max_prompt_tokens=5,
    max_reward_abs=100.0,
    max_temperature=2.0,
    task_kinds=frozenset({"arithmetic", "countdown"}),
    min_logprob=-50.0,
)
OPEN_LIMITS = Limits(vocab_size=0, max_group_size=5, max_new_tokens=6, max_prompt_tokens=5, task_kinds=None)
STAGES = ("rollouts", "scored", "ready")
U32, U64 = 2**32 - 1, 2**64 - 1


# --- the oracle: every rule, recomputed with plain loops ------------------------------------


def _json_ok(text: str) -> bool:
    if text == "":
        return True
    try:
        value = json.loads(text)  # the default parser: NaN, Infinity and 1e999 become floats
    except (ValueError, RecursionError):
        return False
    if not isinstance(value, dict):
        return False
    todo: list[Any] = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return True


def _ids_ok(ids: list[int], max_count: int, vocab: int) -> bool:
    return len(ids) <= max_count and all(vocab == 0 or i < vocab for i in ids)


def _logprobs_ok(values: list[float], n: int, limits: Limits) -> bool:
    return len(values) == n and all(math.isfinite(x) and limits.min_logprob <= x <= LOGPROB_SLACK for x in values)


def task_ok(t: rollout_pb2.PromptTask, limits: Limits) -> bool:
    s = t.sampling
    return (
        t.task_id != ""
        and (len(t.messages) > 0 or len(t.prompt_ids) > 0)
        and all(m.role in CHAT_ROLES for m in t.messages)
        and _ids_ok(list(t.prompt_ids), limits.max_prompt_tokens, limits.vocab_size)
        and 1 <= t.group_size <= limits.max_group_size
        and 1 <= s.max_new_tokens <= limits.max_new_tokens
        and math.isfinite(s.temperature)
        and 0 <= s.temperature <= limits.max_temperature
        and math.isfinite(s.top_p)
        and 0 <= s.top_p <= 1
        and (limits.vocab_size == 0 or s.top_k <= limits.vocab_size)
        and _json_ok(t.metadata_json)
        and (limits.task_kinds is None or t.task_kind in limits.task_kinds)
    )


def is_trainable(g: rollout_pb2.RolloutGroup, limits: Limits, stage: str, need_ref: bool) -> bool:
    """Whether a group read from `stage` satisfies every invariant (the oracle)."""
    n = len(g.completions)
    if g.group_id == "" or n == 0 or n > limits.max_group_size or (g.group_size != 0 and n != g.group_size):
        return False
    if len(g.prompt_ids) == 0 or not _ids_ok(list(g.prompt_ids), limits.max_prompt_tokens, limits.vocab_size):
        return False
    if not _json_ok(g.metadata_json):
        return False
    rewarded = stage in ("scored", "ready")
    if (rewarded and not g.scored) or (need_ref and not g.has_ref_logprobs):
        return False
    for c in g.completions:
        tokens = list(c.token_ids)
        if len(tokens) == 0 or not _ids_ok(tokens, limits.max_new_tokens, limits.vocab_size):
            return False
        if not _logprobs_ok(list(c.behaviour_logprobs), len(tokens), limits):
            return False
        if g.has_ref_logprobs and not _logprobs_ok(list(c.ref_logprobs), len(tokens), limits):
            return False
        if any(not (0 <= v.start <= v.end <= len(tokens)) for v in c.versions):
            return False
        if rewarded:
            if not (math.isfinite(c.reward) and abs(c.reward) <= limits.max_reward_abs):
                return False
            if any(not (math.isfinite(rc.value) and math.isfinite(rc.weight)) for rc in c.reward_components):
                return False
    return True


def metrics_ok(m: rollout_pb2.StepMetrics) -> bool:
    return m.step >= 1 and math.isfinite(m.reward_mean) and math.isfinite(m.loss)


def _passes(check: Callable[[], None]) -> bool:
    """True if the check accepts, False if it refuses with EntryError; anything else propagates."""
    try:
        check()
    except EntryError as e:
        reason = str(e)
        assert reason and "\n" not in reason and len(reason) < 400, reason
        return False
    return True


# --- strategies: a valid message from a seeded PRNG, then 0-3 faults drawn by hypothesis ----
#
# Drawing every value of a group through hypothesis costs ~15 ms an example; a PRNG base is
# nearly free, and the faults (where the NaNs, huge ints and wrong lengths are) still come
# from hypothesis, which favours edge values. A base value is valid under LIMITS and
# OPEN_LIMITS; whether a fault makes the message bad is for the oracle to say (a drawn
# float may well be a fine log-prob).

ODD_FLOATS = [
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    1e30,
    -1e30,
    5.0,
    1e-3,
    5e-4,
    2e-3,
    0.0,
    -0.0,
    -50.0,
    -50.001,
    100.0,
    100.01,
    -100.0,
    3.5e38,
    1e-45,
    2.0,
    2.0001,
    1.0,
    1.0001,
    -1e4,
    -1e4 - 1,
]
ODD_INTS = [0, 1, 4, 5, 6, 49, 50, 51, 100000, 2**31, U32]
JSON_TEXTS = [
    "",
    "{}",
    '{"numbers": [1, 2, 3]}',
    '{"x": NaN}',
    '{"x": Infinity}',
    '{"x": [-Infinity]}',
    '{"x": 1e999}',
    '{"x": -1e999}',
    '{"x": 1e308}',
    "[1]",
    "1",
    '"s"',
    "null",
    "{",
    "{not json}",
    '{"a": {"b": [1.5, {"c": 2}]}}',
    "[" * 5000,
    "{}{}",
    '{"n": ' + "1" * 5000 + "}",
    '{"a": 1} ',
    '{"a":\n1}',
]
FAULT_COUNTS = [0, 0, 0, 1, 1, 1, 2, 3]  # sampled_from picks by index: ~3/8 of messages start clean

# Strategies are built once here: building one inside a draw re-validates it every time.
# Text has an explicit alphabet (quotes, brackets, controls, non-ASCII): the default one
# builds a Unicode table on first use, seconds per run.
ALPHABET = 'ab {}[]":,\\\n\x00\x7fé€😀'
any_float = st.floats(width=32) | st.sampled_from(ODD_FLOATS)  # NaN and +-inf included
uint32 = st.integers(0, U32) | st.sampled_from(ODD_INTS)
short_text = st.text(ALPHABET, max_size=6)
metadata = st.sampled_from(JSON_TEXTS) | st.text(ALPHABET, max_size=12)
seeds = st.integers(0, 2**32 - 1)
fault_counts = st.sampled_from(FAULT_COUNTS)
index = st.integers(0, 63)  # taken modulo the length of what it indexes
small = st.integers(1, 8)
span_bound = st.integers(0, 8) | uint32
versions = st.integers(0, U64)
ids = st.sampled_from(["", "x" * 1000, "a\nb"]) | short_text
kinds = st.sampled_from(["", "poetry", "arithmetic "]) | short_text
roles = st.sampled_from(["", "user"]) | short_text
GROUP_FAULTS = st.sampled_from(
    [
        "group_id",
        "group_size",
        "completions",
        "prompt_ids",
        "metadata",
        "unscored",
        "ref_flag",
        "need_ref",
        "token",
        "tokens",
        "behaviour",
        "behaviour_len",
        "ref",
        "ref_len",
        "span",
        "reward",
        "component",
    ]
)
TASK_FAULTS = st.sampled_from(
    [
        "task_id",
        "no_prompt",
        "role",
        "prompt_id",
        "prompt_len",
        "group_size",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "task_kind",
    ]
)


def _logprob(rnd: random.Random) -> float:
    return rnd.choice([0.0, -50.0, 5e-4]) if rnd.random() < 0.1 else rnd.uniform(-50.0, 0.0)


def _base_group(rnd: random.Random) -> rollout_pb2.RolloutGroup:
    n = rnd.randint(1, 5)
    has_ref = rnd.random() < 0.5
    g = rollout_pb2.RolloutGroup(
        group_id=f"g-{rnd.randrange(1000)}",
        task_id="t",
        policy_version=rnd.randrange(2**64),
        prompt_ids=[rnd.randrange(50) for _ in range(rnd.randint(1, 5))],
        metadata_json=rnd.choice(["", "{}", '{"numbers": [1, 2]}']),
        task_kind="arithmetic",
        scored=True,
        has_ref_logprobs=has_ref,
        group_size=rnd.choice([0, n]),
        created_at=rnd.random(),
    )
    for _ in range(n):
        k = rnd.randint(1, 6)
        c = g.completions.add(
            token_ids=[rnd.randrange(50) for _ in range(k)],
            behaviour_logprobs=[_logprob(rnd) for _ in range(k)],
            reward=rnd.choice([-100.0, 100.0, 0.0]) if rnd.random() < 0.1 else rnd.uniform(-100.0, 100.0),
            finish_reason="stop",
        )
        if has_ref or rnd.random() < 0.2:  # without the flag they are ignored, whatever they hold
            c.ref_logprobs.extend(_logprob(rnd) for _ in range(k))
        cut = rnd.randint(0, k)
        c.versions.add(version=3, start=0, end=cut)
        if cut < k or rnd.random() < 0.2:
            c.versions.add(version=4, start=cut, end=k)
        if rnd.random() < 0.5:
            c.reward_components.add(
                name="answer", value=rnd.uniform(-1.0, 1.0), weight=rnd.uniform(0.0, 2.0), status="ok"
            )
    return g


def _pick(draw: st.DrawFn, repeated: Any) -> int | None:
    """An index into a repeated field (None when it is empty)."""
    return draw(index) % len(repeated) if len(repeated) else None


def _fault_group(draw: st.DrawFn, g: rollout_pb2.RolloutGroup) -> bool:
    """Apply one drawn fault to g; returns True when the fault is "the trainer needs refs"."""
    kind = draw(GROUP_FAULTS)
    ci = _pick(draw, g.completions)
    c = g.completions[ci] if ci is not None else None
    if kind == "group_id":
        g.group_id = draw(ids)
    elif kind == "group_size":
        n = len(g.completions)
        g.group_size = [n + 1, max(0, n - 1), 0, U32, draw(uint32)][draw(index) % 5]
    elif kind == "completions":
        if c is None or draw(st.booleans()):
            del g.completions[draw(index) % (len(g.completions) + 1) :]
        else:
            for _ in range(draw(small)):
                g.completions.add().CopyFrom(c)
    elif kind == "prompt_ids":
        how = draw(index) % 3
        if how == 0:
            del g.prompt_ids[:]
        elif how == 1 and g.prompt_ids:
            g.prompt_ids[_pick(draw, g.prompt_ids)] = draw(uint32)
        else:
            g.prompt_ids.extend([1] * draw(small))
    elif kind == "metadata":
        g.metadata_json = draw(metadata)
    elif kind == "unscored":
        g.scored = False
    elif kind == "ref_flag":
        g.has_ref_logprobs = not g.has_ref_logprobs
    elif kind == "need_ref":
        return True
    elif c is None:
        pass  # the per-completion faults need a completion
    elif kind == "token" and c.token_ids:
        c.token_ids[_pick(draw, c.token_ids)] = draw(uint32)
    elif kind == "tokens":
        if draw(st.booleans()):
            del c.token_ids[:]
        else:  # longer, with matching log-probs: only the count limit is broken
            extra = draw(small)
            c.token_ids.extend([1] * extra)
            c.behaviour_logprobs.extend([-1.0] * extra)
            if c.ref_logprobs:
                c.ref_logprobs.extend([-1.0] * extra)
    elif kind in ("behaviour", "ref"):
        values = c.behaviour_logprobs if kind == "behaviour" else c.ref_logprobs
        if values:
            values[_pick(draw, values)] = draw(any_float)
    elif kind in ("behaviour_len", "ref_len"):
        values = c.behaviour_logprobs if kind == "behaviour_len" else c.ref_logprobs
        if values and draw(st.booleans()):
            del values[-1]
        else:
            values.append(draw(any_float))
    elif kind == "span":
        c.versions.add(version=draw(versions), start=draw(span_bound), end=draw(span_bound))
    elif kind == "reward":
        c.reward = draw(any_float)
    elif kind == "component":
        c.reward_components.add(name=draw(short_text), value=draw(any_float), weight=draw(any_float), status="ok")
    return False


@st.composite
def groups(draw: st.DrawFn) -> tuple[rollout_pb2.RolloutGroup, bool]:
    """(group, need_ref: whether the reader needs reference log-probs)."""
    g = _base_group(random.Random(draw(seeds)))
    need_ref = g.has_ref_logprobs and draw(st.booleans())
    for _ in range(draw(fault_counts)):
        need_ref |= _fault_group(draw, g)
    return g, need_ref


def _base_task(rnd: random.Random) -> rollout_pb2.PromptTask:
    t = rollout_pb2.PromptTask(
        task_id=f"t-{rnd.randrange(1000)}",
        answer="3",
        metadata_json=rnd.choice(["", "{}", '{"numbers": [1, 2]}']),
        group_size=rnd.randint(1, 5),
        task_kind=rnd.choice(["arithmetic", "countdown"]),
        sampling=rollout_pb2.SamplingParams(
            temperature=rnd.choice([0.0, 2.0, 1.0]) if rnd.random() < 0.2 else rnd.uniform(0.0, 2.0),
            top_p=rnd.choice([0.0, 1.0]) if rnd.random() < 0.2 else rnd.uniform(0.0, 1.0),
            max_new_tokens=rnd.randint(1, 6),
            top_k=rnd.choice([0, 0, rnd.randint(1, 50)]),
            seed=rnd.randrange(2**64),
        ),
    )
    form = rnd.choice(["messages", "ids", "both"])
    if form != "ids":
        t.messages.add(role="system", content="be brief")
        t.messages.add(role="user", content="1 + 2")
    if form != "messages":
        t.prompt_ids.extend(rnd.randrange(50) for _ in range(rnd.randint(1, 5)))
    return t


def _fault_task(draw: st.DrawFn, t: rollout_pb2.PromptTask) -> None:
    kind = draw(TASK_FAULTS)
    s = t.sampling
    if kind == "task_id":
        t.task_id = draw(ids)
    elif kind == "no_prompt":
        del t.messages[:]
        if draw(st.booleans()):
            del t.prompt_ids[:]
    elif kind == "role":
        t.messages.add(role=draw(roles), content="x")
    elif kind == "prompt_id":
        t.prompt_ids.append(draw(uint32))
    elif kind == "prompt_len":
        t.prompt_ids.extend([1] * draw(small))
    elif kind == "group_size":
        t.group_size = draw(uint32)
    elif kind == "max_new_tokens":
        s.max_new_tokens = draw(uint32)
    elif kind == "temperature":
        s.temperature = draw(any_float)
    elif kind == "top_p":
        s.top_p = draw(any_float)
    elif kind == "top_k":
        s.top_k = draw(uint32)
    elif kind == "metadata":
        t.metadata_json = draw(metadata)
    else:
        t.task_kind = draw(kinds)


@st.composite
def tasks(draw: st.DrawFn) -> rollout_pb2.PromptTask:
    t = _base_task(random.Random(draw(seeds)))
    for _ in range(draw(fault_counts)):
        _fault_task(draw, t)
    return t


metrics = st.builds(
    rollout_pb2.StepMetrics,
    step=st.sampled_from([0, 1, 2, 10**6, U64]),
    reward_mean=any_float,
    loss=any_float,
    kl=any_float,
    grad_norm=any_float,
)


# --- (b) structured messages: refused exactly when the oracle says so ------------------------


def test_groups_pass_exactly_when_trainable() -> None:
    seen: Counter[str] = Counter()

    @fuzz_settings(3000)
    @given(drawn=groups())
    def prop(drawn: tuple[rollout_pb2.RolloutGroup, bool]) -> None:
        g, need_ref = drawn
        # The check costs microseconds next to hypothesis' milliseconds: judge the group as
        # read from every stage, and under both sets of limits.
        for limits in (LIMITS, OPEN_LIMITS):
            for at in STAGES:
                ok = _passes(lambda: check_group(g, limits, stage=at, need_ref=need_ref))  # type: ignore[arg-type]  # a stage name from STAGES, one of the literals
                assert ok == is_trainable(g, limits, at, need_ref), (ok, at, need_ref, limits, g)
        seen["passed" if ok else "refused"] += 1  # the last verdict: ready, OPEN_LIMITS

    prop()
    # Both outcomes are well represented, so the equality above tests something both ways.
    assert seen["passed"] >= 500 and seen["refused"] >= 500, seen


def test_tasks_pass_exactly_when_valid() -> None:
    seen: Counter[str] = Counter()

    @fuzz_settings(2500)
    @given(t=tasks())
    def prop(t: rollout_pb2.PromptTask) -> None:
        for limits in (LIMITS, OPEN_LIMITS):
            ok = _passes(lambda: check_task(t, limits))
            assert ok == task_ok(t, limits), (ok, limits, t)
            seen["passed" if ok else "refused"] += 1

    prop()
    assert seen["passed"] >= 600 and seen["refused"] >= 600, seen


def test_metrics_pass_exactly_when_showable() -> None:
    @fuzz_settings(500)
    @given(m=metrics)
    def prop(m: rollout_pb2.StepMetrics) -> None:
        assert _passes(lambda: check_metrics(m)) == metrics_ok(m)

    prop()


# --- (a) bytes off the wire: decode + check raise EntryError or pass, never anything else ----

TYPES: list[type] = [rollout_pb2.PromptTask, rollout_pb2.RolloutGroup, rollout_pb2.StepMetrics]


def _check_decoded(msg: Any, stage: str) -> bool:
    if isinstance(msg, rollout_pb2.PromptTask):
        ok = _passes(lambda: check_task(msg, LIMITS))
        assert ok == task_ok(msg, LIMITS), msg
    elif isinstance(msg, rollout_pb2.RolloutGroup):
        ok = _passes(lambda: check_group(msg, LIMITS, stage=stage, need_ref=False))  # type: ignore[arg-type]  # a stage name from STAGES, one of the literals
        assert ok == is_trainable(msg, LIMITS, stage, False), msg
    else:
        ok = _passes(lambda: check_metrics(msg))
        assert ok == metrics_ok(msg), msg
    return ok


def _decode_and_check(fields: dict[bytes, bytes], cls: type, stage: str) -> str:
    try:
        msg = validation.decode(fields, cls)
    except EntryError as e:
        assert str(e), fields
        return "undecodable"
    return "passed" if _check_decoded(msg, stage) else "refused"


header_key = st.sampled_from([b"type", b"schema", b"data"])
arbitrary_fields = st.dictionaries(header_key | st.binary(max_size=6), st.binary(max_size=60), max_size=5)


def test_arbitrary_field_dicts_raise_only_entry_error() -> None:
    @fuzz_settings(1200)
    @given(fields=arbitrary_fields, cls=st.sampled_from(TYPES), stage=st.sampled_from(STAGES))
    def prop(fields: dict[bytes, bytes], cls: type, stage: str) -> None:
        _decode_and_check(fields, cls, stage)

    prop()


schema = st.sampled_from(
    [b"1"] * 12 + [b"01", b" 1 ", b"2", b"-1", b"1.0", b"", b"\xff", b"\xd9\xa1", b"9" * 5000, b"1\x00"]
)
EDITS = st.sampled_from(["flip", "set", "insert", "delete", "truncate"])
edit_counts = st.integers(0, 4)
positions = st.integers(0, 2**16)  # taken modulo the length
bits = st.integers(0, 7)
byte_values = st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x08, 0x0A, 0x12, 0x2A, 0x22]) | st.integers(0, 255)
inserts = st.binary(min_size=1, max_size=6)
deletes = st.integers(1, 4)
MESSAGES = {
    rollout_pb2.PromptTask: tasks(),
    rollout_pb2.RolloutGroup: groups().map(lambda d: d[0]),
    rollout_pb2.StepMetrics: metrics,
}
TYPE_NAMES = {
    cls: st.sampled_from(
        [cls.DESCRIPTOR.full_name.encode()] * 10
        + [t.DESCRIPTOR.full_name.encode() for t in TYPES]
        + [b"", b"rollstream.v1.Nope", b"\xff"]
    )
    for cls in TYPES
}
keep_bytes = st.sampled_from([True] * 5 + [False])
random_data = st.binary(max_size=80)
missing = st.lists(header_key, max_size=1)


def _corrupt(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with a few byte flips, overwrites, insertions, deletions or a truncation."""
    buf = bytearray(data)
    for _ in range(draw(edit_counts)):
        op = draw(EDITS)
        at = draw(positions) % max(1, len(buf))
        if op == "flip" and buf:
            buf[at] ^= 1 << draw(bits)
        elif op == "set" and buf:
            buf[at] = draw(byte_values)
        elif op == "insert":
            buf[at:at] = draw(inserts)
        elif op == "delete" and buf:
            del buf[at : at + draw(deletes)]
        elif op == "truncate":
            del buf[at:]
    return bytes(buf)


@st.composite
def wire_entries(draw: st.DrawFn) -> tuple[dict[bytes, bytes], type, str]:
    """A well-formed entry of a fuzzed message, its bytes then corrupted, under a maybe-wrong header."""
    cls = draw(st.sampled_from(TYPES))
    stage = draw(st.sampled_from(STAGES))
    msg = draw(MESSAGES[cls])
    data = _corrupt(draw, msg.SerializeToString()) if draw(keep_bytes) else draw(random_data)
    fields = {b"type": draw(TYPE_NAMES[cls]), b"schema": draw(schema), b"data": data}
    for key in draw(missing):
        del fields[key]  # now and then a header field is missing
    return fields, cls, stage


def test_wire_entries_raise_only_entry_error() -> None:
    seen: Counter[str] = Counter()

    @fuzz_settings(3000)
    @given(entry=wire_entries())
    def prop(entry: tuple[dict[bytes, bytes], type, str]) -> None:
        seen[_decode_and_check(*entry)] += 1

    prop()
    assert min(seen["undecodable"], seen["refused"], seen["passed"]) >= 200, seen
