"""Issue 27's poisoned `ready` entries against a real trainer process and a real Redis: each
is refused alone, with a reason naming the field and the numbers, and the good groups read
with them train. The test plays the upstream stages (it writes `ready` itself).

- a 120,000-token prompt in a 2,048-token model (once: 34 minutes of failed allocations,
  five restarts, then a generic "delivered 6 times" that took a good group along);
- 200 completions claiming group_size 200 in a group-size-4 run;
- a behaviour log-prob of -200 (finite; its ratio exp(logp + 200) overflows float32);
- behaviour log-probs at the floor (-87, accepted) whose step still overflows: the step is
  refused and only that group is dead-lettered; the good group of the same step stays and
  trains in the next one (once: the whole step's groups went).
"""

from __future__ import annotations

from pathlib import Path

import redis

from helpers import dead_letters, wait_for, write_ready
from procs import start_service
from rollstream.core import run_keys, validation
from rollstream.v1 import rollout_pb2
from synthetic import Decode, scored_groups


def _group(group_id: str, step: int) -> rollout_pb2.RolloutGroup:
    (g,) = scored_groups(step, 1, tag=group_id)
    g.group_id = g.task_id = group_id
    return g


def test_poisoned_ready_entries_are_refused_alone_and_the_good_ones_train(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    long_prompt = _group("long-prompt", 1)
    long_prompt.prompt_ids.extend([5] * (120_000 - len(long_prompt.prompt_ids)))
    two_hundred = _group("two-hundred", 2)
    two_hundred.group_size = 200
    while len(two_hundred.completions) < 200:
        two_hundred.completions.add().CopyFrom(two_hundred.completions[0])
    low = _group("low-behaviour", 3)
    low.completions[2].behaviour_logprobs[0] = -200.0
    overflow = _group("overflow", 4)
    for c, reward in zip(overflow.completions, (0.0, 1.0, 0.0, 1.0), strict=True):  # advantages of +-0.87
        c.behaviour_logprobs[:] = [validation.MIN_LOGPROB] * len(c.token_ids)
        c.reward = reward
    good_1, good_2 = _group("good-1", 5), _group("good-2", 6)
    # One read: the intake refuses three; the batch is good-1 + overflow, a step that is refused.
    write_ready(rclient, keys, [long_prompt, two_hundred, low, good_1, overflow], tiny_decode)

    trainer = start_service(
        "trainer", tmp_path,
        "--redis-url", redis_url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1", "--consumer", "trainer-0",
        "--groups-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--prompt-buffer", "2", "--lr", "1e-3",
        "--max-staleness", "100", "--block-ms", "100", "--steps", "1", "--linger",
    )  # fmt: skip
    try:
        trainer.wait_ready()
        wait_for(
            lambda: len(dead_letters(rclient, keys)) == 4,
            120,
            "4 dead letters",
            [trainer],
            details=lambda: str(dead_letters(rclient, keys)),
        )
        dead = dead_letters(rclient, keys)
        # good-1 is still held for the next step: not dead, not trained.
        assert not rclient.sismember(keys.groups("trained"), "good-1")
        write_ready(rclient, keys, [good_2], tiny_decode)
        wait_for(
            lambda: int(rclient.hget(keys.counters("trainer"), "step") or 0) == 1, 120, "step 1 committed", [trainer]
        )

        assert {m.decode() for m in rclient.smembers(keys.groups("trained"))} == {"good-1", "good-2"}
        assert set(dead) == {"long-prompt", "two-hundred", "low-behaviour", "overflow"}
        assert (
            "prompt 120000 + completion" in dead["long-prompt"]
            and "longer than the model's context of 2048" in dead["long-prompt"]
        )
        assert "200 completions, more than the limit 4" in dead["two-hundred"]
        assert "behaviour_logprobs[0] = -200.0 is not a log-prob (finite, in [-87, 0])" in dead["low-behaviour"]
        assert dead["overflow"].startswith("step 1 refused: on its own this group's ")
        assert int(rclient.hget(keys.counters("trainer"), "nonfinite_steps") or 0) == 1
        assert rclient.xpending(keys.stream("ready"), "trainer")["pending"] == 0
        assert "delivered" not in " ".join(dead.values())  # each refused for itself, at once
    finally:
        trainer.stop()
