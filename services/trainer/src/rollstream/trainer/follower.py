"""A rank > 0 of the trainer on N ranks (ranks.py): its shards of the model and of the
optimizer, doing what rank 0 leads, one command at a time, until rank 0 says stop.

Rank 0 is the trainer service (service.py, trainer.py): it alone reads the ready stream,
commits, publishes and pushes. Each of its calls that touches the sharded model is first sent
here (Ranks.lead), so every rank runs the same collectives in the same order:
  start  the checkpoint to resume from ("" for none), once, before anything else
  step   a step's groups: step.train_step on this rank's share, then the bits joined at rank 0
  probe  a refused step's groups: step.nonfinite_groups
  save   a checkpoint's folder: this rank's optimizer shards into it
  stop   the run is over (or rank 0 is ending): leave
A rank that dies ends the whole job (torchrun stops the others); the restart resumes from the
last checkpoint, and rank 0 replays the trained log from there (replay.py).
"""

from __future__ import annotations

import signal
from pathlib import Path

from rollstream.core import logs
from rollstream.trainer import checkpoint, ranks
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import NonFiniteStep
from rollstream.trainer.step import nonfinite_groups, train_step
from rollstream.trainer.trained import Trained


def run(settings: TrainerSettings, team: ranks.Ranks) -> int:
    """Follow rank 0 until it says stop; never returns (ranks.leave)."""
    # Rank 0 leads the stop: a SIGTERM (torchrun passes one to every rank) must not end this
    # rank while rank 0 still finishes its step and its checkpoint with it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = logs.setup(f"trainer-rank{team.world.rank}", settings.log_level, settings.log_json, run=settings.run)
    trained = Trained.load(settings, team)
    optimizer, params, model = trained.optimizer, trained.params, trained.model
    pad_id = trained.tokenizer.pad_token_id
    header, _ = team.follow()
    if header["command"] != "start":
        raise RuntimeError(f"rank {team.world.rank}: rank 0's first command is {header['command']!r}, not start")
    if header["resume"]:
        path = Path(header["resume"])
        trained.restore_optimizer(path, checkpoint.load_state(path), team)
        team.full_bits(params, optimizer.published_bits())
    else:
        team.full_bits(params, optimizer.sync_model())
    logs.event(log, "rank_following", rank=team.world.rank, world=team.world.size, resumed=header["resume"])
    while True:
        header, payload = team.follow()
        command = header["command"]
        if command == "step":
            try:
                r = train_step(
                    model, optimizer, ranks.decode_groups(payload), trained.step_config, pad_id=pad_id, ranks=team
                )
            except NonFiniteStep:
                continue  # every rank refused it (the finite check is agreed); rank 0 probes next
            if r.trained_bits is not None:
                team.full_bits(params, r.trained_bits)
        elif command == "probe":
            nonfinite_groups(
                model, optimizer, ranks.decode_groups(payload), trained.step_config, pad_id=pad_id, ranks=team
            )
        elif command == "save":
            checkpoint.save_sharded_optimizer(Path(header["folder"]), optimizer, params)
        elif command == "stop":
            ranks.leave(0)
        else:
            raise RuntimeError(f"rank {team.world.rank}: unknown command {command!r} from rank 0")
