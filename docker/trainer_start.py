"""Container entrypoint of the trainer: `python -m rollstream.trainer`, resuming from the
newest complete checkpoint in `checkpoint_dir` when there is one.

The trainer's own `resume = "latest"` refuses to start when checkpoint_dir holds no
checkpoint, which is exactly the state of a fresh volume on the first start; a container
that restarts (crash, eviction, node drain, `docker compose restart`) must pick up where
it left off. So: settings are read the trainer's way (TOML, ROLLSTREAM_* environment,
flags), and `--resume latest` is added only when a checkpoint exists and no `resume` was
configured. Everything else is the trainer's own main().

    trainer_start.py [trainer flags]

A configuration file (`--config`) that says `colocate = "sync"` or `"async"` runs the colocated
process instead (the trainer and a generator in one process: rollstream.launcher.colocated,
its file's shape in launcher/colocation.py; compose.one-gpu.yaml, k8s-one-gpu/), with the same
resume rule for its trainer. `backend = "vllm"` in its [generator] table makes the generator
half a vLLM engine in this process (docs/design.md, "One device"); this image has no vLLM, so
that exits at start saying so (docs/deploy.md, "One GPU": what an image for it needs).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollstream.core.config import load_or_exit
from rollstream.launcher import colocation  # torch-free: the image's launcher and generator packages
from rollstream.trainer import checkpoint
from rollstream.trainer.config import TrainerSettings


def start_args(argv: list[str], table: str = "") -> list[str]:
    """The trainer's arguments: `argv`, plus `--resume latest` when a checkpoint is there
    (`table`: the trainer's table of a colocated file)."""
    settings = load_or_exit(TrainerSettings, argv, table)  # a bad setting exits 2 here, named, as the trainer would
    if settings.resume or not settings.checkpoint_dir:
        return argv
    if checkpoint.latest(Path(settings.checkpoint_dir)) is None:
        return argv  # first start: nothing to resume
    return [*argv, "--resume", "latest"]


def main() -> None:
    argv = sys.argv[1:]
    if colocation.colocated_file(argv):
        from rollstream.launcher import colocated

        args = start_args(argv, table="trainer")
        print(f"trainer_start: python -m rollstream.launcher.colocated {' '.join(args)}", file=sys.stderr, flush=True)
        sys.exit(colocated.main(args))
    from rollstream.trainer.service import main as trainer_main

    args = start_args(argv)
    print(f"trainer_start: python -m rollstream.trainer {' '.join(args)}", file=sys.stderr, flush=True)
    trainer_main(args)


if __name__ == "__main__":
    main()
