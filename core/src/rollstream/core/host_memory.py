"""glibc malloc settings for processes that run torch on the CPU (see docs/benchmarks.md,
"Trainer memory by component").

torch's CPU allocator is plain malloc. glibc serves a request of at least
M_MMAP_THRESHOLD bytes (128 KiB at start) with its own mmap, returned to the OS on free,
but every time such a block is freed it raises the threshold to that block's size, up to
32 MiB. After the first step's activations are freed, every activation tensor smaller than
32 MiB (nearly all of them: 4k tokens x 1536 x 4 bytes is 24 MiB) comes from the heap
arenas instead, where freed memory stays resident and fragments: measured on the demo
trainer (SmolLM2-135M, benchmarks/trainer_memory.py), 5.4 GB of freed memory held by malloc
between steps (8.8 GB resident where 3.4 GB is live) and 0.8 GB more at the step's peak.

A fixed threshold (setting it turns the dynamic adjustment off) keeps large blocks on
mmap: given back at once on free. The price is page faults when the next step allocates
them again: about 1.4 M minor faults, 3 to 3.5 s of CPU, per 5.7 GB of activations on
dev-cpu (glibc's arenas fault too, but not every step). GLIBC_TUNABLES=glibc.malloc.hugetlb=1
in a process's environment (transparent huge pages in "madvise" mode) cuts the faults 7x
and their cost to about 1.5 s. Values are unaffected: only where the memory comes from
changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

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
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    lib = _libc()
    if lib is None:
        return False
    ok = lib.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1
    return ok and lib.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * nbytes)) == 1
