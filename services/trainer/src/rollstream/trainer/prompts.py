"""Where prompts come from and how they are fed.

Sources: each an endless, seeded iterator of `Prompt`s (chat messages, reference answer, task
kind, metadata) that the reward scores with the recipe named by the task kind.
- `arithmetic`: single-digit additions (the demo task; reward recipe `arithmetic`).
- `countdown`: reach a target with the given numbers and + - * / (recipe `countdown`;
  the numbers and target travel in metadata_json).
- `from_file`: rows of a local JSONL or Parquet file; `from_disk`: a data set saved with
  `datasets.Dataset.save_to_disk`. A field mapping names the prompt, answer and
  (optionally) metadata columns.

The feeder (`PromptFeeder`) keeps `prompt_buffer` tasks waiting in rs:{<run>}:prompts, and
the task map rs:{<run>}:tasks that the reward scores with and the trainer checks groups
against. Its position (prompts fed so far) lives in Redis, written in the same atomic script
as the tasks it counts, so a restarted trainer continues the seeded source exactly where the
stream left it: no prompt is fed twice and none is skipped, whichever checkpoint it resumed.

The same script records each task in the map (task_id -> the PromptTask, its prompt ids
rendered with the trainer's tokenizer, as the generator renders them). Only the trainer's
Redis user may write the map, so what a group is scored against and trained on comes from
what the trainer fed, not from whoever wrote the group. The map holds exactly the tasks
fed at positions [swept, fed): the sweep deletes a prefix of it once no group of those
tasks can be trained any more (`mark`, `sweep`).
"""

from __future__ import annotations

import itertools
import json
import operator
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.core import redis_policy, run_keys, streams, validation
from rollstream.v1 import rollout_pb2

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


def metadata_json(raw: Any) -> str:
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
                metadata_json=metadata_json(row[metadata_field]) if metadata_field else "",
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


def from_settings(settings: TrainerSettings) -> Iterator[Prompt]:
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


def held_out(settings: TrainerSettings) -> list[Prompt]:
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


# Renders chat messages into prompt ids exactly as the generator does (backends.encode_chat).
Encode = Callable[[Sequence[tuple[str, str]]], list[int]]
SWEEP_CHUNK = 1000  # task ids per HDEL


def chat_encoder(tokenizer: Any) -> Encode:
    """Chat messages -> prompt ids, as the generator renders them (backends.encode_chat)."""

    def encode(messages: Sequence[tuple[str, str]]) -> list[int]:
        chat = [{"role": r, "content": c} for r, c in messages]
        return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))

    return encode


def feed_task(
    ops: streams.Ops, keys: run_keys.RunKeys, stream: str, task: rollout_pb2.PromptTask, prompt_ids: Sequence[int]
) -> None:
    """Add `task` to `stream` and to the task map, with its prompt ids as the trainer rendered
    them (what groups of it are checked against), in the same `ops`."""
    ops.xadd(stream, validation.encode(task))
    known = rollout_pb2.PromptTask()
    known.CopyFrom(task)
    known.prompt_ids.extend(prompt_ids)
    ops.hset(keys.tasks, task.task_id, known.SerializeToString())


def check_answers(
    client: redis_policy.Client,
    stage: streams.StreamStage,
    keys: run_keys.RunKeys,
    new: validation.Groups,
    version: int,
    stale: Callable[[rollout_pb2.RolloutGroup], bool],
    decode: Callable[[Sequence[int]], str],
) -> tuple[validation.Groups, validation.Groups]:
    """The groups of `new` that answer a task of the task map (feed_task), as they say, with
    text that is their tokens (validation.check_against_task): (training groups, evaluation
    groups: the task map's word, not the group's). The others are dead-lettered on `stage`
    with the reason. What trains is what the trainer asked, sampled as the reward saw it.
    Stale groups pass (the trainer counts them; their task may already be swept); an
    evaluation group from a version after `version` does not (a round's versions are the
    report's)."""
    if not new:
        return [], []
    tasks = validation.fetch_tasks(client, keys.tasks, [g.task_id for _, g in new])
    kept: validation.Groups = []
    evals: validation.Groups = []
    for entry, group in new:
        task = tasks.get(group.task_id)
        try:
            if task is not None and task.eval:
                validation.check_against_task(group, task, decode)
                if group.policy_version > version:
                    raise validation.EntryError(
                        f"group {group.group_id}: policy_version {group.policy_version} is newer than the trainer's {version}"
                    )
                evals.append((entry, group))
                continue
            if not stale(group):
                if task is None:
                    raise validation.EntryError(validation.unknown_task(group, keys.tasks))
                validation.check_against_task(group, task, decode)
        except validation.EntryError as e:
            stage.dead_letter(entry, str(e))
            continue
        kept.append((entry, group))
    return kept, evals


