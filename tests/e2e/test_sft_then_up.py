"""The warm start end to end (issue 46): `rollstream sft` on the tiny model, then `rollstream up
--model OUT` trains GRPO from the folder it wrote, as from any model folder."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_up import rollstream_cmd

from rollstream.core import steplog
from rollstream.trainer import checkpoint

pytestmark = pytest.mark.e2e


def test_up_trains_grpo_from_the_model_sft_wrote(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    data = tmp_path / "sums.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{a} + {b} ="}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(6)
        for b in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "warm"
    sft = [rollstream_cmd(), "sft", "--model", str(tiny_model_dir), "--dataset", str(data), "--out", str(out),
           "--workdir", str(tmp_path / "sft"), "--sft.max-length", "64", "--sft.batch-rows", "2", "--sft.epochs", "1",
           "--sft.lr", "1e-3", "--sft.threads", "1"]  # fmt: skip
    done = subprocess.run(sft, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "rollstream-export.json").read_text())["kind"] == "full"

    workdir = tmp_path / "grpo"
    up = [rollstream_cmd(), "up", "--model", str(out), "--run", "warm", "--workdir", str(workdir), "--redis-url", redis_url,
          "--trainer.group-size", "2", "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "6", "--threads", "1",
          "--trainer.steps", "2", "--trainer.eval-prompts", "0"]  # fmt: skip
    done = subprocess.run(up, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"curves: {workdir / 'curves.png'}" in done.stdout + done.stderr  # plot.render_at_end, as sft's end
    assert [r["step"] for r in steplog.read(workdir / steplog.FILE_NAME).steps] == [1, 2]
    latest = checkpoint.latest(workdir / "checkpoints")
    assert latest is not None and checkpoint.load_state(latest).settings["model"] == str(out)
