"""The whole system with examples/custom_reward_node as its only reward stage, through
`rollstream up --reward external` on the tiny model: `up` starts no reward service, says
what an outside one must use (WORKDIR/external-reward.json) and waits for it; the Node.js
service joins from that file alone, as the `reward` ACL user.

Checked: every step's reward mean is the mean of exactly the rewards the Node service wrote
(the trained groups' own bytes, from the trainer's trained log), with its grader's rule and
component; kill -9 of the Node service while it holds entries, twice (restarted under the
same consumer name: it resumes its own pending entries; then under a new name: it takes
over the dead consumer's), loses nothing: the fault suite's ledger check (every generated
group trained, stale, dead with a reason, or waiting; nothing trained twice) holds, and
the server refused the `reward` user nothing. Skips where node/npm or the npm registry is
missing (tests/node_example.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import redis

from faults.harness import FaultRun, RunShape, check_invariants
from helpers import wait_for
from node_example import install_node_example, start_node_reward
from procs import ChildProcess
from rollstream.core import validation
from rollstream.v1 import rollout_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SHAPE = RunShape(
    steps=6, group_size=4, groups_per_step=2, max_new_tokens=6, beta=0.0, checkpoint_every=100, reward="external"
)
STEP_S = 300.0  # generous: a loaded 2-core machine; they only bound a run that hangs


def node_rule(n_tokens: int) -> float:
    """The example's grader: (number of completion tokens mod 3) / 2."""
    return (n_tokens % 3) / 2


def test_up_with_the_node_reward_service_as_the_only_reward_stage(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = install_node_example(tmp_path / "node")
    started: list[ChildProcess] = []
    with FaultRun(tiny_model_dir, tmp_path / "run", seed=16, shape=SHAPE, run="node16") as run:
        try:
            run.start()
            info_path = run.workdir / "external-reward.json"
            wait_for(
                info_path.exists,
                STEP_S,
                "up to write external-reward.json",
                check=lambda: run._check_upalive("external-reward.json"),
                poll_s=0.2,
            )
            info = json.loads(info_path.read_text())
            source = f"rs:{{{run.run}}}:rollouts"
            assert info["input_stream"] == source and info["output_stream"] == f"rs:{{{run.run}}}:ready"
            assert (
                info["consumer_group"] == "reward"
                and info["redis_username"] == "reward"
                and info["max_deliveries"] == 5
            )
            assert f"waiting for a reward consumer on {source}" in run.up_log.read_text()
            assert not (run.workdir / "state" / "reward-0.json").exists()

            def node(consumer: str, *args: str) -> ChildProcess:
                # Slow on purpose (each batch held 0.5 s), so that a kill lands while it holds entries.
                proc = start_node_reward(folder, tmp_path / f"{consumer}.log", "--from-up", str(info_path), "--consumer", consumer,
                                         "--hold-ms", "500", "--count", "2", *args, name=consumer)  # fmt: skip
                started.append(proc)
                return proc

            admin = redis.Redis.from_url(run.redis_url(), socket_timeout=30, **run.admin())
            try:
                admin.acl_log_reset()

                def kill_while_holding(proc: ChildProcess) -> list[bytes]:
                    def holds() -> bool:
                        return any(
                            c["name"].decode() == proc.name and c["pending"] > 0
                            for c in admin.xinfo_consumers(source, "reward")
                        )

                    wait_for(
                        holds, STEP_S, f"{proc.name} holding entries", procs=[proc], details=run.logs_tail, poll_s=0.02
                    )
                    proc.kill()
                    return [
                        p["message_id"]
                        for p in admin.xpending_range(source, "reward", "-", "+", 100, consumername=proc.name)
                    ]

                first = node("node-0")
                run.wait_step(2, STEP_S)
                assert "a reward consumer joined consumer group reward" in run.up_log.read_text()
                held_1 = kill_while_holding(first)
                node("node-0")  # the same name: its own pending entries first
                run.wait_step(4, STEP_S)
                held_2 = kill_while_holding(started[-1])
                # A new name: node-0's entries are taken over once idle for 1 s.
                node("node-1", "--claim-idle-ms", "1000")
                wait_for(
                    lambda: run.proc.poll() is not None,
                    2 * STEP_S,
                    "up to finish its steps",
                    details=run.logs_tail,
                    poll_s=0.5,
                )
                assert run.proc.returncode == 0, run.logs_tail()
            finally:
                admin.close()
            for proc in started[-1:]:
                assert proc.stop() == 0, proc.log()
        finally:
            for proc in started:
                if proc.proc.poll() is None:
                    proc.proc.kill()
                    proc.proc.wait(timeout=30)

        assert held_1 and held_2, "a kill landed after the service had committed everything it read"
        summary = run.summary()
        ledger_client = run.open_ledger()
        ledger = check_invariants(
            ledger_client,
            run.keys,
            steps=SHAPE.steps,
            groups_per_step=SHAPE.groups_per_step,
            versions=summary["versions"],
        )
        assert not ledger.violations, ledger.describe()
        assert ledger.dead == 0, ledger.describe()

        # Every step trained on exactly what the Node service wrote: the trained log holds the
        # very entries the trainer took from `ready`, with their step.
        metrics = {
            m.step: m
            for m in (
                validation.decode(f, rollout_pb2.StepMetrics) for _id, f in ledger_client.xrange(run.keys.metrics)
            )
        }
        assert sorted(metrics) == list(range(1, SHAPE.steps + 1))
        by_step: dict[int, list[rollout_pb2.RolloutGroup]] = defaultdict(list)
        for _id, fields in ledger_client.xrange(run.keys.trained_log):
            by_step[int(fields.pop(b"step"))].append(validation.decode(fields, rollout_pb2.RolloutGroup))
        assert sorted(by_step) == sorted(metrics)
        for step, groups in by_step.items():
            assert len(groups) == SHAPE.groups_per_step
            rewards = []
            for g in groups:
                for c in g.completions:
                    assert c.reward == node_rule(len(c.token_ids))
                    assert [(rc.name, rc.value, rc.status) for rc in c.reward_components] == [
                        ("length_mod3", c.reward, "ok")
                    ]
                    rewards.append(c.reward)
            assert metrics[step].completions == len(rewards)
            assert metrics[step].reward_mean == pytest.approx(sum(rewards) / len(rewards), abs=1e-6), f"step {step}"
        logs = "".join(p.log() for p in started)
        assert '"event":"claimed"' in logs, "node-1 took nothing over"
        assert "misconfigured" not in logs and "dead_letter" not in logs
