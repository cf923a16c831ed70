"""Held-out evaluation end to end (issue 43, part 2): `rollstream up` on the tiny model with
rounds at steps 0, 2 and 4, read back from the run's Redis, steps.jsonl and summary.json;
then `rollstream eval` of the model that run exported, which trains nothing."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
import redis
from test_up import rollstream_cmd

from rollstream.core import steplog, validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.trainer.evaluation import ROUND_PREFIX
from rollstream.v1 import rollout_pb2

pytestmark = pytest.mark.e2e

STEPS, EVERY, PROMPTS, GROUPS_PER_STEP = 4, 2, 6, 2
SMALL = [
    "--trainer.group-size",
    "2",
    "--trainer.groups-per-step",
    str(GROUPS_PER_STEP),
    "--trainer.max-new-tokens",
    "6",
    "--threads",
    "1",
]


def up_with_rounds(model_dir: Path, redis_url: str, run: str, workdir: Path, samples: int, *flags: str) -> str:
    """`up --steps 4` with a held-out round of 6 prompts every 2 steps, to the end; its output."""
    cmd = [
        rollstream_cmd(), "up", "--model", str(model_dir), "--run", run, "--workdir", str(workdir), "--redis-url", redis_url, *SMALL,
        "--trainer.steps", str(STEPS), "--trainer.eval-prompts", str(PROMPTS), "--trainer.eval-every", str(EVERY), "--trainer.eval-samples", str(samples),
        *flags,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def check_rounds(rclient: redis.Redis, keys: RunKeys, workdir: Path, out: str, samples: int, synchronous: bool) -> None:
    """The run's rounds at 0, 2, 4 reported once each, counted apart from training, in every place they are read."""
    rounds = [validation.decode(fields, rollout_pb2.EvalMetrics) for _id, fields in rclient.xrange(keys.evals)]
    assert [m.step for m in rounds] == [0, 2, 4], rounds
    for m in rounds:
        assert m.prompts == m.prompts_fed == PROMPTS and m.samples == samples, m
        assert 0.0 <= m.accuracy <= m.pass_at_k <= 1.0 and m.completion_tokens > 0, m
        assert m.version <= m.version_max <= m.step, (
            m
        )  # never a version the trainer had not published at the round's step
        if synchronous:  # sampled by the trainer's own weights, right after the step's commit
            assert m.version == m.version_max == m.step, m
        if samples == 1:
            assert m.accuracy == m.pass_at_k, m  # greedy: one completion, pass@1

    stats = read_counters(rclient, keys)[0]
    assert stats["evaluated"] == 3 * PROMPTS and stats["trained"] == STEPS * GROUPS_PER_STEP, stats
    evaluated = {m.decode() for m in rclient.smembers(keys.groups("evaluated"))}
    trained = {m.decode() for m in rclient.smembers(keys.groups("trained"))}
    assert len(evaluated) == 3 * PROMPTS and not evaluated & trained, (sorted(evaluated), sorted(trained))
    assert all("-eval-" in g for g in evaluated) and not any("-eval-" in g for g in trained)
    assert not [t for t in rclient.hkeys(keys.tasks) if b"-eval-" in t], "evaluation tasks left in the task map"
    assert sorted(k.decode() for k in rclient.hkeys(keys.eval_results)) == [f"{ROUND_PREFIX}{s:08d}" for s in (0, 2, 4)]

    log = steplog.read(workdir / steplog.FILE_NAME)
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4] and not log.skipped
    assert [(r["step"], r["kind"], r["eval_prompts"], r["eval_samples"]) for r in log.evals] == [
        (s, "eval", PROMPTS, samples) for s in (0, 2, 4)
    ]

    held_out = json.loads((workdir / "summary.json").read_text())["held_out"]
    assert [(h["step"], h["prompts"], h["samples"]) for h in held_out] == [(s, PROMPTS, samples) for s in (0, 2, 4)]
    for s in (0, 2, 4):
        assert f" at step {s}, " in out and f"{PROMPTS} prompts" in out, out
    assert out.count("held-out: accuracy ") == 3 and "(incomplete)" not in out, out
    assert "held-out accuracy: " in out and "at step 0 -> " in out, out  # the before/after line


def test_up_colocated_synchronous_evaluates_greedily_at_steps_0_2_4_then_eval_evaluates_its_model(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """The demo's mode (colocated, max_staleness 0), greedy rounds; then `rollstream eval
    --model <that run>`: one round of the model the run exported, nothing trained."""
    workdir = tmp_path / "train"
    out = up_with_rounds(
        tiny_model_dir, redis_url, run_name, workdir, 1, "--colocate", "sync", "--trainer.max-staleness", "0"
    )
    check_rounds(rclient, RunKeys(run_name), workdir, out, samples=1, synchronous=True)
    exported = workdir / "model"
    assert json.loads((exported / "rollstream-export.json").read_text())["step"] == STEPS

    evaldir = tmp_path / "eval"
    cmd = [
        rollstream_cmd(),
        "eval",
        "--model",
        str(workdir),
        "--prompts",
        "5",
        "--workdir",
        str(evaldir),
        "--run",
        f"{run_name}-eval",
        "--redis-url",
        redis_url,
        *SMALL,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    keys = RunKeys(f"{run_name}-eval")
    rounds = [validation.decode(fields, rollout_pb2.EvalMetrics) for _id, fields in rclient.xrange(keys.evals)]
    assert [(m.step, m.version, m.prompts, m.prompts_fed, m.samples) for m in rounds] == [(0, 0, 5, 5, 1)], rounds
    log = steplog.read(evaldir / steplog.FILE_NAME)
    assert log.steps == [] and [(r["step"], r["eval_prompts"]) for r in log.evals] == [(0, 5)]
    summary = json.loads((evaldir / "summary.json").read_text())
    assert summary["steps"] == 0 and [(h["step"], h["prompts"]) for h in summary["held_out"]] == [(0, 5)], summary
    assert summary["stats"].get("trained", 0) == 0 and summary["stats"]["evaluated"] == 5, summary["stats"]
    assert rclient.xlen(keys.metrics) == 0 and not (evaldir / "model").exists()  # nothing trained, nothing exported
    # The model it loaded is the run's exported folder, not the run folder or the base model
    # (the demo profile colocates: the process's one file, its trainer table).
    assert tomllib.loads((evaldir / "config" / "trainer.toml").read_text())["trainer"]["model"] == str(exported)
    assert "held-out: accuracy " in done.stdout + done.stderr


def test_up_asynchronous_evaluates_three_samples_at_steps_0_2_4(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """Generators in processes of their own, one version of staleness, 3 sampled completions a
    prompt (pass@3): the same rounds, each once, at the version the generator had."""
    out = up_with_rounds(
        tiny_model_dir, redis_url, run_name, tmp_path, 3, "--colocate", "off", "--trainer.max-staleness", "1"
    )
    check_rounds(rclient, RunKeys(run_name), tmp_path, out, samples=3, synchronous=False)
