"""Synthetic scored groups for trainer tests that play the upstream stages themselves."""

from __future__ import annotations

import random

from rollstream.v1 import rollout_pb2


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
            completions.append(rollout_pb2.Completion(
                token_ids=[rng.randrange(5, 200) for _ in range(n)],
                behaviour_logprobs=[-5.5 + rng.gauss(0, 0.2) for _ in range(n)],
                reward=float(rng.random() < 0.5),
            ))
        group_id = f"{tag}-s{step}-g{g}"
        out.append(rollout_pb2.RolloutGroup(
            group_id=group_id, task_id=group_id, policy_version=0,
            prompt_ids=[rng.randrange(5, 200) for _ in range(5)], completions=completions, scored=True,
        ))
    return out
