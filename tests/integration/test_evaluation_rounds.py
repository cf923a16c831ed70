"""Held-out rounds against a real Redis: fed with their tasks, taken once, finished by a
restarted trainer, reported once, cleaned up (trainer/evaluation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from rollstream.core import validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.core.streams import Ops, StreamStage
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.evaluation import ROUND_PREFIX, Evaluator
from rollstream.trainer.prompts import chat_encoder
from rollstream.v1 import rollout_pb2


def answered(task: rollout_pb2.PromptTask, right: list[bool], version: int) -> rollout_pb2.RolloutGroup:
    """The scored group a generator and the reward stage make of `task` (the reward's
    arithmetic recipe: answer + format)."""
    completions = [
        rollout_pb2.Completion(
            token_ids=[5, 6],
            behaviour_logprobs=[-0.1, -0.2],
            text="xy",
            finish_reason="stop",
            reward=1.1 if ok else 0.1,
            reward_components=[
                rollout_pb2.RewardComponent(name="answer", value=1.0 if ok else 0.0, weight=1.0, status="ok"),
                rollout_pb2.RewardComponent(name="format", value=1.0, weight=0.1, status="ok"),
            ],
        )
        for ok in right
    ]
    return rollout_pb2.RolloutGroup(
        group_id=task.task_id,
        task_id=task.task_id,
        policy_version=version,
        prompt_ids=[1, 2],
        completions=completions,
        answer=task.answer,
        task_kind=task.task_kind,
        group_size=task.group_size,
        scored=True,
        eval=True,
    )


def sample_round(rclient: redis.Redis, keys: RunKeys, right: list[list[bool]], version: int) -> None:
    """A generator takes the round's tasks from eval_prompts; their scored groups reach `ready`."""
    generator = StreamStage(rclient, keys, "eval_prompts", "generators", "gen-0")
    for (entry, task), ok in zip(
        generator.read_valid(100, None, lambda e: validation.decode(e.fields, rollout_pb2.PromptTask)), right
    ):
        generator.commit([entry], outputs=[("ready", answered(task, ok, version))])


def take_all(evaluator: Evaluator, stage: StreamStage, count: int = 100) -> None:
    evaluator.take(stage.read_valid(count, None, lambda e: validation.decode(e.fields, rollout_pb2.RolloutGroup)))


def evaluator_feed(evaluator: Evaluator, stage: StreamStage, step: int, version: int) -> int:
    """Feed the round after `step` alone (the trainer feeds the first so; the others with their step's commit)."""
    ops = Ops()
    evaluator.feed(ops, step, version)
    stage.apply(ops)
    return evaluator.rounds[step].fed


def test_a_round_is_fed_taken_across_a_restart_reported_once_and_cleaned_up(
    rclient: redis.Redis, keys: RunKeys, run_name: str, tiny_model_dir: Path
) -> None:
    encode = chat_encoder(AutoTokenizer.from_pretrained(tiny_model_dir))
    settings = TrainerSettings(run=run_name, steps=4, eval_every=2, eval_prompts=3, eval_samples=2, temperature=0.7)
    stage = StreamStage(rclient, keys, "ready", "trainer", "trainer-0")
    evaluator = Evaluator(settings, rclient, stage, encode)
    assert [evaluator.due(step) for step in range(6)] == [True, False, True, False, True, False]

    # 1. Fed: the tasks in eval_prompts, the task map (eval, prompt ids rendered) and the round's marker.
    assert evaluator_feed(evaluator, stage, step=0, version=0) == 3 and not evaluator.due(0)
    fed = [validation.decode(f, rollout_pb2.PromptTask) for _, f in rclient.xrange(keys.stream("eval_prompts"))]
    assert [t.task_id for t in fed] == [f"{run_name}-eval-00000000-0000{n}" for n in range(3)]
    assert all(
        t.eval and t.group_size == 2 and abs(t.sampling.temperature - 0.7) < 1e-6 and t.fed_at_version == 0 for t in fed
    )
    known = rollout_pb2.PromptTask.FromString(rclient.hget(keys.tasks, fed[0].task_id))
    assert known.eval and list(known.prompt_ids) == encode([(m.role, m.content) for m in fed[0].messages])

    # 2. Two groups taken; the trainer restarts; the third is taken by the new one.
    sample_round(rclient, keys, [[True, False], [False, False], [True, True]], version=0)
    take_all(evaluator, stage, count=2)
    assert evaluator.report_ready() == []
    restarted = Evaluator(settings, rclient, StreamStage(rclient, keys, "ready", "trainer", "trainer-0"), encode)
    assert not restarted.due(0) and len(restarted.rounds[0].results) == 2
    take_all(restarted, stage)
    (m,) = restarted.report_ready()
    assert (m.step, m.version, m.version_max, m.prompts, m.prompts_fed, m.samples) == (0, 0, 0, 3, 3, 2)
    assert (m.accuracy, m.pass_at_k, m.reward_mean) == (
        pytest.approx(3 / 6),
        pytest.approx(2 / 3),
        pytest.approx((3 * 1.1 + 3 * 0.1) / 6),
    )

    # 3. Reported once, in evals; the round's tasks and results gone, its marker kept.
    (entry,) = rclient.xrange(keys.evals)
    assert validation.decode(entry[1], rollout_pb2.EvalMetrics) == m
    assert not [t for t in rclient.hkeys(keys.tasks) if b"-eval-" in t]
    assert rclient.hkeys(keys.eval_results) == [f"{ROUND_PREFIX}00000000".encode()]
    assert restarted.report_ready() == [] and not restarted.waiting()
    stats = read_counters(rclient, keys)[0]
    assert stats["evaluated"] == 3 and "trained" not in stats
    assert rclient.smembers(keys.groups("evaluated")) == {t.task_id.encode() for t in fed}
    assert not rclient.xpending(keys.stream("ready"), "trainer")["pending"]

    # 4. A copy of a group whose round is reported (a take-over's duplicate) is only acknowledged.
    rclient.xadd(keys.stream("ready"), validation.encode(answered(fed[2], [True, True], 0)))
    take_all(restarted, stage)
    assert read_counters(rclient, keys)[0]["eval_duplicates"] == 1 and len(rclient.xrange(keys.evals)) == 1


def test_a_round_that_never_completes_is_reported_with_what_came_in_after_its_timeout(
    rclient: redis.Redis, keys: RunKeys, run_name: str, tiny_model_dir: Path
) -> None:
    encode = chat_encoder(AutoTokenizer.from_pretrained(tiny_model_dir))
    settings = TrainerSettings(run=run_name, steps=2, eval_prompts=3, eval_timeout_s=1e-6)  # a round is overdue at once
    stage = StreamStage(rclient, keys, "ready", "trainer", "trainer-0")
    evaluator = Evaluator(settings, rclient, stage, encode)
    evaluator_feed(evaluator, stage, step=2, version=2)
    sample_round(rclient, keys, [[True]], version=2)  # one of three: the others were dead-lettered upstream, say
    take_all(evaluator, stage)
    (m,) = evaluator.report_ready()
    assert (m.step, m.prompts, m.prompts_fed, m.accuracy, m.samples) == (2, 1, 3, 1.0, 1)
    assert not evaluator.waiting() and not [t for t in rclient.hkeys(keys.tasks) if b"-eval-" in t]
