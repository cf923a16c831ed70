"""Scale-out: several reward processes share the consumer group; every group is scored
exactly once, and the work is split between them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from helpers import assert_scored_exactly_once, groups_in, wait_for, write_many
from procs import start_reward
from rollstream.core.run_keys import RunKeys
from synthetic import rollout_group

N_GROUPS = 1200


def scored_by(http_port: int) -> int:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith('rollstream_reward_groups_total{outcome="scored"}'))
    return int(float(line.split()[-1]))


def test_two_workers_share_the_group_and_score_each_group_once(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys
) -> None:
    # Both join the group and wait before anything is written, so both compete for it.
    workers = [start_reward(tmp_path, redis_url, keys.run, "--consumer", f"worker-{w}", tag=f"-{w}") for w in "ab"]
    try:
        ids = [f"s{i}" for i in range(N_GROUPS)]
        write_many(rclient, keys, [rollout_group(i, ["8", "9", "The answer is 8", "eight"]) for i in ids])
        wait_for(lambda: rclient.xlen(keys.stream("scored")) >= N_GROUPS, 120, f"all {N_GROUPS} scored", [workers[0]])
        assert_scored_exactly_once(rclient, keys, ids)
        for g in groups_in(rclient, keys.stream("scored")):
            assert [c.reward for c in g.completions] == pytest.approx([1.1, 0.1, 1.1, 0.0])
        # Each worker's own count of what it committed: together exactly the whole, both non-zero.
        # A worker counts a batch just after committing it (its counter cannot take back a
        # failed commit), so the last batch's count may trail the stream by a moment: waited for.
        counts = wait_for(
            lambda: c if sum(c := [scored_by(w.http_port) for w in workers]) >= N_GROUPS else None,
            120,
            "both workers' counts to reach the stream",
            workers,
        )
        assert sum(counts) == N_GROUPS and min(counts) > 0, counts
        assert int(rclient.hget(keys.counters("reward"), "scored") or 0) == N_GROUPS
    finally:
        for w in workers:
            w.kill()
