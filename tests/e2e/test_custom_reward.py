"""The pipeline with examples/custom_reward in place of the built-in reward service:
trainer + generator (tiny model) + the example, which imports nothing from rollstream.
The trainer must train on exactly the scores the example assigned."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from helpers import CUSTOM_REWARD_EXAMPLE as EXAMPLE
from helpers import MIN_WAIT_S, LoggedProc, wait_for
from procs import start_service
from rollstream.core import run_keys, streams, validation
from rollstream.v1 import rollout_pb2

pytestmark = pytest.mark.e2e

STEPS = 3
GROUPS_PER_STEP = 2
GROUP_SIZE = 4

# Runs the example with every `rollstream` import refused: the proof that it needs nothing
# of ours at run time (the venv has rollstream installed, so merely not importing it by
# accident would otherwise go unnoticed).
NO_ROLLSTREAM = """
import importlib.abc, runpy, sys

class NoRollstream(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "rollstream" or name.startswith("rollstream."):
            raise ImportError(f"the custom reward example must not import {name}")
        return None

sys.meta_path.insert(0, NoRollstream())
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_example_source_imports_only_redis_protobuf_and_the_stdlib() -> None:
    allowed = {"redis", "google", "rollout_pb2", "grpc_tools"} | set(sys.stdlib_module_names)
    for path in EXAMPLE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_trainer_trains_on_the_custom_services_scores(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    custom_reward_stubs: Path,
    tmp_path: Path,
) -> None:
    # An audit group on `ready` that never reads: the trainer trims `ready` only behind every
    # group, so every group the custom service wrote stays there for the checks below.
    streams.StreamStage.ensure_group(rclient, keys.stream("ready"), "audit")

    common = ["--redis-url", redis_url, "--run", keys.run, "--threads", "1"]
    model = ["--model", str(tiny_model_dir)]
    trainer = start_service(
        "trainer",
        tmp_path,
        *common,
        *model,
        "--steps",
        str(STEPS),
        "--groups-per-step",
        str(GROUPS_PER_STEP),
        "--group-size",
        str(GROUP_SIZE),
        "--max-new-tokens",
        "7",
        "--lr",
        "1e-3",
        "--beta",
        "0",
        "--prompt-buffer",
        "4",
        "--consumer",
        "trainer-0",
        "--linger",
    ).wait_ready()
    # `ready` is never trimmed here (the audit group), so let the generator run ahead.
    generator = start_service(
        "generator",
        tmp_path,
        *common,
        *model,
        "--trainer-address",
        trainer.grpc_address,
        "--consumer",
        "gen-0",
        "--max-inflight-groups",
        "1000",
    ).wait_ready()
    custom_log = tmp_path / "custom.log"
    with custom_log.open("wb") as log:
        custom = subprocess.Popen(
            [sys.executable, "-c", NO_ROLLSTREAM, str(EXAMPLE / "parity_reward.py"), "--redis-url", redis_url, "--run", keys.run,
             "--output-stage", "ready", "--stubs", str(custom_reward_stubs), "--consumer", "parity-0", "--block-ms", "100"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    procs = [trainer, generator]
    try:
        wait_for(lambda: rclient.xlen(keys.metrics) >= STEPS, 600, f"{STEPS} training steps",
                 procs=[*procs, LoggedProc("the custom reward service", custom, custom_log)], poll_s=0.2)  # fmt: skip

        steps = [validation.decode(fields, rollout_pb2.StepMetrics) for _id, fields in rclient.xrange(keys.metrics)]
        trained = {m.decode() for m in rclient.smembers(keys.groups("trained"))}
        ready = {}
        for _id, fields in rclient.xrange(keys.stream("ready")):
            group = validation.decode(fields, rollout_pb2.RolloutGroup)
            ready[group.group_id] = group

        # Only the custom service scored: its consumer group, its component, its rule.
        groups_on_rollouts = {g["name"].decode() for g in rclient.xinfo_groups(keys.stream("rollouts"))}
        assert groups_on_rollouts == {"custom-reward"}
        assert ready, "nothing reached the trainer"
        for group in ready.values():
            assert group.scored
            for c in group.completions:
                assert [(rc.name, rc.status) for rc in c.reward_components] == [("parity", "ok")]
                assert c.reward == (1.0 if len(c.token_ids) % 2 == 0 else 0.0)

        # The trainer trained on exactly those scores: every trained group came from the custom
        # service, and the steps' reward means add up to the custom rewards of those groups.
        assert len(steps) == STEPS and len(trained) == STEPS * GROUPS_PER_STEP
        assert trained <= set(ready)
        trained_total = sum(c.reward for gid in trained for c in ready[gid].completions)
        steps_total = sum(m.reward_mean * m.completions for m in steps)
        assert steps_total == pytest.approx(trained_total, abs=1e-4)
        assert all(m.completions == GROUPS_PER_STEP * GROUP_SIZE for m in steps)
        assert int(rclient.hget(keys.counters("reward"), "scored") or 0) >= len(trained)
        assert "must not import" not in custom_log.read_text()
    finally:
        custom.terminate()
        try:
            custom.wait(timeout=MIN_WAIT_S)
        except subprocess.TimeoutExpired:
            custom.kill()
        for p in reversed(procs):
            p.stop()
    assert custom.returncode == 0, custom_log.read_text()[-3000:]  # SIGTERM: a clean stop
