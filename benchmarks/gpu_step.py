"""A GRPO step on long sequences, with the optimizer on the host against one on the GPU, and
the largest model one step fits.

    python3 benchmarks/gpu_step.py step --size 1.5b --device cuda                 # tokens/s
    python3 benchmarks/gpu_step.py largest --device cuda --moments-dtype bfloat16  # what fits

`step`: one warm-up and `--repeats` timed GRPO steps (the trainer's own step.train_step) on
synthetic groups of `--sequences` sequences of `--seq-tokens` tokens (`--prompt-tokens` of
them prompt; random token ids, 0/1 rewards), one sequence per micro-batch (token_budget =
seq-tokens), activation checkpointing on, for three optimizers:
  host          HostAdamW: fp32 masters and moments in host memory, per bucket gradients
                down, fused CPU AdamW, bf16 weights up; the step's new bits on the host
                (what the trainer publishes) and the delta encoded on the way, on one
                thread (the trainer's default);
  host_offload  the same with grad_offload (gradients to the host during backward);
  resident      the baseline: fp32 masters and moments on the GPU, torch.optim.AdamW(fused=True)
                there, bf16 weights copied from the masters; no host bits, no delta (which
                flatters the baseline: publishing would add a 2-bytes-per-parameter copy).
Reports tokens/s per optimizer, the host runs' ratio to the resident one, and the GPU idle
fraction of each step: 1 - (time the GPU spent in forward/backward kernels, from CUDA events
on the compute stream) / step wall time. The optimizer phase is where a host step leaves
the GPU idle but for its copies; the events bracket whole phases, so the busy time is an
upper bound and the idle fraction a lower bound.

`largest`: for each size in `--sizes` (ascending) builds the model on the device and runs
one host step as above (two sequences of seq-tokens, one per micro-batch), stops at the first that runs out of
device or host memory, and reports for each: parameters, fit or why not, step time, peak
device memory (torch.cuda.max_memory_allocated) and peak resident host memory. Host memory
per parameter: fp32 master 4 + moments 8 (fp32) or 4 (bf16) + the published bits 2 and the
previous version's 2 (the delta's base), so 16 or 12 bytes; a 128 GiB machine holds at most
~8.5B parameters with fp32 moments and ~11B with bf16 moments (the trainer service also keeps
an anchor payload, 2 more bytes per parameter).

On a CPU device everything runs the same way (no resident baseline: there is no GPU), to
check the script at small sizes (--size 0.1b --seq-tokens 256 --dtype float32). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import devices  # benchmarks/devices.py
import numpy as np
import torch
from rollstream.core import deltas
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep, OnTensor
from rollstream.trainer.step import StepConfig, train_step
from rollstream.v1 import rollout_pb2
from shapes import SIZES, build_model, parameter_count  # benchmarks/shapes.py

LR, BETAS, WD = 1e-6, (0.9, 0.999), 0.0
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ResidentAdamW:
    """The GPU-resident baseline, with HostAdamW's interface as train_step uses it: fp32
    masters and moments on the device, torch's fused CUDA AdamW, torch's own clipping."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params
        self.master = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
        self.opt = torch.optim.AdamW(list(self.master.values()), lr=LR, betas=BETAS, weight_decay=WD, fused=True)

    def discard_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, max_grad_norm: float, on_tensor: OnTensor | None = None) -> tuple[float, dict[str, np.ndarray]]:
        for n, p in self.params.items():
            self.master[n].grad = None if p.grad is None else p.grad.float()
            p.grad = None
        masters = list(self.master.values())
        if max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm))
        else:
            norm = float(torch.nn.utils.get_total_norm([m.grad for m in masters if m.grad is not None]))
        if not np.isfinite(norm):
            self.opt.zero_grad(set_to_none=True)
            raise NonFiniteStep(f"gradient norm is {norm}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for n, p in self.params.items():
            p.copy_(self.master[n])
        return norm, {}


def synthetic_groups(sequences: int, seq_tokens: int, prompt_tokens: int, vocab: int, seed: int) -> list[rollout_pb2.RolloutGroup]:
    """Groups of 4 completions filling `seq_tokens` each; 0/1 rewards so every group has a signal."""
    rng = np.random.default_rng(seed)
    completion = seq_tokens - prompt_tokens
    groups = []
    for g, first in enumerate(range(0, sequences, 4)):
        size = min(4, sequences - first)
        completions = [
            rollout_pb2.Completion(
                token_ids=rng.integers(10, vocab, completion).tolist(),
                behaviour_logprobs=[-11.0] * completion,
                reward=float(i % 2),
            )
            for i in range(size)
        ]
        groups.append(rollout_pb2.RolloutGroup(group_id=f"g{g}", prompt_ids=rng.integers(10, vocab, prompt_tokens).tolist(), completions=completions, scored=True))
    return groups


def step_config(seq_tokens: int, device: torch.device) -> StepConfig:
    loss = LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0, tis_cap=0.0, max_completion_tokens=seq_tokens)
    return StepConfig(loss, token_budget=seq_tokens, chunk_tokens=1024, temperature=1.0, max_grad_norm=1.0, device=str(device))


def peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Marks:
    """CUDA events on the compute stream at the first forward of a step and at its optimizer
    call (after the last backward was queued); nothing off CUDA."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def first_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        if not self.events:
            self.mark()

    def busy_s(self) -> float | None:
        return self.events[0].elapsed_time(self.events[1]) / 1e3 if len(self.events) == 2 else None


class MarkedOptimizer:
    """`opt` as train_step uses it, marking the optimizer call first."""

    def __init__(self, opt: Any, marks: Marks):
        self.opt, self.marks = opt, marks

    def step(self, max_grad_norm: float, on_tensor: OnTensor | None = None) -> tuple[float, dict[str, np.ndarray]]:
        self.marks.mark()
        return self.opt.step(max_grad_norm, on_tensor)

    def discard_grads(self) -> None:
        self.opt.discard_grads()


def timed_steps(model: torch.nn.Module, opt: Any, groups: list[rollout_pb2.RolloutGroup], cfg: StepConfig, device: torch.device, repeats: int, pad_id: int, delta: bool) -> dict[str, Any]:
    """One warm-up and `repeats` timed steps. On CUDA the distance between the Marks is the
    GPU's busy span of the step (the micro-batches run back to back between them; an upper
    bound: kernels do not fill it completely). With `delta`, each step's delta is encoded on
    the way on one thread, as the trainer does by default (delta_encode_threads 1)."""
    cuda = device.type == "cuda"
    walls, idles, phases = [], [], []
    bits = None
    tokens = 0
    encode_pool = ThreadPoolExecutor(1, thread_name_prefix="delta")
    for i in range(repeats + 1):
        marks = Marks(cuda)
        encoder = deltas.DeltaEncoder(bits, i - 1, i, "bench", executor=encode_pool) if delta and bits is not None else None
        hook = model.get_decoder().register_forward_pre_hook(marks.first_forward)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            r = train_step(model, MarkedOptimizer(opt, marks), groups, cfg, pad_id=pad_id, on_tensor=encoder.add if encoder else None)  # type: ignore[arg-type]
            if encoder is not None:
                encoder.finish()
            if cuda:
                torch.cuda.synchronize(device)
        finally:
            hook.remove()
        wall = time.perf_counter() - start
        if delta and r.trained_bits:
            bits = {n: b.copy() for n, b in r.trained_bits.items()}  # the next delta's base
        if i == 0:
            continue  # warm-up
        walls.append(wall)
        tokens = r.train_tokens
        phases.append({"forward_s": round(r.forward_s, 3), "backward_s": round(r.backward_s, 3), "optimizer_s": round(r.optimizer_s, 3)})
        busy = marks.busy_s()
        if busy is not None:
            idles.append(1.0 - busy / wall)
    encode_pool.shutdown()
    median = float(np.median(walls))
    out: dict[str, Any] = {"step_s": round(median, 3), "tokens_per_s": round(tokens / median, 1), "phases": phases}
    if idles:
        out["gpu_idle_fraction"] = round(float(np.median(idles)), 3)
    return out


def build(size: str, device: torch.device, dtype: torch.dtype, grad_offload: bool, moments_dtype: str, resident: bool) -> tuple[torch.nn.Module, Any]:
    model = build_model(size, device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    params = dict(model.named_parameters())
    if resident:
        return model, ResidentAdamW(params)
    opt = HostAdamW(params, lr=LR, betas=BETAS, weight_decay=WD, moments_dtype=moments_dtype, grad_offload=grad_offload)  # type: ignore[arg-type]
    opt.sync_model()
    return model, opt


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_step(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    vocab = SIZES[args.size][5]
    groups = synthetic_groups(args.sequences, args.seq_tokens, args.prompt_tokens, vocab, seed=0)
    cfg = step_config(args.seq_tokens, device)
    results: dict[str, Any] = {}
    variants = [("host", False, False), ("host_offload", True, False)]
    if device.type == "cuda":
        variants.append(("resident", False, True))
    for name, offload, resident in variants:
        release(device)
        try:
            model, opt = build(args.size, device, DTYPES[args.dtype], offload, args.moments_dtype, resident)
            results[name] = timed_steps(model, opt, groups, cfg, device, args.repeats, pad_id=0, delta=not resident)
        except torch.OutOfMemoryError as e:
            results[name] = {"error": f"out of device memory: {str(e).splitlines()[0]}"}
        finally:
            model = opt = None  # noqa: F841  (free before the next variant)
    if "resident" in results and "tokens_per_s" in results["resident"]:
        for name in ("host", "host_offload"):
            if "tokens_per_s" in results.get(name, {}):
                results[f"{name}_over_resident"] = round(results[name]["tokens_per_s"] / results["resident"]["tokens_per_s"], 3)
    return {"size": args.size, "sequences": args.sequences, "seq_tokens": args.seq_tokens, **results}


def host_bytes_needed(parameters: int, moments_dtype: str) -> int:
    """HostAdamW's host memory: fp32 master, two moments, the new and the previous bits."""
    return parameters * (4 + (8 if moments_dtype == "float32" else 4) + 4)


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_largest(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rows = []
    for size in args.sizes.split(","):
        release(device)
        row: dict[str, Any] = {"size": size}
        vocab = SIZES[size][5]
        # Running out of host memory is a kill by the OOM killer, not an exception: decide
        # from the arithmetic first.
        need, have = host_bytes_needed(parameter_count(size), args.moments_dtype), available_host_bytes()
        row["host_gib_needed"] = round(need / 2**30, 1)
        if need > 0.95 * have:
            rows.append(row | {"fits": False, "why": f"host memory: the optimizer needs {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"})
            break
        try:
            model, opt = build(size, device, DTYPES[args.dtype], grad_offload=args.grad_offload, moments_dtype=args.moments_dtype, resident=False)
            row["parameters"] = sum(p.numel() for p in model.parameters())
            groups = synthetic_groups(2, args.seq_tokens, args.prompt_tokens, vocab, seed=0)  # one group of two: a signal
            start = time.perf_counter()
            train_step(model, opt, groups, step_config(args.seq_tokens, device), pad_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row |= {"fits": True, "step_s": round(time.perf_counter() - start, 2)}
        except torch.OutOfMemoryError as e:
            row |= {"fits": False, "why": f"device memory: {str(e).splitlines()[0]}"}
        except MemoryError as e:
            row |= {"fits": False, "why": f"host memory: {e}"}
        finally:
            model = opt = None  # noqa: F841
        if device.type == "cuda":
            row["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        row["peak_host_gib_so_far"] = round(peak_host_gib(), 2)
        rows.append(row)
        if not row["fits"]:
            break
    return {"moments_dtype": args.moments_dtype, "grad_offload": args.grad_offload, "seq_tokens": args.seq_tokens, "sizes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["step", "largest"])
    devices.add_argument(parser)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.5b", help="step: the model shape")
    parser.add_argument("--sizes", default="1.5b,3b,7b,14b", help="largest: shapes to try, ascending")
    parser.add_argument("--sequences", type=int, default=8, help="step: sequences a step")
    parser.add_argument("--seq-tokens", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="compute dtype (float32 to check the script on a CPU without fast bf16)")
    parser.add_argument("--moments-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--grad-offload", action="store_true", help="largest: with gradient offload")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = devices.resolve(args.device)
    result = run_step(args, device) if args.mode == "step" else run_largest(args, device)
    print(json.dumps({
        "benchmark": f"gpu_step/{args.mode}", **devices.info(device), "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2), **result,
    }, indent=2))


if __name__ == "__main__":
    main()
