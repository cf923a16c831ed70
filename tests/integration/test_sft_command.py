"""`rollstream sft` (trainer/sft.py) on the tiny model, end to end: the command's steps.jsonl,
held-out losses, checkpoints and the exported folder transformers loads; a bad setting named
(flag, [sft] table); a bad row refused before anything is written; and a real process
killed with SIGKILL between steps, resumed with --resume latest, ending on the bits of the
run never stopped."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rollstream.core import steplog
from rollstream.launcher import cli, plot
from rollstream.trainer import lora, packed_attention, sft
from rollstream.trainer.sft_step import SftStepConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LR = 1e-3
# 40 short conversations packed into 14 rows of up to 64 tokens: 10 trained, 4 held out;
# 5 steps an epoch of 2 rows, 15 steps in all.
SETTINGS = ["--sft.max-length", "64", "--sft.batch-rows", "2", "--sft.epochs", "3", "--sft.lr", str(LR),
            "--sft.threads", "1", "--sft.checkpoint-every", "2", "--sft.eval-fraction", "0.25", "--sft.eval-every", "3"]  # fmt: skip
STEPS = 15
# A real process that runs the command and kills itself (SIGKILL: no handler, no flush, no
# atexit) once step argv[1] is recorded: between two steps, deterministically.
KILLED_AFTER = (
    "import os, signal, sys\n"
    "from rollstream.trainer import sft\n"
    "stop = int(sys.argv[1])\n"
    "sys.exit(sft.main(sys.argv[2:], after_step=lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == stop else None))\n"
)
# The same, killed inside held-out round argv[1] (the step's line written, its checkpoint not).
KILLED_IN_HELD_OUT = (
    "import os, signal, sys\n"
    "from rollstream.trainer import sft\n"
    "rounds = []\n"
    "def held_out_loss(*args, real=sft.held_out_loss):\n"
    "    rounds.append(1)\n"
    "    if len(rounds) == int(sys.argv[1]):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(*args)\n"
    "sft.held_out_loss = held_out_loss\n"
    "sys.exit(sft.main(sys.argv[2:]))\n"
)


def chat(question: str, answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sft-data") / "sums.jsonl"
    rows = [
        chat(f"What is {a} + {b}?", str(a + b)) for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(40))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def command(model: Path, data: Path, out: Path, workdir: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--out",
        str(out),
        "--workdir",
        str(workdir),
        *SETTINGS,
        *extra,
    ]


def test_the_command_trains_logs_and_exports_a_model_transformers_loads(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    out, workdir = tmp_path / "out", tmp_path / "run"
    assert cli.main_code(["sft", *command(tiny_model_dir, dataset, out, workdir)]) == 0, capsys.readouterr().err

    log = steplog.read(workdir / steplog.FILE_NAME)
    assert [r["step"] for r in log.steps] == list(range(1, STEPS + 1)) and not log.skipped
    for r in log.steps:
        assert r["tokens"] > 0 and r["grad_norm"] > 0 and r["seconds"] > 0 and r["rows"] <= 2
        assert r["lr"] == pytest.approx(LR * (STEPS - r["step"] + 1) / STEPS)  # TRL's linear schedule to 0
    assert log.steps[-1]["loss"] < log.steps[0]["loss"]  # three epochs of the same sums
    assert [e["step"] for e in log.evals] == [3, 6, 9, 12, 15]  # eval_every 3, and the last step
    assert log.evals[-1]["eval_loss"] < log.evals[0]["eval_loss"]
    # Checkpoints every 2 steps and at the last, two kept; the export marks what it holds.
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["step-00000014", "step-00000015"]
    assert json.loads((out / "rollstream-export.json").read_text())["step"] == STEPS

    trained = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    changed = [n for n, p in trained.state_dict().items() if not torch.equal(p.float(), base.state_dict()[n].float())]
    assert len(changed) == len(base.state_dict()), f"weights not trained: {set(base.state_dict()) - set(changed)}"
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["last_loss"] == log.steps[-1]["loss"] and summary["model"] == str(out)
    assert [h["step"] for h in summary["held_out"]] == [3, 6, 9, 12, 15]
    # The command drew the curves; `rollstream plot` draws them again: an SFT run's panels, no GRPO one.
    assert f"curves: {workdir / 'curves.png'}" in capsys.readouterr().out
    assert cli.main_code(["plot", str(workdir)]) == 0 and (workdir / "curves.png").stat().st_size > 0
    assert [ax.get_title() for ax in plot.figure(log, "sft").axes] == [
        "held-out loss (per trained token)",
        "gradient norm (before clipping)",
        "step phases (s, stacked)",
        "loss",
        "training tokens/s",
    ]


def test_report_to_gives_the_trackers_each_step_and_held_out_loss(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tracker_readers  # tests/tracker_readers.py: TensorBoard's own reader

    workdir = tmp_path / "run"
    args = command(
        tiny_model_dir, dataset, tmp_path / "out", workdir, "--sft.epochs", "1", "--sft.report-to", "tensorboard"
    )
    assert cli.main_code(["sft", *args]) == 0, capsys.readouterr().err
    log = steplog.read(workdir / steplog.FILE_NAME)
    tb = tracker_readers.tensorboard(workdir / "trackers")  # tracker_dir's default: WORKDIR/trackers
    # TensorBoard keeps float32 scalars.
    assert tb.series["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in log.steps}, rel=1e-6)
    assert tb.series["eval/loss"] == pytest.approx({e["step"]: e["eval_loss"] for e in log.evals}, rel=1e-6)
    assert tb.config["lr"] == LR and tb.config["report_to"] == ["tensorboard"]


def test_a_bad_setting_is_named_before_anything_runs(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, workdir = tmp_path / "out", tmp_path / "run"
    assert cli.main_code(["sft", *command(tiny_model_dir, dataset, out, workdir, "--sft.lr", "-1")]) == 2
    assert "field 'lr': Input should be greater than 0" in capsys.readouterr().err
    config = tmp_path / "sft.toml"
    # The [sft] table of --config (no flags of SETTINGS over it here).
    plain = ["--model", str(tiny_model_dir), "--dataset", str(dataset), "--out", str(out), "--workdir", str(workdir)]
    config.write_text("[sft]\neval_fraction = 1.5\n")
    assert cli.main_code(["sft", *plain, "--config", str(config)]) == 2
    assert "field 'eval_fraction': Input should be less than 1" in capsys.readouterr().err
    config.write_text("[sft]\nlearning_rate = 1e-4\n")  # TRL's name, not this command's
    assert cli.main_code(["sft", *plain, "--config", str(config)]) == 2
    assert "field 'learning_rate': Extra inputs are not permitted" in capsys.readouterr().err
    # A packed row longer than the model's context (the tiny model's: 2048 tokens).
    assert cli.main_code(["sft", *plain, "--sft.max-length", "4096"]) == 2
    assert "max_length 4096: over the model's context of 2048 tokens" in capsys.readouterr().err
    assert not out.exists() and not workdir.exists()
    # The [sft] table's good values are taken, under the flags.
    config.write_text("[sft]\nbatch_rows = 3\nseed = 7\nlr = 1e-4\n")
    s = sft.load([*plain, "--config", str(config), "--sft.seed", "8"])
    assert (s.batch_rows, s.seed, s.lr) == (3, 8, 1e-4)


def test_a_profile_holds_up_s_tables_and_sft_s_and_the_environment_its_own_variables(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollstream.launcher import run_config
    from rollstream.trainer.config import TrainerSettings

    profile = tmp_path / "warm.toml"
    profile.write_text("[trainer]\nsteps = 3\n\n[sft]\nepochs = 1\nlr = 1e-4\n")
    plain = ["--model", str(tiny_model_dir), "--dataset", str(dataset), "--out", str(tmp_path / "out")]
    assert run_config.load(["--profile", str(profile)]).trainer.steps == 3  # `up` leaves [sft] to sft
    s = sft.load([*plain, "--profile", str(profile)], run_config.PROFILES)
    assert (s.epochs, s.lr) == (1, 1e-4)
    # A named profile without an [sft] table (the demo's) sets nothing here.
    assert sft.load([*plain, "--profile", "demo"], run_config.PROFILES).epochs == 3
    monkeypatch.setenv("ROLLSTREAM_SFT_LR", "3e-4")
    assert sft.load(plain).lr == 3e-4 and TrainerSettings().lr == 2e-5  # not the GRPO trainer's ROLLSTREAM_LR


def test_a_bad_row_is_refused_before_any_step(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = dataset.read_text().splitlines()
    lines[3] = json.dumps(chat("What is 1 + 2?", "  "))
    lines[6] = json.dumps(
        {"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "3"}]}
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out, workdir = tmp_path / "out", tmp_path / "run"
    assert cli.main_code(["sft", *command(tiny_model_dir, bad, out, workdir)]) == 2
    err = capsys.readouterr().err
    assert "2 bad row(s), nothing trained" in err
    assert "row 3 (line 4), messages[1].content: empty assistant turn" in err
    assert "row 6 (line 7), messages[0].role: 'narrator' is not a role" in err
    assert not out.exists() and not workdir.exists()  # no step, no checkpoint, no step log, no model


def test_killed_between_steps_resume_latest_gives_the_bits_of_a_run_never_stopped(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f32 = ("--sft.export-dtype", "float32")  # the fp32 masters: every bit of the optimizer's weights
    whole = command(tiny_model_dir, dataset, tmp_path / "out-whole", tmp_path / "whole", *f32)
    assert cli.main_code(["sft", *whole]) == 0, capsys.readouterr().err

    out, workdir = tmp_path / "out", tmp_path / "run"
    args = command(tiny_model_dir, dataset, out, workdir, *f32)
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER, "5", *args], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr  # SIGKILL after step 5: the checkpoint of step 4 is the latest
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert not out.exists()
    # Resumed with other settings that decide the steps: refused, naming the field.
    assert cli.main_code(["sft", *args, "--sft.resume", "latest", "--sft.seed", "1"]) == 2
    assert "seed: " in capsys.readouterr().err
    assert cli.main_code(["sft", *args, "--sft.resume", "latest"]) == 0, capsys.readouterr().err

    assert_same_tensors(load_file(out / "model.safetensors"), load_file(tmp_path / "out-whole" / "model.safetensors"))
    last = f"checkpoints/step-{STEPS:08d}/optimizer.safetensors"  # masters and both moments
    assert_same_tensors(load_file(workdir / last), load_file(tmp_path / "whole" / last))
    # Step 5, trained twice, counts once (the last line); every step as the whole run's.
    resumed, never_stopped = (
        steplog.read(workdir / steplog.FILE_NAME),
        steplog.read(tmp_path / "whole" / steplog.FILE_NAME),
    )
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed.steps] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in never_stopped.steps
    ]


def test_killed_in_a_held_out_round_resume_latest_gives_the_run_never_stopped(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed in step 6's held-out round (held out every 3 steps, checkpoints every 2): step 6's
    line is written, its checkpoint is not; resumed from step 4's, steps 5 and 6 run again and
    the held-out losses and the model are the uninterrupted run's."""
    f32 = ("--sft.export-dtype", "float32")
    whole = command(tiny_model_dir, dataset, tmp_path / "out-whole", tmp_path / "whole", *f32)
    assert cli.main_code(["sft", *whole]) == 0, capsys.readouterr().err
    out, workdir = tmp_path / "out", tmp_path / "run"
    args = command(tiny_model_dir, dataset, out, workdir, *f32)
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_HELD_OUT, "2", *args], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    cut = steplog.read(workdir / steplog.FILE_NAME)
    assert [r["step"] for r in cut.steps][-1] == 6 and [e["step"] for e in cut.evals] == [3]
    assert cli.main_code(["sft", *args, "--sft.resume", "latest"]) == 0, capsys.readouterr().err
    resumed, never_stopped = (
        steplog.read(workdir / steplog.FILE_NAME),
        steplog.read(tmp_path / "whole" / steplog.FILE_NAME),
    )
    assert [(e["step"], e["eval_loss"]) for e in resumed.evals] == [
        (e["step"], e["eval_loss"]) for e in never_stopped.evals
    ]
    assert [r["loss"] for r in resumed.steps] == [r["loss"] for r in never_stopped.steps]
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(tmp_path / "out-whole" / "model.safetensors"))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(
            a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)
        ), name


