"""A GRPO step on long sequences, with the optimizer on the host against one on the GPU, and
the largest model one step fits.

    python3 benchmarks/gpu_step.py step --size 1.5b --device cuda                 # tokens/s
    python3 benchmarks/gpu_step.py largest --device cuda --moments-dtype bfloat16  # what fits
    python3 benchmarks/gpu_step.py largest --device cuda --moments-dtype bfloat16 --sizes 14b  # 14B, 8 bytes a parameter

`step`: one warm-up and `--repeats` timed GRPO steps (the trainer's own step.train_step) on
synthetic groups of `--sequences` sequences of `--seq-tokens` tokens (`--prompt-tokens` of
them prompt; random token ids, 0/1 rewards), one sequence per micro-batch (token_budget =
seq-tokens), activation checkpointing on, for three optimizers:
  host          HostAdamW: masters (`--master-layout`, split by default) and moments in host
                memory, per bucket gradients down, fused CPU AdamW, bf16 weights up; the
                step's new bits on the host (what the trainer publishes) and the delta encoded
                on the way (on_piece: DeltaEncoder.add_piece), on the trainer's default
                number of threads (delta_encode_threads = auto: half the cores);
  host_offload  the same with grad_offload (gradients to the host during backward);
  resident      the baseline: fp32 masters and moments on the GPU, torch.optim.AdamW(fused=True)
                there, bf16 weights copied from the masters; no host bits, no delta (which
                flatters the baseline: publishing would add a 2-bytes-per-parameter copy).
Reports tokens/s per optimizer, the host runs' ratio to the resident one, and the GPU idle
fraction of each step: 1 - (time the GPU spent in forward/backward kernels, from CUDA events
on the compute stream) / step wall time. The optimizer phase is where a host step leaves
the GPU idle but for its copies; the events bracket whole phases, so the busy time is an
upper bound and the idle fraction a lower bound.

`largest`: for each size in `--sizes` (ascending) decides from the arithmetic whether the
host holds the optimizer: optimizer.host_bytes_per_parameter(--master-layout, --moments-dtype,
--grad-offload) a parameter, plus what the process will still take (on a GPU up to
HOST_OVERHEAD_BYTES in all), within HOST_FRACTION of MemAvailable (running out of host memory
is a kill, not an exception). Then it builds the model straight on the device in --dtype
(random, nothing of it on the host), the host optimizer over it (which reads the parameters
a bucket at a time), and runs one GRPO step of 2 sequences of --seq-tokens (one per
micro-batch, activation checkpointing); it stops at the first size that does not fit. Host
bytes a parameter (split / fp32 master layout): 8 / 12 with bf16 moments, 12 / 16 with fp32
ones (+4 with gradient offload): with the 123 GiB the GPU machines had available, ~15.4B
parameters (Qwen2.5-14B has 14.77B) in the split layout with bf16 moments, ~10B in the fp32
one. Reports for each size: parameters, host GiB needed and available, fits or why not, the
phases' times (model init, optimizer init, the step and its forward / backward / optimizer),
tokens/s, peak host resident set (VmHWM, reset before each size) and peak device memory
(torch.cuda.max_memory_allocated), and a timeline: seconds since the process started at the
end of each phase. The result so far is printed (one JSON line) after every phase, so a run
cut at its time limit still says where it was; the last object printed is the result.

On a CPU device everything runs the same way (no resident baseline: there is no GPU), to
check the script at small sizes (--size tiny --seq-tokens 128 --dtype float32). Prints JSON
(`largest`: a line per phase, then the result).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import devices  # benchmarks/devices.py
from host_memory import reset_peak_host  # benchmarks/host_memory.py
import numpy as np
import torch
from rollstream.core import deltas
from rollstream.trainer.config import auto_encode_threads
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW, MasterLayout, NonFiniteStep, OnPiece, host_bytes_per_parameter
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
    def step(self, max_grad_norm: float, on_piece: OnPiece | None = None) -> tuple[float, dict[str, np.ndarray]]:
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
    return StepConfig(loss, token_budget=seq_tokens, chunk_tokens=1024, temperature=1.0, max_grad_norm=1.0, device=str(device), share_prompts=False)


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

    def step(self, max_grad_norm: float, on_piece: OnPiece | None = None) -> tuple[float, dict[str, np.ndarray]]:
        self.marks.mark()
        return self.opt.step(max_grad_norm, on_piece)

    def discard_grads(self) -> None:
        self.opt.discard_grads()


def delta_base(opt: HostAdamW) -> dict[str, np.ndarray]:
    """The delta encoder's base. With on_piece the optimizer hands over each piece's old bits
    (HostAdamW.step), so the encoder reads only the base's names and shapes: zero-byte
    stand-ins of the right shapes, not a 2-bytes-a-parameter copy of the previous version."""
    return {name: np.broadcast_to(np.uint16(0), shape) for name, (_off, _n, shape) in opt.layout.items()}


def timed_steps(model: torch.nn.Module, opt: Any, groups: list[rollout_pb2.RolloutGroup], cfg: StepConfig, device: torch.device, repeats: int, pad_id: int, delta: bool) -> dict[str, Any]:
    """One warm-up and `repeats` timed steps. On CUDA the distance between the Marks is the
    GPU's busy span of the step (the micro-batches run back to back between them; an upper
    bound: kernels do not fill it completely). With `delta`, each step's delta is encoded on
    the way (on_piece: DeltaEncoder.add_piece) on as many threads as the trainer's default
    (delta_encode_threads = auto: half the cores torch has)."""
    cuda = device.type == "cuda"
    walls, idles, phases = [], [], []
    base = delta_base(opt) if delta else None
    tokens = 0
    encode_pool = ThreadPoolExecutor(auto_encode_threads(torch.get_num_threads()), thread_name_prefix="delta")
    for i in range(repeats + 1):
        marks = Marks(cuda)
        encoder = deltas.DeltaEncoder(base, i, i + 1, "bench", executor=encode_pool) if base is not None else None
        hook = model.get_decoder().register_forward_pre_hook(marks.first_forward)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            r = train_step(model, MarkedOptimizer(opt, marks), groups, cfg, pad_id=pad_id, on_piece=encoder.add_piece if encoder else None)  # type: ignore[arg-type]
            if encoder is not None:
                encoder.finish()
            if cuda:
                torch.cuda.synchronize(device)
        finally:
            hook.remove()
        wall = time.perf_counter() - start
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


def build_model_for_step(size: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model, random, allocated once on `device` in `dtype` (shapes.build_model: built on
    meta, then N(0, 0.02) drawn on the device; no host copy), set up to train with activation
    checkpointing."""
    model = build_model(size, device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def host_optimizer(model: torch.nn.Module, grad_offload: bool, moments_dtype: str, master_layout: MasterLayout, sync: bool = True) -> HostAdamW:
    """HostAdamW over the model's parameters (it reads them a bucket at a time: no whole fp32
    copy of the model on the host). `sync`: write the served bits into the model. Not needed
    where the parameters are bf16 already: the masters are then exactly the weights, whose bf16
    rounding in either layout is the weights themselves."""
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD, moments_dtype=moments_dtype,  # type: ignore[arg-type]
                    master_layout=master_layout, grad_offload=grad_offload)
    if sync:
        opt.sync_model()
    return opt


