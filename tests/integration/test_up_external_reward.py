"""`rollstream up --external-reward`'s watch on the rollouts stream (plan.ExternalReward),
against a real redis-server: waiting until a consumer of the expected group appears, a
warning for any other consumer group, and the file an outside service reads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import redis
from rich.console import Console

from rollstream.core import status as pipeline_status
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import StreamStage
from rollstream.launcher.plan import EXTERNAL_REWARD_FILE, ExternalReward


def watch(keys: RunKeys, password_file: Path | None = None) -> ExternalReward:
    return ExternalReward(
        redis_url="redis://:secret@127.0.0.1:6379/0", keys=keys, group="reward", output_stage="ready",
        username="reward" if password_file else "", password_file=password_file,
    )  # fmt: skip


def test_waits_for_a_consumer_of_its_group_and_warns_about_others(rclient: redis.Redis, keys: RunKeys) -> None:
    out = io.StringIO()
    console = Console(file=out, width=300)
    w = watch(keys)
    source = keys.stream("rollouts")
    assert (
        w.poll(rclient, console) == f"waiting for a reward consumer on {source} (consumer group reward)"
    )  # no stream yet
    StreamStage.ensure_group(rclient, source, "reward")
    assert w.poll(rclient, console).endswith(
        "no consumer has taken an entry yet"
    )  # a group without consumers is nobody
    StreamStage.ensure_group(rclient, source, "custom-reward")
    rclient.xreadgroup("custom-reward", "x", {source: ">"}, count=1)
    assert w.poll(rclient, console).startswith("waiting")
    assert "consumer group 'custom-reward'" in out.getvalue() and "XGROUP DESTROY" in out.getvalue()
    # Redis 6.2 lists a consumer once it has been handed an entry (not for a read of nothing).
    rclient.xreadgroup("reward", "node-0", {source: ">"}, count=1, block=10)
    assert w.poll(rclient, console).endswith("no consumer has taken an entry yet")
    rclient.xadd(source, {"type": "x"})
    rclient.xreadgroup("reward", "node-0", {source: ">"}, count=1)  # a consumer joins
    assert w.poll(rclient, console) == ""
    assert w.poll(rclient, console) == ""
    text = out.getvalue()
    assert (
        text.count("consumer group 'custom-reward'") == 1 and text.count("a reward consumer joined") == 1
    )  # each said once


def test_the_file_names_everything_and_no_secret(tmp_path: Path) -> None:
    keys = RunKeys("demo")
    w = watch(keys, password_file=tmp_path / "reward.password")
    w.write(tmp_path / EXTERNAL_REWARD_FILE)
    info = json.loads((tmp_path / EXTERNAL_REWARD_FILE).read_text())
    assert info == {
        "redis_url": "redis://:***@127.0.0.1:6379/0",
        "redis_username": "reward",
        "redis_password_file": str(tmp_path / "reward.password"),
        "run": "demo",
        "input_stream": "rs:{demo}:rollouts",
        "consumer_group": "reward",
        "output_stream": "rs:{demo}:ready",
        "output_stage": "ready",
        "dead_stream": "rs:{demo}:dead",
        "stats_hash": "rs:{demo}:stats:reward",
        "task_map": "rs:{demo}:tasks",
        "max_deliveries": 5,
        "claim_idle_ms": 30000,
    }
    assert "secret" not in w.instructions()


def test_status_says_when_no_reward_consumer_reads_the_rollouts(rclient: redis.Redis, keys: RunKeys) -> None:
    def shown() -> str:
        out = io.StringIO()
        snap, extra = pipeline_status.collect(rclient, keys)
        Console(file=out, width=300).print(pipeline_status.render(keys, snap, extra))
        return " ".join(out.getvalue().split())  # the caption wraps at the table's width

    source = keys.stream("rollouts")
    assert f"waiting for a reward consumer on {source}" in shown()
    StreamStage.ensure_group(rclient, source, "reward")
    rclient.xadd(source, {"type": "x"})
    assert f"waiting for a reward consumer on {source}" in shown()
    rclient.xreadgroup("reward", "node-0", {source: ">"}, count=1)
    assert "waiting for a reward consumer" not in shown()
