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
        (role, question), = p.messages
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
