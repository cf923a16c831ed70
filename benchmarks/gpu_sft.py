"""SFT on one GPU at long sequences (issue 46): `rollstream sft`'s step (sft_step) on a model of
`--size` (benchmarks/shapes.py: Qwen2.5-14B's shape at 14b, random bf16 weights made on the
device), beside LSRL's table.

    python3 benchmarks/gpu_sft.py --size 14b --device cuda     # 4K, 8K, 18K, then the longest row

The step as `rollstream sft` runs it: split masters and bf16 moments on the host (HostAdamW;
`--grad-offload` where the host holds its 4 more bytes a parameter: not at 14B on 128 GiB),
activation checkpointing, the chunked LM head (`--chunk-tokens`), each row one example of
random tokens with every token trained, so attention is plain causal with no mask
(sft_data.packed_batch: SDPA's is_causal kernels), each row its own micro-batch (the token
budget is the row), the update overlapped with the next step's forward (sft_step background).

1. `--lengths` (4096,8192,18432): for each, a warm-up step of one row, then `--steps` steps of
   `--rows` rows each (LSRL's 4 accumulation steps). Reports tokens/s of the steps (the
   update's wait included), tokens/s of forward and backward alone (what many accumulation
   steps tend to, LSRL's 256), the phases (forward, backward, optimizer: sft_step's), peak
   device memory (max_memory_allocated, reset per length) and peak host RSS (VmHWM, reset per
   length).
2. `--longest` (32768,49152,65536,98304,131072): one step of one row at each, ascending, until
   one runs out of device memory (torch.OutOfMemoryError, caught: its gradients dropped, the
   row says so) or until the next would not finish in the time left (`--time-budget-s` since
   the process started; the next is guessed at (T'/T)^2 of the last step, attention's
   growth). `longest_trained` is the last length that stepped, and `stopped_by` says why the
   search ended (device memory, time, the list's end).

The result so far is printed (one JSON line) after each step, so a run cut at its time limit
still says where it was; the last object printed is the result. On a CPU device everything
runs the same way at small sizes (--size tiny --dtype float32 --lengths 64,128 --longest
256,512), to check the script. A host that cannot hold the optimizer is refused before any
allocation, with the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import devices  # benchmarks/devices.py
from gpu_step import (  # benchmarks/gpu_step.py: the model and the host optimizer as issue 44's runs build them
    DTYPES,
    HOST_FRACTION,
    available_host_bytes,
    build_model_for_step,
    host_optimizer,
    host_overhead_bytes,
    optimizer_path,
    peak_host_rss_gib,
    progress,
    release,
    since_start_s,
)
from host_memory import reset_peak_host  # benchmarks/host_memory.py
from rollstream.trainer.optimizer import HostAdamW, host_bytes_per_parameter
from rollstream.trainer.sft_data import PackedRow
from rollstream.trainer.sft_step import SftStepConfig, sft_step
from shapes import SIZES, parameter_count  # benchmarks/shapes.py

# LSRL's README: 14B SFT on one 80 GB A800 (tokens/s at 4 and at 256 accumulation steps); 18K
# with gradient offload. DeepSpeed ZeRO-2 ran out of memory at 18K there.
LSRL_A800 = {
    "4096": {"accumulation_4": 642, "accumulation_256": 1568},
    "18432": {"accumulation_4": 766, "accumulation_256": 1102, "grad_offload": True},
}
MAX_GRAD_NORM = 1.0  # SftSettings' (TRL's) default


def synthetic_rows(count: int, length: int, vocab: int, seed: int) -> list[PackedRow]:
    """`count` rows of one example of `length` random tokens, every token trained."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(count):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        rows.append(PackedRow(ids, list(ids), [length], [k]))
    return rows


