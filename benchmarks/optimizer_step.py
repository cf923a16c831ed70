"""The trainer's optimizer step (HostAdamW: bucketed, fp32 masters and moments in host
memory) against the physical limit and against a naive per-parameter offload.

    .venv/bin/python benchmarks/optimizer_step.py --size 0.1b            # CPU (the default)
    .venv/bin/python benchmarks/optimizer_step.py --size 1.5b --device cuda
    .venv/bin/python benchmarks/optimizer_step.py --size 0.5b --master-layout fp32 --moments-dtype float32 --skip-baseline
    python3 benchmarks/optimizer_step.py --size 1.5b --device cuda --repeats 1 --skip-baseline --skip-delta-after   # GPU kit 1

Builds a Qwen2-style model from a config (random bf16 weights, no download) and random bf16
gradients, then times, in one run:
  offloaded   HostAdamW.step(): gradient norm + clip, per bucket D2H of the gradients, fused CPU
              AdamW on the fp32 masters, bf16 back H2D, the new published bits;
  + delta     the same step until the weight delta against the previous version is encoded,
              two ways: after the step (deltas.encode_delta over every tensor, on the
              caller's thread, as the trainer did) and on the way (each bucket's piece of
              each tensor handed to a DeltaEncoder, with its old bits, on `--encode-threads`
              threads as the bucket is stepped: HostAdamW.step's on_piece, what the trainer
              does now; --skip-delta-after leaves the first out: ~21 s a step at 1.5B on
              the H200, and no longer the trainer's way);
  limit       max(N / fused CPU AdamW rate, 2N bytes / pinned D2H rate, 2N bytes / pinned H2D
              rate), each rate measured here on large buffers: what perfect overlap could reach;
  baseline    LSRL-style: parameter by parameter, the gradient to a pageable fp32 copy, one
              torch.optim.AdamW (default implementation) per parameter on a pageable fp32 master,
              the bf16 result copied back; nothing overlapped.
On a CPU device there are no copies across a bus: the limit is the AdamW rate alone.
Prints one JSON object, which names the optimizer path that ran (`optimizer`: the split
layout's compiled kernel or torch operations, and the kernel's threads); docs/benchmarks.md
records results.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.optim.adamw import adamw as functional_adamw

import devices  # benchmarks/devices.py
import rollstream.trainer  # noqa: F401  before torch (devices imports it): sets OpenMP's passive wait policy, as in the trainer
from gpu_step import optimizer_path  # benchmarks/gpu_step.py
from rollstream.core import deltas
from rollstream.trainer.config import auto_encode_threads
from rollstream.trainer.optimizer import HostAdamW
from shapes import SIZES, build_model  # benchmarks/shapes.py


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], prepare: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    """Run prepare() then time fn(), `repeats` times after one warm-up."""
    times = []
    for i in range(repeats + 1):
        prepare()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return times


def adamw_rate(elements: int, repeats: int) -> float:
    """Parameters per second of torch's fused CPU AdamW on one large fp32 buffer."""
    p, g = torch.randn(elements), torch.randn(elements) * 1e-3
    m, v = torch.zeros(elements), torch.zeros(elements)
    step = torch.tensor(0.0)

    def run() -> None:
        functional_adamw(
            [p],
            [g],
            [m],
            [v],
            [],
            [step],
            fused=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=1e-5,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )

    times = timed(run, lambda: None, torch.device("cpu"), repeats)
    return elements / min(times)


def copy_rates(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """Bytes per second device-to-host and host-to-device with pinned host memory."""
    n = nbytes // 2
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), lambda: None, device, repeats)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), lambda: None, device, repeats)
    return nbytes / min(d2h), nbytes / min(h2d)


def make_grads(params: list[torch.nn.Parameter], seed: int) -> Callable[[], None]:
    gen = torch.Generator(device=params[0].device).manual_seed(seed)

    def prepare() -> None:
        for p in params:
            # In place: no second gradient-sized temporary per parameter.
            p.grad = torch.empty_like(p).normal_(0.0, 1e-3, generator=gen)

    return prepare


def baseline_step(
    params: list[torch.nn.Parameter], masters: list[torch.Tensor], opts: list[torch.optim.Optimizer]
) -> None:
    """LSRL-style: one parameter at a time, synchronous, pageable memory."""
    with torch.no_grad():
        for p, master, opt in zip(params, masters, opts, strict=True):
            assert p.grad is not None  # make_grads gave every parameter one
            master.grad = p.grad.to(device="cpu", dtype=torch.float32)
            opt.step()
            master.grad = None
            p.copy_(master.to(torch.bfloat16))
            p.grad = None


