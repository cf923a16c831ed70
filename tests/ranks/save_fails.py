"""A rank program for tests/ranks: 2 ranks save with sharded_state, rank 1 with a value that is
not a tensor (refused). Prints each rank's outcome ("<rank> raised <type>: <message>"); exits 0
when every rank raised, 1 otherwise.

    torchrun --nproc-per-node 2 save_fails.py FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rollstream.trainer import ranks, sharded_state


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensors: dict[str, object] = {"a": torch.ones(3)}
    if rank == 1:
        tensors["step"] = 3
    try:
        sharded_state.save(Path(sys.argv[1]), tensors)  # type: ignore[arg-type]  # (the refused value, on purpose)
    except Exception as e:  # noqa: BLE001 - the outcome is what this program reports
        print(f"{rank} raised {type(e).__name__}: {e}", flush=True)
        ranks.leave(0)
    print(f"{rank} saved", flush=True)
    ranks.leave(1)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
