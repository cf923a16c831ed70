"""The stream wire contract: committed stubs are current, and rollstream.core.validation
encodes, decodes and refuses entries with a reason a dead-letter reader can act on."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from rollstream.core import validation
from rollstream.v1 import rollout_pb2

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _gen_protos():
    spec = importlib.util.spec_from_file_location("rollstream_gen_protos", SCRIPTS / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_committed_stubs_are_current() -> None:
    gen = _gen_protos()
    # Sanity: the script looks where the stubs actually are.
    assert (gen.STUB_DIR / "rollout_pb2.py").is_file()
    assert sorted(p.name for p in gen.PROTO_ROOT.glob("rollstream/v1/*.proto"))
    assert gen.stale_files() == [], "run `python scripts/gen_protos.py` after editing proto/"


def test_the_schema_number_is_stated_in_the_proto_and_the_doc() -> None:
    """rollout.proto is where a reader in another language learns the `schema` number; it,
    docs/custom-reward.md and validation.SCHEMA_VERSION must say the same."""
    root = Path(__file__).resolve().parents[2]
    proto = (root / "proto" / "rollstream" / "v1" / "rollout.proto").read_text()
    stated = re.search(r"schema\s+the ASCII integer (\d+)", proto)
    assert stated is not None and int(stated.group(1)) == validation.SCHEMA_VERSION
    doc = (root / "docs" / "custom-reward.md").read_text()
    assert f"| `schema` | the ASCII integer `{validation.SCHEMA_VERSION}`" in doc


# --- round trips ---------------------------------------------------------------------------


def _prompt_task() -> rollout_pb2.PromptTask:
    return rollout_pb2.PromptTask(
        task_id="task-1",
        messages=[rollout_pb2.ChatMessage(role="user", content="What is 3 + 5? ünïcødé")],
        prompt_ids=[1, 2, 3, 4_000_000_000],
        answer="8",
        metadata_json='{"a": 1}',
        group_size=8,
        sampling=rollout_pb2.SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, top_k=50, seed=2**63),
        fed_at_version=17,
        task_kind="arithmetic",
    )


def _rollout_group() -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id="g-1",
        task_id="task-1",
        policy_version=3,
        prompt_ids=[11, 12, 13],
        completions=[
            rollout_pb2.Completion(
                token_ids=[5, 6, 7],
                behaviour_logprobs=[-0.5, -0.25, -1.5],
                versions=[
                    rollout_pb2.VersionSpan(version=3, start=0, end=2),
                    rollout_pb2.VersionSpan(version=4, start=2, end=3),
                ],
                text="8",
                finish_reason="stop",
                reward=1.0,
                reward_components=[rollout_pb2.RewardComponent(name="correct", value=1.0, weight=1.0, status="ok")],
                ref_logprobs=[-0.75, -0.125, -2.0],
            ),
            rollout_pb2.Completion(
                token_ids=[9], behaviour_logprobs=[-3.0], text="x", finish_reason="length", ref_logprobs=[-1.0]
            ),
        ],
        answer="8",
        metadata_json="{}",
        task_kind="arithmetic",
        generator_id="gen-0",
        scored=True,
        has_ref_logprobs=True,
        created_at=1_700_000_000.25,
    )


def _dead_letter() -> rollout_pb2.DeadLetter:
    return rollout_pb2.DeadLetter(
        source_stream="rs:demo:rollouts",
        source_id="1-0",
        consumer_group="reward",
        consumer="host-1",
        reason="data does not parse",
        deliveries=6,
        original_fields={"type": b"x", "schema": b"1", "data": b"\x00\xff\x10"},
        dead_at=1_700_000_000.5,
    )


def _step_metrics() -> rollout_pb2.StepMetrics:
    return rollout_pb2.StepMetrics(
        step=5,
        version=6,
        groups=8,
        completions=64,
        reward_mean=0.5,
        reward_std=0.25,
        loss=-0.125,
        kl=0.01,
        clip_fraction=0.0625,
        entropy=2.5,
        stale_dropped=1,
        tokens=900,
        step_seconds=1.5,
        train_tokens_per_s=600.0,
        delta_bytes=12345,
        dense_bytes=2**40,
        mean_staleness=0.5,
        grad_norm=0.75,
        time=1_700_000_001.0,
        zero_variance_groups=2,
    )


def _as_redis_fields(encoded: dict[str, bytes]) -> dict[bytes, bytes]:
    """What XREAD returns for an entry written with `encoded` (keys come back as bytes)."""
    return {k.encode(): v for k, v in encoded.items()}


@pytest.mark.parametrize(
    "make", [_prompt_task, _rollout_group, _dead_letter, _step_metrics], ids=lambda f: f.__name__.strip("_")
)
def test_round_trip(make) -> None:
    message = make()
    encoded = validation.encode(message)
    assert set(encoded) == {"type", "schema", "data"}
    assert encoded["type"] == message.DESCRIPTOR.full_name.encode()
    assert encoded["type"].startswith(b"rollstream.v1.")
    assert encoded["schema"] == str(validation.SCHEMA_VERSION).encode()
    decoded = validation.decode(_as_redis_fields(encoded), type(message))
    assert decoded == message
    assert decoded.SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)


def test_round_trip_of_a_valid_group_passes_validation() -> None:
    decoded = validation.decode(_as_redis_fields(validation.encode(_rollout_group())), rollout_pb2.RolloutGroup)
    validation.check_group(decoded, validation.Limits(), stage="ready")  # no exception
    assert decoded.completions[0].versions[1].version == 4


# --- decode errors -------------------------------------------------------------------------


def _fields() -> dict[bytes, bytes]:
    return _as_redis_fields(validation.encode(_prompt_task()))


@pytest.mark.parametrize("missing", [b"type", b"schema", b"data"])
def test_decode_missing_field(missing: bytes) -> None:
    fields = _fields()
    del fields[missing]
    with pytest.raises(validation.EntryError, match=rf"missing field\(s\) {missing.decode()}"):
        validation.decode(fields, rollout_pb2.PromptTask)


def test_decode_missing_several_fields_names_them_all() -> None:
    with pytest.raises(validation.EntryError) as err:
        validation.decode({b"data": b""}, rollout_pb2.PromptTask)
    assert "type" in str(err.value) and "schema" in str(err.value)


def test_decode_wrong_type() -> None:
    fields = _fields()
    with pytest.raises(validation.EntryError) as err:
        validation.decode(fields, rollout_pb2.RolloutGroup)
    msg = str(err.value)
    assert "rollstream.v1.PromptTask" in msg and "rollstream.v1.RolloutGroup" in msg


def test_decode_non_integer_schema() -> None:
    fields = _fields()
    fields[b"schema"] = b"one"
    with pytest.raises(validation.EntryError, match=r"schema b'one' is not an integer"):
        validation.decode(fields, rollout_pb2.PromptTask)


def test_decode_unsupported_schema() -> None:
    fields = _fields()
    fields[b"schema"] = str(validation.SCHEMA_VERSION + 1).encode()
    with pytest.raises(validation.EntryError, match=rf"schema {validation.SCHEMA_VERSION + 1} is not supported"):
        validation.decode(fields, rollout_pb2.PromptTask)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff\xff",  # truncated varint / invalid tag
        b"\x0a\x10abc",  # field 1 (task_id) claims 16 bytes, has 3
        b"\x07",  # wire type 7 does not exist
    ],
)
def test_decode_bad_bytes(data: bytes) -> None:
    fields = _fields()
    fields[b"data"] = data
    with pytest.raises(validation.EntryError, match=r"data does not parse as rollstream.v1.PromptTask"):
        validation.decode(fields, rollout_pb2.PromptTask)


def test_entry_error_is_a_value_error() -> None:
    # Stages catch ValueError around parsing; EntryError must be one.
    assert issubclass(validation.EntryError, ValueError)
