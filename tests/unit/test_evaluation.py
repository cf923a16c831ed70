"""Held-out evaluation's pure parts: full marks, a round's figures, the held-out set, the
settings it is refused with, and `rollstream eval`'s flags (trainer/evaluation.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollstream.launcher.cli import EVAL_PROMPTS, eval_argv
from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.evaluation import Result, Round, full_marks
from rollstream.v1 import rollout_pb2


def completion(reward: float, **components: tuple[float, float]) -> rollout_pb2.Completion:
    """A scored completion; components name -> (value, weight)."""
    return rollout_pb2.Completion(
        token_ids=[1, 2, 3],
        reward=reward,
        reward_components=[
            rollout_pb2.RewardComponent(name=n, value=v, weight=w, status="ok") for n, (v, w) in components.items()
        ],
    )


def test_full_marks_is_the_answer_component_where_there_is_one() -> None:
    # The arithmetic recipe: answer (weight 1) + format (weight 0.1). A right answer in the
    # wrong format has full marks for its answer; a wrong one in the right format has not.
    assert full_marks(completion(1.0, answer=(1.0, 1.0), format=(0.0, 0.1)))
    assert not full_marks(completion(0.1, answer=(0.0, 1.0), format=(1.0, 0.1)))
    # No `answer` component: every component of positive weight at 1 (a penalty of weight < 0 does not count).
    assert full_marks(completion(0.5, passed=(1.0, 1.0), style=(1.0, 0.5), length=(0.0, -0.2)))
    assert not full_marks(completion(1.2, passed=(1.0, 1.0), style=(0.4, 0.5)))
    # No components (a custom scorer): the reward itself.
    assert full_marks(completion(1.0)) and not full_marks(completion(0.99))


def test_a_rounds_figures_follow_the_docstrings_formulas() -> None:
    # 2 prompts x 3 samples: prompt a right once, prompt b never.
    r = Round(step=4, fed=3, fed_at=0.0)
    r.results["run-eval-00000004-00000"] = Result(
        version=4, rewards=[1.0, 0.0, 0.1], correct=[True, False, False], tokens=30
    )
    r.results["run-eval-00000004-00001"] = Result(
        version=5, rewards=[0.0, 0.0, 0.0], correct=[False, False, False], tokens=12
    )
    m = r.metrics(samples=3)
    assert (m.step, m.version, m.version_max, m.prompts, m.prompts_fed, m.samples) == (4, 4, 5, 2, 3, 3)
    assert m.reward_mean == pytest.approx(1.1 / 6)
    assert m.accuracy == pytest.approx(1 / 6)  # right completions / completions (pass@1)
    assert m.pass_at_k == pytest.approx(1 / 2)  # prompts with a right completion / prompts
    assert m.completion_tokens == pytest.approx(42 / 6)
    empty = Round(step=0, fed=5, fed_at=0.0).metrics(samples=1)
    assert (empty.prompts, empty.accuracy, empty.pass_at_k, empty.reward_mean) == (0, 0.0, 0.0, 0.0)


def test_a_result_survives_its_json() -> None:
    result = Result(version=7, rewards=[1.0, -0.5], correct=[True, False], tokens=9)
    assert Result.from_json(result.to_json()) == result
    group = rollout_pb2.RolloutGroup(
        policy_version=3, completions=[completion(1.1, answer=(1.0, 1.0)), completion(0.0, answer=(0.0, 1.0))]
    )
    assert Result.of(group) == Result(version=3, rewards=[pytest.approx(1.1), 0.0], correct=[True, False], tokens=6)


def test_the_held_out_set_is_distinct_fixed_and_not_the_training_prompts() -> None:
    s = TrainerSettings(eval_prompts=32)
    held_out = prompts.held_out(s)
    assert len(held_out) == 32 and len({p.messages for p in held_out}) == 32
    assert prompts.held_out(s) == held_out  # the same prompts every round
    assert held_out[0] != next(prompts.from_settings(s))  # another seed than training's
    # A small task has fewer distinct prompts than asked: each once, no endless draw.
    assert len(prompts.held_out(TrainerSettings(eval_prompts=500, max_operand=3))) == 16


def test_held_out_rows_of_a_file_are_each_taken_once(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    s = TrainerSettings(
        eval_prompts=20, task="jsonl", dataset_path=str(path), eval_dataset_path=str(path), task_kind="exact"
    )
    held_out = prompts.held_out(s)
    assert sorted(p.answer for p in held_out) == ["0", "1", "2", "3", "4"]
    assert all(p.task_kind == "exact" for p in held_out)


def test_evaluation_settings_are_refused_with_the_field_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="eval_only needs eval_prompts"):
        TrainerSettings(eval_only=True)
    with pytest.raises(ValidationError, match="eval_dataset_path is required"):
        TrainerSettings(eval_prompts=4, task="jsonl", dataset_path=str(tmp_path))
    with pytest.raises(ValidationError, match="eval_dataset_path .*no such file"):
        TrainerSettings(eval_prompts=4, eval_dataset_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValidationError, match="eval_samples"):
        TrainerSettings(eval_prompts=4, eval_samples=0)


def test_rollstream_eval_flags_become_ups(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    argv = eval_argv(["--model", str(run), "--dataset=data.jsonl", "--samples", "4", "--generator.backend", "vllm"])
    assert argv == [
        "--model",
        str(run / "model"),
        "--trainer.eval-dataset-path",
        "data.jsonl",
        "--trainer.eval-samples",
        "4",
        "--generator.backend",
        "vllm",
        "--trainer.eval-prompts",
        str(EVAL_PROMPTS),
        "--run",
        "eval",
        "--trainer.eval-only",
    ]
    # A model folder stays as it is; --prompts and --run are kept.
    argv = eval_argv(["--model", str(tmp_path), "--prompts", "7", "--run", "mine"])
    assert argv == ["--model", str(tmp_path), "--trainer.eval-prompts", "7", "--run", "mine", "--trainer.eval-only"]
