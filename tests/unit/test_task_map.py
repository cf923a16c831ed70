"""The checks of a group against the task the trainer fed (rollstream.core.validation):
what the trainer dead-letters, and what it lets through (vLLM's held-back last bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from rollstream.core import validation
from rollstream.core.run_keys import RunKeys
from rollstream.core.validation import EntryError
from rollstream.v1 import rollout_pb2
from synthetic import Decode


def _pair(decode: Decode) -> tuple[rollout_pb2.RolloutGroup, rollout_pb2.PromptTask]:
    task = rollout_pb2.PromptTask(
        task_id="t-1", prompt_ids=[7, 8, 9], answer="12", metadata_json='{"n": 1}', task_kind="arithmetic", group_size=2
    )
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
        "completion 1: text 'The answer is 12' is not its token_ids decoded": lambda g: setattr(
            g.completions[1], "text", "The answer is 12"
        ),
    }
    for reason, forge in cases.items():
        forged = rollout_pb2.RolloutGroup()
        forged.CopyFrom(group)
        forge(forged)
        with pytest.raises(EntryError) as e:
            validation.check_against_task(forged, task, tiny_decode)
        assert reason in str(e.value), (reason, str(e.value))


def test_what_vllm_holds_back_may_be_missing_and_nothing_else(tiny_model_dir: Path) -> None:
    """vLLM's incremental detokenizer holds back the last tokens while their text ends in
    U+FFFD (bytes of a character they do not complete, and anything else such a token
    carries: " \\xe2", a space and a lead byte); decode() writes U+FFFD for them."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    words = tokenizer.encode("The answer is", add_special_tokens=False)
    snowman = tokenizer.encode(" \u2603", add_special_tokens=False)  # " ☃": a space, then bytes e2 98 83, a token each
    cut = words + snowman[:3]  # cut inside the character: " ", e2, 98
    assert decode(cut) == "The answer is \ufffd"
    assert validation.completion_text_matches("The answer is ", cut, decode)  # vLLM's text: e2 98 held back
    assert validation.completion_text_matches(decode(cut), cut, decode)  # the transformers backend's
    assert validation.completion_text_matches(decode(words + snowman), words + snowman, decode)
    assert validation.completion_text_matches(" " + decode(words), words, decode)  # a SentencePiece first word, primed
    assert not validation.completion_text_matches("The answer is", cut, decode)  # more held back than vLLM does
    assert not validation.completion_text_matches(
        "The answer is ", words + snowman, decode
    )  # a whole character missing
    assert not validation.completion_text_matches("The answer is 7", words, decode)
    assert not validation.completion_text_matches("  " + decode(words), words, decode)


def test_fetch_tasks_leaves_out_what_is_not_a_task_of_that_id(rclient: redis.Redis, keys: RunKeys) -> None:
    task = rollout_pb2.PromptTask(task_id="a", answer="1")
    other = rollout_pb2.PromptTask(task_id="elsewhere", answer="2")
    rclient.hset(keys.tasks, mapping={"a": task.SerializeToString(), "b": other.SerializeToString(), "c": b"\xff\xff"})
    assert validation.fetch_tasks(rclient, keys.tasks, ["a", "b", "c", "d", "a"]) == {"a": task}
    assert validation.fetch_tasks(rclient, keys.tasks, []) == {}
