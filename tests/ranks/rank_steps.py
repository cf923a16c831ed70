"""A rank program for tests/ranks: `steps` GRPO steps (step.train_step, the trainer's own) on
synthetic groups, in one process (`python rank_steps.py ...`) or as N ranks
(`torchrun --nproc-per-node N rank_steps.py ...`). Writes into OUT: rank<r>.safetensors (the
rank's masters and moments, its shards' shapes: rank order along dim 0 joins them) and, from
rank 0, bits.safetensors (the published bf16 bits of the last step, whole) and steps.json (per
step: the loss, the gradient norm and the sha256 of the whole published bits).

    rank_steps.py MODEL_DIR OUT --steps 20 [--dtype float32|bfloat16] [--token-budget 48]
                  [--save-at K DIR] [--resume DIR]

--save-at K DIR: after step K, the optimizer's state is saved into DIR (sharded_state.save,
every rank its shards; rank 0 the step count in DIR/state.json). --resume DIR: that state is
loaded before the first step (on any number of ranks, or in a plain process), and the steps
run are K+1..steps (the synthetic groups are fixed by the step's number), so steps.json then
lists those steps only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: synthetic
from rollstream.trainer import lora, ranks, sharded_state
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import NonFiniteStep
from rollstream.trainer.step import StepConfig, nonfinite_groups, train_step
from synthetic import scored_groups


def sha(bits: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(bits):
        h.update(name.encode())
        h.update(np.ascontiguousarray(bits[name]).tobytes())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--token-budget", type=int, default=48)
    parser.add_argument("--save-at", nargs=2, metavar=("K", "DIR"))
    parser.add_argument("--resume", type=Path, metavar="DIR")
    parser.add_argument("--nan-at", type=int, default=0, help="a NaN behaviour log-prob in group 3 at this step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Clipping on at a norm the tiny model's gradients exceed: the clip factor is in every step.
    settings = TrainerSettings(
        model=args.model_dir, dtype=args.dtype, token_budget=args.token_budget, max_grad_norm=0.05, lr=1e-3
    )
    world = ranks.World.from_env()
    team = ranks.Ranks.join(world, "cpu") if world is not None else None
    model, _tok, _lora, params = lora.load(args.model_dir, settings.dtype, "cpu")
    model.train()
    if team is not None:
        params = team.shard(model)
    optimizer = settings.host_adamw(params, reduce=team.sum_of_squares if team is not None else None)

    def state() -> dict[str, torch.Tensor]:
        """The optimizer's state as sharded_state saves and loads it: views, no copies."""
        return sharded_state.as_dtensors(optimizer, params) if team is not None else optimizer.state_tensors()

    first = 1
    if args.resume is not None:
        saved = sharded_state.read_state(args.resume)
        local_bits = sharded_state.load_optimizer(args.resume, optimizer, state(), saved["optimizer_steps"])
        first = saved["step"] + 1
    else:
        local_bits = optimizer.sync_model()
    save_at, save_dir = (int(args.save_at[0]), Path(args.save_at[1])) if args.save_at else (0, None)
    cfg = StepConfig.from_settings(settings)
    log = []
    bits: dict[str, np.ndarray] = {}
    for step in range(first, args.steps + 1):
        groups = scored_groups(step, 4)
        blamed: dict[int, str] = {}
        if step == args.nan_at:  # refused on every rank, the group found, the rest trained: as the trainer does
            groups[3].completions[0].behaviour_logprobs[0] = math.nan
            try:
                train_step(model, optimizer, groups, cfg, pad_id=0, ranks=team)
                raise AssertionError("a NaN log-prob trained")
            except NonFiniteStep:
                blamed = nonfinite_groups(model, optimizer, groups, cfg, pad_id=0, ranks=team)
            groups = [g for k, g in enumerate(groups) if k not in blamed]
        r = train_step(model, optimizer, groups, cfg, pad_id=0, ranks=team)
        local_bits = r.trained_bits or local_bits
        bits = team.full_bits(params, local_bits) if team is not None else local_bits
        if team is None or team.lead_rank:
            log.append(
                {"step": step, "loss": r.loss, "grad_norm": r.grad_norm, "tokens": r.tokens, "bits": sha(bits)}
                | ({"blamed": sorted(blamed)} if blamed else {})
            )
        if step == save_at and save_dir is not None:
            sharded_state.save(save_dir, state(), {"step": step, "optimizer_steps": optimizer.step_count})
    rank = team.world.rank if team is not None else 0
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous().clone() for k, v in optimizer.state_tensors().items()}, args.out / f"rank{rank}.safetensors"
    )
    if rank == 0:
        save_numpy({k: np.ascontiguousarray(v) for k, v in bits.items()}, str(args.out / "bits.safetensors"))
        (args.out / "steps.json").write_text(json.dumps(log, indent=1))
    if team is not None:
        ranks.leave(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
