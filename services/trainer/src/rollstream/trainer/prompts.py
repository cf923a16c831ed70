"""Prompt sources: the built-in arithmetic task (verifiable, no files) and JSONL/Parquet sets.

Each yields (messages, answer, task_kind); the trainer wraps them into PromptTasks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]
    answer: str
    task_kind: str


def arithmetic(seed: int, max_operand: int = 9) -> Iterator[Prompt]:
    """Endless single-digit additions. SmolLM2-135M-Instruct (temperature 1) starts around
    0.15-0.2 mean reward with this wording and the reward service's `arithmetic` recipe:
    enough signal to learn from (two-digit sums start near 0; scripts/probe_demo_task.py
    compares wordings)."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        question = f'What is {a} + {b}? Reply with "The answer is" and the number.'
        yield Prompt(messages=(("user", question),), answer=str(a + b), task_kind="arithmetic")


def from_file(path: str, prompt_field: str, answer_field: str, task_kind: str, seed: int) -> Iterator[Prompt]:
    """Rows of a local JSONL or Parquet file, reshuffled every epoch. `prompt_field` holds
    either a string (one user message) or a list of {role, content} chat messages."""
    from datasets import load_dataset  # only the trainer needs `datasets`

    kind = "parquet" if path.endswith(".parquet") else "json"
    data = load_dataset(kind, data_files=path, split="train")
    for name in (prompt_field, answer_field):
        if name not in data.column_names:
            raise ValueError(f"{path}: no field {name!r} (fields: {data.column_names})")
    epoch = 0
    while True:
        for row in data.shuffle(seed=seed + epoch):
            raw = row[prompt_field]
            if isinstance(raw, str):
                messages: tuple[tuple[str, str], ...] = (("user", raw),)
            else:
                messages = tuple((m["role"], m["content"]) for m in raw)
            yield Prompt(messages=messages, answer=str(row[answer_field]), task_kind=task_kind)
        epoch += 1
