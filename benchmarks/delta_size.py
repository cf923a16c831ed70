"""Weight-delta size over consecutive AdamW steps on SmolLM2-135M with real GRPO gradients.

    .venv/bin/python benchmarks/delta_size.py [--lrs 1e-6 3e-6] [--steps 20]

What it does, as the trainer does it:
1. samples a pool of groups on the demo task (arithmetic, temperature 1) with the
   transformers backend at version 0, and scores them with the reward service's
   `arithmetic_answer` verifier: real completions, real rewards, real behaviour log-probs;
2. per learning rate, from the fp32 checkpoint: HostAdamW (fp32 masters, the trainer's
   default settings otherwise: betas 0.9/0.999, no weight decay, grad-norm clip 1.0), then
   `--steps` steps of the trainer's own step.train_step (the clipped GRPO loss by default),
   each on the next `--groups-per-step` groups of the pool; after each step the published
   bf16 weights are delta-encoded against the previous version with core/deltas.py (the
   generator's format, exact);
3. prints one JSON object: per step the delta's bytes, its fraction of the dense bf16
   weights, the fraction of values that changed, and the encodings chosen per tensor.

The pool is sampled once (not per step) to keep the run to minutes on a CPU: later
steps see groups whose behaviour policy is a few steps old, as an asynchronous trainer
does with max_staleness > 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pool-groups", type=int, default=20)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    import torch

    from demo_task import arithmetic_requests  # benchmarks/demo_task.py
    from rollstream.core import deltas, modeling
    from rollstream.core.models import resolve_model
    from rollstream.generator.backends import TransformersBackend
    from rollstream.reward.verifiers import arithmetic_answer
    from rollstream.trainer.config import TrainerSettings
    from rollstream.trainer.optimizer import HostAdamW
    from rollstream.trainer.step import StepConfig, train_step
    from rollstream.v1 import rollout_pb2

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))

    # 1. The pool of scored groups, sampled at version 0 (the bf16 rounding, as generators serve).
    t0 = time.perf_counter()
    sampler = TransformersBackend(model_dir)
    sampler.load_weights(sampler.host_bits())
    tasks, requests = arithmetic_requests(sampler, args.pool_groups, args.group_size, args.max_new_tokens)
    pool: list[rollout_pb2.RolloutGroup] = []
    rewards_all = []
    for task, request, group in zip(tasks, requests, sampler.sample(requests)):
        rewards = [arithmetic_answer(s.text, task.answer) for s in group]
        rewards_all.extend(rewards)
        completions = [
            rollout_pb2.Completion(token_ids=s.token_ids, behaviour_logprobs=s.logprobs, reward=r)
            for s, r in zip(group, rewards)
        ]
        pool.append(rollout_pb2.RolloutGroup(prompt_ids=request.prompt_ids, completions=completions, scored=True))
    tokenizer = sampler.tokenizer
    del sampler
    sample_s = time.perf_counter() - t0

    curves = []
    for lr in args.lrs:
        settings = TrainerSettings(lr=lr, max_new_tokens=args.max_new_tokens)
        step_config = StepConfig.from_settings(settings)
        model, _ = modeling.load_model(model_dir)
        model.train()
        params = modeling.named_weights(model)
        opt = HostAdamW(
            params,
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
            bucket_mb=settings.bucket_mb,
            moments_dtype=settings.moments_dtype,
            master_layout=settings.master_layout,
        )
        # Copies: in the split layout the bits are views of the masters, which each step rewrites.
        prev = {k: v.copy() for k, v in opt.sync_model().items()}
        fingerprint = deltas.model_fingerprint({k: v.shape for k, v in prev.items()})
        steps = []
        for step in range(1, args.steps + 1):
            first = (step - 1) * args.groups_per_step
            groups = [pool[g % len(pool)] for g in range(first, first + args.groups_per_step)]
            result = train_step(model, opt, groups, step_config, pad_id=tokenizer.pad_token_id)
            assert result.trained_bits is not None  # grpo trains every group
            grad_norm, bits = result.grad_norm, result.trained_bits
            t = time.perf_counter()
            _payload, stats = deltas.encode_delta(prev, bits, step - 1, step, fingerprint)
            encode_s = time.perf_counter() - t
            steps.append(
                {
                    "step": step,
                    "bytes": stats.nbytes,
                    "fraction_of_dense": round(stats.fraction_of_dense, 5),
                    "changed_values_fraction": round(stats.changed_values / stats.total_values, 5),
                    "changed_tensors": stats.changed_tensors,
                    "encodings": stats.encodings,
                    "grad_norm": round(grad_norm, 4),
                    "encode_s": round(encode_s, 2),
                }
            )
            print(json.dumps({"lr": lr, **steps[-1]}), flush=True)  # progress (stdout: JSON lines, then the result)
            prev = {k: v.copy() for k, v in bits.items()}
        fractions = [s["fraction_of_dense"] for s in steps]
        curves.append(
            {
                "lr": lr,
                "steps": steps,
                "first_step_fraction": fractions[0],
                "max_fraction_after_step_1": max(fractions[1:]) if len(fractions) > 1 else None,
                "mean_fraction_after_step_1": round(sum(fractions[1:]) / max(1, len(fractions) - 1), 5),
            }
        )
        del model, opt

    print(
        json.dumps(
            {
                "benchmark": "delta_size",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "model": model_dir,
                "parameters": sum(int(b.size) for b in prev.values()),
                "dense_bf16_bytes": sum(int(b.size) * 2 for b in prev.values()),
                "pool": {
                    "groups": len(pool),
                    "group_size": args.group_size,
                    "mean_reward": round(sum(rewards_all) / len(rewards_all), 3),
                    "sample_s": round(sample_s, 1),
                },
                "groups_per_step": args.groups_per_step,
                "curves": curves,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