def time_offloaded(
    named: dict[str, torch.nn.Parameter], prepare: Callable[[], None], device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """The step alone, then the step with its delta encoded after it and on the way."""
    opt = HostAdamW(
        named,
        lr=1e-5,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        bucket_mb=args.bucket_mb,
        moments_dtype=args.moments_dtype,
        master_layout=args.master_layout,
        split_kernel=False if args.torch_split else None,
    )
    step_only = timed(lambda: opt.step(1.0), prepare, device, args.repeats)
    # The base of each delta. A copy: in the split layout the published bits are views of the
    # masters, which the step overwrites (the on-the-way encoder gets each piece's old bits
    # from the step itself and reads only names and shapes from its base).
    prev = {n: b.copy() for n, b in opt.published_bits().items()}
    stats: list[deltas.DeltaStats] = []

    def step_then_delta() -> None:
        _, bits = opt.step(1.0)
        stats.append(deltas.encode_delta(prev, bits, 0, 1, "bench")[1])

    def step_with_delta_on_the_way() -> None:
        encoder = deltas.DeltaEncoder(prev, 0, 1, "bench", executor=pool)
        opt.step(1.0, on_piece=encoder.add_piece)
        stats.append(encoder.finish()[1])

    def reset() -> None:
        prepare()
        for n, b in opt.published_bits().items():
            prev[n][...] = b  # each delta is one step's, as in the trainer

    after = [] if args.skip_delta_after else timed(step_then_delta, reset, device, args.repeats)
    with ThreadPoolExecutor(args.encode_threads) as pool:
        on_the_way = timed(step_with_delta_on_the_way, reset, device, args.repeats)
    last = stats[-1]
    return {
        "step_only": step_only,
        "step_then_delta": after,
        "step_with_delta_on_the_way": on_the_way,
        "buckets": len(opt.buckets),
        "split_kernel": opt.uses_split_kernel,
        "optimizer": optimizer_path(opt, args.master_layout, args.moments_dtype, False),
        "delta": {
            "bytes": last.nbytes,
            "fraction_of_dense": round(last.fraction_of_dense, 4),
            "changed_values": last.changed_values,
        },
    }


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="0.1b")
    devices.add_argument(parser)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument(
        "--encode-threads",
        type=int,
        default=0,
        help="delta encoder threads (0: the trainer's delta_encode_threads = auto, half the cores)",
    )
    parser.add_argument("--moments-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--master-layout",
        choices=["split", "fp32"],
        default="split",
        help="HostAdamW's master_layout (the trainer's default: split)",
    )
    parser.add_argument(
        "--torch-split", action="store_true", help="split layout: step with torch operations, not the compiled kernel"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--skip-baseline", action="store_true", help="the baseline needs another 12 bytes per parameter of host memory"
    )
    parser.add_argument(
        "--skip-delta-after",
        action="store_true",
        help="time the delta on the way only, not also encoded after the step",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = devices.resolve(args.device)
    args.encode_threads = args.encode_threads or auto_encode_threads(args.threads)

    model = build_model(args.size, device)
    named = dict(model.named_parameters())
    params = list(named.values())
    n = sum(p.numel() for p in params)
    prepare = make_grads(params, seed=1)

    # The limit's ingredients, measured on this machine.
    rate = adamw_rate(min(n, 64 * 2**20), args.repeats)
    adam_s = n / rate
    limit: dict[str, float | str | None] = {"adamw_params_per_s": round(rate), "adamw_s": round(adam_s, 4)}
    bound = {"adamw": adam_s}
    if device.type == "cuda":
        d2h, h2d = copy_rates(device, 256 * 2**20, args.repeats)
        bound["d2h"], bound["h2d"] = 2 * n / d2h, 2 * n / h2d
        limit |= {
            "d2h_GB_per_s": round(d2h / 1e9, 2),
            "h2d_GB_per_s": round(h2d / 1e9, 2),
            "d2h_s": round(bound["d2h"], 4),
            "h2d_s": round(bound["h2d"], 4),
        }
    limit_s = max(bound.values())
    limit |= {"limit_s": round(limit_s, 4), "bound_by": max(bound, key=lambda k: bound[k])}

    timings = time_offloaded(named, prepare, device, args)
    offloaded = timings["step_only"]
    gc.collect()  # its 12 bytes per parameter go before the baseline takes as much

    result = {
        "benchmark": "optimizer_step",
        "machine": machine(device),
        **devices.info(device),
        "threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),  # the machine may be shared
        "size": args.size,
        "parameters": n,
        "bucket_mb": args.bucket_mb,
        "buckets": timings["buckets"],
        "moments_dtype": args.moments_dtype,
        "master_layout": args.master_layout,
        "split_kernel": timings["split_kernel"],
        "optimizer": timings["optimizer"],
        "offloaded": {
            "median_s": round(statistics.median(offloaded), 4),
            "min_s": round(min(offloaded), 4),
            "params_per_s": round(n / statistics.median(offloaded)),
        },
        "limit": limit,
        "offloaded_over_limit": round(statistics.median(offloaded) / limit_s, 2),
        "encode_threads": args.encode_threads,
        "delta": timings["delta"],
        **{
            key: {"median_s": round(statistics.median(timings[key]), 4), "min_s": round(min(timings[key]), 4)}
            for key in ("step_then_delta", "step_with_delta_on_the_way")
            if timings[key]
        },
    }
    if not args.skip_baseline:
        masters = [p.detach().to(device="cpu", dtype=torch.float32) for p in params]
        opts: list[torch.optim.Optimizer] = [
            torch.optim.AdamW([m], lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0) for m in masters
        ]
        base = timed(lambda: baseline_step(params, masters, opts), prepare, device, args.repeats)
        result["baseline"] = {"median_s": round(statistics.median(base), 4), "min_s": round(min(base), 4)}
        result["baseline_over_offloaded"] = round(statistics.median(base) / statistics.median(offloaded), 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
