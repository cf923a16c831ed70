"""The prompt feeder: keeps `prompt_buffer` tasks waiting in rs:{<run>}:prompts, and the
task map rs:{<run>}:tasks that the reward scores with and the trainer checks groups against.

Its position (prompts fed so far) lives in Redis, written in the same atomic script as the
tasks it counts, so a restarted trainer continues the seeded prompt source exactly where the
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
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from rollstream.core import codec, redis_policy, run_keys, streams
from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.v1 import rollout_pb2

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
    ops.xadd(stream, codec.encode(task))
    known = rollout_pb2.PromptTask()
    known.CopyFrom(task)
    known.prompt_ids.extend(prompt_ids)
    ops.hset(keys.tasks, task.task_id, known.SerializeToString())


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
        self.source = prompts.from_settings(settings)
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
                task = codec.decode(head[0][1], rollout_pb2.PromptTask)
            except codec.EntryError:
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
