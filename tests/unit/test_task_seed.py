"""The generator's per-task sampling seed (generator.task_seed): the task's position in the
prompt stream and the generator's seed decide it, never the run's name."""

from __future__ import annotations

import zlib

from rollstream.generator.generator import task_seed
from rollstream.v1 import rollout_pb2


def task(task_id: str, seed: int = 0) -> rollout_pb2.PromptTask:
    return rollout_pb2.PromptTask(task_id=task_id, sampling=rollout_pb2.SamplingParams(seed=seed))


def test_the_run_name_does_not_change_the_seed() -> None:
    assert task_seed(task("demo-00000003"), "demo", 0) == task_seed(task("wt17-x-00000003"), "wt17-x", 0)
    assert task_seed(task("demo-00000003"), "demo", 0) == zlib.crc32(b"00000003")


def test_position_and_seed_change_it() -> None:
    seeds = {task_seed(task(f"a-{n:08d}"), "a", s) for n in range(50) for s in range(3)}
    assert len(seeds) == 150
    assert task_seed(task("a-00000001"), "a", 5) == zlib.crc32(b"00000001") ^ 5


def test_a_seed_the_task_carries_wins() -> None:
    assert task_seed(task("a-00000001", seed=1234), "a", 0) == 1234
    assert task_seed(task("a-00000001", seed=1234), "a", 3) == 1234 ^ 3


def test_a_task_id_from_elsewhere_is_used_whole() -> None:
    # Only this run's prefix is stripped: a run named "a" does not eat the "ab-" of another id.
    assert task_seed(task("ab-00000001"), "a", 0) == zlib.crc32(b"ab-00000001")
    assert task_seed(task("eval-7"), "demo", 0) == zlib.crc32(b"eval-7")
