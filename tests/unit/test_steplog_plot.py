"""The trainer's step log (core/steplog.py) and `rollstream plot` (core/plot.py): lines
written whole, torn and garbage lines skipped with a warning, a PNG rendered from them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rollstream.core import steplog
from rollstream.launcher import cli, plot
from rollstream.v1 import rollout_pb2


def metrics(step: int) -> rollout_pb2.StepMetrics:
    return rollout_pb2.StepMetrics(
        step=step,
        version=step,
        groups=8,
        completions=64,
        reward_mean=0.1 + 0.05 * step,
        reward_std=0.3,
        loss=-0.01,
        kl=0.001 * step,
        clip_fraction=0.02,
        entropy=1.5,
        tokens=900,
        step_seconds=2.5,
        train_tokens_per_s=1200.0 + step,
        delta_bytes=40_000 + step,
        dense_bytes=2_000_000,
        mean_staleness=0.5,
        grad_norm=0.7,
        time=1_790_000_000.0 + step,
        zero_variance_groups=1,
    )


def write_log(path: Path, steps: range) -> None:
    for s in steps:
        steplog.append(
            path,
            steplog.record(
                metrics(s), run="demo", phases={"forward_s": 0.5, "backward_s": 1.0, "optimizer_s": 0.25, "push_s": 0.1}
            ),
        )


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_record_holds_every_step_metrics_field_and_the_phases(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    write_log(path, range(1, 4))
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    rec = json.loads(lines[0])
    assert set(f.name for f in rollout_pb2.StepMetrics.DESCRIPTOR.fields) <= set(rec)
    assert rec["step"] == 1 and rec["run"] == "demo" and rec["schema"] == steplog.SCHEMA
    assert rec["reward_mean"] == 0.15 and rec["forward_s"] == 0.5 and rec["push_s"] == 0.1
    assert rec["utc"].startswith("2026-")
    assert [r["step"] for r in steplog.read(path).steps] == [1, 2, 3]


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    write_log(path, range(1, 3))
    with path.open("ab") as f:  # a crash in the middle of a write
        f.write(b'{"schema":1,"step":3,"reward_me')
    torn = steplog.read(path)
    assert [r["step"] for r in torn.steps] == [1, 2]
    assert len(torn.skipped) == 1 and torn.skipped[0][0] == 3 and "torn" in torn.skipped[0][1]
    write_log(path, range(3, 5))  # the restarted trainer goes on
    log = steplog.read(path)
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4]
    assert [n for n, _ in log.skipped] == [3]


def test_garbage_lines_are_skipped_and_a_repeated_step_keeps_its_last_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    write_log(path, range(1, 4))
    with path.open("a") as f:
        f.write('not json at all\n[1, 2]\n{"step": "x"}\n\n')
    steplog.append(
        path, {**steplog.record(metrics(2), run="demo"), "reward_mean": 0.99}
    )  # step 2 trained again after a resume
    log = steplog.read(path)
    assert [r["step"] for r in log.steps] == [1, 2, 3]
    assert log.steps[1]["reward_mean"] == 0.99
    assert [n for n, _ in log.skipped] == [4, 5, 6]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    steplog.append(path, {"step": 1, "loss": float("nan"), "kl": float("inf")})
    assert json.loads(path.read_text()) == {"step": 1, "loss": None, "kl": None}


def test_plot_renders_a_png_and_warns_about_skipped_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs" / "demo"
    write_log(run / steplog.FILE_NAME, range(1, 16))
    with (run / steplog.FILE_NAME).open("a") as f:
        f.write('garbage\n{"step": 16, "rew')
    assert cli.main_code(["plot", str(run)]) == 0
    out = capsys.readouterr()
    png = run / "curves.png"
    assert out.out.strip() == str(png)
    assert out.err.count("warning") == 2 and ":16 skipped" in out.err and ":17 skipped" in out.err
    # reward, KL, delta size, tokens/s move; the rest is constant in write_log: two rows of two
    assert png_size(png) == (1200, 560)  # 12 x (2.4 * 2 + 0.8) inches at 100 dpi
    assert png.stat().st_size > 20_000  # four panels of curves, not an empty canvas

    # -o elsewhere; a step log file instead of a folder
    other = tmp_path / "out" / "c.png"
    assert cli.main_code(["plot", str(run / steplog.FILE_NAME), "-o", str(other)]) == 0
    assert png_size(other) == (1200, 560)


def test_plot_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main_code(["plot", str(tmp_path)]) == 1
    assert f"has no {steplog.FILE_NAME}" in capsys.readouterr().err
    assert cli.main_code(["plot", str(tmp_path / "nope.jsonl")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / steplog.FILE_NAME).write_text("")
    assert cli.main_code(["plot", str(tmp_path)]) == 1
    assert "no step records" in capsys.readouterr().err
    (tmp_path / steplog.FILE_NAME).write_text("junk\n")
    with pytest.raises(plot.PlotError, match="1 unreadable lines"):
        plot.render(tmp_path / steplog.FILE_NAME, tmp_path / "x.png")


def eval_metrics(step: int, accuracy: float, samples: int = 1) -> rollout_pb2.EvalMetrics:
    return rollout_pb2.EvalMetrics(
        step=step,
        version=step,
        version_max=step,
        prompts=32,
        prompts_fed=32,
        samples=samples,
        reward_mean=accuracy + 0.1,
        accuracy=accuracy,
        pass_at_k=min(1.0, accuracy + 0.1),
        completion_tokens=7.5,
        time=1_790_000_100.0 + step,
    )


def test_eval_record_prefixes_every_field_but_the_step() -> None:
    rec = steplog.eval_record(eval_metrics(5, 0.3), run="demo")
    fields = [f.name for f in rollout_pb2.EvalMetrics.DESCRIPTOR.fields if f.name != "step"]
    assert {k for k in rec if k.startswith("eval_")} == {f"eval_{f}" for f in fields}
    assert rec["kind"] == "eval" and rec["step"] == 5 and rec["run"] == "demo" and rec["schema"] == steplog.SCHEMA
    assert rec["eval_accuracy"] == 0.3 and rec["eval_reward_mean"] == 0.4  # float32 rounded to 7 digits, as steps are
    assert rec["eval_prompts"] == 32 and rec["eval_samples"] == 1 and rec["eval_time"] == 1_790_000_105.0
    assert rec["utc"].startswith("2026-")


def test_eval_lines_are_read_apart_from_the_step_lines(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    steplog.append(path, steplog.eval_record(eval_metrics(0, 0.2), run="demo"))  # before the first step
    write_log(path, range(1, 4))
    steplog.append(path, steplog.eval_record(eval_metrics(2, 0.5), run="demo"))  # reported after step 3's line
    steplog.append(
        path, steplog.eval_record(eval_metrics(2, 0.6), run="demo")
    )  # a resumed trainer's round again: the last wins
    steplog.append(path, {"schema": 1, "kind": "summary", "step": 3})  # a kind from a later version
    log = steplog.read(path)
    assert [r["step"] for r in log.steps] == [1, 2, 3] and all("kind" not in r for r in log.steps)
    assert log.steps[1]["reward_mean"] == 0.2  # step 2's own line, not the eval's
    assert [(e["step"], e["eval_accuracy"]) for e in log.evals] == [(0, 0.2), (2, 0.6)]
    assert [(n, why) for n, why in log.skipped] == [(7, "unknown kind 'summary'")]


def test_plot_leaves_out_constant_panels_and_draws_held_out_rounds(tmp_path: Path) -> None:
    """KL 0 and staleness 0 every step (as in the demo) are left out, named on the bottom
    line; eval lines add held-out accuracy (pass@k beside it when rounds sample 4) and reward."""
    path = tmp_path / "steps.jsonl"
    for s in range(1, 9):
        m = metrics(s)
        m.kl, m.mean_staleness, m.entropy, m.grad_norm, m.tokens = (
            0.0,
            0.0,
            1.5 - 0.01 * s,
            0.5 + 0.1 * (s % 3),
            900 + 10 * s,
        )
        steplog.append(
            path, steplog.record(m, run="demo", phases={"forward_s": 0.5 + 0.01 * s, "backward_s": 1.0, "push_s": 0.1})
        )
    for s, acc in ((0, 0.2), (4, 0.5), (8, 0.9)):
        steplog.append(path, steplog.eval_record(eval_metrics(s, acc, samples=4), run="demo"))
    log = steplog.read(path)
    fig = plot.figure(log, "demo")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "reward (train, mean ± std)",
        "held-out accuracy (%)",
        "held-out reward (mean)",
        "completion length (tokens trained / completions)",
        "entropy (nats per token)",
        "gradient norm (before clipping)",
        "step phases (s, stacked)",
        "delta size (% of dense bf16)",
        "training tokens/s",
    ]  # loss is constant in metrics() too
    held_out = fig.axes[1]
    assert [line.get_label() for line in held_out.get_lines()] == ["accuracy", "pass@k"]
    assert list(held_out.get_lines()[0].get_xdata()) == [0, 4, 8]
    assert [round(y, 3) for y in held_out.get_lines()[0].get_ydata()] == [20.0, 50.0, 90.0]
    bottom = fig.get_supxlabel()
    assert "KL (k3, per token) = 0" in bottom and "mean staleness (versions) = 0" in bottom and "loss = -0.01" in bottom
    assert "15 steps" not in fig.get_suptitle() and "8 steps, 3 held-out rounds" in fig.get_suptitle()

    png = tmp_path / "curves.png"
    plot.render(path, png)
    assert png_size(png) == (1200, 1280)  # five rows of two: 12 x (2.4 * 5 + 0.8) inches at 100 dpi
