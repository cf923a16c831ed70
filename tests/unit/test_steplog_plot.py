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
        step=step, version=step, groups=8, completions=64, reward_mean=0.1 + 0.05 * step, reward_std=0.3, loss=-0.01, kl=0.001 * step,
        clip_fraction=0.02, entropy=1.5, tokens=900, step_seconds=2.5, train_tokens_per_s=1200.0 + step, delta_bytes=40_000 + step,
        dense_bytes=2_000_000, mean_staleness=0.5, grad_norm=0.7, time=1_790_000_000.0 + step, zero_variance_groups=1,
    )


def write_log(path: Path, steps: range) -> None:
    for s in steps:
        steplog.append(path, steplog.record(metrics(s), run="demo", phases={"forward_s": 0.5, "backward_s": 1.0, "optimizer_s": 0.25, "push_s": 0.1}))


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
        f.write("not json at all\n[1, 2]\n{\"step\": \"x\"}\n\n")
    steplog.append(path, {**steplog.record(metrics(2), run="demo"), "reward_mean": 0.99})  # step 2 trained again after a resume
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
        f.write("garbage\n{\"step\": 16, \"rew")
    assert cli.main_code(["plot", str(run)]) == 0
    out = capsys.readouterr()
    png = run / "curves.png"
    assert out.out.strip() == str(png)
    assert out.err.count("warning") == 2 and ":16 skipped" in out.err and ":17 skipped" in out.err
    width, height = png_size(png)
    assert (width, height) == (800, 1100)  # 8 x 11 inches at 100 dpi
    assert png.stat().st_size > 20_000  # five panels of curves, not an empty canvas

    # -o elsewhere; a step log file instead of a folder
    other = tmp_path / "out" / "c.png"
    assert cli.main_code(["plot", str(run / steplog.FILE_NAME), "-o", str(other)]) == 0
    assert png_size(other) == (800, 1100)


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