def step_config(length: int, chunk_tokens: int, device: torch.device) -> SftStepConfig:
    """A row a micro-batch: the budget is the row's length."""
    return SftStepConfig(
        token_budget=length, chunk_tokens=chunk_tokens, max_grad_norm=MAX_GRAD_NORM, device=str(device)
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peaks(device: torch.device) -> str:
    release(device)  # also resets the device's peak
    return "this length" if reset_peak_host() else "the process so far"


def peaks(device: torch.device) -> dict[str, float]:
    out = {"peak_host_gib": round(peak_host_rss_gib(), 2)}
    if device.type == "cuda":
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_device_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    return out


def timed_steps(
    model: torch.nn.Module,
    opt: HostAdamW,
    steps: list[list[PackedRow]],
    cfg: SftStepConfig,
    device: torch.device,
) -> dict[str, Any]:
    """Back-to-back SFT steps as the command runs them (each update overlapped with the next
    step's forward), timed until the last update is in the model."""
    phases = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
    tokens = 0
    losses = []
    start = time.perf_counter()
    for rows in steps:
        r = sft_step(model, opt, rows, cfg, pad_id=0, background=True)
        for name in phases:
            phases[name] += getattr(r, name)
        tokens += r.train_tokens
        losses.append(round(r.loss, 4))
    opt.wait()
    sync(device)
    seconds = time.perf_counter() - start
    fwd_bwd = phases["forward_s"] + phases["backward_s"]
    return {
        "steps": len(steps),
        "rows_a_step": len(steps[0]),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "forward_backward_tokens_per_s": round(tokens / fwd_bwd, 1) if fwd_bwd > 0 else None,
        **{k: round(v / len(steps), 2) for k, v in phases.items()},  # a step's
        "losses": losses,
    }


def run_lengths(
    model: torch.nn.Module, opt: HostAdamW, args: argparse.Namespace, device: torch.device, result: dict[str, Any]
) -> None:
    vocab = SIZES[args.size][5]
    for length in map(int, args.lengths.split(",")):
        row: dict[str, Any] = {"length": length, "peak_host_is": reset_peaks(device)}
        result["lengths"].append(row)
        cfg = step_config(length, args.chunk_tokens, device)
        start = time.perf_counter()
        sft_step(model, opt, synthetic_rows(1, length, vocab, seed=length), cfg, pad_id=0, background=True)
        opt.wait()
        sync(device)
        row["warmup_s"] = round(time.perf_counter() - start, 2)
        steps = [synthetic_rows(args.rows, length, vocab, seed=length + 1 + s) for s in range(args.steps)]
        row |= timed_steps(model, opt, steps, cfg, device)
        row |= peaks(device)
        lsrl = LSRL_A800.get(str(length))
        if lsrl is not None:
            row["of_lsrl_accumulation_4"] = round(row["tokens_per_s"] / lsrl["accumulation_4"], 3)
        progress(result, f"{length} tokens: {row['tokens_per_s']} tokens/s")


def run_longest(
    model: torch.nn.Module, opt: HostAdamW, args: argparse.Namespace, device: torch.device, result: dict[str, Any]
) -> None:
    """One step of one row at each length, ascending, until device memory or time runs out."""
    vocab = SIZES[args.size][5]
    search: dict[str, Any] = {"tried": [], "longest_trained": None, "stopped_by": "the list's end"}
    result["longest"] = search
    last: tuple[int, float] | None = None
    for length in map(int, args.longest.split(",")):
        left = args.time_budget_s - since_start_s()
        guess = last[1] * (length / last[0]) ** 2 if last else 0.0
        if guess > left:
            search["stopped_by"] = f"time: {length} tokens would take ~{guess:.0f} s, {left:.0f} s left"
            break
        row: dict[str, Any] = {"length": length, "peak_host_is": reset_peaks(device)}
        search["tried"].append(row)
        try:
            row |= timed_steps(
                model,
                opt,
                [synthetic_rows(1, length, vocab, seed=length)],
                step_config(length, args.chunk_tokens, device),
                device,
            )
        except torch.OutOfMemoryError as e:
            opt.discard_grads()  # a backward cut short leaves some: the next step must not add to them
            row |= {"fits": False, "why": f"device memory: {str(e).splitlines()[0]}"}
            row |= peaks(device)
            search["stopped_by"] = f"device memory at {length} tokens"
            progress(result, f"longest: {length} tokens does not fit")
            break
        row |= {"fits": True, **peaks(device)}
        search["longest_trained"] = length
        last = (length, row["seconds"])
        progress(result, f"longest: {length} tokens stepped in {row['seconds']} s")


def host_check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Whether the host holds the optimizer, from the arithmetic (as gpu_step.py largest)."""
    parameters = parameter_count(args.size)
    per_parameter = host_bytes_per_parameter("split", "bfloat16", args.grad_offload)
    need = parameters * per_parameter + host_overhead_bytes(device, parameters, dtype)
    have = available_host_bytes()
    out: dict[str, Any] = {
        "parameters": parameters,
        "host_bytes_per_parameter": per_parameter,
        "host_gib_needed": round(need / 2**30, 2),
        "host_gib_available": round(have / 2**30, 1),
        "fits_host": need <= HOST_FRACTION * have,
    }
    if not out["fits_host"]:
        out["why"] = (
            f"host memory: {need / 2**30:.1f} GiB needed ({per_parameter} bytes a parameter with the process), "
            f"{have / 2**30:.1f} GiB available"
            + ("; without --grad-offload it is 4 bytes a parameter less" if args.grad_offload else "")
        )
    return out


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    result: dict[str, Any] = {
        "size": args.size,
        "dtype": args.dtype,
        "master_layout": "split",
        "moments_dtype": "bfloat16",
        "grad_offload": args.grad_offload,
        "activation_checkpointing": True,
        "chunk_tokens": args.chunk_tokens,
        "attention": "causal, no mask (one example a row)",
        "lsrl_a800": LSRL_A800,
        "lengths": [],
    }
    result |= host_check(args, device, dtype)
    if not result["fits_host"]:
        progress(result, f"{args.size}: the host cannot hold the optimizer")
        return result
    start = time.perf_counter()
    model = build_model_for_step(args.size, device, dtype)
    sync(device)
    result["model_init_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    opt = host_optimizer(model, args.grad_offload, "bfloat16", "split", sync=dtype != torch.bfloat16)
    result["optimizer_init_s"] = round(time.perf_counter() - start, 2)
    result["optimizer"] = optimizer_path(opt, "split", "bfloat16", args.grad_offload)
    progress(result, f"{args.size}: model and host optimizer built")
    run_lengths(model, opt, args, device, result)
    if args.longest:
        run_longest(model, opt, args, device, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    devices.add_argument(parser)
    parser.add_argument("--size", choices=sorted(SIZES), default="14b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the model's weights")
    parser.add_argument("--lengths", default="4096,8192,18432", help="row lengths timed, in tokens")
    parser.add_argument("--rows", type=int, default=4, help="rows a step: accumulation steps (LSRL's 4)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps a length, after one warm-up step")
    parser.add_argument(
        "--longest", default="32768,49152,65536,98304,131072", help="lengths tried ascending for the longest ('': none)"
    )
    parser.add_argument("--time-budget-s", type=float, default=480.0, help="no longest try past this (process seconds)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="LM-head rows at a time (SftSettings' default)")
    parser.add_argument("--grad-offload", action="store_true", help="gradients to the host during backward")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rows < 1 or args.steps < 1:
        parser.error("--rows and --steps: at least 1")
    device = devices.resolve(args.device)
    result = run(args, device)
    print(
        json.dumps(
            {
                "benchmark": "gpu_sft",
                **devices.info(device),
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "load_average_1min": round(os.getloadavg()[0], 2),
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
