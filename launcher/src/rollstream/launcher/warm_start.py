"""`rollstream up --warm-start N`: SFT on N examples of the answer format, then GRPO from that model.

Before the services start, `up`:
  1. writes WORKDIR/warm-start/data.jsonl: N prompts of the run's own task generator
     (prompts.arithmetic, the demo's), each with the reference completion "The answer is S."
     (the reward recipe `arithmetic` gives it full marks: answer 1.0 + format 0.1);
  2. runs `rollstream sft` on it (trainer/sft.py, the command's own code path, as a child
     process so that `up` does not hold a model for the whole run) with WORKDIR/warm-start/sft.toml,
     into WORKDIR/warm-start/model (its checkpoints, steps.jsonl and curves beside it);
  3. hands that folder to the plan as the run's model: GRPO starts from it.

Which prompts. The examples come from the task's generator at seed trainer.seed + SEED_OFFSET,
a stream of its own: neither the training stream (trainer.seed) nor the held-out one (eval_seed,
refused if it is the same). The arithmetic task has only (max_operand + 1)^2 distinct questions
(100 in the demo), so streams alone cannot keep questions apart; the held-out questions
(prompts.held_out, the very set the trainer evaluates) are left out of the examples by their
text, so the held-out accuracy after the warm start is on sums the SFT never saw. The training
stream does meet the examples' questions: GRPO trains on every sum of the task anyway.

Only a task whose reference completion is known can be warm-started: the built-in arithmetic.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomli_w
from rich.console import Console

from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings

FOLDER = "warm-start"  # in the run's workdir
SEED_OFFSET = 7_000_001  # the examples' prompt stream: trainer.seed + this
RECORD = "warm-start.json"  # what ran and how long, for the benchmark and the reader
# The SFT's settings (the [sft] table it is given; ROLLSTREAM_SFT_* variables override them).
# One pass over the examples in rows of 256 tokens (about 4 examples each), 4 rows a step: 19
# steps for 300 examples. lr 1e-4, not TRL's 2e-5: measured on the demo's model, 300 examples,
# seeds 0-2, held-out accuracy 93.8-100 % after the SFT (docs/benchmarks.md, "The demo's warm
# start"); 2e-5 is not measured there.
SFT_SETTINGS: dict[str, Any] = {
    "epochs": 1,
    "lr": 1e-4,
    "max_length": 256,
    "batch_rows": 4,
    "checkpoint_every": 0,
    "keep_checkpoints": 1,
}


class WarmStartError(RuntimeError):
    """The warm start could not produce a model: the SFT exited with an error."""


def refusal(trainer: TrainerSettings, examples: int) -> str | None:
    """Why a run of these trainer settings cannot be warm-started with `examples`, or None."""
    if trainer.task != "arithmetic":
        return (
            f"warm_start: task {trainer.task!r} has no reference completion to learn the answer format from; "
            "only the built-in arithmetic task can be warm-started (or run `rollstream sft` on your own data, then `up --model OUT`)"
        )
    if trainer.eval_only:
        return "warm_start: an evaluation trains nothing to start warm"
    if trainer.eval_prompts and trainer.eval_seed == trainer.seed + SEED_OFFSET:
        return (
            f"warm_start: trainer.eval_seed {trainer.eval_seed} is the warm start's seed (trainer.seed + {SEED_OFFSET})"
        )
    if examples > 0 and not questions(trainer):
        return "warm_start: every question of the task is held out (trainer.eval_prompts); none is left to learn from"
    return None


def questions(trainer: TrainerSettings) -> set[tuple[tuple[str, str], ...]]:
    """The task's distinct questions that are not held out."""
    held = {p.messages for p in prompts.held_out(trainer)} if trainer.eval_prompts else set()
    side = trainer.max_operand + 1
    every = itertools.islice(prompts.arithmetic(trainer.seed + SEED_OFFSET, trainer.max_operand), 100 * side * side)
    return {p.messages for p in every} - held


def examples(trainer: TrainerSettings, n: int) -> list[dict[str, Any]]:
    """n conversations: a prompt of the warm start's stream that is not held out, and its
    reference completion, in the order the stream gives them (a question may repeat)."""
    held = {p.messages for p in prompts.held_out(trainer)} if trainer.eval_prompts else set()
    rows: list[dict[str, Any]] = []
    for p in prompts.arithmetic(trainer.seed + SEED_OFFSET, trainer.max_operand):
        if p.messages in held:
            continue
        turns = [{"role": role, "content": content} for role, content in p.messages]
        rows.append({"messages": [*turns, {"role": "assistant", "content": f"The answer is {p.answer}."}]})
        if len(rows) == n:
            return rows
    raise AssertionError("unreachable: the stream is endless")


def prepare(trainer: TrainerSettings, n: int, model: str, folder: Path, run: str, seed: int, threads: int) -> list[str]:
    """Write the examples and the SFT's settings into `folder`; the `rollstream sft` command line."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in examples(trainer, n)))
    table = {
        **SFT_SETTINGS,
        "model": model,
        "dataset": str(data),
        "out": str(folder / "model"),
        "workdir": str(folder),
        "run": f"{run}-warm-start",
        "seed": seed,
        "threads": threads,
    }
    config = folder / "sft.toml"
    config.write_text(tomli_w.dumps({"sft": table}))
    return [sys.executable, "-m", "rollstream.launcher.cli", "sft", "--config", str(config)]


def warm_start(
    trainer: TrainerSettings,
    n: int,
    model: str,
    workdir: Path,
    run: str,
    seed: int,
    threads: int,
    fresh: bool,
    console: Console,
) -> str:
    """The model folder GRPO starts from: WORKDIR/warm-start/model, trained now (a fresh run)
    or the one a continued run (--no-fresh) trained before."""
    folder = workdir / FOLDER
    out = folder / "model"
    if not fresh and (out / "config.json").is_file():
        console.print(
            f"warm start: continuing the run, GRPO from the model its warm start trained ({out})", soft_wrap=True
        )
        return str(out)
    if folder.exists():
        shutil.rmtree(folder)  # a fresh run's warm start is its own, not the last run's
    cmd = prepare(trainer, n, model, folder, run, seed, threads)
    console.print(
        f"warm start: {n} examples of the answer format ({folder / 'data.jsonl'}; prompts of seed "
        f"{trainer.seed + SEED_OFFSET}, the held-out questions left out), rollstream sft with {folder / 'sft.toml'}...",
        soft_wrap=True,
    )
    started = time.monotonic()
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise WarmStartError(
            f"warm start: rollstream sft exited with {done.returncode} (its settings: {folder / 'sft.toml'})"
        )
    record = {"examples": n, "prompt_seed": trainer.seed + SEED_OFFSET, "sft_seed": seed, "seconds": round(seconds, 1),
              "model": str(out), "base_model": model}  # fmt: skip
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"warm start: SFT done in {seconds:.0f}s; GRPO starts from {out}", soft_wrap=True)
    return str(out)
