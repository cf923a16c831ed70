"""`rollstream sft`'s held-out score (trainer/sft_eval.py) on the tiny model, through the
launcher (cmd_sft builds the reward's scorer: its recipes in its worker pool): the eval
lines' reward_mean and accuracy are those of the reward recipes on the completions the run
wrote, which are the exported model's own greedy completions; a dataset without answers
reports the loss only; bad settings and bad answers are named before anything trains."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rollstream.core import steplog
from rollstream.launcher import cli
from rollstream.reward.recipes import Sample, build_recipes, default_specs
from rollstream.trainer import sft_eval

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 40 sums, all answered "The answer is 4.": a few steps at a high rate teach the tiny model that
# one completion, right for the held-out sums of 4 and wrong (well formed) for the others.
SETTINGS = ["--sft.max-length", "64", "--sft.batch-rows", "2", "--sft.epochs", "2", "--sft.lr", "1e-2",
            "--sft.threads", "1", "--sft.eval-every", "5", "--sft.eval-max-new-tokens", "12",
            "--sft.eval-batch-size", "3", "--sft.export-dtype", "float32"]  # fmt: skip


def rows(answers: bool) -> list[dict[str, Any]]:
    rng = random.Random(1)
    out = []
    for _ in range(40):
        a, b = rng.randrange(5), rng.randrange(5)
        chat = [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": "The answer is 4."},
        ]
        out.append({"messages": chat, **({"answer": a + b} if answers else {})})
    return out


def write(path: Path, data: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def command(model: Path, data: Path, tmp: Path, *extra: str, held_out: Path | None = None) -> list[str]:
    """The run's flags: eval_fraction 0.25 of `data` held out, or the `held_out` dataset."""
    paths = ["--dataset", str(data), "--out", str(tmp / "out"), "--workdir", str(tmp / "run")]
    split = ["--sft.eval-dataset", str(held_out)] if held_out else ["--sft.eval-fraction", "0.25"]
    return ["sft", "--model", str(model), *paths, *SETTINGS, *split, *extra]


def test_the_held_out_score_is_the_reward_recipes_on_the_model_s_greedy_completions(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write(tmp_path / "sums.jsonl", rows(answers=True))
    assert cli.main_code(command(tiny_model_dir, data, tmp_path)) == 0, capsys.readouterr().err
    workdir = tmp_path / "run"
    evals = steplog.read(workdir / steplog.FILE_NAME).evals
    recipes = build_recipes(default_specs(), None)  # the reward service's built-ins, scored here
    sums = [json.loads(line) for line in data.read_text().splitlines()]
    for e in evals:
        done = [json.loads(line) for line in (workdir / "held_out" / f"{e['step']:08d}.jsonl").read_text().splitlines()]
        assert e["eval_prompts"] == len(done) > 0 and e["eval_loss"] > 0 and e["eval_generate_s"] > 0
        scores = [recipes.score("arithmetic", Sample(d["completion"], d["answer"])) for d in done]
        correct = [next(c.value for c in x.components if c.name == "answer") >= 1 for x in scores]
        assert [d["reward"] for d in done] == pytest.approx([x.reward for x in scores], abs=1e-6)
        assert e["eval_reward_mean"] == pytest.approx(sum(x.reward for x in scores) / len(done), abs=1e-6)
        assert e["eval_accuracy"] == sum(correct) / len(done) and [d["correct"] for d in done] == correct
        assert [d["answer"] for d in done] == [str(sums[d["row"]]["answer"]) for d in done]
    assert [e["step"] for e in evals] == [5, 10, 15, 16]  # 8 steps an epoch: eval_every 5, and the last
    # The model learnt its one completion: right for the sums of 4, a well-formed wrong answer else.
    last = [
        json.loads(line) for line in (workdir / "held_out" / f"{evals[-1]['step']:08d}.jsonl").read_text().splitlines()
    ]
    assert {d["completion"] for d in last} == {"The answer is 4."}
    assert 0 < evals[-1]["eval_accuracy"] < 1 and evals[-1]["eval_reward_mean"] > evals[-1]["eval_accuracy"]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["held_out"][-1]["accuracy"] == evals[-1]["eval_accuracy"]
    # Those completions are the exported model's (fp32: the weights the last round ran on),
    # each prompt alone, unpadded: batching and left padding changed nothing.
    model: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tokenizer: Any = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    for d in last:
        messages = sums[d["row"]]["messages"][:1]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert tokenizer.decode(new, skip_special_tokens=True) == d["completion"]


def test_batched_greedy_generation_is_each_prompt_s_alone(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    prompts = [tokenizer(text=t)["input_ids"] for t in ("What is", "What is 3 + 4? The answer", "1 + 2 =")]
    model.train()
    alone = [sft_eval.generate(model, tokenizer, [p], 8, 1, "cpu")[0] for p in prompts]
    together = sft_eval.generate(model, tokenizer, prompts, 8, 3, "cpu")
    assert together == alone and model.training  # and the model is left in training mode
    assert all(c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= 8 for c in together)


def test_a_dataset_without_answers_reports_the_held_out_loss_only(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write(tmp_path / "sums.jsonl", rows(answers=False))
    assert cli.main_code(command(tiny_model_dir, data, tmp_path, "--sft.max-steps", "2")) == 0, capsys.readouterr().err
    evals = steplog.read(tmp_path / "run" / steplog.FILE_NAME).evals
    assert [sorted(k for k in e if k.startswith("eval_")) for e in evals] == [["eval_loss"]]
    assert not (tmp_path / "run" / "held_out").exists()


def test_bad_settings_and_bad_answers_are_named_before_anything_trains(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write(tmp_path / "sums.jsonl", rows(answers=True))
    with monkeypatch.context() as env:  # the reward's own settings, read as its service reads them
        env.setenv("ROLLSTREAM_ANSWER_WEIGHT", "nan")
        assert cli.main_code(command(tiny_model_dir, data, tmp_path)) == 2
    assert "answer_weight" in capsys.readouterr().err
    profile = tmp_path / "mine.toml"  # an `up` profile: its [reward] table is the reward service's too
    profile.write_text("[reward]\nformat_weight = inf\n")
    assert cli.main_code(command(tiny_model_dir, data, tmp_path, "--profile", str(profile))) == 2
    assert "format_weight" in capsys.readouterr().err
    assert cli.main_code(command(tiny_model_dir, data, tmp_path, "--sft.eval-max-new-tokens", "0")) == 2
    assert "field 'eval_max_new_tokens': Input should be greater than or equal to 1" in capsys.readouterr().err
    assert cli.main_code(command(tiny_model_dir, data, tmp_path, "--sft.task-kind", "sums")) == 2
    assert "task_kind 'sums': no reward recipe of that name (known: arithmetic, code" in capsys.readouterr().err
    bad = rows(answers=True)[:10]
    bad[7]["answer"] = [4]
    bad[9]["meta"] = "[1]"
    held_out = write(tmp_path / "bad.jsonl", bad)
    assert (
        cli.main_code(command(tiny_model_dir, data, tmp_path, "--sft.metadata-field", "meta", held_out=held_out)) == 2
    )
    err = capsys.readouterr().err
    assert "row 7 (line 8), answer: a string or number expected, got list" in err
    assert (
        "row 9 (line 10), meta: metadata '[1]' is not a JSON object" in err
    )  # as GRPO's prompt files (prompts.metadata_json)
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
