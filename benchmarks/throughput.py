"""Generation and training throughput of the CPU code paths, on the demo model.

    .venv/bin/python benchmarks/throughput.py [--model PATH] [--completions 64] [--threads 2]

Prints one JSON object: generation tokens/s (transformers backend, the demo's sampling
settings) and training tokens/s (one GRPO step: log-probs, loss, backward, host AdamW,
delta encoding), each phase timed separately. Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from demo_task import arithmetic_requests  # benchmarks/demo_task.py
from rollstream.core import deltas, modeling
from rollstream.core.models import resolve_model
from rollstream.generator.backends import TransformersBackend
from rollstream.trainer import grpo
from rollstream.trainer.optimizer import HostAdamW


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))

    backend = TransformersBackend(model_dir)
    _, requests = arithmetic_requests(backend, args.completions // args.group_size, args.group_size, args.max_new_tokens)
    start = time.perf_counter()
    samples = backend.sample(requests)
    gen_s = time.perf_counter() - start
    gen_tokens = sum(len(s.token_ids) for group in samples for s in group)

    model, tokenizer = modeling.load_model(model_dir)
    model.train()
    params = modeling.named_weights(model)
    opt = HostAdamW(params, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    bits0 = opt.sync_model()
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits0.items()})
    sequences, behaviour, adv = [], [], []
    rng = torch.Generator().manual_seed(0)
    for request, group in zip(requests, samples):
        rewards = torch.randint(0, 2, (len(group),), generator=rng).float().tolist()
        for s, a in zip(group, grpo.group_advantages(rewards)):
            sequences.append((request.prompt_ids, s.token_ids))
            behaviour.extend(s.logprobs)
            adv.extend([a] * len(s.token_ids))
    start = time.perf_counter()
    batch = modeling.make_batch(sequences, tokenizer.pad_token_id)
    logp, _ = modeling.completion_logprobs(model, batch)
    lengths = torch.tensor(batch.lengths)
    seq = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    parts = grpo.grpo_loss(logp, torch.tensor(behaviour), torch.tensor(adv), seq, lengths, len(sequences), 0.2)
    forward_s = time.perf_counter() - start
    parts.loss.backward()
    backward_s = time.perf_counter() - start - forward_s
    t = time.perf_counter()
    _, bits1 = opt.step(1.0)
    optimizer_s = time.perf_counter() - t
    t = time.perf_counter()
    payload, stats = deltas.encode_delta(bits0, bits1, 0, 1, fingerprint)
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    deltas.decode(payload, bits0, 0, fingerprint)
    decode_s = time.perf_counter() - t
    train_tokens = int(batch.attention_mask.sum())
    step_s = forward_s + backward_s + optimizer_s + encode_s
    print(json.dumps({
        "benchmark": "throughput",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": args.threads,
        "model": model_dir,
        "parameters": sum(p.numel() for p in params.values()),
        "generation": {"completions": args.completions, "tokens": gen_tokens, "seconds": round(gen_s, 2), "tokens_per_s": round(gen_tokens / gen_s, 1)},
        "training": {
            "sequences": len(sequences), "tokens": train_tokens, "completion_tokens": int(lengths.sum()),
            "forward_s": round(forward_s, 2), "backward_s": round(backward_s, 2), "optimizer_s": round(optimizer_s, 2),
            "delta_encode_s": round(encode_s, 2), "delta_decode_s": round(decode_s, 2),
            "step_s": round(step_s, 2), "tokens_per_s": round(train_tokens / step_s, 1),
        },
        "delta": {"bytes": stats.nbytes, "dense_bf16_bytes": stats.dense_bytes, "fraction_of_dense": round(stats.fraction_of_dense, 4), "encodings": stats.encodings},
    }, indent=2))


if __name__ == "__main__":
    main()