class PromptFeeder:
    def __init__(
        self,
        settings: TrainerSettings,
        client: redis_policy.Client,
        stage: streams.StreamStage,
        fed: int,
        encode: Encode,
    ):
        self.settings = settings
        self.client = client
        self.stage = stage  # runs the feeder's writes through the run's commit script
        self.keys = stage.keys
        self.encode = encode
        self.source = from_settings(settings)
        # Sources are seeded: drawing `fed` prompts and dropping them puts this one where the
        # run left off (itertools' "consume" recipe).
        next(itertools.islice(self.source, fed, fed), None)
        self.fed = fed
        # Where the map starts; read from its length at the first sweep (a restart keeps it).
        self.swept: int | None = None
        # (version, position): at that version every task before that position had been
        # taken and its group written, with weights of that version or older.
        self.marks: deque[tuple[int, int]] = deque()

    @staticmethod
    def position(client: redis_policy.Client, keys: run_keys.RunKeys, checkpoint_fed: int) -> int:
        """Prompts fed so far: Redis's count, else (a run from before it was kept) the checkpoint's."""
        value = client.get(keys.fed)
        return int(value) if value is not None else checkpoint_fed

    def task_id(self, n: int) -> str:
        # The generator seeds the group by what follows "<run>-" (generator.task_seed), so the
        # samples do not depend on the run's name.
        return f"{self.keys.run}-{n:08d}"

    def top_up(self, version: int) -> int:
        s = self.settings
        stream = self.keys.stream("prompts")
        run_keys.trim_acknowledged(self.client, stream)
        self.mark(version, stream)
        self.sweep(version)
        missing = s.prompt_buffer - run_keys.waiting(self.client, stream, limit=s.prompt_buffer)
        if missing <= 0:
            return 0
        ops = streams.Ops()
        for n, p in zip(range(self.fed, self.fed + missing), itertools.islice(self.source, missing)):
            task = rollout_pb2.PromptTask(
                task_id=self.task_id(n),
                messages=[rollout_pb2.ChatMessage(role=r, content=c) for r, c in p.messages],
                answer=p.answer,
                group_size=s.group_size,
                sampling=rollout_pb2.SamplingParams(
                    temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
                ),
                fed_at_version=version,
                task_kind=p.task_kind,
                metadata_json=p.metadata_json,
            )
            feed_task(ops, self.keys, stream, task, self.encode(p.messages))
        ops.set(self.keys.fed, self.fed + missing)
        self.stage.apply(ops)
        self.fed += missing
        return missing

    def mark(self, version: int, stream: str) -> None:
        """Record how far the tasks have all been taken, just after the prompts stream was
        trimmed to the oldest entry a generator still needs: every task before it was
        acknowledged with its group written. The head counts only if it is one of ours (the
        map holds it as fed): the generator may append to the stream, and a forged head
        that claimed a later position would sweep tasks still in flight."""
        head: Any = self.client.xrange(stream, count=1)  # [(id, fields)]: redis-py types fields loosely
        if not head:
            position = self.fed
        else:
            try:
                task = validation.decode(head[0][1], rollout_pb2.PromptTask)
            except validation.EntryError:
                return
            n = self.position_of(task.task_id)
            if n is None:
                return
            known = self.client.hget(self.keys.tasks, task.task_id)
            if known is None:
                return
            ours = rollout_pb2.PromptTask()
            ours.ParseFromString(known)
            del ours.prompt_ids[:]
            if ours != task:
                return
            position = n
        if not self.marks or position > self.marks[-1][1]:
            self.marks.append((version, position))

    def sweep(self, version: int) -> None:
        """Delete the tasks no group of which can still be trained: a group is written with
        weights no newer than the trainer's version then, and trains only within
        max_staleness versions of them, so once the version is past a mark's by more than
        that, its tasks' groups are all trained, stale or dead. Such a group arriving later
        is refused as of an unknown task instead of dropped as stale: not trained either way.
        The map's memory is then the tasks of max_staleness + 1 steps and those in flight."""
        due = 0
        while self.marks and version > self.marks[0][0] + self.settings.max_staleness:
            due = self.marks.popleft()[1]
        if self.swept is None:
            self.swept = max(0, self.fed - int(self.client.hlen(self.keys.tasks)))
        while self.swept < min(due, self.fed):
            end = min(due, self.fed, self.swept + SWEEP_CHUNK)
            self.client.hdel(self.keys.tasks, *[self.task_id(n) for n in range(self.swept, end)])
            self.swept = end

    def position_of(self, task_id: str) -> int | None:
        """n for one of our task ids (`<run>-<n>`), None for anything else."""
        digits = task_id.removeprefix(f"{self.keys.run}-")
        return int(digits) if digits != task_id and digits.isascii() and digits.isdigit() and len(digits) >= 8 else None
