"""Reference stage throughput: tokens/s of ReferenceModel.logprobs.

    .venv/bin/python benchmarks/reference_throughput.py [--model PATH | --shape 0.5b] [--groups 16]
        [--threads 2] [--token-budgets 2048,8192] [--dtypes float32,bfloat16] [--device cuda]

The model is the demo's SmolLM2-135M-Instruct, a local folder (`--model`), or a Qwen2-shaped
model of a given size with random weights (`--shape 0.5b | 1.5b`, no download: the speed of
a forward does not depend on the values).

The workload is what the stage sees: groups of `group_size` completions sharing a chat
prompt of the demo's length, completions of 16-192 tokens (`--completion-tokens`). For each dtype, token budget
and `--share-prompts` setting: one warm-up call, then the median of `--repeats` timed calls over all sequences
(packing into micro-batches and the chunked LM head included). Also reports tokens per
CPU-second (process CPU time), which says more than wall time on a machine shared with
other work. Prints one JSON object; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch

from rollstream.core import modeling
from rollstream.core.models import resolve_model
from rollstream.reference.scoring import ReferenceModel, TokenPair, round_to_bf16_
from shapes import SIZES, build_model  # benchmarks/shapes.py


def workload(
    vocab: int, groups: int, group_size: int, prompt_tokens: int, completion_tokens: tuple[int, int], seed: int
) -> list[TokenPair]:
    rng = random.Random(seed)
    sequences: list[TokenPair] = []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(group_size):
            sequences.append((prompt, [rng.randrange(vocab) for _ in range(rng.randint(*completion_tokens))]))
    return sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct via resolve_model)"
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SIZES),
        default=None,
        help="a Qwen2-shaped model with random weights instead of --model",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--prompt-tokens", type=int, default=48, help="the demo prompt with SmolLM2's chat template is about this long"
    )
    parser.add_argument("--completion-tokens", default="16,192", help="MIN,MAX completion length (uniform)")
    parser.add_argument("--token-budgets", default="2048,8192")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--share-prompts",
        default="true",
        help="true, false, or both: the reference's shared-prompt path (KV cache per group)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = None if args.shape else resolve_model(args.model)

    def load(dtype: str, budget: int, share: bool) -> ReferenceModel:
        if model_dir is not None:
            return ReferenceModel.load(
                model_dir,
                dtype=dtype,
                device=args.device,
                token_budget=budget,
                chunk_tokens=args.chunk_tokens,
                share_prompts=share,
            )
        model = build_model(args.shape, torch.device(args.device), getattr(torch, dtype))
        round_to_bf16_(model)  # as the service does at load
        return ReferenceModel(model, pad_id=0, token_budget=budget, chunk_tokens=args.chunk_tokens, share_prompts=share)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    shares = {"true": [True], "false": [False], "both": [False, True]}[args.share_prompts]
    results = []
    for dtype in args.dtypes.split(","):
        for budget in (int(b) for b in args.token_budgets.split(",")):
            for share in shares:
                ref = load(dtype, budget, share)
                low, high = (int(x) for x in args.completion_tokens.split(","))
                sequences = workload(
                    ref.vocab_size, args.groups, args.group_size, args.prompt_tokens, (low, high), seed=0
                )
                lengths = [len(p) + len(c) for p, c in sequences]
                # Micro-batches: over all sequences, or per group when the prompt is shared.
                per = args.group_size if share else len(sequences)
                packed = [
                    b
                    for k in range(0, len(sequences), per)
                    for b in modeling.pack_by_tokens(lengths[k : k + per], budget)
                ]
                ref.logprobs(sequences[: args.group_size])  # warm-up (allocations, kernels)
                seconds, cpu_seconds = [], []
                for _ in range(args.repeats):
                    sync()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    ref.logprobs(sequences)  # returns Python floats: the device work is done
                    seconds.append(time.perf_counter() - start)
                    cpu_seconds.append(time.process_time() - cpu_start)
                s, cpu = statistics.median(seconds), statistics.median(cpu_seconds)
                tokens = sum(lengths)
                completion_tokens = sum(len(c) for _, c in sequences)
                results.append(
                    {
                        "dtype": dtype,
                        "token_budget": budget,
                        "share_prompts": share,
                        "micro_batches": len(packed),
                        "sequences": len(sequences),
                        "tokens": tokens,
                        "seconds": round(s, 3),
                        "tokens_per_s": round(tokens / s),
                        "completion_tokens_per_s": round(completion_tokens / s),
                        "cpu_seconds": round(cpu, 3),
                        "tokens_per_cpu_s": round(tokens / cpu),
                    }
                )
                del ref
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "benchmark": "reference_throughput",
                "model": f"qwen2-{args.shape} (random weights)" if args.shape else str(model_dir),
                "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(),
                "threads": args.threads,
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
