"""`rollstream up --warm-start N` (issue 46, launcher/warm_start.py): the examples written, `rollstream
sft` run on them into the run folder, and GRPO started from the model it wrote; bad values named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.core import steplog
from rollstream.launcher import cli, warm_start
from rollstream.reward import recipes
from rollstream.trainer import checkpoint, prompts
from rollstream.trainer.config import TrainerSettings


def rollstream_cmd() -> str:
    return str(Path(sys.executable).parent / "rollstream")


def test_up_warm_start_writes_the_examples_trains_sft_then_grpo_from_its_model(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    workdir = tmp_path / "run"
    up = [rollstream_cmd(), "up", "--warm-start", "12", "--model", str(tiny_model_dir), "--run", "warm",
          "--workdir", str(workdir), "--redis-url", redis_url, "--trainer.group-size", "2",
          "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "4", "--threads", "1", "--trainer.steps", "1",
          "--trainer.eval-prompts", "20", "--generator.seed", "3"]  # fmt: skip
    done = subprocess.run(up, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    folder = workdir / warm_start.FOLDER
    assert "warm start: 12 examples of the answer format" in output and f"GRPO starts from {folder / 'model'}" in output

    # The examples: the task's prompts, none of the 20 held-out questions, each answered in
    # exactly the form the demo's reward recipe gives full marks (answer 1.0 + format 0.1).
    rows = [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    trainer = TrainerSettings.model_validate({"eval_prompts": 20})
    held = {p.messages for p in prompts.held_out(trainer)}
    assert len(held) == 20
    arithmetic = recipes.build_recipes(recipes.default_specs(), None)
    for row in rows:
        (user, assistant) = row["messages"]
        question = user["content"]
        assert ((user["role"], question),) not in held and question.startswith("What is ")
        a, b = question.removeprefix("What is ").split("?")[0].split(" + ")
        assert assistant == {"role": "assistant", "content": f"The answer is {int(a) + int(b)}."}
        assert arithmetic.score("arithmetic", recipes.Sample(assistant["content"], str(int(a) + int(b)))).reward == 1.1

    # The SFT ran as the command does (its settings file, step log and exported model), with --seed.
    assert "seed = 3" in (folder / "sft.toml").read_text()
    sft_steps = steplog.read(folder / steplog.FILE_NAME).steps
    assert sft_steps and sum(r["examples"] for r in sft_steps) == 12  # one epoch
    assert json.loads((folder / "model" / "rollstream-export.json").read_text())["kind"] == "full"
    assert json.loads((folder / warm_start.RECORD).read_text())["examples"] == 12
    # GRPO trained from that folder.
    assert [r["step"] for r in steplog.read(workdir / steplog.FILE_NAME).steps] == [1]
    latest = checkpoint.latest(workdir / "checkpoints")
    assert latest is not None and checkpoint.load_state(latest).settings["model"] == str(folder / "model")


def test_up_warm_start_refuses_bad_values_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        ("--warm-start", "-5"): "field 'warm_start': Input should be greater than or equal to 0",
        ("--warm-start", "many"): "field 'warm_start': Input should be a valid integer",
        (
            "--warm-start",
            "300",
            "--trainer.task",
            "countdown",
        ): "warm_start: task 'countdown' has no reference completion",
        ("--warm-start", "300", "--trainer.eval-prompts", "100"): "warm_start: every question of the task is held out",
        ("--warm-start", "300", "--trainer.eval-seed", str(warm_start.SEED_OFFSET)): "is the warm start's seed",
    }
    for flags, said in cases.items():
        # `rollstream up` itself (cli.cmd_up), in this process: the flags, the checks, the exit status.
        assert cli.cmd_up(["--workdir", str(tmp_path / "never"), *flags]) == 2, flags
        err = " ".join(capsys.readouterr().err.split())
        assert said in err, (flags, err)
        assert not (tmp_path / "never").exists()