def build(size: str, device: torch.device, dtype: torch.dtype, grad_offload: bool, moments_dtype: str, resident: bool, master_layout: MasterLayout = "split") -> tuple[torch.nn.Module, Any]:
    model = build_model_for_step(size, device, dtype)
    if resident:
        return model, ResidentAdamW(dict(model.named_parameters()))
    return model, host_optimizer(model, grad_offload, moments_dtype, master_layout)


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
            model, opt = build(args.size, device, DTYPES[args.dtype], offload, args.moments_dtype, resident, args.master_layout)
            results[name] = timed_steps(model, opt, groups, cfg, device, args.repeats, pad_id=0, delta=not resident)
        except torch.OutOfMemoryError as e:
            results[name] = {"error": f"out of device memory: {str(e).splitlines()[0]}"}
        finally:
            model = opt = None  # noqa: F841  (free before the next variant)
    if "resident" in results and "tokens_per_s" in results["resident"]:
        for name in ("host", "host_offload"):
            if "tokens_per_s" in results.get(name, {}):
                results[f"{name}_over_resident"] = round(results[name]["tokens_per_s"] / results["resident"]["tokens_per_s"], 3)
    return {"size": args.size, "sequences": args.sequences, "seq_tokens": args.seq_tokens, "master_layout": args.master_layout,
            "moments_dtype": args.moments_dtype, **results}


