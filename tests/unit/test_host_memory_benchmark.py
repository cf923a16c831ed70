"""benchmarks/host_memory.py at the tiny shape: its JSON has the fields the docs read, and the
default layout (split masters, bf16 moments) measures below the old one (fp32 + fp32). No
timing is asserted: the machine running this may be loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_memory_benchmark_at_the_tiny_shape() -> None:
    # Two layouts only (each runs in its own process, most of which is importing torch); a
    # small bucket, since the staging buffers are a bucket wide and tiny has 3.3M parameters.
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "host_memory.py"),
            "--sizes",
            "tiny",
            "--layouts",
            "split+bfloat16,fp32+float32",
            "--bucket-mb",
            "0.25",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    runs = {r["layout"]: r for r in result["runs"]}
    assert set(runs) == {"split+bfloat16", "fp32+float32"}
    for run in runs.values():
        assert "error" not in run and "skipped" not in run, run
        assert run["size"] == "tiny" and run["parameters"] == 3279104
        assert isinstance(
            run["peak_reset"], bool
        )  # False where /proc/self/clear_refs is refused: then the baseline is the peak so far
        assert set(run["peak_by_phase_bytes_per_param"]) == {"init", "sync_model+publisher", "step1", "step2"}
        # The layout's own buffers are there, at least its nominal bytes.
        assert run["measured_bytes_per_param"] >= run["nominal_bytes_per_param"], run
        assert len(run["payloads"]) == 2 and all(p["bytes"] > 0 and p["changed_values"] > 0 for p in run["payloads"])
        assert run["publisher_kept_delta_bytes"] == sum(p["bytes"] for p in run["payloads"])
        assert (
            sum(run["optimizer_buffers_bytes_per_param"].values()) >= run["nominal_bytes_per_param"] - 2
        )  # fp32: one bits buffer is the publisher's
    assert (
        runs["split+bfloat16"]["nominal_bytes_per_param"] == 8 and runs["fp32+float32"]["nominal_bytes_per_param"] == 16
    )
    assert runs["split+bfloat16"]["measured_bytes_per_param"] < runs["fp32+float32"]["measured_bytes_per_param"]
    arithmetic = result["arithmetic"]["layouts"]
    for layout in runs:
        for target in ("7b", "14b", "32b"):
            entry = arithmetic[layout][target]
            assert entry["parameters"] > 7e9 and isinstance(entry["fits_128_gib"], bool)
            assert entry["with_process_gib"] > entry["optimizer_gib"] > 0
