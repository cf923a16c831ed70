"""Synthetic rollout groups for tests that play the stages upstream of the one under test:
`rollout_group` as the generator writes it (for the reward stage), `scored_group_in_vocab`
as the reward stage writes it (for the reference stage), `scored_groups` for the trainer.
`record_tasks` plays the trainer's feeder for them: the reward and the trainer take only
groups of tasks in the run's task map (rs:{<run>}:tasks)."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import redis

from rollstream.core.run_keys import RunKeys
from rollstream.v1 import rollout_pb2

# A tokenizer's decode, special tokens skipped: the text the trainer checks a completion against.
Decode = Callable[[Sequence[int]], str]


def scored_groups(step: int, count: int, tag: str = "g", group_size: int = 4) -> list[rollout_pb2.RolloutGroup]:
    """`count` scored groups sampled at version 0, their content fixed by `step` alone: two
    calls with another `tag` give the same groups under other ids (the trainer deduplicates
    by group id). Tokens stay in 5..199, inside every test model's vocabulary; rewards are
    0/1 so most groups have a signal."""
    rng = random.Random(step)
    out = []
    for g in range(count):
        completions = []
        for _ in range(group_size):
            n = rng.randint(1, 6)
            completions.append(
                rollout_pb2.Completion(
                    token_ids=[rng.randrange(5, 200) for _ in range(n)],
                    behaviour_logprobs=[-5.5 + rng.gauss(0, 0.2) for _ in range(n)],
                    reward=float(rng.random() < 0.5),
                )
            )
        group_id = f"{tag}-s{step}-g{g}"
        out.append(
            rollout_pb2.RolloutGroup(
                group_id=group_id,
                task_id=group_id,
                policy_version=0,
                prompt_ids=[rng.randrange(5, 200) for _ in range(5)],
                completions=completions,
                scored=True,
            )
        )
    return out


def rollout_group(
    group_id: str, texts: list[str], answer: str = "8", task_kind: str = "arithmetic"
) -> rollout_pb2.RolloutGroup:
    """An unscored group as the generator writes it: one completion per text (2 tokens each)."""
    return rollout_pb2.RolloutGroup(
        group_id=group_id,
        task_id="task-" + group_id,
        policy_version=3,
        prompt_ids=[11, 12, 13],
        answer=answer,
        task_kind=task_kind,
        generator_id="gen-0",
        created_at=time.time(),
        completions=[
            rollout_pb2.Completion(
                text=t,
                token_ids=[5, 6],
                behaviour_logprobs=[-0.5, -0.25],
                versions=[rollout_pb2.VersionSpan(version=3, start=0, end=2)],
                finish_reason="stop",
            )
            for t in texts
        ],
    )


def scored_group_in_vocab(vocab: int, n: int = 3, prompt_len: int = 11, seed: int = 0) -> rollout_pb2.RolloutGroup:
    """A scored group as the reward stage writes it, token ids below `vocab`: `n` completions
    of different lengths, a fresh group id."""
    prompt = [(seed * 7 + 3 * i) % vocab for i in range(prompt_len)]
    completions = []
    for j in range(n):
        tokens = [(seed + 5 * j + 11 * k) % vocab for k in range(4 + 6 * j)]
        completions.append(
            rollout_pb2.Completion(
                token_ids=tokens,
                behaviour_logprobs=[-1.5] * len(tokens),
                versions=[rollout_pb2.VersionSpan(version=0, start=0, end=len(tokens))],
                text=f"completion {j}",
                finish_reason="length",
                reward=float(j),
                reward_components=[
                    rollout_pb2.RewardComponent(name="correct", value=float(j), weight=1.0, status="ok")
                ],
            )
        )
    return rollout_pb2.RolloutGroup(
        group_id="g-" + uuid.uuid4().hex[:8],
        task_id="task-" + str(seed),
        policy_version=0,
        prompt_ids=prompt,
        completions=completions,
        answer="42",
        task_kind="arithmetic",
        generator_id="gen-test",
        scored=True,
        created_at=time.time(),
    )


def task_of(group: rollout_pb2.RolloutGroup) -> rollout_pb2.PromptTask:
    """The task `group` answers, as the trainer's map would hold it (prompt ids rendered)."""
    return rollout_pb2.PromptTask(
        task_id=group.task_id,
        prompt_ids=group.prompt_ids,
        answer=group.answer,
        metadata_json=group.metadata_json,
        group_size=group.group_size,
        task_kind=group.task_kind,
        messages=[rollout_pb2.ChatMessage(role="user", content=group.task_id)],
    )


def record_tasks(
    client: redis.Redis, keys: RunKeys, groups: Iterable[rollout_pb2.RolloutGroup], decode: Decode | None = None
) -> None:
    """Record each group's task in the run's task map, as if the trainer had fed it; with
    `decode` (the model's tokenizer, special tokens skipped), first set each completion's
    text to its tokens decoded, as a generator writes it. Call before encoding the groups."""
    pipe = client.pipeline(transaction=False)
    for g in groups:
        if decode is not None:
            for c in g.completions:
                c.text = decode(c.token_ids)
        pipe.hset(keys.tasks, g.task_id, task_of(g).SerializeToString())
    pipe.execute()


def tokenizer_decode(model_dir: object) -> Decode:
    """The trainer's decode for the model in `model_dir`: what its text check compares with."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))
