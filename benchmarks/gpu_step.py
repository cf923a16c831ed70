"""A GRPO step on long sequences, with the optimizer on the host against one on the GPU, and
the largest model one step fits.

    python3 benchmarks/gpu_step.py step --size 1.5b --device cuda                 # tokens/s, 8 x 4096
    python3 benchmarks/gpu_step.py step --size 1.5b --device cuda --sequences 64 --seq-tokens 2048 --moments-dtype bfloat16  # an RL batch
    python3 benchmarks/gpu_step.py largest --device cuda --moments-dtype bfloat16  # what fits
    python3 benchmarks/gpu_step.py largest --device cuda --moments-dtype bfloat16 --sizes 14b --sequences 16 --delta  # 14B, 8 bytes a parameter

Both run the trainer's own step.train_step on synthetic groups of `--sequences` sequences of
`--seq-tokens` tokens (`--prompt-tokens` of them prompt; random token ids, 0/1 rewards), with
gradient accumulation as the trainer does it: micro-batches of at most `--token-budget` padded
tokens (the trainer's default, 4096: 2 sequences of 2048 a micro-batch, 1 of 4096), activation
checkpointing on. Every result names the optimizer path that ran (`optimizer`: the split
layout's compiled kernel or torch operations, the master layout, the moments' dtype, the
kernel's threads).

`step`: for three optimizers, in this order, one warm-up step on one micro-batch's sequences
(the same shapes: CUDA's kernels and the optimizer's buffers warmed) and `--repeats` timed
steps of the whole batch:
  resident      the baseline: fp32 masters and moments on the GPU, torch.optim.AdamW(fused=True)
                there, bf16 weights copied from the masters; no host bits, no delta (which
                flatters the baseline: publishing would add a 2-bytes-per-parameter copy);
                CUDA only;
  host          HostAdamW: masters (`--master-layout`, split by default) and moments in host
                memory, per bucket gradients down, AdamW on the host, bf16 weights up; the
                step's new bits on the host (what the trainer publishes) and the delta encoded
                on the way (on_piece: DeltaEncoder.add_piece), on the trainer's default
                number of threads (delta_encode_threads = auto: half the cores);
  host_offload  the same with grad_offload (gradients to the host during backward).
Reports per optimizer: s a step (until the new weights are in the model and the delta is
encoded: `delta.wait_s` is the part spent waiting for the encoder after the step returned),
tokens/s, the phases (forward, backward, optimizer: train_step's), the GPU idle fraction, the
peak host memory (VmHWM, reset before each) and per parameter; then the host runs' ratio of
tokens/s to the resident one and of backward seconds to the host run's (gradient offload's
cost). The GPU idle fraction of a step: 1 - (time the GPU spent in forward/backward kernels,
from CUDA events on the compute stream) / step wall time. The optimizer phase is where a host
step leaves the GPU idle but for its copies; the events bracket whole phases, so the busy time
is an upper bound and the idle fraction a lower bound. The result so far is printed (one JSON
line) after each optimizer.

`largest`: for each size in `--sizes` (ascending) decides from the arithmetic whether the
host holds the optimizer: optimizer.host_bytes_per_parameter(--master-layout, --moments-dtype,
--grad-offload) a parameter, plus what the process will still take (on a GPU up to
HOST_OVERHEAD_BYTES in all), within HOST_FRACTION of MemAvailable (running out of host memory
is a kill, not an exception). Then it builds the model straight on the device in --dtype
(random, nothing of it on the host), warms up on one micro-batch and times forward and
backward alone over the whole batch (no optimizer: the gradients dropped; what the step would
take with an optimizer that cost nothing, the stand-in for a GPU-resident one, which does not
fit beside a 14B model), then builds the host optimizer over it (which reads the parameters a
bucket at a time) and runs one GRPO step of `--sequences` (2 by default), with `--delta` its
delta encoded on the way as the trainer does; it stops at the first size that does not fit.
Host bytes a parameter (split / fp32 master layout): 8 / 12 with bf16 moments, 12 / 16 with
fp32 ones (+4 with gradient offload): with the 123 GiB the GPU machines had available, ~15.4B
parameters (Qwen2.5-14B has 14.77B) in the split layout with bf16 moments, ~10B in the fp32
one. Reports for each size: parameters, host GiB needed and available, fits or why not, the
phases' times (model init, forward and backward alone, optimizer init, the step and its
forward / backward / optimizer), the step over forward and backward alone, tokens/s, the GPU
idle fraction, peak host resident set (VmHWM, reset before each size) and per parameter, peak
device memory (torch.cuda.max_memory_allocated), and a timeline: seconds since the process
started at the end of each phase. The result so far is printed (one JSON line) after every
phase, so a run cut at its time limit still says where it was; the last object printed is
the result.

`ranks` (issue 47's bar, docs/gpu.md): the host optimizer's step (HostAdamW, no delta) on the
same batch and weights three times, each on a model of its own: `one_process` sequential
(train_step's background off: the step the trainer runs on N ranks), `ranks_world1` the same
at world size 1 through ranks.py (this process its only rank: a process group on a free local
port, NCCL on CUDA and gloo on the CPU; Ranks.shard's FSDP2, HostAdamW's reduce over the
ranks, each step until Ranks.full_bits has joined the published bits, as the trainer does:
`join_s`), then `one_process_overlapped` (today's trainer with no reader). Reports each run's
tokens/s, phases, peak host memory and the sha256 of the bits it publishes after its last
step; `ranks_over_one_process` (the bar: >= 0.95), `ranks_without_join_over_one_process`,
`ranks_over_one_process_overlapped`, `bits_equal` (the bar: true) and `bits_equal_overlapped`
(a control: two runs in one process agree, else the kernels are not deterministic).

    python3 benchmarks/gpu_step.py ranks --size 1.5b --device cuda --sequences 16 --seq-tokens 2048 --moments-dtype bfloat16

On a CPU device everything runs the same way (no resident baseline: there is no GPU), to
check the script at small sizes (--size tiny --seq-tokens 128 --dtype float32). Prints JSON
(a line per phase, then the result).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch
from transformers import PreTrainedModel

import devices  # benchmarks/devices.py
from host_memory import reset_peak_host  # benchmarks/host_memory.py
from rollstream.core import deltas, modeling
from rollstream.trainer.config import TrainerSettings, auto_encode_threads
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

    def wait(self) -> None:
        """Nothing in flight: the step is done when step() returns."""

    @torch.no_grad()
    def step(
        self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None
    ) -> tuple[float, dict[str, np.ndarray]]:
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


def synthetic_groups(
    sequences: int, seq_tokens: int, prompt_tokens: int, vocab: int, seed: int
) -> list[rollout_pb2.RolloutGroup]:
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
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{g}",
                prompt_ids=rng.integers(10, vocab, prompt_tokens).tolist(),
                completions=completions,
                scored=True,
            )
        )
    return groups


# The trainer's micro-batch: at most this many padded tokens (TrainerSettings.token_budget).
TRAINER_TOKEN_BUDGET: int = TrainerSettings.model_fields["token_budget"].default


def step_config(seq_tokens: int, token_budget: int, device: torch.device) -> StepConfig:
    loss = LossConfig(
        kind="grpo", clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0, tis_cap=0.0, max_completion_tokens=seq_tokens
    )
    return StepConfig(
        loss,
        token_budget=token_budget,
        chunk_tokens=1024,
        temperature=1.0,
        max_grad_norm=1.0,
        device=str(device),
        share_prompts=False,
    )


def micro_batches(sequences: int, seq_tokens: int, token_budget: int) -> int:
    """How many micro-batches train_step cuts the batch into (share_prompts off: whole
    sequences packed to the budget, modeling.pack_by_tokens)."""
    return len(modeling.pack_by_tokens([seq_tokens] * sequences, token_budget))


def one_micro_batch(sequences: int, seq_tokens: int, token_budget: int) -> int:
    """The sequences of one full micro-batch: a warm-up of the step's shapes."""
    return max(1, min(sequences, token_budget // seq_tokens))


def optimizer_path(
    opt: HostAdamW, master_layout: MasterLayout, moments_dtype: str, grad_offload: bool
) -> dict[str, Any]:
    """Which optimizer path steps (docs/gpu.md): the split layout's compiled one-pass kernel or
    torch operations (HostAdamW.uses_split_kernel: False where the kernel was not built or not
    carried), and on how many threads the kernel runs (split_kernel.load's default, as
    HostAdamW loads it: this process's torch threads)."""
    kernel = opt.uses_split_kernel
    return {
        "path": "split_kernel" if kernel else "torch",
        "master_layout": master_layout,
        "moments_dtype": moments_dtype,
        "grad_offload": grad_offload,
        "kernel_threads": torch.get_num_threads() if kernel else None,
    }


RESIDENT_PATH = {
    "path": "torch fused AdamW on the GPU",
    "master_layout": "fp32",
    "moments_dtype": "float32",
    "grad_offload": False,
    "kernel_threads": None,
}


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
    """`opt` as train_step uses it, marking the optimizer call first (anything else train_step
    asks of the optimizer goes to `opt` itself)."""

    def __init__(self, opt: Any, marks: Marks):
        self.opt, self.marks = opt, marks

    def step(
        self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None
    ) -> tuple[float, dict[str, np.ndarray]]:
        self.marks.mark()
        return self.opt.step(max_grad_norm, on_piece, model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opt, name)


class DropGrads:
    """An optimizer for train_step that applies nothing: the step's forward and backward alone,
    its gradients dropped: what the step would take with an optimizer that cost nothing."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params

    def discard_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    def wait(self) -> None:
        """Nothing in flight."""

    def step(
        self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None
    ) -> tuple[float, dict[str, np.ndarray]]:
        self.discard_grads()
        return 0.0, {}


def delta_base(opt: HostAdamW) -> dict[str, np.ndarray]:
    """The delta encoder's base. With on_piece the optimizer hands over each piece's old bits
    (HostAdamW.step), so the encoder reads only the base's names and shapes: zero-byte
    stand-ins of the right shapes, not a 2-bytes-a-parameter copy of the previous version."""
    return {name: np.broadcast_to(np.uint16(0), shape) for name, (_off, _n, shape) in opt.layout.items()}


def one_step(
    model: PreTrainedModel,
    opt: Any,
    groups: list[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    device: torch.device,
    pad_id: int,
    base: dict[str, np.ndarray] | None = None,
    pool: ThreadPoolExecutor | None = None,
    overlapped: bool = False,
    team: Any = None,
    join: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    keep: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One train_step, timed. Sequential (the trainer's step when a delta is built): until the
    new weights are in the model and, with `base`, the step's delta (encoded on the way on
    `pool`: DeltaEncoder.add_piece as on_piece) is finished. `overlapped` (train_step's
    background: the trainer's step when no delta is built): until train_step returns, its
    update then running on the optimizer's thread while the next step's forward runs; the
    caller waits for the last one (opt.wait()). On CUDA the Marks bracket the compute stream
    from the step's first forward to its optimizer call: a busy span, so 1 - span / wall is a
    lower bound of the GPU's idle fraction. With `team` (a ranks.Ranks) the step runs on the
    trainer's N-rank path (train_step's `ranks`) and `join` (Ranks.full_bits) turns its shard
    bits into the published ones, inside the step's time (the trainer's step on N ranks);
    `keep["bits"]` gets the step's (published) bits."""
    cuda = device.type == "cuda"
    marks = Marks(cuda)
    encoder = deltas.DeltaEncoder(base, 0, 1, "bench", executor=pool) if base is not None else None
    hook = model.get_decoder().register_forward_pre_hook(marks.first_forward)
    if cuda and not overlapped:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        r = train_step(
            model,
            MarkedOptimizer(opt, marks),  # type: ignore[arg-type]  # a wrapper (or DropGrads) with HostAdamW's calls, not one
            groups,
            cfg,
            pad_id=pad_id,
            on_piece=encoder.add_piece if encoder else None,
            background=overlapped,
            ranks=team,
        )
        if cuda and not overlapped:
            torch.cuda.synchronize(device)
        joined_s = None
        bits = r.trained_bits or {}
        if join is not None:
            joining = time.perf_counter()
            bits = join(bits)
            joined_s = time.perf_counter() - joining
        if keep is not None:
            keep["bits"] = bits
        stepped = time.perf_counter()
        stats = encoder.finish()[1] if encoder is not None else None
    finally:
        hook.remove()
    wall = time.perf_counter() - start
    out: dict[str, Any] = {
        "step_s": round(wall, 3),
        "train_tokens": r.train_tokens,
        "grad_norm": round(r.grad_norm, 4),
        "phases": {
            "forward_s": round(r.forward_s, 3),
            "backward_s": round(r.backward_s, 3),
            "optimizer_s": round(r.optimizer_s, 3),
        },
    }
    if joined_s is not None:
        out["join_s"] = round(joined_s, 3)
    busy = marks.busy_s()
    if busy is not None:
        out["gpu_idle_lower_bound"] = round(1.0 - busy / wall, 3)
    if stats is not None:
        out["delta"] = {
            "wait_s": round(time.perf_counter() - stepped, 3),
            "bytes": stats.nbytes,
            "fraction_of_dense": round(stats.fraction_of_dense, 4),
        }
    return out


def forward_backward_alone(
    model: PreTrainedModel,
    groups: list[rollout_pb2.RolloutGroup],
    warmup: list[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    device: torch.device,
) -> dict[str, Any]:
    """The step's forward and backward with no optimizer (DropGrads), after a warm-up on one
    micro-batch: the floor a host optimizer is measured against, and what the GPU-resident
    fused AdamW's step nearly is (its optimizer phase: 0.02 s of 2.03 at 1.5B on the H200).
    Run before any HostAdamW is built over the model (none of its hooks in it)."""
    drop = DropGrads(dict(model.named_parameters()))
    one_step(model, drop, warmup, cfg, device, 0)
    alone = one_step(model, drop, groups, cfg, device, 0)
    return {
        "s": alone["step_s"],
        "tokens_per_s": round(alone["train_tokens"] / alone["step_s"], 1),
        "phases": alone["phases"],
    }


def timed_steps(
    model: PreTrainedModel,
    opt: Any,
    groups: list[rollout_pb2.RolloutGroup],
    warmup: list[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    device: torch.device,
    repeats: int,
    delta: bool,
    overlapped: bool,
    alone_s: float | None,
    team: Any = None,
    join: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    keep: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One warm-up step on `warmup` and `repeats` timed steps on `groups`, back to back (an
    overlapped step's update runs during the next one's forward, the warm-up's during the first
    timed one's; `update_tail_s` is the wait for the last, which a following step would hide).
    With `delta`, each step's delta is encoded on the way on as many threads as the trainer's
    default (delta_encode_threads = auto: half the cores torch has). `gpu_idle_fraction`: the
    share of the step beyond forward and backward alone on the same batch (`alone_s`), the
    time the GPU waits for the optimizer (left out without `alone_s`). `team`, `join`, `keep`:
    one_step's (`keep["bits"]`: the last step's bits, final once the last update is waited for)."""
    base = delta_base(opt) if delta else None
    steps = []
    with ThreadPoolExecutor(auto_encode_threads(torch.get_num_threads()), thread_name_prefix="delta") as pool:
        one_step(model, opt, warmup, cfg, device, 0, base, pool, overlapped, team, join)
        for _ in range(repeats):
            steps.append(one_step(model, opt, groups, cfg, device, 0, base, pool, overlapped, team, join, keep))
        start = time.perf_counter()
        opt.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tail = time.perf_counter() - start
    median = float(np.median([x["step_s"] for x in steps]))
    out: dict[str, Any] = {
        "step_s": round(median, 3),
        "train_tokens": steps[0]["train_tokens"],
        "tokens_per_s": round(steps[0]["train_tokens"] / median, 1),
        "overlapped": overlapped,
        "update_tail_s": round(tail, 3),
        "phases": [x["phases"] for x in steps],
    }
    if alone_s is not None:
        out["gpu_idle_fraction"] = round(1.0 - alone_s / median, 3)
    if "join_s" in steps[0]:
        out["join_s"] = round(float(np.median([x["join_s"] for x in steps])), 3)
    if "gpu_idle_lower_bound" in steps[0]:
        out["gpu_idle_lower_bound"] = round(float(np.median([x["gpu_idle_lower_bound"] for x in steps])), 3)
    if "delta" in steps[-1]:
        out["delta"] = steps[-1]["delta"]
    return out


def build_model_for_step(size: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The model, random, allocated once on `device` in `dtype` (shapes.build_model: built on
    meta, then N(0, 0.02) drawn on the device; no host copy), set up to train with activation
    checkpointing."""
    model = cast(PreTrainedModel, build_model(size, device, dtype))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def host_optimizer(
    model: torch.nn.Module,
    grad_offload: bool,
    moments_dtype: str,
    master_layout: MasterLayout,
    sync: bool = True,
    reduce: Callable[[float], float] | None = None,
) -> HostAdamW:
    """HostAdamW over the model's parameters (it reads them a bucket at a time: no whole fp32
    copy of the model on the host). `sync`: write the served bits into the model. Not needed
    where the parameters are bf16 already: the masters are then exactly the weights, whose bf16
    rounding in either layout is the weights themselves. `reduce`: HostAdamW's (N ranks:
    Ranks.sum_of_squares), the parameters then the model's FSDP2 shards."""
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        moments_dtype=moments_dtype,  # type: ignore[arg-type]  # a --moments-dtype string, one of the literals
        master_layout=master_layout,
        grad_offload=grad_offload,
        reduce=reduce,
    )
    if sync:
        opt.sync_model()
    return opt


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# step's optimizers, in order of value (docs/gpu.md): name -> (host, gradient offload,
# overlapped, delta). The first two are issue 44's bar: the host optimizer as the trainer runs
# it when no delta is built (no reader), against the resident one.
VARIANTS = {
    "resident": (False, False, False, False),
    "host_overlapped": (True, False, True, False),
    "host": (True, False, False, True),  # a remote generator reads deltas: each built on the way
    "host_offload": (True, True, False, True),
}


def run_variant(
    args: argparse.Namespace,
    device: torch.device,
    name: str,
    groups: list[rollout_pb2.RolloutGroup],
    warmup: list[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    alone_s: float,
    parameters: int,
) -> dict[str, Any]:
    """One of VARIANTS on a model of its own: its timed steps, optimizer path and peak host memory."""
    host, offload, overlapped, delta = VARIANTS[name]
    peak_is_own = reset_peak_host()
    model = build_model_for_step(args.size, device, DTYPES[args.dtype])
    opt: HostAdamW | ResidentAdamW
    if host:
        opt = host_optimizer(model, offload, args.moments_dtype, args.master_layout)
        path = optimizer_path(opt, args.master_layout, args.moments_dtype, offload)
    else:
        opt, path = ResidentAdamW(dict(model.named_parameters())), RESIDENT_PATH
    timed = timed_steps(model, opt, groups, warmup, cfg, device, args.repeats, delta, overlapped, alone_s)
    peak = peak_host_rss_gib()
    return {
        **timed,
        "optimizer": path,
        "peak_host_gib": round(peak, 2),
        "peak_host_bytes_per_parameter": round(peak * 2**30 / parameters, 2),
        "peak_host_is": "this run" if peak_is_own else "the process so far",
    }


def step_inputs(
    args: argparse.Namespace, device: torch.device
) -> tuple[list[rollout_pb2.RolloutGroup], list[rollout_pb2.RolloutGroup], StepConfig, dict[str, Any]]:
    """`step`'s and `ranks`'s batch (seed 0), warm-up micro-batch (seed 1), step config and
    the result's header."""
    vocab = SIZES[args.size][5]
    groups = synthetic_groups(args.sequences, args.seq_tokens, args.prompt_tokens, vocab, seed=0)
    warmup = synthetic_groups(
        one_micro_batch(args.sequences, args.seq_tokens, args.token_budget),
        args.seq_tokens,
        args.prompt_tokens,
        vocab,
        seed=1,
    )
    cfg = step_config(args.seq_tokens, args.token_budget, device)
    header = {
        "size": args.size,
        "parameters": parameter_count(args.size),
        "sequences": args.sequences,
        "seq_tokens": args.seq_tokens,
        "token_budget": args.token_budget,
        "micro_batches": micro_batches(args.sequences, args.seq_tokens, args.token_budget),
        "master_layout": args.master_layout,
        "moments_dtype": args.moments_dtype,
    }
    return groups, warmup, cfg, header


def run_step(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    groups, warmup, cfg, result = step_inputs(args, device)
    parameters = result["parameters"]
    result["forward_backward_alone"] = forward_backward_alone(
        build_model_for_step(args.size, device, DTYPES[args.dtype]), groups, warmup, cfg, device
    )
    progress(result, f"forward and backward alone: {result['forward_backward_alone']['s']} s")
    for name in args.variants.split(","):
        if name == "resident" and device.type != "cuda":
            continue  # the resident baseline is a GPU's
        release(device)  # the last variant's model and optimizer went with run_variant's frame
        try:
            result[name] = run_variant(
                args, device, name, groups, warmup, cfg, result["forward_backward_alone"]["s"], parameters
            )
        except torch.OutOfMemoryError as e:
            result[name] = {"error": f"out of device memory: {str(e).splitlines()[0]}"}
        progress(result, f"{name}: {result[name].get('tokens_per_s', result[name].get('error'))} tokens/s")
    if "tokens_per_s" in result.get("resident", {}):
        for name in VARIANTS:
            if name != "resident" and "tokens_per_s" in result.get(name, {}):
                result[f"{name}_over_resident"] = round(
                    result[name]["tokens_per_s"] / result["resident"]["tokens_per_s"], 3
                )
    if all("phases" in result.get(name, {}) for name in ("host", "host_offload")):
        # Gradient offload's cost: backward with it over backward without it (the same sequential step).
        backward = {
            name: float(np.median([x["backward_s"] for x in result[name]["phases"]]))
            for name in ("host", "host_offload")
        }
        if backward["host"] > 0:
            result["offload_backward_over_host"] = round(backward["host_offload"] / backward["host"], 3)
    return result


def bits_digests(bits: dict[str, np.ndarray]) -> tuple[str, dict[str, str]]:
    """The sha256 of published bits (each name, then its bits, in name order: tests/ranks's
    rank_steps.sha) and each tensor's own sha256 (to name the tensors that differ)."""
    whole, each = hashlib.sha256(), {}
    for name in sorted(bits):
        data = np.ascontiguousarray(bits[name]).tobytes()
        whole.update(name.encode())
        whole.update(data)
        each[name] = hashlib.sha256(data).hexdigest()
    return whole.hexdigest(), each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `ranks`'s runs, in this order: name -> (through ranks.py at world size 1, overlapped).
RANKS_RUNS = {
    "one_process": (False, False),  # like for like with the ranks' step: sequential, no delta
    "ranks_world1": (True, False),  # ranks.py: FSDP2 over 1 rank, the bits joined (full_bits)
    "one_process_overlapped": (False, True),  # today's trainer with no reader: the update overlapped
}
# Issue 47's bar: world size 1 through ranks.py at least this fraction of one process's tokens/s.
RANKS_BAR = 0.95


def run_ranks_variant(
    args: argparse.Namespace,
    device: torch.device,
    name: str,
    groups: list[rollout_pb2.RolloutGroup],
    warmup: list[rollout_pb2.RolloutGroup],
    cfg: StepConfig,
    parameters: int,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One of RANKS_RUNS on a model of its own (the same seed: the same weights): its timed
    steps, optimizer path, peak host memory and the sha256 of the bits it publishes after
    them; and each tensor's sha256."""
    through_ranks, overlapped = RANKS_RUNS[name]
    peak_is_own = reset_peak_host()
    model = build_model_for_step(args.size, device, DTYPES[args.dtype])
    team = join = None
    if through_ranks:
        from rollstream.trainer import ranks  # torch.distributed's FSDP2: only this run imports it

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        world = ranks.World(0, 1, 0)
        team = ranks.Ranks.join(world, ranks.rank_device(device.type, world))
        params = team.shard(model)
        join = lambda bits: team.full_bits(params, bits)  # noqa: E731  # the trainer's _published_bits
    try:
        opt = host_optimizer(
            model,
            False,
            args.moments_dtype,
            args.master_layout,
            reduce=team.sum_of_squares if team is not None else None,
        )
        path = optimizer_path(opt, args.master_layout, args.moments_dtype, False)
        keep: dict[str, Any] = {}
        timed = timed_steps(
            model, opt, groups, warmup, cfg, device, args.repeats, False, overlapped, None, team, join, keep
        )
        peak = peak_host_rss_gib()
        start = time.perf_counter()
        sha, each = bits_digests(keep["bits"])
        sha_s = time.perf_counter() - start
    finally:
        if team is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {
        **timed,
        "through_ranks": through_ranks,
        "world_size": 1 if through_ranks else None,
        "optimizer": path,
        "peak_host_gib": round(peak, 2),
        "peak_host_bytes_per_parameter": round(peak * 2**30 / parameters, 2),
        "peak_host_is": "this run" if peak_is_own else "the process so far",
        "bits_sha256": sha,
        "sha_s": round(sha_s, 2),
    }, each


def run_ranks(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Issue 47's bar on one device: the host optimizer's step (HostAdamW, split masters) in
    one process as the trainer runs it, then at world size 1 through ranks.py (FSDP2, this
    process its only rank), the same batch and weights: tokens/s, ratio, bits."""
    groups, warmup, cfg, result = step_inputs(args, device)
    result["repeats"] = args.repeats
    digests: dict[str, dict[str, str]] = {}
    for name in RANKS_RUNS:
        release(device)
        try:
            result[name], digests[name] = run_ranks_variant(
                args, device, name, groups, warmup, cfg, result["parameters"]
            )
        except torch.OutOfMemoryError as e:
            result[name] = {"error": f"out of device memory: {str(e).splitlines()[0]}"}
        ranks_figures(result, digests)
        progress(result, f"{name}: {result[name].get('tokens_per_s', result[name].get('error'))} tokens/s")
    return result


def ranks_figures(result: dict[str, Any], digests: dict[str, dict[str, str]]) -> None:
    """The ratios and the bits' comparison of the runs so far (RANKS_RUNS), into `result`."""
    one, ranked, today = (result.get(n, {}) for n in ("one_process", "ranks_world1", "one_process_overlapped"))
    if "tokens_per_s" in one and "tokens_per_s" in ranked:
        ratio = round(ranked["tokens_per_s"] / one["tokens_per_s"], 3)
        result["ranks_over_one_process"] = ratio
        # FSDP2's share alone: the ranks' step less its join (Ranks.full_bits: padded copies
        # and a gather of the whole bits on the host, at world size 1 too).
        result["ranks_without_join_over_one_process"] = round(
            ranked["train_tokens"] / (ranked["step_s"] - ranked["join_s"]) / one["tokens_per_s"], 3
        )
        result["bits_equal"] = ranked["bits_sha256"] == one["bits_sha256"]
        differing = sorted(n for n, d in digests["one_process"].items() if digests["ranks_world1"].get(n) != d)
        result["tensors_differing"] = {"count": len(differing), "first": differing[:5]}
        result["bar"] = {
            "ranks_over_one_process_min": RANKS_BAR,
            "bits_equal": True,
            "passes": ratio >= RANKS_BAR and result["bits_equal"],
        }
    if "tokens_per_s" in today and "tokens_per_s" in ranked:
        # Against today's trainer (the update overlapped with the next forward): what the
        # N-rank path's sequential update costs at world size 1.
        result["ranks_over_one_process_overlapped"] = round(ranked["tokens_per_s"] / today["tokens_per_s"], 3)
    if "bits_sha256" in today and "bits_sha256" in one:
        # A control: two runs in one process agree (else the kernels are not deterministic
        # and bits_equal false says nothing about ranks.py).
        result["bits_equal_overlapped"] = today["bits_sha256"] == one["bits_sha256"]


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


def sample_colocated(
    model: PreTrainedModel, args: argparse.Namespace, vocab: int, device: torch.device
) -> dict[str, Any]:
    """After the step, sampling from the trained model itself as the colocated generator does
    (TransformersBackend.sharing: no second copy of the weights; issue 31): --sample-rows
    completions in groups of 8 of --sample-tokens each, from random prompts of --prompt-tokens,
    temperature 1. Tokens/s of the whole batch, prefill included."""
    from transformers import AutoTokenizer

    from rollstream.generator.backends import SampleRequest, TransformersBackend

    backend = TransformersBackend.sharing(model, AutoTokenizer.from_pretrained(args.tokenizer))
    g = torch.Generator().manual_seed(1)
    group = min(8, args.sample_rows)
    requests = [
        SampleRequest(
            torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist(),
            group,
            1.0,
            1.0,
            0,
            args.sample_tokens,
            seed=i,
        )
        for i in range(max(1, args.sample_rows // group))
    ]
    start = time.perf_counter()
    samples = backend.sample(requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(x.token_ids) for grp in samples for x in grp)
    return {
        "rows": len(requests) * group,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.sample_tokens,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def run_largest(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """For each size, ascending, until one does not fit: decide from the arithmetic whether the
    host holds the optimizer (running out of host memory is a kill by the OOM killer, not an
    exception), then build the model on the device, time forward and backward alone, build
    the host optimizer, and run one step. Each row's `timeline` holds the seconds since the
    process started at the end of each phase (model, forward_backward, optimizer, step), and
    the result so far is printed after each: a run cut short still says where it was."""
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    per_parameter = host_bytes_per_parameter(args.master_layout, args.moments_dtype, args.grad_offload)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "master_layout": args.master_layout,
        "moments_dtype": args.moments_dtype,
        "grad_offload": args.grad_offload,
        "host_bytes_per_parameter": per_parameter,
        "host_fraction": HOST_FRACTION,
        "dtype": args.dtype,
        "sequences": args.sequences,
        "seq_tokens": args.seq_tokens,
        "token_budget": args.token_budget,
        "micro_batches": micro_batches(args.sequences, args.seq_tokens, args.token_budget),
        "delta": args.delta,
        "activation_checkpointing": True,
        "sizes": rows,
    }
    cfg = step_config(args.seq_tokens, args.token_budget, device)
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
        row |= {
            "parameters": parameters,
            "host_gib_optimizer": round(optimizer_bytes / 2**30, 2),
            "host_gib_needed": round(need / 2**30, 2),
            "host_gib_available": round(have / 2**30, 1),
            # Why there is no GPU-resident baseline at this size: ResidentAdamW's fp32 masters, their
            # gradients and two fp32 moments on the device, beside the weights and their gradients.
            "resident_optimizer_device_gib": round(parameters * 16 / 2**30, 1),
        }
        if need > HOST_FRACTION * have:
            row |= {
                "fits": False,
                "why": f"host memory: {need / 2**30:.1f} GiB more needed ({per_parameter} bytes a parameter and "
                f"{overhead / 2**30:.1f} GiB for the process), {have / 2**30:.1f} GiB available",
            }
            progress(result, f"{size}: does not fit the host")
            break
        row["peak_host_is"] = "this size" if reset_peak_host() else "the process so far"
        vocab = SIZES[size][5]
        groups = synthetic_groups(args.sequences, args.seq_tokens, args.prompt_tokens, vocab, seed=0)
        warmup = synthetic_groups(
            one_micro_batch(args.sequences, args.seq_tokens, args.token_budget),
            args.seq_tokens,
            args.prompt_tokens,
            vocab,
            seed=1,
        )
        model = opt = r = None
        try:
            start = time.perf_counter()
            model = build_model_for_step(size, device, dtype)
            if cuda:
                torch.cuda.synchronize(device)
            row["model_init_s"] = round(time.perf_counter() - start, 2)
            timeline["model"] = round(since_start_s(), 1)
            progress(result, f"{size}: model built on {device}")
            # Forward and backward alone, before the optimizer exists: the step's floor.
            alone = row["forward_backward_alone"] = forward_backward_alone(model, groups, warmup, cfg, device)
            timeline["forward_backward"] = round(since_start_s(), 1)
            progress(result, f"{size}: forward and backward alone")
            start = time.perf_counter()
            opt = host_optimizer(
                model, args.grad_offload, args.moments_dtype, args.master_layout, sync=dtype != torch.bfloat16
            )
            row["optimizer_init_s"] = round(time.perf_counter() - start, 2)
            row["buckets"] = len(opt.buckets)
            row["optimizer"] = optimizer_path(opt, args.master_layout, args.moments_dtype, args.grad_offload)
            timeline["optimizer"] = round(since_start_s(), 1)
            progress(result, f"{size}: host optimizer built")
            # The trainer's step when no delta is built: overlapped with the next forward (a
            # warm-up step's update runs during the timed step's forward).
            r = timed_steps(model, opt, groups, warmup, cfg, device, 1, False, True, alone["s"])
            timeline["step"] = round(since_start_s(), 1)
            row |= {"fits": True, **r, "step_over_forward_backward": round(r["step_s"] / alone["s"], 3)}
            if args.delta:
                progress(result, f"{size}: stepped; a step with its delta")
                with ThreadPoolExecutor(
                    auto_encode_threads(torch.get_num_threads()), thread_name_prefix="delta"
                ) as pool:
                    with_delta = one_step(model, opt, groups, cfg, device, 0, delta_base(opt), pool)
                row["with_delta"] = {
                    **with_delta,
                    "tokens_per_s": round(with_delta["train_tokens"] / with_delta["step_s"], 1),
                }
                timeline["with_delta"] = round(since_start_s(), 1)
            if args.sample_tokens:
                progress(result, f"{size}: stepped; sampling from the same model")
                row["sampling"] = sample_colocated(model, args, vocab, device)
                timeline["sampling"] = round(since_start_s(), 1)
        except torch.OutOfMemoryError as e:
            row |= {"fits": False, "why": f"device memory: {str(e).splitlines()[0]}"}
        except MemoryError as e:
            row |= {"fits": False, "why": f"host memory: {e}"}
        row["peak_host_gib"] = round(peak_host_rss_gib(), 2)
        row["peak_host_bytes_per_parameter"] = round(row["peak_host_gib"] * 2**30 / parameters, 2)
        if cuda:
            row["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            row["peak_device_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        progress(result, f"{size}: {'stepped' if row['fits'] else 'does not fit: ' + row['why']}")
        # Freeing ~100 GiB of host memory takes seconds: after the row is out. The step's bits
        # are views of the optimizer's (split layout): they go too.
        model = opt = r = None
        if not row["fits"]:
            break
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["step", "largest", "ranks"])
    devices.add_argument(parser)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.5b", help="step: the model shape")
    parser.add_argument("--sizes", default="1.5b,3b,7b,14b", help="largest: shapes to try, ascending")
    parser.add_argument(
        "--sequences", type=int, default=None, help="sequences a step (default: step and ranks 8, largest 2)"
    )
    parser.add_argument("--seq-tokens", type=int, default=4096)
    parser.add_argument(
        "--token-budget",
        type=int,
        default=TRAINER_TOKEN_BUDGET,
        help="padded tokens a micro-batch, the gradients accumulated over them (default: the trainer's)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--sample-tokens",
        type=int,
        default=0,
        help="largest: after the step, sample this many tokens a row from the same model (colocated; 0: no sampling)",
    )
    parser.add_argument("--sample-rows", type=int, default=64, help="largest: rows sampled (groups of 8)")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="largest with --sample-tokens: a tokenizer folder (its eos and pad ids; the kit's demo tokenizer)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="compute dtype (float32 to check the script on a CPU without fast bf16)",
    )
    parser.add_argument("--moments-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--master-layout",
        choices=["split", "fp32"],
        default="split",
        help="HostAdamW's masters: split (the served bf16 bits and a 16-bit remainder) or fp32 (a vector, and the bits twice)",
    )
    parser.add_argument("--grad-offload", action="store_true", help="largest: with gradient offload")
    parser.add_argument(
        "--delta",
        action="store_true",
        help="largest: after the overlapped step, one with its delta encoded on the way (the trainer's step for a remote reader; in the peak host memory)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"step: the optimizers, in this order (of {', '.join(VARIANTS)}; resident: CUDA only)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sample_tokens and not args.tokenizer:
        parser.error("--sample-tokens needs --tokenizer")
    if args.sequences is None:
        args.sequences = 2 if args.mode == "largest" else 8
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: no {', '.join(sorted(unknown))} (there are {', '.join(VARIANTS)})")
    if args.token_budget < args.seq_tokens:
        parser.error(
            f"--token-budget {args.token_budget} is under --seq-tokens {args.seq_tokens}: a sequence must fit one micro-batch"
        )
    device = devices.resolve(args.device)
    run = {"step": run_step, "largest": run_largest, "ranks": run_ranks}[args.mode]
    result = run(args, device)
    print(
        json.dumps(
            {
                "benchmark": f"gpu_step/{args.mode}",
                **devices.info(device),
                "threads": torch.get_num_threads(),
                "encode_threads": auto_encode_threads(torch.get_num_threads()),
                "cpus": os.cpu_count(),
                "load_average_1min": round(os.getloadavg()[0], 2),
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
