"""How much of an AdamW update reaches bf16 weights, and how far it moves the policy.

    .venv/bin/python benchmarks/bf16_drift.py [--lr 2e-5] [--steps 1 2 3 5 8 12]

rollstream's trainer keeps fp32 masters and computes (and publishes) bf16(master): a weight
moves only once its master has crossed half a bf16 ULP. At RL learning rates and a few
steps that is most weights not moving at all. This measures it on the demo model and task,
cheaply and independently of machine load (a few forward passes):

1. One demo batch (8 prompts x 8 completions of up to 16 tokens, the seed-0 arithmetic
   stream, the reward service's recipe), one backward of the trainer's GRPO loss.
2. k AdamW steps of the trainer's HostAdamW with that gradient held fixed (an upper bound
   on how consistently a weight moves: real gradients change direction, so real masters
   cross ULP boundaries later still). Masters m_k are the same for both policies.
3. For each k: the fp32 policy m_k against the bf16 policy bf16(m_k): the share of bf16
   weights changed from the start, the norm of the update each carries, and the first-order
   gain of the GRPO surrogate on the batch, sum_i A_i mean_t (logp_k - logp_0) / G, which is
   what the step was for.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from demo_task import arithmetic_requests  # benchmarks/demo_task.py
from rollstream.core import modeling
from rollstream.core.models import resolve_model
from rollstream.generator.backends import TransformersBackend
from rollstream.reward.recipes import Sample, build_recipes, default_specs
from rollstream.trainer import grpo
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.step import StepConfig, train_step
from rollstream.v1 import rollout_pb2


class KeepGrads:
    """Stands in for the optimizer inside one train_step: keeps the gradients, steps nothing."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, max_grad_norm: float, on_piece: object = None) -> tuple[float, None]:
        self.grads = {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in self.grads.values()])))
        for p in self.params.values():
            p.grad = None
        return norm, None

    def discard_grads(self) -> None:
        for p in self.params.values():
            p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 5, 8, 12])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))

    # 1. One demo batch, scored by the reward service's recipe.
    backend = TransformersBackend(model_dir)
    tasks, requests = arithmetic_requests(backend, groups=8, group_size=8, max_new_tokens=16)
    recipes = build_recipes(default_specs(), None)
    groups, advantages = [], []
    for task, request, samples in zip(tasks, requests, backend.sample(requests), strict=True):
        rewards = [recipes.score(task.task_kind, Sample(completion=s.text, answer=task.answer)).reward for s in samples]
        advantages += grpo.group_advantages(rewards)
        completions = [
            rollout_pb2.Completion(token_ids=s.token_ids, behaviour_logprobs=s.logprobs, reward=r)
            for s, r in zip(samples, rewards, strict=True)
        ]
        groups.append(rollout_pb2.RolloutGroup(prompt_ids=request.prompt_ids, completions=completions, scored=True))
    del backend
    sequences = [(g.prompt_ids, c.token_ids) for g in groups for c in g.completions]

    # The trainer's model starts from the fp32 checkpoint as the trainer does (bf16 values).
    settings = TrainerSettings(lr=args.lr, max_new_tokens=16)
    model, tokenizer = modeling.load_model(model_dir, dtype="float32", device="cpu")
    params = modeling.named_weights(model)
    opt = HostAdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
        bucket_mb=settings.bucket_mb,
        master_layout="fp32",
        moments_dtype="float32",
    )  # reads flat_master
    opt.sync_model()
    batch = modeling.make_batch(sequences, tokenizer.pad_token_id)
    adv = torch.tensor(
        [a for a, n in zip(advantages, batch.lengths, strict=True) for _ in range(n)], dtype=torch.float32
    )
    weight = torch.tensor([1.0 / n for n in batch.lengths for _ in range(n)], dtype=torch.float32) / len(batch.lengths)

    @torch.no_grad()
    def surrogate() -> float:
        logp, _ = modeling.completion_logprobs(model, batch)
        return float((adv * weight * logp).sum())

    # 2. The gradient of the trainer's own loss on this batch, once.
    keep = KeepGrads(params)
    train_step(model, keep, groups, StepConfig.from_settings(settings), pad_id=tokenizer.pad_token_id)  # type: ignore[arg-type]  # KeepGrads keeps the gradients, it is no HostAdamW
    masters0 = opt.flat_master.clone()
    bits0 = opt.sync_model()
    base_bf16 = surrogate()
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(opt.master[name].view_as(p))
    base_fp32 = surrogate()  # the checkpoint need not be bf16-exact

    rows, done = [], 0
    for k in sorted(args.steps):
        while done < k:
            for name, p in params.items():
                p.grad = keep.grads[name].clone() if name in keep.grads else None
            opt.step(settings.max_grad_norm)
            done += 1
        bits = opt.sync_model()  # bf16(m_k) in the model
        gain_bf16 = surrogate() - base_bf16
        changed = sum(int((bits[n] != bits0[n]).sum()) for n in bits) / opt.numel
        d32 = opt.flat_master - masters0
        d16 = torch.cat([p.detach().reshape(-1) for p in params.values()]) - torch.cat(
            [modeling.bits_to_tensor(bits0[n]).float().reshape(-1) for n in params]
        )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(opt.master[name].view_as(p))  # the fp32 policy m_k
        gain_fp32 = surrogate() - base_fp32
        rows.append(
            {
                "steps": k,
                "bf16_weights_changed": round(changed, 4),
                "update_norm_fp32": round(float(d32.norm()), 6),
                "update_norm_bf16": round(float(d16.norm()), 6),
                "cosine": round(float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)), 4),
                "surrogate_gain_fp32": round(gain_fp32, 6),
                "surrogate_gain_bf16": round(gain_bf16, 6),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        json.dumps(
            {
                "benchmark": "bf16_drift",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "model": model_dir,
                "lr": args.lr,
                "completions": len(sequences),
                "rows": rows,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
