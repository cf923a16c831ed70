"""Generation tokens/s of one backend on the demo task's prompts, as the generator samples.

    .venv/bin/python benchmarks/generation_speed.py --backend transformers
    .venv-vllm/bin/python benchmarks/generation_speed.py --backend vllm [--enforce-eager]

The same prompts (the arithmetic task, seed 0), group size, temperature and token limit
for both, so the two JSON results compare directly. vLLM needs its own venv
(scripts/install_vllm.sh); the transformers backend runs in either. One warm-up batch
first (vLLM's first batch also compiles), then `--repeats` timed batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["transformers", "vllm"], required=True)
    parser.add_argument("--model", default=None, help="local HF folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vllm: no torch.compile (starts fast, samples slower)"
    )
    args = parser.parse_args()

    # vLLM logs to stdout by default; stdout is for the JSON result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch

    from rollstream.core.models import resolve_model
    from rollstream.generator.backends import Backend, SampleRequest, TransformersBackend
    from rollstream.trainer import prompts

    model_dir = str(resolve_model(args.model))
    start = time.perf_counter()
    backend: Backend
    if args.backend == "transformers":
        torch.set_num_threads(args.threads)
        backend = TransformersBackend(model_dir)
    else:
        from rollstream.generator.config import GeneratorSettings
        from rollstream.generator.vllm_backend import VllmBackend

        backend = VllmBackend(
            model_dir, GeneratorSettings(backend="vllm", enforce_eager=args.enforce_eager, threads=args.threads)
        )
    backend.load_weights(backend.host_bits(), version=0)  # as the generator does: version 0
    startup_s = time.perf_counter() - start

    source = prompts.arithmetic(seed=0)
    requests = [
        SampleRequest(
            backend.encode_chat(next(source).messages),
            args.group_size,
            args.temperature,
            1.0,
            0,
            args.max_new_tokens,
            seed=i,
        )
        for i in range(args.groups)
    ]
    t = time.perf_counter()
    backend.sample(requests)
    warmup_s = time.perf_counter() - t
    runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        samples = backend.sample(requests)
        seconds = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for group in samples for s in group)
        runs.append({"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)})
    best = max(r["tokens_per_s"] for r in runs)
    print(
        json.dumps(
            {
                "benchmark": "generation_speed",
                "backend": args.backend + (" (enforce_eager)" if args.backend == "vllm" and args.enforce_eager else ""),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "threads": args.threads,
                "model": model_dir,
                "completions": args.groups * args.group_size,
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature,
                "startup_s": round(startup_s, 1),
                "warmup_batch_s": round(warmup_s, 2),
                "runs": runs,
                "best_tokens_per_s": best,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