# What `largest` adds to the optimizer's arithmetic before deciding a size fits, on a GPU: the
# process itself (CUDA context, torch and its libraries, staging buffers, the step's host
# tensors), measured at 7B on the H200 (87.1 GiB peak against 85.1 GiB of optimizer state;
# docs/benchmarks.md); and at most this fraction of MemAvailable (the rest is for the kernel
# and page cache).
HOST_OVERHEAD_BYTES = 2 * 2**30
HOST_FRACTION = 0.95


def host_overhead_bytes(device: torch.device, parameters: int, dtype: torch.dtype) -> int:
    """What the process will still take beside the optimizer (MemAvailable leaves out what it
    holds already): on a GPU the rest of the measured HOST_OVERHEAD_BYTES; on the CPU the
    model's weights and gradients, which are in host memory there."""
    if device.type == "cuda":
        return max(0, HOST_OVERHEAD_BYTES - resident_bytes())
    return 2 * parameters * torch.finfo(dtype).bits // 8


def resident_bytes() -> int:
    """VmRSS: this process's resident set now."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def since_start_s() -> float:
    """Seconds since this process started (interpreter start and imports included), from
    /proc/self/stat; since this module was imported where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def peak_host_rss_gib() -> float:
    """VmHWM: the peak resident set (since the last reset_peak_host)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return peak_host_gib()


def progress(result: dict[str, Any], what: str) -> None:
    """The result so far as one JSON line on stdout (a kit check cut at its cap keeps the last
    such line: scripts/gpu_kit/checks.py partial_result), and a line on stderr."""
    print(json.dumps({"progress": what, **result}), flush=True)
    print(f"[{since_start_s():7.1f} s] {what}", file=sys.stderr, flush=True)


def sample_colocated(model: torch.nn.Module, args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, Any]:
    """After the step, sampling from the trained model itself as the colocated generator does
    (TransformersBackend.sharing: no second copy of the weights; issue 31): --sample-rows
    completions in groups of 8 of --sample-tokens each, from random prompts of --prompt-tokens,
    temperature 1. Tokens/s of the whole batch, prefill included."""
    from transformers import AutoTokenizer

    from rollstream.generator.backends import SampleRequest, TransformersBackend

    backend = TransformersBackend.sharing(model, AutoTokenizer.from_pretrained(args.tokenizer))
    g = torch.Generator().manual_seed(1)
    group = min(8, args.sample_rows)
    requests = [SampleRequest(torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist(), group, 1.0, 1.0, 0, args.sample_tokens, seed=i)
                for i in range(max(1, args.sample_rows // group))]
    start = time.perf_counter()
    samples = backend.sample(requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(x.token_ids) for grp in samples for x in grp)
    return {"rows": len(requests) * group, "prompt_tokens": args.prompt_tokens, "new_tokens": args.sample_tokens, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def run_largest(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """For each size, ascending, until one does not fit: decide from the arithmetic whether the
    host holds the optimizer (running out of host memory is a kill by the OOM killer, not an
    exception), then build the model on the device, the host optimizer, and run one step.
    Each row's `timeline` holds the seconds since the process started at the end of each phase
    (model, optimizer, step), and the result so far is printed after each: a run cut short
    still says where it was."""
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    per_parameter = host_bytes_per_parameter(args.master_layout, args.moments_dtype, args.grad_offload)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "master_layout": args.master_layout, "moments_dtype": args.moments_dtype, "grad_offload": args.grad_offload,
        "host_bytes_per_parameter": per_parameter, "host_fraction": HOST_FRACTION, "dtype": args.dtype,
        "sequences": 2, "seq_tokens": args.seq_tokens, "activation_checkpointing": True, "sizes": rows,
    }
    for size in args.sizes.split(","):
        release(device)
        row: dict[str, Any] = {"size": size}
        timeline: dict[str, float] = {"start": round(since_start_s(), 1)}
        row["timeline"] = timeline
        rows.append(row)
        parameters = parameter_count(size)  # on meta: nothing allocated
        timeline["counted"] = round(since_start_s(), 1)
        optimizer_bytes = parameters * per_parameter
        overhead = host_overhead_bytes(device, parameters, dtype)
        need, have = optimizer_bytes + overhead, available_host_bytes()
        row |= {"parameters": parameters, "host_gib_optimizer": round(optimizer_bytes / 2**30, 2), "host_gib_needed": round(need / 2**30, 2),
                "host_gib_available": round(have / 2**30, 1)}
        if need > HOST_FRACTION * have:
            row |= {"fits": False, "why": f"host memory: {need / 2**30:.1f} GiB more needed ({per_parameter} bytes a parameter and "
                    f"{overhead / 2**30:.1f} GiB for the process), {have / 2**30:.1f} GiB available"}
            progress(result, f"{size}: does not fit the host")
            break
        row["peak_host_is"] = "this size" if reset_peak_host() else "the process so far"
        model = opt = r = None
        try:
            start = time.perf_counter()
            model = build_model_for_step(size, device, dtype)
            if cuda:
                torch.cuda.synchronize(device)
            row["model_init_s"] = round(time.perf_counter() - start, 2)
            timeline["model"] = round(since_start_s(), 1)
            progress(result, f"{size}: model built on {device}")
            start = time.perf_counter()
            opt = host_optimizer(model, args.grad_offload, args.moments_dtype, args.master_layout, sync=dtype != torch.bfloat16)
            row["optimizer_init_s"] = round(time.perf_counter() - start, 2)
            row["buckets"] = len(opt.buckets)
            timeline["optimizer"] = round(since_start_s(), 1)
            progress(result, f"{size}: host optimizer built")
            groups = synthetic_groups(2, args.seq_tokens, args.prompt_tokens, SIZES[size][5], seed=0)  # one group of two: a signal
            start = time.perf_counter()
            r = train_step(model, opt, groups, step_config(args.seq_tokens, device), pad_id=0)
            if cuda:
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - start
            timeline["step"] = round(since_start_s(), 1)
            row |= {
                "fits": True, "step_s": round(step_s, 2), "train_tokens": r.train_tokens, "tokens_per_s": round(r.train_tokens / step_s, 1),
                "phases": {"forward_s": round(r.forward_s, 2), "backward_s": round(r.backward_s, 2), "optimizer_s": round(r.optimizer_s, 2)},
                "grad_norm": round(r.grad_norm, 4),
            }
            if args.sample_tokens:
                progress(result, f"{size}: stepped; sampling from the same model")
                row["sampling"] = sample_colocated(model, args, SIZES[size][5], device)
                timeline["sampling"] = round(since_start_s(), 1)
        except torch.OutOfMemoryError as e:
            row |= {"fits": False, "why": f"device memory: {str(e).splitlines()[0]}"}
        except MemoryError as e:
            row |= {"fits": False, "why": f"host memory: {e}"}
        row["peak_host_gib"] = round(peak_host_rss_gib(), 2)
        if cuda:
            row["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            row["peak_device_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        progress(result, f"{size}: {'stepped' if row['fits'] else 'does not fit: ' + row['why']}")
        # Freeing ~100 GiB of host memory takes seconds: after the row is out. The step's bits
        # are views of the optimizer's (split layout): they go too.
        model = opt = r = None  # noqa: F841
        if not row["fits"]:
            break
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["step", "largest"])
    devices.add_argument(parser)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.5b", help="step: the model shape")
    parser.add_argument("--sizes", default="1.5b,3b,7b,14b", help="largest: shapes to try, ascending")
    parser.add_argument("--sequences", type=int, default=8, help="step: sequences a step")
    parser.add_argument("--seq-tokens", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--sample-tokens", type=int, default=0, help="largest: after the step, sample this many tokens a row from the same model (colocated; 0: no sampling)")
    parser.add_argument("--sample-rows", type=int, default=64, help="largest: rows sampled (groups of 8)")
    parser.add_argument("--tokenizer", default="", help="largest with --sample-tokens: a tokenizer folder (its eos and pad ids; the kit's demo tokenizer)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="compute dtype (float32 to check the script on a CPU without fast bf16)")
    parser.add_argument("--moments-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--master-layout", choices=["split", "fp32"], default="split",
                        help="HostAdamW's masters: split (the served bf16 bits and a 16-bit remainder) or fp32 (a vector, and the bits twice)")
    parser.add_argument("--grad-offload", action="store_true", help="largest: with gradient offload")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sample_tokens and not args.tokenizer:
        parser.error("--sample-tokens needs --tokenizer")
    device = devices.resolve(args.device)
    result = run_step(args, device) if args.mode == "step" else run_largest(args, device)
    print(json.dumps({
        "benchmark": f"gpu_step/{args.mode}", **devices.info(device), "threads": torch.get_num_threads(), "encode_threads": auto_encode_threads(torch.get_num_threads()),
        "cpus": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2), **result,
    }, indent=2))


if __name__ == "__main__":
    main()
