"""Where the trainer's host memory goes: peak and resident memory by phase, against the sum
of the parts it has to hold.

    .venv/bin/python benchmarks/trainer_memory.py [--steps 3] [--groups 8] [--group-size 8] [--new-tokens 16]
    MALLOC_ARENA_MAX=2 .venv/bin/python benchmarks/trainer_memory.py --malloc-trim   # glibc's share
    python3 benchmarks/trainer_memory.py --device cuda   # host memory with the model on a GPU, and the GPU's

What it does, as the trainer does it: builds a real `Trainer` (trainer.py, on a ServiceHost
that serves nothing, as tests/unit/test_trainer_guards.py does) on the demo model and the
demo's settings (fp32 compute, full fine-tuning), then runs `--steps` GRPO steps
(`Trainer.train_step`: step.train_step, then the delta published) on synthetic scored
groups shaped like the demo's: the arithmetic task's chat prompts tokenized by the model's
own tokenizer, `--group-size` completions of `--new-tokens` random tokens, rewards 0/1.

Phases are cut by wrapping the functions the trainer calls (model load, HostAdamW init,
sync_model, WeightPublisher init; per step: forward+backward up to the optimizer step, the
optimizer step, the publish). At each cut it reads /proc/self/status (VmRSS now, VmHWM: the
peak since the previous cut, which is then reset through /proc/self/clear_refs), glibc's
mallinfo2 (bytes malloc holds free inside its heaps: freed but not returned to the OS) and,
with --tracemalloc, the Python heap (numpy's buffers are in it, torch's CPU tensors are
not); with --device cuda, also the GPU memory allocated now and at its peak in the phase. The parts: unique bytes (views deduplicated by their underlying buffer) of the model's
parameters, the gradients at the optimizer step, the fp32 masters, the moments, the
optimizer's staging buffers and bits buffers, the publisher's anchor and delta payloads.

Prints one JSON object; docs/benchmarks.md records results ("Trainer memory by component").
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import gc
import json
import os
import platform
import random
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

MB = 2**20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _Mallinfo2
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc (>= 2.33)
    _libc = None


def _malloc_free_bytes() -> int | None:
    """Bytes glibc malloc holds free in its heaps (all arenas): freed, not given back."""
    return int(_libc.mallinfo2().fordblks) if _libc is not None else None


class Recorder:
    """Cuts the run into phases; each phase's peak RSS, the RSS at its end, and more."""

    def __init__(self, trim: bool, trace: bool):
        self.trim = trim
        self.trace = trace
        self.phases: list[dict[str, Any]] = []
        self.cuda = None  # a CUDA device: also its allocated memory and peak per phase
        self.started = time.perf_counter()
        _reset_peak()

    def mark(self, phase: str, **extra: Any) -> None:
        st = _status()
        row: dict[str, Any] = {"phase": phase, "peak_mb": round(st["VmHWM"] / MB), "rss_mb": round(st["VmRSS"] / MB)}
        free = _malloc_free_bytes()
        if free is not None:
            row["malloc_free_mb"] = round(free / MB)
        if self.trace:
            current, peak = tracemalloc.get_traced_memory()
            row["py_heap_mb"], row["py_heap_peak_mb"] = round(current / MB), round(peak / MB)
            tracemalloc.reset_peak()
        if self.trim and _libc is not None:
            _libc.malloc_trim(0)
            row["rss_after_trim_mb"] = round(_status()["VmRSS"] / MB)
        if self.cuda is not None:
            import torch

            torch.cuda.synchronize(self.cuda)
            row["cuda_allocated_mb"] = round(torch.cuda.memory_allocated(self.cuda) / MB)
            row["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(self.cuda) / MB)
            row["cuda_reserved_mb"] = round(torch.cuda.memory_reserved(self.cuda) / MB)
            torch.cuda.reset_peak_memory_stats(self.cuda)
        row["t_s"] = round(time.perf_counter() - self.started, 1)
        row.update(extra)
        self.phases.append(row)
        print(json.dumps(row), flush=True)  # progress (stdout: JSON lines, then the result)
        _reset_peak()


def unique_bytes(*objs: Any) -> int:
    """Bytes of the distinct buffers behind numpy arrays, torch tensors and bytes objects
    (nested in dicts, lists, tuples); views of one buffer count once."""
    import numpy as np
    import torch

    seen: dict[int, int] = {}

    def walk(o: Any) -> None:
        if o is None:
            return
        if isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, torch.Tensor):
            if o.device.type != "cpu":
                return  # host memory only: a GPU's tensors are not in RSS
            s = o.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(o, np.ndarray):
            root = o
            while isinstance(root.base, np.ndarray):
                root = root.base
            seen[root.__array_interface__["data"][0]] = max(
                seen.get(root.__array_interface__["data"][0], 0), root.nbytes
            )
        elif isinstance(o, (bytes, bytearray)):
            seen[id(o)] = len(o)
        elif hasattr(o, "payload"):  # publisher.Published
            walk(o.payload)

    for o in objs:
        walk(o)
    return sum(seen.values())


