"""Prompt sources: built-in synthetic tasks (verifiable, no files) and local data sets.

Each source is an endless iterator of `Prompt`s (chat messages, reference answer, task
kind, metadata); the trainer wraps them into PromptTasks, the generator renders the
messages with the tokenizer's chat template, and the reward service scores completions
with the recipe named by the task kind (using the answer and metadata).

- `arithmetic`: single-digit additions (the demo task; reward recipe `arithmetic`).
- `countdown`: reach a target with the given numbers and + - * / (recipe `countdown`;
  the numbers and target travel in metadata_json).
- `from_file`: rows of a local JSONL or Parquet file; `from_disk`: a data set saved with
  `datasets.Dataset.save_to_disk`. A field mapping names the prompt, answer and
  (optionally) metadata columns.
"""

from __future__ import annotations

import itertools
import json
import operator
import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

    from rollstream.trainer.config import TrainerSettings


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]
    answer: str
    task_kind: str
    metadata_json: str = ""


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


def countdown(
    seed: int, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20, max_target: int = 100
) -> Iterator[Prompt]:
    """Endless countdown puzzles: numbers, and a target that some expression of them reaches.

    Every puzzle is solvable: the target is the value of a random expression built from
    the numbers (in a random order, each once), kept when it is a whole number in
    1..max_target. Not every number has to be used in an answer; the reward service's
    `countdown` recipe checks that each is used at most as often as it is given.
    """
    rng = random.Random(seed)
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        target = _reachable_target(rng, numbers, max_target)
        if target is None:
            continue
        listed = ", ".join(str(n) for n in numbers)
        question = (
            f"Using the numbers [{listed}], write an arithmetic expression that equals {target}. "
            "Use + - * / and parentheses; each number at most once. "
            "Put the expression in <answer></answer>, for example <answer>(1 + 2) * 3</answer>."
        )
        yield Prompt(
            messages=(("user", question),),
            answer=str(target),
            task_kind="countdown",
            metadata_json=json.dumps({"numbers": numbers, "target": target}),
        )


_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _reachable_target(rng: random.Random, numbers: list[int], max_target: int) -> int | None:
    """The value of a random expression over all of `numbers`, if it is an integer in 1..max_target."""
    order = rng.sample(numbers, len(numbers))
    value = Fraction(order[0])
    for n in order[1:]:
        value = _OPERATORS[rng.choice("+-*/")](value, n)  # n >= 1: never a division by zero
    if value.denominator != 1 or not 1 <= value <= max_target:
        return None
    return int(value)


def _messages(raw: Any) -> tuple[tuple[str, str], ...]:
    """A prompt cell: a string (one user message) or a list of {role, content} messages."""
    if isinstance(raw, str):
        return (("user", raw),)
    return tuple((m["role"], m["content"]) for m in raw)


def _metadata_json(raw: Any) -> str:
    """A metadata cell: an object (stored as JSON) or JSON text (checked, kept as is)."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        if raw and not isinstance(json.loads(raw), dict):
            raise ValueError(f"metadata {raw[:80]!r} is not a JSON object")
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"metadata of type {type(raw).__name__} is not an object")
    return json.dumps(raw)


def _rows(
    data: "Dataset",
    source: str,
    prompt_field: str,
    answer_field: str,
    task_kind: str,
    seed: int,
    metadata_field: str,
    epochs: int | None = None,
) -> Iterator[Prompt]:
    """Rows of `data` as prompts, reshuffled every epoch (`epochs` of them; None: endless)."""
    wanted = [prompt_field, answer_field] + ([metadata_field] if metadata_field else [])
    for name in wanted:
        if name not in data.column_names:
            raise ValueError(f"{source}: no field {name!r} (fields: {data.column_names})")
    if len(data) == 0:
        raise ValueError(f"{source}: no rows")
    epoch = 0
    while epochs is None or epoch < epochs:
        for row in data.shuffle(seed=seed + epoch):
            yield Prompt(
                messages=_messages(row[prompt_field]),
                answer=str(row[answer_field]),
                task_kind=task_kind,
                metadata_json=_metadata_json(row[metadata_field]) if metadata_field else "",
            )
        epoch += 1


def from_file(
    path: str,
    prompt_field: str,
    answer_field: str,
    task_kind: str,
    seed: int,
    metadata_field: str = "",
    epochs: int | None = None,
) -> Iterator[Prompt]:
    """Rows of a local JSONL or Parquet file, reshuffled every epoch. `prompt_field` holds
    either a string (one user message) or a list of {role, content} chat messages;
    `metadata_field` (optional) an object or JSON text, passed to the reward recipe."""
    from datasets import load_dataset  # only the trainer needs `datasets`

    kind = "parquet" if path.endswith(".parquet") else "json"
    data = load_dataset(kind, data_files=path, split="train")
    yield from _rows(data, path, prompt_field, answer_field, task_kind, seed, metadata_field, epochs)


def from_disk(
    path: str,
    prompt_field: str,
    answer_field: str,
    task_kind: str,
    seed: int,
    metadata_field: str = "",
    split: str = "train",
    epochs: int | None = None,
) -> Iterator[Prompt]:
    """A data set saved with `save_to_disk` (a Dataset, or a DatasetDict and its `split`)."""
    from datasets import Dataset, DatasetDict, load_from_disk

    loaded = load_from_disk(path)
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path}: no split {split!r} (splits: {sorted(loaded)})")
        loaded = loaded[split]
    assert isinstance(loaded, Dataset)
    yield from _rows(loaded, path, prompt_field, answer_field, task_kind, seed, metadata_field, epochs)


def from_settings(settings: "TrainerSettings") -> Iterator[Prompt]:
    """The prompt source the trainer's settings ask for."""
    s = settings
    match s.task:
        case "arithmetic":
            return arithmetic(s.seed, s.max_operand)
        case "countdown":
            return countdown(s.seed)
        case "jsonl":
            return from_file(s.dataset_path, s.prompt_field, s.answer_field, s.task_kind, s.seed, s.metadata_field)
        case "dataset":
            return from_disk(s.dataset_path, s.prompt_field, s.answer_field, s.task_kind, s.seed, s.metadata_field)
    raise ValueError(f"unknown task {s.task!r}")


def held_out(settings: "TrainerSettings") -> list[Prompt]:
    """The evaluation set: the first `eval_prompts` prompts of eval_dataset_path (a JSONL or
    Parquet file, or a save_to_disk folder, with the training task's fields; shuffled with
    eval_seed, each row at most once), else of the built-in task's generator seeded with
    eval_seed. The same prompts every round, so rounds compare."""
    s = settings
    source: Iterator[Prompt]
    if s.eval_dataset_path:
        read = from_disk if Path(s.eval_dataset_path).is_dir() else from_file
        source = read(
            s.eval_dataset_path, s.prompt_field, s.answer_field, s.task_kind, s.eval_seed, s.metadata_field, epochs=1
        )
    elif s.task == "arithmetic":
        source = arithmetic(s.eval_seed, s.max_operand)
    elif s.task == "countdown":
        source = countdown(s.eval_seed)
    else:
        raise ValueError(f"eval_dataset_path is required for held-out prompts of task {s.task!r}")
    # Each prompt once: a small task (100 sums at max_operand 9) repeats within 32 draws.
    distinct: dict[tuple[tuple[str, str], ...], Prompt] = {}
    for prompt in itertools.islice(source, 100 * s.eval_prompts):
        distinct.setdefault(prompt.messages, prompt)
        if len(distinct) == s.eval_prompts:
            break
    return list(distinct.values())
