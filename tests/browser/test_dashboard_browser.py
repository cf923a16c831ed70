"""The dashboard in a real browser (Debian's chromium, headless): a real trainer that trained a
few steps, a real Redis holding every stage's stream (tests/dashboard_run.py). The page's
script runs (--virtual-time-budget lets its fetches and timers finish), then the DOM must name
every stage, hold the curves that move with their data points and the held-out rounds, name
the constant curves it left out (KL: beta is 0), and the screenshot must show the reward
curve's colour. Skipped, saying why, where chromium is absent (scripts/test.sh installs it
as root on Debian)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dashboard_run import EVAL_ROUNDS, STEPS, TrainedRun, start_trained_run
from rollstream.core.run_keys import RunKeys

pytestmark = pytest.mark.browser

CHROMIUM = (
    os.environ.get("ROLLSTREAM_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
    or "/usr/bin/chromium"
)
REWARD_RGB = (0xD6, 0x27, 0x28)  # the reward curve's colour in static/dashboard.js
STAGES = ("generator", "reward", "reference", "trainer")


def chromium(tmp_path: Path, url: str, *mode: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    profile.mkdir()
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--window-size=1280,1100",
        *mode,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def run(redis_server, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TrainedRun]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; scripts/test.sh does it as root on Debian)")
    keys = RunKeys("browser-" + tmp_path_factory.mktemp("n").name[-6:].replace("_", ""))
    client = redis.Redis.from_url(redis_server.url)
    r = start_trained_run(tmp_path_factory.mktemp("browser-run"), redis_server.url, client, keys, tiny_model_dir)
    yield r
    r.trainer.stop()
    client.close()


def test_dom_names_every_stage_and_draws_curves(run: TrainedRun, tmp_path: Path) -> None:
    done = chromium(tmp_path, run.base + "/dashboard", "--dump-dom")
    dom = done.stdout
    assert done.returncode == 0 and "<html" in dom, done.stderr[-2000:]
    assert "data-refreshed" in dom, "the page's script did not finish a refresh"
    for stage in STAGES:
        assert re.search(rf'<tr id="stage-{stage}" data-stage="{stage}">', dom), f"no row for {stage}"
    assert 'id="headline"' in dom and re.search(r'id="headline"[^>]*data-level="(ok|info|warn|stuck)"', dom)
    assert f"trainer step {STEPS}, policy version {STEPS}" in dom
    curves = dict(re.findall(r'class="curve" data-metric="([a-z_]+)" data-points="(\d+)"', dom))
    # What moves over the three steps is charted; KL (beta 0) is not, and is named as left out.
    assert {"reward_mean", "train_tokens_per_s", "phases"} <= set(curves), curves
    assert "kl" not in curves and re.search(
        r'id="left-out"[^>]*>constant over the run, not charted: [^<]*KL to reference = 0[;<]', dom
    )
    assert {"eval_accuracy", "eval_reward_mean"} <= set(curves), curves
    held_out = {k: int(n) for k, n in curves.items() if k.startswith("eval_")}
    steps = {k: int(n) for k, n in curves.items() if not k.startswith("eval_")}
    assert all(n == len(EVAL_ROUNDS) for n in held_out.values()) and all(n == STEPS for n in steps.values()), curves
    assert dom.count('class="point"') >= STEPS * len(steps)
    assert "<polyline" in dom and 'stroke="#d62728"' in dom
    assert "held-out: accuracy 75% (pass@4 100%), reward 0.88 at step 3, version 3, 8 prompts" in dom


def test_screenshot_shows_the_reward_curve(run: TrainedRun, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "dashboard.png"
    done = chromium(tmp_path, run.base + "/dashboard", f"--screenshot={png}")
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 1100)
    rgb = image.tobytes()
    close = sum(
        1 for px in zip(rgb[0::3], rgb[1::3], rgb[2::3]) if all(abs(a - b) <= 24 for a, b in zip(px, REWARD_RGB))
    )
    assert close >= 50, f"only {close} pixels of the reward curve's colour in the screenshot"
