"""Run a rank program of tests/ranks in one process or as N ranks under torchrun (its
standalone rendezvous on loopback), one torch thread a rank: CI has 2 cores for 4 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A step of the tiny model takes a second or two a rank on an idle core; a loaded 2-core
# machine stretches that many times over. A hang (a rank waiting on a dead one) ends here.
TIMEOUT_S = 900


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(program: str, args: list[str], nproc: int = 0, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`program` (a file of tests/ranks) with `args`: one plain process when nproc is 0, else
    nproc ranks. Raises with the output when it fails."""
    script = str(HERE / program)
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run(
        [sys.executable, *launcher, script, *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise AssertionError(
            f"{program} {args} on {nproc or 1} process(es) exited {done.returncode}:\n{done.stderr[-6000:]}"
        )
    return done
