"""How much the demo task learns per step, one factor at a time, in one process.

    .venv/bin/python benchmarks/learning_per_step.py --weights bf16 --loss grpo --staleness 1 --seed 0
    .venv/bin/python benchmarks/learning_per_step.py --weights fp32 --loss dapo --staleness 0 --seed 0
    .venv/bin/python benchmarks/learning_per_step.py --master-layout fp32 --moments-dtype float32 --seed 0

The pipeline's learning rule without the pipeline: the trainer's own `train_step` (losses,
clipping against the behaviour log-probs, host AdamW with fp32-exact masters) and the generator's
own transformers sampling loop, on a second copy of the model as in a real generator, the
demo's task (the seed-0 arithmetic stream, in order) and the reward service's `arithmetic`
recipe. No Redis, no gRPC, no timing: what changes between runs is only the factor named on
the command line, so reward-by-step curves can be compared even on a loaded machine.

Factors:
  --weights bf16   what rollstream does: the model computes with bf16(master) values and the
                   generator samples from the same bf16 weights (deltas are of bf16 bits)
  --weights fp32   the model and the generator hold the fp32 masters themselves, as TRL does
                   on the CPU (no rounding anywhere)
  --loss           the trainer's policy loss (TRL 1.16's default is dapo's token mean)
  --staleness K    train each batch K versions after the weights that sampled it (the
                   pipeline's steady state at max_staleness K; 0 is the synchronous control)
  --master-layout  HostAdamW's master layout: split (the trainer's default: the served bf16
                   bits, rounded ties away from zero, plus a 16-bit remainder) or fp32 (an fp32
                   vector, served bits rounded to nearest even); the update is fp32 either way
  --moments-dtype  HostAdamW's moments: bfloat16 (the trainer's default) or float32

The sampling seed of group g of step s is a function of (--seed, s, g), the same for every
factor, so curves differ by the factor, not by luck of the draw (common random numbers).
Prints one JSON object: the reward by step, the first step at or above 0.85 and 0.95, and
per step the loss, gradient norm, clip fraction and the share of bf16 weights that changed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import time

import numpy as np
import torch

from rollstream.core import modeling
from rollstream.core.models import resolve_model
from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.reward.recipes import Sample, build_recipes, default_specs
from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.step import StepConfig, train_step
from rollstream.v1 import rollout_pb2


def first_step_at(rewards: list[float], level: float) -> int | None:
    return next((i + 1 for i, r in enumerate(rewards) if r >= level), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--loss", choices=["grpo", "dr_grpo", "dapo", "gspo"], default="grpo")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--master-layout", choices=["split", "fp32"], default="split")
    parser.add_argument("--moments-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--tis-cap", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = str(resolve_model(args.model))

    settings = TrainerSettings(
        lr=args.lr,
        loss=args.loss,
        tis_cap=args.tis_cap,
        max_new_tokens=args.max_new_tokens,
        token_budget=args.token_budget,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
    )
    cfg = StepConfig.from_settings(settings)
    model, tokenizer = modeling.load_model(model_dir, dtype="float32", device="cpu")
    model.train()
    params = modeling.named_weights(model)
    opt = HostAdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
        bucket_mb=settings.bucket_mb,
        moments_dtype=args.moments_dtype,
        master_layout=args.master_layout,
    )
    generator = TransformersBackend(model_dir)
    gen_params = modeling.named_weights(generator.model)

    @torch.no_grad()
    def set_weights() -> np.ndarray:
        """Make trainer and generator compute with this variant's weights; return the bf16 bits."""
        bits = opt.sync_model()  # bf16(master) into the trainer's model
        if args.weights == "fp32":
            for name, p in params.items():
                p.copy_(opt.master[name].view_as(p))
        for name, p in params.items():
            gen_params[name].copy_(p)
        return np.concatenate([b.reshape(-1) for b in bits.values()])

    recipes = build_recipes(default_specs(), None)
    source = prompts.arithmetic(seed=0)
    bits = set_weights()
    queue: collections.deque[list[rollout_pb2.RolloutGroup]] = collections.deque()
    history = []
    started = time.monotonic()
    load_start = os.getloadavg()
    for step in range(1, args.steps + 1):
        # Sample until the batch to train is `staleness` versions old (the pipeline's steady state).
        while len(queue) <= args.staleness:
            batch_index = step + len(queue)
            tasks = [next(source) for _ in range(args.groups_per_step)]
            requests = [
                SampleRequest(
                    generator.encode_chat(t.messages),
                    args.group_size,
                    1.0,
                    1.0,
                    0,
                    args.max_new_tokens,
                    seed=(args.seed * 1000 + batch_index) * 100 + g,
                )
                for g, t in enumerate(tasks)
            ]
            groups = []
            for task, request, samples in zip(tasks, requests, generator.sample(requests), strict=True):
                completions = [
                    rollout_pb2.Completion(
                        token_ids=s.token_ids,
                        behaviour_logprobs=s.logprobs,
                        reward=recipes.score(task.task_kind, Sample(completion=s.text, answer=task.answer)).reward,
                    )
                    for s in samples
                ]
                groups.append(
                    rollout_pb2.RolloutGroup(prompt_ids=request.prompt_ids, completions=completions, scored=True)
                )
            queue.append(groups)
        groups = queue.popleft()
        rewards = [c.reward for g in groups for c in g.completions]
        result = train_step(model, opt, groups, cfg, pad_id=tokenizer.pad_token_id)
        new_bits = set_weights()
        changed = float(np.count_nonzero(new_bits != bits)) / new_bits.size
        bits = new_bits
        history.append(
            {
                "step": step,
                "reward": round(float(np.mean(rewards)), 4),
                "loss": round(result.loss, 5),
                "grad_norm": round(result.grad_norm, 4),
                "clip_fraction": round(result.clip_fraction, 4),
                "bf16_changed": round(changed, 5),
            }
        )
        print(json.dumps(history[-1]), flush=True)
    rewards = [h["reward"] for h in history]
    print(
        json.dumps(
            {
                "benchmark": "learning_per_step",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "factors": {
                    "weights": args.weights,
                    "loss": args.loss,
                    "staleness": args.staleness,
                    "tis_cap": args.tis_cap,
                    "master_layout": args.master_layout,
                    "moments_dtype": args.moments_dtype,
                },
                "seed": args.seed,
                "lr": args.lr,
                "steps": args.steps,
                "threads": args.threads,
                "reward_by_step": rewards,
                "first_step_at_0.85": first_step_at(rewards, 0.85),
                "first_step_at_0.95": first_step_at(rewards, 0.95),
                "mean_reward_last5": round(float(np.mean(rewards[-5:])), 4),
                "wall_s": round(time.monotonic() - started, 1),
                "loadavg_1_5_15": {
                    "start": [round(x, 2) for x in load_start],
                    "end": [round(x, 2) for x in os.getloadavg()],
                },
                "steps_detail": history,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