def demo_groups(tokenizer: Any, step: int, count: int, group_size: int, new_tokens: int, vocab: int) -> list:
    """Groups shaped like the demo's: its arithmetic chat prompts, full-length completions."""
    from rollstream.trainer import prompts
    from rollstream.v1 import rollout_pb2

    rng = random.Random(step)
    source = prompts.arithmetic(seed=step)
    out = []
    for g in range(count):
        prompt = next(source)
        ids = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in prompt.messages],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        completions = [
            rollout_pb2.Completion(
                token_ids=[rng.randrange(vocab) for _ in range(new_tokens)],
                behaviour_logprobs=[-3.0 + rng.gauss(0, 0.5) for _ in range(new_tokens)],
                reward=float(rng.random() < 0.3),
            )
            for _ in range(group_size)
        ]
        gid = f"mem-s{step}-g{g}"
        out.append(
            rollout_pb2.RolloutGroup(
                group_id=gid,
                task_id=gid,
                policy_version=step - 1,
                prompt_ids=list(ids),
                completions=completions,
                scored=True,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (the demo's: float32)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward (the trainer's setting)",
    )
    parser.add_argument(
        "--token-budget", type=int, default=4096, help="padded tokens per micro-batch (the trainer's setting)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="LM-head rows at a time (the trainer's setting)")
    parser.add_argument(
        "--moments-dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="AdamW moments (the trainer's setting)",
    )
    parser.add_argument(
        "--master-layout", choices=["split", "fp32"], default="split", help="the trainer's master layout (masters.py)"
    )
    parser.add_argument("--anchor-interval", type=int, default=20)
    parser.add_argument(
        "--anchor-file",
        action="store_true",
        help="keep the anchor in a file (the trainer's anchor_dir, as `up` sets it), not in memory",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also save a checkpoint every N steps (to a temp dir)"
    )
    parser.add_argument(
        "--malloc-trim",
        action="store_true",
        help="malloc_trim(0) at every cut: how much of RSS is glibc holding freed memory",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="compute device (the optimizer state stays in host memory either way)",
    )
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also trace the Python heap (slower; its own bookkeeping is counted in RSS)",
    )
    parser.add_argument(
        "--reader",
        choices=["yes", "no", "alternate"],
        default="yes",
        help="whether anyone reads the deltas: yes (as before); no (a colocated run's trainer: none encoded, no anchor kept; issue 44); "
        "alternate (no on odd steps, yes on even ones, the anchor written before those outside their time: both in one process)",
    )
    args = parser.parse_args()

    if args.tracemalloc:
        tracemalloc.start(1)
    rec = Recorder(trim=args.malloc_trim, trace=args.tracemalloc)

    import numpy as np
    import torch

    import devices  # benchmarks/devices.py
    from rollstream.core import deltas, modeling
    from rollstream.core.config import load_settings
    from rollstream.core.service import ServiceHost
    from rollstream.trainer import optimizer as optimizer_mod
    from rollstream.trainer import publisher as publisher_mod
    from rollstream.trainer import trainer as trainer_mod
    from rollstream.trainer.config import TrainerSettings
    from rollstream.trainer.masters import Fp32Masters

    device = devices.resolve(args.device)
    if device.type == "cuda":
        rec.cuda = device
    rec.mark("imports")

    # -- phase cuts: wrap what Trainer calls ------------------------------------------------
    grads_at_step: dict[str, int] = {}
    step_no = [0]

    def after(fn, name):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            out = fn(*a, **kw)
            rec.mark(name() if callable(name) else name)
            return out

        return wrapper

    orig_load = modeling.load_model
    modeling.load_model = after(orig_load, "model_load")
    orig_init, orig_sync, orig_step = (
        optimizer_mod.HostAdamW.__init__,
        optimizer_mod.HostAdamW.sync_model,
        optimizer_mod.HostAdamW.step,
    )
    optimizer_mod.HostAdamW.__init__ = after(orig_init, "optimizer_init")
    optimizer_mod.HostAdamW.sync_model = after(orig_sync, "optimizer_sync_model")

    orig_pub_init, orig_publish = publisher_mod.WeightPublisher.__init__, publisher_mod.WeightPublisher.publish
    publisher_mod.WeightPublisher.__init__ = after(orig_pub_init, "publisher_init")
    publisher_mod.WeightPublisher.publish = after(orig_publish, lambda: f"step{step_no[0]}_publish")

    # The autograd graph: unique bytes of the tensors forward saves for backward (the
    # parameters themselves excluded), summed over the step's micro-batches.
    saved: dict[int, int] = {}
    param_ptrs: set[int] = set()
    orig_train_step = trainer_mod.train_step

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
        return t

    def traced_train_step(model, *a, **kw):
        param_ptrs.update(p.untyped_storage().data_ptr() for p in model.parameters())
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return orig_train_step(model, *a, **kw)

    trainer_mod.train_step = traced_train_step

    def step_wrapper(self, *a, **kw):
        grads_at_step["grads"] = unique_bytes([p.grad for p in self.params.values()])
        rec.mark(
            f"step{step_no[0]}_forward_backward",
            grads_mb=round(grads_at_step["grads"] / MB),
            autograd_saved_mb=round(sum(saved.values()) / MB),
        )
        out = orig_step(self, *a, **kw)
        rec.mark(f"step{step_no[0]}_optimizer")
        return out

    optimizer_mod.HostAdamW.step = step_wrapper

    ckpt_dir = tempfile.mkdtemp(prefix="trainer-memory-")
    atexit.register(shutil.rmtree, ckpt_dir, True)  # checkpoints of the measured steps: gone at exit
    settings = load_settings(
        TrainerSettings,
        [],
        model=args.model,
        threads=args.threads,
        device=str(device),
        dtype=args.dtype,
        groups_per_step=args.groups,
        group_size=args.group_size,
        max_new_tokens=args.new_tokens,
        anchor_interval=args.anchor_interval,
        checkpoint_dir=ckpt_dir,
        activation_checkpointing=args.activation_checkpointing,
        token_budget=args.token_budget,
        chunk_tokens=args.chunk_tokens,
        anchor_dir=str(Path(ckpt_dir) / "anchor") if args.anchor_file else "",
        moments_dtype=args.moments_dtype,
        master_layout=args.master_layout,
    )
    host = ServiceHost("trainer", settings)
    t0 = time.perf_counter()
    trainer = trainer_mod.Trainer(settings, host)
    init_s = time.perf_counter() - t0
    rec.mark("trainer_ready")

    opt, pub = trainer.optimizer, trainer.publisher

    def reader_at(step: int) -> bool:
        return args.reader == "yes" or (args.reader == "alternate" and step % 2 == 0)

    vocab = trainer.limits.vocab_size
    step_times, step_phases = [], []
    for step in range(1, args.steps + 1):
        step_no[0] = step
        groups = demo_groups(trainer.tokenizer, step, args.groups, args.group_size, args.new_tokens, vocab)
        if args.reader != "yes":  # what the loop sees: a colocated run's registry, or a generator with an address
            pub.readers.saw(["reader:1"] if reader_at(step) else [], from_registry=True)
            if reader_at(step):
                trainer.reanchor("benchmark: a reader")  # after skipped deltas: the anchor, not timed
        t, cpu = time.perf_counter(), time.process_time()
        _metrics, published, stats = trainer.train_step(groups)
        step_times.append(round(time.perf_counter() - t, 2))
        step_phases.append(
            {
                "reader": reader_at(step),
                "cpu_s": round(time.process_time() - cpu, 2),
                **{k: round(v, 3) for k, v in trainer.last_phases.items()},
            }
        )
        del published, groups
        rec.mark(f"step{step}_done", delta_mb=round(stats.nbytes / MB, 1))
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            trainer.save_checkpoint(os.path.join(ckpt_dir, f"step-{step:08d}"))
            rec.mark(f"step{step}_checkpoint")
    gc.collect()
    rec.mark("end")

    # -- the parts ----------------------------------------------------------------------
    model_params = unique_bytes(list(trainer.model.parameters()), list(trainer.model.buffers()))
    parts = {
        "model_params": model_params,
        "grads": grads_at_step.get("grads", 0),
        "masters_fp32": unique_bytes(opt.flat_master, opt.hi, opt.lo),  # split layout: hi + lo are the fp32 masters
        "moments": unique_bytes(opt.exp_avg, opt.exp_avg_sq),
        "optimizer_staging": unique_bytes(
            opt._bf16_out,
            opt.moments._wide,
            opt.host_grad,
            *(vars(o).get(k) for o in (opt.grads, opt.masters) for k in ("_staging", "_grad32", "_master32", "_int32")),
        ),
        # Split layout: the published bits are the masters' hi plane, counted above.
        "bits_buffers": unique_bytes(opt.masters.bits, opt.masters._spare, pub._bits)
        if isinstance(opt.masters, Fp32Masters)
        else 0,
        "anchor_payload": unique_bytes(pub._anchor),
        "delta_payloads": unique_bytes(pub._deltas),
    }
    parts_mb = {k: round(v / MB) for k, v in parts.items()}
    imports_rss = next(p["rss_mb"] for p in rec.phases if p["phase"] == "imports")
    sum_parts = round(sum(parts.values()) / MB)
    peak = max(p["peak_mb"] for p in rec.phases)
    n = sum(int(b.size) for b in pub.bits().values())
    print(
        json.dumps(
            {
                "benchmark": "trainer_memory",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, numpy {np.__version__}",
                **devices.info(device),
                "env": {
                    k: os.environ[k]
                    for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
                    if k in os.environ
                },
                "model": trainer.model_dir,
                "parameters": n,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "load_average_1min": round(os.getloadavg()[0], 2),
                "settings": {
                    k: getattr(settings, k)
                    for k in (
                        "activation_checkpointing",
                        "token_budget",
                        "chunk_tokens",
                        "anchor_interval",
                        "anchor_dir",
                        "moments_dtype",
                        "master_layout",
                    )
                },
                "shape": {
                    "groups": args.groups,
                    "group_size": args.group_size,
                    "new_tokens": args.new_tokens,
                    "steps": args.steps,
                },
                # Equal hashes across runs (same flags and threads) = bit-identical trained weights.
                "weights_sha256": deltas.weights_sha256(pub.bits()),
                "init_s": round(init_s, 1),
                "step_s": step_times,
                "reader": args.reader,
                "step_phases": step_phases,
                "phases": rec.phases,
                "parts_mb": parts_mb,
                "imports_rss_mb": imports_rss,
                "sum_of_parts_mb": sum_parts,
                "sum_of_parts_plus_imports_mb": sum_parts + imports_rss,
                "peak_rss_mb": peak,
                "peak_phase": max(rec.phases, key=lambda p: p["peak_mb"])["phase"],
                "peak_over_parts_plus_imports": round(peak / (sum_parts + imports_rss), 2),
                **(
                    {
                        "cuda_peak_mb": max(p["cuda_peak_mb"] for p in rec.phases),
                        "cuda_peak_phase": max(rec.phases, key=lambda p: p["cuda_peak_mb"])["phase"],
                    }
                    if device.type == "cuda"
                    else {}
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
