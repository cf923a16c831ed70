"""Generation and training throughput of the CPU code paths, on the demo model.

    .venv/bin/python benchmarks/throughput.py [--model PATH] [--completions 64] [--threads 2]
    python3 benchmarks/throughput.py --device cuda --dtype bfloat16 --size 1.5b [--grad-offload]

Prints one JSON object: generation tokens/s (transformers backend, the demo's sampling
settings) and training tokens/s (one GRPO step, the trainer's own step.train_step with the
trainer's default settings: log-probs, loss, backward, host AdamW; then delta encoding),
each phase timed separately; on a GPU after one untimed batch and step (CUDA's start). Results
go to docs/benchmarks.md.

--size (a shape from shapes.py) swaps the model for a Qwen2-shaped one with random weights
(no download), written to a temp folder with --model's tokenizer and loaded from there like
any checkpoint; the prompts are then --model's tokens, the completions random weights' samples.
--grad-offload sets the trainer's grad_offload (gradients to host memory during backward).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch

import devices  # benchmarks/devices.py
from demo_task import arithmetic_requests  # benchmarks/demo_task.py
from rollstream.core import deltas, modeling
from rollstream.core.models import resolve_model
from rollstream.generator.backends import TransformersBackend
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.step import StepConfig, train_step
from rollstream.v1 import rollout_pb2
from shapes import SIZES, build_model  # benchmarks/shapes.py


def sized_model_dir(size: str, tokenizer_dir: str, dtype: str) -> str:
    """A temp model folder: a random-weight Qwen2 of `size` and the tokenizer of `tokenizer_dir`."""
    from transformers import AutoTokenizer

    out = tempfile.mkdtemp(prefix=f"throughput-{size}-")
    model = build_model(size, torch.device("cpu"), modeling.DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    devices.add_argument(parser)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype of generation and training (the demo's: float32)",
    )
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="a random-weight Qwen2 of this shape instead of --model's weights",
    )
    parser.add_argument("--grad-offload", action="store_true", help="the trainer's grad_offload setting")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = devices.resolve(args.device)
    model_dir = str(resolve_model(args.model))
    tmp_dir = None
    if args.size:
        model_dir = tmp_dir = sized_model_dir(args.size, model_dir, args.dtype)
    try:
        run(args, device, model_dir)
    finally:
        if tmp_dir:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def run(args: argparse.Namespace, device: torch.device, model_dir: str) -> None:
    backend = TransformersBackend(model_dir, dtype=args.dtype, device=str(device))
    _, requests = arithmetic_requests(
        backend, args.completions // args.group_size, args.group_size, args.max_new_tokens
    )
    # On a GPU the first batch and the first step of a process pay for CUDA's start (kernels
    # loaded, cuBLAS handles, the caching allocator): each is run once untimed before.
    warm = device.type == "cuda"
    if warm:
        backend.sample(requests[:1])
    start = time.perf_counter()
    samples = backend.sample(requests)
    gen_s = time.perf_counter() - start
    gen_tokens = sum(len(s.token_ids) for group in samples for s in group)

    # The trainer's step with the trainer's defaults (TrainerSettings), on random 0/1 rewards.
    settings = TrainerSettings(
        max_new_tokens=args.max_new_tokens, device=str(device), dtype=args.dtype, grad_offload=args.grad_offload
    )
    del backend  # its weights on the device are not needed for training
    model, tokenizer = modeling.load_model(model_dir, dtype=settings.dtype, device=settings.device)
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
        grad_offload=settings.grad_offload,
    )
    bits = opt.sync_model()
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits.items()})
    rng = torch.Generator().manual_seed(0)
    groups = []
    for request, group in zip(requests, samples):
        rewards = torch.randint(0, 2, (len(group),), generator=rng).float().tolist()
        completions = [
            rollout_pb2.Completion(token_ids=s.token_ids, behaviour_logprobs=s.logprobs, reward=r)
            for s, r in zip(group, rewards)
        ]
        groups.append(rollout_pb2.RolloutGroup(prompt_ids=request.prompt_ids, completions=completions, scored=True))
    config = StepConfig.from_settings(settings)
    if warm:
        warm_step = train_step(model, opt, groups, config, pad_id=tokenizer.pad_token_id)
        assert warm_step.trained_bits is not None  # grpo trains every group
        bits = warm_step.trained_bits
    # A copy: in the split layout the bits are views of the masters, which the step rewrites.
    bits0 = {k: v.copy() for k, v in bits.items()}
    result = train_step(model, opt, groups, config, pad_id=tokenizer.pad_token_id)
    assert result.trained_bits is not None  # grpo trains every group
    t = time.perf_counter()
    payload, stats = deltas.encode_delta(bits0, result.trained_bits, 0, 1, fingerprint)
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    deltas.decode(payload, bits0, 0, fingerprint)
    decode_s = time.perf_counter() - t
    step_s = result.forward_s + result.backward_s + result.optimizer_s + encode_s
    print(
        json.dumps(
            {
                "benchmark": "throughput",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                **devices.info(device),
                "threads": args.threads,
                "model": model_dir if not args.size else f"random-weight Qwen2 {args.size} (shapes.py)",
                "dtype": args.dtype,
                "grad_offload": args.grad_offload,
                "parameters": sum(p.numel() for p in params.values()),
                "generation": {
                    "completions": args.completions,
                    "tokens": gen_tokens,
                    "seconds": round(gen_s, 2),
                    "tokens_per_s": round(gen_tokens / gen_s, 1),
                },
                "training": {
                    "sequences": result.completions,
                    "tokens": result.train_tokens,
                    "completion_tokens": result.tokens,
                    "forward_s": round(result.forward_s, 2),
                    "backward_s": round(result.backward_s, 2),
                    "optimizer_s": round(result.optimizer_s, 2),
                    "delta_encode_s": round(encode_s, 2),
                    "delta_decode_s": round(decode_s, 2),
                    "step_s": round(step_s, 2),
                    "tokens_per_s": round(result.train_tokens / step_s, 1),
                },
                "delta": {
                    "bytes": stats.nbytes,
                    "dense_bf16_bytes": stats.dense_bytes,
                    "fraction_of_dense": round(stats.fraction_of_dense, 4),
                    "encodings": stats.encodings,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
