"""Prompt sources: the synthetic arithmetic task and local JSONL / Parquet files."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from rollstream.trainer import prompts


def test_arithmetic_is_seeded_and_verifiable() -> None:
    a = list(itertools.islice(prompts.arithmetic(seed=3), 50))
    b = list(itertools.islice(prompts.arithmetic(seed=3), 50))
    assert a == b
    assert a != list(itertools.islice(prompts.arithmetic(seed=4), 50))
    for p in a:
        ((role, question),) = p.messages
        x, y = (int(t) for t in question.split("?")[0].removeprefix("What is ").split(" + "))
        assert role == "user" and 0 <= x <= 9 and 0 <= y <= 9
        assert p.answer == str(x + y) and p.task_kind == "arithmetic"


def test_jsonl_with_string_and_chat_prompts(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": "2+2?", "solution": 4},
        {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}], "solution": 6},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = list(itertools.islice(prompts.from_file(str(path), "question", "solution", "exact", seed=0), 4))
    assert len(got) == 4  # epochs repeat
    by_answer = {p.answer: p for p in got}
    assert by_answer["4"].messages == (("user", "2+2?"),)
    assert by_answer["6"].messages == (("system", "Be brief."), ("user", "3+3?"))
    assert {p.task_kind for p in got} == {"exact"}


def test_missing_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="no field 'answer'"):
        next(prompts.from_file(str(path), "prompt", "answer", "exact", seed=0))


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?"], "answer": ["2"]}), path)
    p = next(prompts.from_file(str(path), "prompt", "answer", "arithmetic", seed=0))
    assert p.messages == (("user", "1+1?"),) and p.answer == "2"


def _solutions(numbers: list[int], target: int) -> list[str]:
    """Every expression (each number at most once, + - * /) reaching `target`: brute force."""
    from fractions import Fraction
    from itertools import permutations

    found: list[str] = []

    def combine(items: list[tuple[Fraction, str]]) -> None:
        for value, text in items:
            if value == target:
                found.append(text)
        for i, j in permutations(range(len(items)), 2):
            (a, ta), (b, tb) = items[i], items[j]
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            options = [(a + b, f"({ta} + {tb})"), (a - b, f"({ta} - {tb})"), (a * b, f"({ta} * {tb})")]
            if b != 0:
                options.append((a / b, f"({ta} / {tb})"))
            for option in options:
                combine(rest + [option])
            if found:
                return

    combine([(Fraction(n), str(n)) for n in numbers])
    return found


def test_countdown_is_seeded_solvable_and_scored_by_the_reward_recipe() -> None:
    from rollstream.reward.verifiers import countdown_value

    a = list(itertools.islice(prompts.countdown(seed=5), 30))
    assert a == list(itertools.islice(prompts.countdown(seed=5), 30))
    assert a != list(itertools.islice(prompts.countdown(seed=6), 30))
    for p in a:
        meta = json.loads(p.metadata_json)
        numbers, target = meta["numbers"], meta["target"]
        assert p.task_kind == "countdown" and p.answer == str(target)
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 20 for n in numbers) and 1 <= target <= 100
        ((role, question),) = p.messages
        assert role == "user" and str(target) in question and "<answer>" in question
        assert all(str(n) in question for n in numbers)
        solution = _solutions(numbers, target)[0]
        # What the reward service's `countdown` recipe checks: a solution scores 1, a wrong one 0.
        assert countdown_value(f"<answer>{solution}</answer>", numbers, target) == 1.0
        assert countdown_value(f"<answer>{solution} + 1</answer>", numbers, target) == 0.0


def test_metadata_field_maps_objects_and_json_text(tmp_path: Path) -> None:
    path = tmp_path / "code.jsonl"
    rows = [
        {"q": "Write inc.", "a": "", "meta": {"tests": ["assert inc(1) == 2"]}},
        {"q": "Write dec.", "a": "", "meta": json.dumps({"tests": ["assert dec(1) == 0"]})},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = {
        p.messages[0][1]: p
        for p in itertools.islice(prompts.from_file(str(path), "q", "a", "code", seed=0, metadata_field="meta"), 2)
    }
    assert json.loads(got["Write inc."].metadata_json) == {"tests": ["assert inc(1) == 2"]}
    assert json.loads(got["Write dec."].metadata_json) == {"tests": ["assert dec(1) == 0"]}
    assert {p.task_kind for p in got.values()} == {"code"}
    with pytest.raises(ValueError, match="no field 'extra'"):
        next(prompts.from_file(str(path), "q", "a", "code", seed=0, metadata_field="extra"))


def test_load_from_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    data = Dataset.from_dict({"problem": ["1+1?", "2+3?"], "solution": [2, 5], "info": [{"level": 1}, {"level": 2}]})
    data.save_to_disk(str(tmp_path / "plain"))
    got = list(
        itertools.islice(
            prompts.from_disk(str(tmp_path / "plain"), "problem", "solution", "math", seed=0, metadata_field="info"), 4
        )
    )
    assert len(got) == 4  # epochs repeat
    assert {(p.messages, p.answer, json.loads(p.metadata_json)["level"]) for p in got} == {
        ((("user", "1+1?"),), "2", 1),
        ((("user", "2+3?"),), "5", 2),
    }
    assert {p.task_kind for p in got} == {"math"}

    DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert next(prompts.from_disk(str(tmp_path / "dict"), "problem", "solution", "math", seed=0)).answer in {"2", "5"}
    assert (
        next(prompts.from_disk(str(tmp_path / "dict"), "problem", "solution", "math", seed=0, split="test")).answer
        == "2"
    )
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: \['test', 'train'\]\)"):
        next(prompts.from_disk(str(tmp_path / "dict"), "problem", "solution", "math", seed=0, split="validation"))
    with pytest.raises(ValueError, match="no field 'question'"):
        next(prompts.from_disk(str(tmp_path / "plain"), "question", "solution", "math", seed=0))


def test_trainer_settings_pick_the_source(tmp_path: Path) -> None:
    from datasets import Dataset

    from rollstream.core.config import ConfigError, load_settings
    from rollstream.trainer.config import TrainerSettings

    assert next(prompts.from_settings(load_settings(TrainerSettings, []))).task_kind == "arithmetic"
    assert next(prompts.from_settings(load_settings(TrainerSettings, ["--task", "countdown"]))).task_kind == "countdown"
    Dataset.from_dict({"p": ["hi"], "a": ["yes"]}).save_to_disk(str(tmp_path / "d"))
    s = load_settings(
        TrainerSettings,
        [
            "--task",
            "dataset",
            "--dataset-path",
            str(tmp_path / "d"),
            "--prompt-field",
            "p",
            "--answer-field",
            "a",
            "--task-kind",
            "exact",
        ],
    )
    assert next(prompts.from_settings(s)) == prompts.Prompt(messages=(("user", "hi"),), answer="yes", task_kind="exact")
    with pytest.raises(ConfigError, match="dataset_path is required when task = 'dataset'"):
        load_settings(TrainerSettings, ["--task", "dataset"])
