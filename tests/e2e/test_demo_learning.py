"""The demo learns: `rollstream up` on SmolLM2-135M-Instruct raises the mean reward on
single-digit addition, with a CPU hog beside it (a shared, busy machine is the normal case:
load averages of 10-40 were seen here). Slow (10-20 minutes on 2 cores); CI runs it in the
slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 10  # with the hog a step takes about two minutes; the rise shows by step 5
# A measurable rise within 15 minutes on an idle 2-core machine, model load included. The hog
# takes most of one of the two cores and the trainer's two threads then wait on each other:
# steps took 110-135 s instead of 30-50 s (docs/reliability.md), hence the margin.
LIMIT_S = 30 * 60


@pytest.mark.timeout(LIMIT_S + 120)
def test_demo_raises_mean_reward(tmp_path: Path) -> None:
    rollstream = Path(sys.executable).parent / "rollstream"
    cmd = [str(rollstream), "up", "--trainer.steps", str(STEPS), "--run", "learning", "--workdir", str(tmp_path)]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core kept busy throughout
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S)
    finally:
        hog.kill()
        hog.wait()
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(json.dumps(summary, indent=2))  # the curve, for the CI log
    assert summary["steps"] == STEPS
    first, last = summary["first5_reward_mean"], summary["last5_reward_mean"]
    # Measured: ~0.3 -> ~0.6 (docs/benchmarks.md). Per-step means of 64 completions have a
    # standard error of ~0.06, so a rise of 0.1 over five-step averages is not noise.
    assert last >= first + 0.1, (
        f"no learning: first five steps {first}, last five {last}; curve {summary['reward_curve']}"
    )
    assert summary["stats"]["trained"] == STEPS * 8
