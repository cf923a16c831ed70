"""Container entrypoint of the trainer: `python -m rollstream.trainer`, resuming from the
newest complete checkpoint in `checkpoint_dir` when there is one.

The trainer's own `resume = "latest"` refuses to start when checkpoint_dir holds no
checkpoint, which is exactly the state of a fresh volume on the first start; a container
that restarts (crash, eviction, node drain, `docker compose restart`) must pick up where
it left off. So: settings are read the trainer's way (TOML, ROLLSTREAM_* environment,
flags), and `--resume latest` is added only when a checkpoint exists and no `resume` was
configured. Everything else is the trainer's own main().

    trainer_start.py [trainer flags]
    trainer_start.py --colocate [--async] [trainer flags] [--generator-flag --NAME VALUE ...]

`--colocate` as the first argument runs the colocated process instead (the trainer and a
generator in one process: rollstream.launcher.colocated, compose.one-gpu.yaml; `--async`:
the generator samples from its own copy while the trainer steps), with the same resume rule
for its trainer. `--generator-flag --backend vllm` makes the generator half a vLLM engine in
this process (docs/design.md, "One device"); this image has no vLLM, so that exits at start
saying so (docs/deploy.md, "One GPU": what an image for it needs).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollstream.core.config import load_or_exit
from rollstream.trainer import checkpoint
from rollstream.trainer.config import TrainerSettings

COLOCATE = "--colocate"


def start_args(argv: list[str]) -> list[str]:
    """The trainer's arguments: `argv`, plus `--resume latest` when a checkpoint is there."""
    settings = load_or_exit(TrainerSettings, argv)  # a bad setting exits 2 here, named, as the trainer would
    if settings.resume or not settings.checkpoint_dir:
        return argv
    if checkpoint.latest(Path(settings.checkpoint_dir)) is None:
        return argv  # first start: nothing to resume
    return [*argv, "--resume", "latest"]


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == [COLOCATE]:
        from rollstream.launcher import colocated  # the image's generator package, needed only here

        trainer_argv, _, _ = colocated.split_argv(argv[1:])
        resume = start_args(trainer_argv)[len(trainer_argv) :]  # what goes to the trainer's flags, if anything
        args = [*argv[1:], *resume]
        print(f"trainer_start: python -m rollstream.launcher.colocated {' '.join(args)}", file=sys.stderr, flush=True)
        sys.exit(colocated.main(args))
    from rollstream.trainer.service import main as trainer_main

    args = start_args(argv)
    print(f"trainer_start: python -m rollstream.trainer {' '.join(args)}", file=sys.stderr, flush=True)
    trainer_main(args)


if __name__ == "__main__":
    main()
