"""core/cpu_runtime.py. With a fixed mmap threshold, large blocks freed by a process go back
to the OS; with glibc's default (a threshold that rises to the size of each freed mmapped
block) the same blocks stay resident. Each case runs in a fresh process, so malloc's state
is its own; 50 blocks of 4 MiB, each followed by a small live block (as a step's activations
are by small tensors), so the heap top cannot simply be trimmed. And the torch services set
OpenMP's wait policy to passive before torch starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.core import cpu_runtime

PROBE = """
import json, sys
import numpy as np
from rollstream.core import cpu_runtime

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

fixed = cpu_runtime.fixed_mmap_threshold() if sys.argv[1] == "fixed" else None
warm = np.ones(4 << 18)  # a 4 MiB block, mmapped at glibc's starting threshold (128 KiB) ...
del warm                 # ... and freed: glibc's default now raises the threshold to 4 MiB
before = rss_mib()
big, small = [], []
for _ in range(50):
    big.append(np.ones(4 << 18))  # 4 MiB each, touched
    small.append(np.ones(64))     # a small live block above each
peak = rss_mib()
del big
print(json.dumps({"fixed": fixed, "before": before, "peak": peak, "after": rss_mib()}))
"""

pytestmark = pytest.mark.skipif(cpu_runtime._libc() is None, reason="not glibc: mallopt is not there")


def probe(mode: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout)


def test_fixed_threshold_gives_freed_blocks_back() -> None:
    r = probe("fixed")
    assert r["fixed"] is True
    assert r["peak"] - r["before"] >= 150  # 200 MiB were live
    assert r["after"] - r["before"] < 50, r


def test_glibc_default_keeps_them_resident() -> None:
    """Why the trainer sets the threshold: without it the same 200 MiB stay resident."""
    r = probe("default")
    assert r["after"] - r["before"] >= 150, r


def test_the_environment_wins() -> None:
    """MALLOC_MMAP_THRESHOLD_ (glibc's own variable) is left alone: the call changes nothing
    and says it is in effect."""
    r = probe("fixed", {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert r["fixed"] is True
    assert r["after"] - r["before"] < 50, r


@pytest.mark.parametrize("service", ["trainer", "generator", "reference"])
def test_torch_services_make_openmp_threads_sleep_unless_told_otherwise(service: str) -> None:
    """Importing a torch service sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP;
    a value already in the environment is kept."""
    code = f"import os, rollstream.{service}, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
    )
    assert out.stdout.strip() == "ACTIVE"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, None),  # no cgroup files: the affinity
        ({"cpu.max": "max 100000\n"}, None),  # v2, no quota
        ({"cpu.max": "400000 100000\n"}, 4),  # v2, `cpu: "4"`
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
        ({"cpu.max": "1000 100000\n"}, 1),  # a sliver: at least 1
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
        ({"cpu.max": "garbage\n"}, None),  # unreadable: the affinity
        ({"cpu.max": "400000 0\n"}, None),
    ],
)
def test_usable_cores_caps_the_affinity_by_the_cgroup_quota(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert cpu_runtime.usable_cores(str(tmp_path)) == (affinity if expected is None else min(affinity, expected))
