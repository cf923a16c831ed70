"""Host bytes a parameter that HostAdamW really holds, per master layout and moments dtype,
measured as the peak resident memory its steps add (VmHWM), next to the nominal figure
(optimizer.host_bytes_per_parameter), and what that means for 7B / 14B / 32B on 128 GiB.

    .venv/bin/python benchmarks/host_memory.py --sizes 0.5b,1.5b
    .venv/bin/python benchmarks/host_memory.py --sizes tiny --layouts split+bfloat16,fp32+float32 --bucket-mb 0.25

Each (layout, size) runs in a fresh subprocess, so one run's high-water mark never hides
another's. In it: the model's parameters are built on the CPU in bf16 (as the GPU path's
device weights would be) with one set of random bf16 gradients; the peak is then reset
(/proc/self/clear_refs) and read as the baseline. Then HostAdamW(master_layout,
moments_dtype), sync_model(), a WeightPublisher (anchor in a file under a temp dir, the
trainer's anchor_interval and delta_encode_threads defaults) and `--steps` steps, each
with a DeltaEncoder (publisher.begin_delta) fed through on_piece and published. The
gradients stay referenced by this script throughout (step() drops p.grad; re-assigning
the same tensors means no memory is freed that later allocations could hide under the
peak). Measured bytes a parameter = (VmHWM at the end - baseline) / parameters: the
optimizer, the scratch of its steps, the delta encoder's work and the publisher's kept
deltas (payload sizes reported beside it). At lr 1e-5 (--lr, the measured runs') random
gradients change 8-23% of the bf16 weights a step, where real RL steps change 2-6%
(docs/benchmarks.md): the same gradients every step make each an Adam first step (every
master moves by the full lr, m/sqrt(v) = sign(g)), and N(0, 0.02) weights have finer bf16
ULPs than trained ones. So the encoder's share is an upper end; --lr 1e-6 changes 2-3% a
step (measured at 1.5B), in the range of real steps.

--trace-encoder adds, per run, the largest per-tensor delta encodes: what the tensor's
pieces' changes hold and the peak its encode adds (the overall peak is kept). --shared-storage
makes every weight and every gradient a view of one buffer (the baseline shrinks, the
optimizer allocates the same): 1.5B on a 23 GiB machine. --encoder-only: a DeltaEncoder on
its own pool instead of the WeightPublisher, for a machine without its gRPC stack.

The arithmetic scales the largest size measured of each layout to 7B / 14B / 32B: a bound
from above, as the fixed buffers (staging, queued old bits: ~0.5 GB) and the vocabulary
matrix's share of the parameters shrink with size. Sizes that would not fit in this
machine's available memory are skipped, with the reason. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
LAYOUTS = ("split+bfloat16", "split+float32", "fp32+bfloat16", "fp32+float32")
# Qwen2.5-32B, for the arithmetic only (shapes.py has no 32b: nothing here builds one).
SHAPE_32B = (5120, 27648, 64, 40, 8, 152064, False)
TARGETS = ("7b", "14b", "32b")
HOST_GIB = 128
# What the trainer process holds beside the optimizer on a GPU machine: CUDA context and
# torch's libraries (~1-2 GiB), pinned staging, Python, gRPC, the publisher's pools.
PROCESS_GIB = 4


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_host() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: clear_refs 5), so that a
    peak read after is its own; False where that is refused (the peak is then the process's
    so far). Also used by gpu_step.py."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Peak:
    """The process's peak resident memory since `start`, in KiB. Resets of VmHWM (for the
    encoder trace) first fold the peak so far in, so the overall peak is never lost."""

    def __init__(self) -> None:
        self.folded = 0

    def start(self) -> bool:
        ok = reset_peak_host()
        self.baseline = _status_kib("VmHWM")
        return ok

    def now(self) -> int:
        return max(self.folded, _status_kib("VmHWM"))

    def reset(self) -> int:
        """Fold the peak in and reset it; returns the resident memory now."""
        self.folded = self.now()
        reset_peak_host()
        return _status_kib("VmRSS")


def _trace_encoder(peak: _Peak, records: list[dict[str, object]]) -> None:
    """--trace-encoder: wrap deltas.encode_changes (each tensor's encode, once its pieces are
    in) to record what its pieces' changes hold and the peak it adds over the memory at its
    start. With one encode thread the calls do not overlap; the step's own thread runs on
    meanwhile (a bucket's old bits, 2 bytes an element, come and go), and queues up to the
    encoder's max_pending_bytes (256 MB) of old bits for the thread this encode holds: that
    is in the peak added too."""
    from rollstream.core import deltas

    original = deltas.encode_changes

    def traced(shape: tuple[int, ...], size: int, pieces: list) -> object:
        held = sum(c.mask.nbytes + c.steps.nbytes for c in pieces)
        changed = sum(c.steps.size for c in pieces)
        rss = peak.reset()
        out = original(shape, size, pieces)
        added = _status_kib("VmHWM") - rss
        records.append(
            {
                "shape": list(shape),
                "changed": changed,
                "held_changes_mb": round(held / 2**20, 1),
                "peak_added_mb": round(added / 1024, 1),
            }
        )
        return out

    deltas.encode_changes = traced


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def parameter_shapes(shape: tuple[int, int, int, int, int, int, bool]) -> dict[str, tuple[int, ...]]:
    """A Qwen2 shape's parameters by Hugging Face name, in named_parameters() order (tied
    embeddings once). Built without transformers: the optimizer sees nothing but these
    tensors, and importing and building the model costs seconds a run on a loaded box."""
    hidden, inter, layers, heads, kv, vocab, tied = shape
    kv_dim = kv * (hidden // heads)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out |= {
            f"{a}.q_proj.weight": (hidden, hidden),
            f"{a}.q_proj.bias": (hidden,),
            f"{a}.k_proj.weight": (kv_dim, hidden),
            f"{a}.k_proj.bias": (kv_dim,),
            f"{a}.v_proj.weight": (kv_dim, hidden),
            f"{a}.v_proj.bias": (kv_dim,),
            f"{a}.o_proj.weight": (hidden, hidden),
            f"{m}.gate_proj.weight": (inter, hidden),
            f"{m}.up_proj.weight": (inter, hidden),
            f"{m}.down_proj.weight": (hidden, inter),
            f"model.layers.{i}.input_layernorm.weight": (hidden,),
            f"model.layers.{i}.post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (vocab, hidden)
    return out


def parameter_count(shape: tuple[int, int, int, int, int, int, bool]) -> int:
    """Parameters of a Qwen2 shape, as shapes.parameter_count counts them, allocating none."""
    return sum(math.prod(s) for s in parameter_shapes(shape).values())


def _optimizer_buffers(opt: Any) -> dict[str, int]:
    """Bytes of every buffer HostAdamW allocates itself or in the objects of its options, by
    attribute (the accounting); a buffer two of them hold counts once."""
    import numpy as np
    import torch

    out: dict[str, int] = {}
    seen: set[int] = set()
    for name, value in [item for holder in (opt, opt.masters, opt.moments, opt.grads) for item in vars(holder).items()]:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, torch.Tensor) and v.numel() and v.data_ptr() not in seen:
                out[name] = out.get(name, 0) + v.numel() * v.element_size()
                seen.add(v.data_ptr())
            elif isinstance(v, np.ndarray) and v.base is None:
                out[name] = out.get(name, 0) + v.nbytes
    return {k: v for k, v in out.items() if v}


def child(
    size: str,
    layout: str,
    steps: int,
    bucket_mb: float,
    threads: int,
    encode_threads: int,
    anchor_interval: int,
    trace: bool,
    encoder_only: bool,
    shared_storage: bool,
    lr: float,
) -> dict[str, object]:
    """One (layout, size) measurement, in this (fresh) process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rollstream.core import cpu_runtime, deltas
    from rollstream.trainer import optimizer  # first: the package sets OpenMP's wait policy before torch starts
    from shapes import SIZES  # benchmarks/shapes.py

    # Imported before the baseline: its modules (gRPC, protobuf, cryptography) are not the step's memory.
    WeightPublisher = None if encoder_only else importlib.import_module("rollstream.trainer.publisher").WeightPublisher

    # As the Trainer does: large blocks on their own mappings, given back when freed (else
    # glibc's heap keeps freed memory resident, and the peak would measure malloc's habits).
    cpu_runtime.fixed_mmap_threshold()

    if threads:
        torch.set_num_threads(threads)
    master_layout, moments_dtype = layout.split("+")
    gen = torch.Generator().manual_seed(0)
    shapes_ = parameter_shapes(SIZES[size])
    # In place (no `randn * scale` temporary): a freed temporary would raise the peak above
    # the resident memory, and the optimizer's first allocations would hide under it.
    if shared_storage:
        # Every weight (and every gradient) a view of one buffer as large as the largest: the
        # optimizer copies the weights into its masters and writes them back, so it allocates
        # the same; the baseline is 4 bytes a parameter smaller (1.5B on a 23 GiB machine).
        largest = max(math.prod(s) for s in shapes_.values())
        weights = torch.empty(largest, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
        gradients = torch.empty(largest, dtype=torch.bfloat16).normal_(0.0, 1e-3, generator=gen)
        params = {name: torch.nn.Parameter(weights[: math.prod(s)].view(s)) for name, s in shapes_.items()}
        grads = [gradients[: p.numel()].view(p.shape) for p in params.values()]
    else:
        # The device weights of the GPU path: bf16, N(0, 0.02) as shapes.build_model makes them.
        params = {
            name: torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen))
            for name, s in shapes_.items()
        }
        grads = [torch.empty_like(p).normal_(0.0, 1e-3, generator=gen) for p in params.values()]
    n = sum(p.numel() for p in params.values())
    gc.collect()
    peak = _Peak()
    reset = peak.start()
    peaks: dict[str, float] = {}
    encodes: list[dict[str, object]] = []
    if trace:
        _trace_encoder(peak, encodes)

    def mark(phase: str) -> None:
        peaks[phase] = round((peak.now() - peak.baseline) * 1024 / n, 3)

    with tempfile.TemporaryDirectory(prefix="host_memory_") as anchor_dir:
        opt = optimizer.HostAdamW(
            params,
            lr=lr,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            bucket_mb=bucket_mb,
            master_layout=master_layout,
            moments_dtype=moments_dtype,  # type: ignore[arg-type]  # strings from --layouts, each one of the literals
        )
        mark("init")
        base = opt.sync_model()
        if encoder_only:
            # The publisher's part without its gRPC stack: its encoder on its pool, each delta
            # kept as the publisher keeps them until the next anchor.
            publisher = None
            pool = ThreadPoolExecutor(encode_threads) if encode_threads else None
            kept: list[bytes] = []
        else:
            publisher = WeightPublisher(
                base, anchor_interval, encode_threads=encode_threads, anchor_dir=Path(anchor_dir)
            )
        mark("sync_model+publisher")
        payloads: list[dict[str, object]] = []
        step_s: list[float] = []
        for i in range(steps):
            for p, g in zip(params.values(), grads, strict=True):
                p.grad = g
            start = time.perf_counter()
            # The split layout's base: the bits of the previous step, views of the masters that
            # the step overwrites; the encoder reads only names and shapes from it, every piece
            # brings its old bits.
            encoder = (
                publisher.begin_delta() if publisher else deltas.DeltaEncoder(base, i, i + 1, "bench", executor=pool)
            )
            _, new_bits = opt.step(1.0, on_piece=encoder.add_piece)
            if publisher:
                _, stats = publisher.publish(new_bits, encoder)
            else:
                payload, stats = encoder.finish()
                kept.append(payload)
                base = new_bits
            step_s.append(round(time.perf_counter() - start, 3))
            payloads.append(
                {
                    "bytes": stats.nbytes,
                    "fraction_of_dense": round(stats.fraction_of_dense, 4),
                    "changed_values": stats.changed_values,
                }
            )
            del encoder, new_bits
            mark(f"step{i + 1}")
        hwm_kib = peak.now()
        rss_kib = _status_kib("VmRSS")
        buffers = _optimizer_buffers(opt)
        if publisher:
            kept_deltas = sum(
                len(d.data()) for d in publisher._deltas
            )  # what the publisher keeps until its next anchor
            publisher.close()
        else:
            kept_deltas = sum(len(k) for k in kept)
    return {
        "size": size,
        "layout": layout,
        "parameters": n,
        "publisher": not encoder_only,
        "shared_storage": shared_storage,
        "lr": lr,
        "nominal_bytes_per_param": optimizer.host_bytes_per_parameter(master_layout, moments_dtype),  # type: ignore[arg-type]  # strings from --layouts, each one of the literals
        "measured_bytes_per_param": round((hwm_kib - peak.baseline) * 1024 / n, 3),
        "resident_after_bytes_per_param": round((rss_kib - peak.baseline) * 1024 / n, 3),
        "peak_by_phase_bytes_per_param": peaks,
        "baseline_gib": round(peak.baseline / 2**20, 3),
        "peak_reset": reset,
        "optimizer_buffers_bytes_per_param": {k: round(v / n, 3) for k, v in buffers.items()},
        "payloads": payloads,
        "publisher_kept_delta_bytes": kept_deltas,
        "step_s": step_s,
        **({"largest_encodes": sorted(encodes, key=lambda e: -float(e["peak_added_mb"]))[:4]} if trace else {}),  # type: ignore[arg-type]  # a list among the dict's numbers: mypy infers one value type
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", default="0.5b,1.5b", help="comma-separated shapes of benchmarks/shapes.py (tiny for a test)"
    )
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help=f"comma-separated master_layout+moments_dtype, of {', '.join(LAYOUTS)}",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=32.0,
        help="the trainer's default; a tiny model needs a small one (staging is a bucket wide)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--encode-threads",
        type=int,
        default=0,
        help="delta encoder threads (0: the trainer's delta_encode_threads = auto, half the cores)",
    )
    parser.add_argument(
        "--anchor-interval",
        type=int,
        default=20,
        help="the trainer's default: the deltas of these steps stay in memory",
    )
    parser.add_argument(
        "--trace-encoder",
        action="store_true",
        help="record the peak each tensor's delta encode adds (the 4 largest per run)",
    )
    parser.add_argument(
        "--encoder-only",
        action="store_true",
        help="a DeltaEncoder on its own pool instead of the WeightPublisher (no gRPC stack needed)",
    )
    parser.add_argument(
        "--shared-storage",
        action="store_true",
        help="weights and gradients as views of one buffer each: a smaller baseline, the same optimizer",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-5,
        help="AdamW's lr (the measured runs'); lower, fewer bf16 values change a step (1e-6: real GRPO densities)",
    )
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # shapes.py
    if not args.encode_threads:
        from rollstream.trainer.config import auto_encode_threads

        args.encode_threads = auto_encode_threads(args.threads)
    if args.child:
        result = child(
            args.child[0],
            args.child[1],
            args.steps,
            args.bucket_mb,
            args.threads,
            args.encode_threads,
            args.anchor_interval,
            args.trace_encoder,
            args.encoder_only,
            args.shared_storage,
            args.lr,
        )
        print(json.dumps(result))
        return

    import shapes

    sizes = [s for s in args.sizes.split(",") if s]
    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            parser.error(f"unknown layout {x!r}: one of {', '.join(LAYOUTS)}")
    from rollstream.trainer.optimizer import host_bytes_per_parameter

    runs: list[dict[str, object]] = []
    for size in sizes:
        n = parameter_count(shapes.SIZES[size])
        for layout in layouts:
            nominal = host_bytes_per_parameter(*layout.split("+"))
            # bf16 weights and gradients, the layout, slack for the step and the encoder
            # (measured: 3-4 bytes a parameter at 0.5B), and Python.
            need = n * ((0 if args.shared_storage else 4) + nominal + 4) + GiB
            available = _available_bytes()
            if need > available:
                runs.append(
                    {
                        "size": size,
                        "layout": layout,
                        "parameters": n,
                        "nominal_bytes_per_param": nominal,
                        "skipped": f"needs ~{need / GiB:.1f} GiB, {available / GiB:.1f} GiB available here",
                    }
                )
                continue
            cmd = (
                [
                    sys.executable,
                    __file__,
                    "--child",
                    size,
                    layout,
                    "--steps",
                    str(args.steps),
                    "--bucket-mb",
                    str(args.bucket_mb),
                    "--threads",
                    str(args.threads),
                    "--encode-threads",
                    str(args.encode_threads),
                    "--anchor-interval",
                    str(args.anchor_interval),
                    "--lr",
                    str(args.lr),
                ]
                + (["--trace-encoder"] if args.trace_encoder else [])
                + (["--encoder-only"] if args.encoder_only else [])
                + (["--shared-storage"] if args.shared_storage else [])
            )
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # -9: most likely the OOM killer
                runs.append(
                    {
                        "size": size,
                        "layout": layout,
                        "parameters": n,
                        "error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}",
                    }
                )
            else:
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress: each run as it ends

    # The arithmetic: the largest size measured of each layout, scaled to the big models.
    counts = {t: parameter_count(SHAPE_32B if t == "32b" else shapes.SIZES[t]) for t in TARGETS}
    arithmetic: dict[str, dict[str, object]] = {}
    for layout in layouts:
        measured = [r for r in runs if r["layout"] == layout and "measured_bytes_per_param" in r]
        if not measured:
            continue
        ref = max(measured, key=lambda r: r["parameters"])  # type: ignore[arg-type, return-value]  # the runs' values are objects: 'parameters' is an int
        per_param = float(ref["measured_bytes_per_param"])  # type: ignore[arg-type]  # a float in an object-valued run
        arithmetic[layout] = {"bytes_per_param": per_param, "measured_at": ref["size"]}
        for t, count in counts.items():
            gib = per_param * count / GiB
            arithmetic[layout][t] = {
                "parameters": count,
                "optimizer_gib": round(gib, 1),
                "with_process_gib": round(gib + PROCESS_GIB, 1),
                "fits_128_gib": gib + PROCESS_GIB <= HOST_GIB,
            }
    print(
        json.dumps(
            {
                "benchmark": "host_memory",
                "load_average_1min": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
                "steps": args.steps,
                "lr": args.lr,
                "bucket_mb": args.bucket_mb,
                "encode_threads": args.encode_threads,
                "anchor_interval": args.anchor_interval,
                "runs": runs,
                "arithmetic": {
                    "host_gib": HOST_GIB,
                    "process_gib": PROCESS_GIB,
                    "note": "GPU path: weights and gradients on the GPU; host = measured bytes/param (largest size measured) x parameters + the process",
                    "layouts": arithmetic,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
