"""A real trainer that has trained a few steps (on synthetic scored groups written to `ready`),
its step log, and the rest of a run's streams as they stand mid-way (a generator group on
`prompts`, reward and reference consumers with a backlog, a live generator in the registry,
two held-out rounds in the step log and the last in `evals`, as the trainer reports them):
what the dashboard tests (tests/integration/test_dashboard.py, tests/browser) look at."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import redis

from helpers import wait_for, write_ready
from procs import ServiceProc, start_service
from rollstream.core import run_keys, steplog, streams, validation
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import rollout_pb2
from synthetic import scored_groups, tokenizer_decode

STEPS = 3
GROUPS_PER_STEP = 2
# Held-out rounds before the first step and after the last: (step, accuracy).
EVAL_ROUNDS = ((0, 0.25), (STEPS, 0.75))


def eval_round(step: int, accuracy: float) -> rollout_pb2.EvalMetrics:
    return rollout_pb2.EvalMetrics(step=step, version=step, version_max=step, prompts=8, prompts_fed=8, samples=4, reward_mean=accuracy + 0.125,
                                   accuracy=accuracy, pass_at_k=1.0, completion_tokens=5.5, time=1_790_000_000.0 + step)  # fmt: skip


@dataclass
class TrainedRun:
    trainer: ServiceProc
    steps_file: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.trainer.http_port}"


def _backlog(client: redis.Redis, keys: RunKeys, stage: str, group: str, consumer: str, n: int, read: int) -> None:
    for g in scored_groups(100 + n, n, tag=f"{stage}-backlog"):
        client.xadd(keys.stream(stage), validation.encode(g))
    streams.StreamStage.ensure_group(client, keys.stream(stage), group)
    client.xreadgroup(group, consumer, {keys.stream(stage): ">"}, count=read)


def start_trained_run(
    tmp_path: Path, redis_url: str, client: redis.Redis, keys: RunKeys, model_dir: Path
) -> TrainedRun:
    steps_file = tmp_path / "steps.jsonl"
    trainer = start_service(
        "trainer",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(model_dir),
        "--threads",
        "1",
        "--groups-per-step",
        str(GROUPS_PER_STEP),
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--prompt-buffer",
        "2",
        "--lr",
        "1e-3",
        "--max-staleness",
        "100",
        "--block-ms",
        "100",
        "--steps",
        str(STEPS),
        "--linger",
        "--metrics-file",
        str(steps_file),
    ).wait_ready()
    try:
        decode = tokenizer_decode(model_dir)
        for step in range(1, STEPS + 1):
            write_ready(client, keys, scored_groups(step, GROUPS_PER_STEP, tag="dash"), decode)

        def trained() -> bool:
            return (
                steps_file.exists() and len([ln for ln in steps_file.read_text().splitlines() if ln.strip()]) == STEPS
            )

        wait_for(trained, 180, f"{STEPS} lines in {steps_file}", procs=[trainer])
        assert [json.loads(ln)["step"] for ln in steps_file.read_text().splitlines()] == list(range(1, STEPS + 1))
        # Training is over (--steps): nothing is pushed to the generator registered now.
        streams.StreamStage.ensure_group(client, keys.stream("prompts"), "generator")
        client.xreadgroup("generator", "gen-0", {keys.stream("prompts"): ">"}, count=1)
        _backlog(client, keys, "rollouts", "reward", "reward-0", 3, 1)
        _backlog(client, keys, "scored", "reference", "reference-0", 2, 1)
        run_keys.heartbeat(client, keys, "gen-0", "127.0.0.1:1", version=STEPS)
        for step, accuracy in EVAL_ROUNDS:
            steplog.append(steps_file, steplog.eval_record(eval_round(step, accuracy), run=keys.run))
            client.xadd(keys.evals, validation.encode(eval_round(step, accuracy)))
    except BaseException:
        trainer.stop()
        raise
    return TrainedRun(trainer, steps_file)