def test_each_epoch_takes_every_row_once_in_its_own_order() -> None:
    steps = [sft.step_rows(7, 3, seed=42, step=k) for k in range(6)]  # 3 steps an epoch: 3 + 3 + 1 rows
    assert [len(s) for s in steps] == [3, 3, 1, 3, 3, 1]
    first, second = sum(steps[:3], []), sum(steps[3:], [])
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    assert sft.step_rows(7, 3, seed=42, step=4) == steps[4]  # a function of the step alone
    assert [sft.lr_factor(k, 4, 0, "linear") for k in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [sft.lr_factor(k, 4, 2, "constant") for k in range(4)] == [0.0, 0.5, 1.0, 1.0]


def test_every_setting_is_a_flag_with_its_description_and_variable() -> None:
    from rollstream.trainer.config import SftSettings

    rollstream = Path(sys.executable).parent / "rollstream"
    shown = subprocess.run([str(rollstream), "sft", "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "400"})  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    options = " ".join(shown.stdout.split("options:", 1)[1].split())
    for name, info in SftSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        found = re.search(rf"(^| ){re.escape(flag)}[ ,](.*?)\[env: (\w+)\]", options)  # the flag's entry
        assert found, f"{flag} is not in sft --help"
        assert info.description and " ".join(info.description.split()) in found[2], name
        assert found[3] == f"ROLLSTREAM_SFT_{name.upper()}", found[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_overlapped_update_gives_the_sequential_steps_losses_and_model(
    dtype: str, tiny_model_dir: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run overlaps each update with the next forward, the held-out one included (float32:
    the update steps the model's own parameters): the same step losses, held-out losses and
    weights as steps run one after the other."""
    f32 = ("--sft.dtype", dtype, "--sft.export-dtype", "float32", "--sft.eval-every", "1", "--sft.epochs", "1")
    assert sft.main(command(tiny_model_dir, dataset, tmp_path / "out-on", tmp_path / "on", *f32)) == 0
    sequential = sft.sft_step
    monkeypatch.setattr(sft, "sft_step", lambda *a, **k: sequential(*a, **{**k, "background": False}))
    assert sft.main(command(tiny_model_dir, dataset, tmp_path / "out-off", tmp_path / "off", *f32)) == 0
    on, off = steplog.read(tmp_path / "on" / steplog.FILE_NAME), steplog.read(tmp_path / "off" / steplog.FILE_NAME)
    assert [r["loss"] for r in on.steps] == [r["loss"] for r in off.steps]
    assert [e["eval_loss"] for e in on.evals] == [e["eval_loss"] for e in off.evals] and len(on.evals) == 5
    assert_same_tensors(
        load_file(tmp_path / "out-on" / "model.safetensors"), load_file(tmp_path / "out-off" / "model.safetensors")
    )


def test_a_float32_model_computes_on_the_unrounded_masters(tiny_model_dir: Path, dataset: Path, tmp_path: Path) -> None:
    """After each update a float32 run's model holds the fp32 masters, not their bf16 rounding
    (TRL's fp32 run does): the last held-out loss is that of the exported fp32 masters, and
    not that of their bf16 rounding."""
    from transformers import AutoTokenizer

    extra = ("--sft.export-dtype", "float32", "--sft.max-steps", "2", "--sft.eval-every", "2")
    argv = command(tiny_model_dir, dataset, tmp_path / "out", tmp_path / "run", *extra)
    assert sft.main(argv) == 0
    logged = steplog.read(tmp_path / "run" / steplog.FILE_NAME).evals[-1]["eval_loss"]
    s = sft.load(argv)
    rows = sft.load_data(s, AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)).held_out
    cfg = SftStepConfig(s.token_budget, s.chunk_tokens, s.max_grad_norm, "cpu")
    masters = load_file(tmp_path / "out" / "model.safetensors")

    def held_out_loss(weights: dict[str, torch.Tensor]) -> float:
        model, tokenizer, _, _ = lora.load(str(tiny_model_dir), "float32", "cpu", None, False)
        packed_attention.use(model)  # as the run's model
        model.load_state_dict(weights, strict=False)  # (a tied head is one tensor, saved once)
        return sft.held_out_loss(model, rows, cfg, tokenizer.pad_token_id)

    assert held_out_loss(masters) == logged
    assert held_out_loss({n: w.bfloat16().float() for n, w in masters.items()}) != logged


def test_a_step_out_of_device_memory_stops_naming_the_lengths(
    tiny_model_dir: Path,
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The device's own error (here raised where sft_step would raise it: no CPU runs out of
    memory on cue) stops the run with exit 1, naming the rows' length, the limits that set it
    and where the latest checkpoint is; the steps before it stay recorded."""
    real = sft.sft_step
    calls = []

    def runs_out_at_step_3(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(sft, "sft_step", runs_out_at_step_3)
    workdir = tmp_path / "run"
    assert sft.main(command(tiny_model_dir, dataset, tmp_path / "out", workdir)) == 1
    said = capsys.readouterr().err
    assert re.search(
        r"step 3: out of memory on cpu with packed rows of up to \d+ tokens \(max_length 64, token_budget 4096", said
    ), said
    assert "CUDA out of memory. Tried to allocate 9.50 GiB" in said and str(workdir / "checkpoints") in said
    assert "; lower max_length or token_budget (the latest" in said  # checkpointing is on already: not advised
    assert [r["step"] for r in steplog.read(workdir / steplog.FILE_NAME).steps] == [1, 2]
    assert not (tmp_path / "out").exists()
