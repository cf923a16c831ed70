"""Process-wide settings of the C runtimes under torch on the CPU, for the torch services
(generator, reference, trainer). Both only change where time and memory go, never values.

OpenMP's wait policy (`passive_openmp`). torch's CPU kernels run in OpenMP parallel regions;
by default each worker thread spins for a while after a region ends, waiting for the next.
On a machine whose cores are shared (the demo runs three torch processes on two cores, and
CI machines are loaded), spinning threads burn the cycles the other processes' threads need.
Measured on dev-cpu under load 5-8 (docs/benchmarks.md, "OpenMP wait policy"): generation of
32 completions of SmolLM2-135M, 2 threads, 118-120 s with spinning, 29-58 s with
OMP_WAIT_POLICY=PASSIVE; the training step within noise (55-81 s against 58-71 s); the
host AdamW step of 0.1B parameters 3.4 s against 0.6 s. The policy is read when the OpenMP
runtime starts, i.e. when torch is first imported: it must be in the environment before.

glibc's mmap threshold (`fixed_mmap_threshold`). torch's CPU allocator is plain malloc. glibc
serves a request of at least M_MMAP_THRESHOLD bytes (128 KiB at start) with its own mmap,
returned to the OS on free, but every time such a block is freed it raises the threshold to
that block's size, up to 32 MiB. After the first step's activations are freed, every
activation tensor smaller than 32 MiB (nearly all of them: 4k tokens x 1536 x 4 bytes is 24
MiB) comes from the heap arenas instead, where freed memory stays resident and fragments:
measured on the demo trainer (SmolLM2-135M, benchmarks/trainer_memory.py), 5.4 GB of freed
memory held by malloc between steps (8.8 GB resident where 3.4 GB is live) and 0.8 GB more
at the step's peak. A fixed threshold (setting it turns the dynamic adjustment off) keeps
large blocks on mmap: given back at once on free. The price is page faults when the next
step allocates them again: about 1.4 M minor faults, 3 to 3.5 s of CPU, per 5.7 GB of
activations on dev-cpu (glibc's arenas fault too, but not every step).
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in a process's environment (transparent huge pages in
"madvise" mode) cuts the faults 7x and their cost to about 1.5 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks of at least this size get their own mapping; smaller ones stay in the arenas,
# where they fragment little (a 1 MiB hole is reused by the next medium-sized tensor).
DEFAULT_MMAP_THRESHOLD = 1 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.mallopt  # noqa: B018  (absent: not glibc)
    except (OSError, AttributeError):
        return None
    return lib


def fixed_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Serve every allocation of at least `nbytes` with its own mmap, returned to the OS on
    free, for the rest of the process (mallopt M_MMAP_THRESHOLD; M_TRIM_THRESHOLD too, so
    the heap top is given back as well). A MALLOC_MMAP_THRESHOLD_ in the environment wins.
    Returns False where this is not glibc (nothing changed)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    lib = _libc()
    if lib is None:
        return False
    ok = lib.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1
    return ok and lib.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * nbytes)) == 1


def passive_openmp() -> None:
    """OpenMP worker threads sleep as soon as a parallel region ends instead of spinning
    (OMP_WAIT_POLICY=PASSIVE; read by GNU and LLVM/Intel OpenMP alike), unless the
    environment already says otherwise. Call before torch is imported: the torch services
    do it in their package's __init__."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """The cores this process may keep busy: its CPU affinity, capped by its cgroup's CPU
    quota where one is set (a container or pod limited to `cpu: "4"` on a 64-core node sees
    64 cores in its affinity but gets the time of 4). cgroup v2's cpu.max, else v1's
    cpu.cfs_quota_us over cpu.cfs_period_us; rounded up, at least 1."""
    cores = len(os.sched_getaffinity(0))
    root = Path(cgroup)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = (
                (root / "cpu" / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            )
        except OSError:
            return cores
    try:
        if quota in ("max", "-1") or int(period) <= 0:
            return cores
        return max(1, min(cores, -(-int(quota) // int(period))))
    except ValueError:
        return cores
