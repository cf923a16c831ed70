"""What the kit runs on, as one JSON object: the GPU and its driver, torch and CUDA, host
memory and cores, for every package the checks import, its version and where it was
imported from (the carried wheels lead PYTHONPATH; the rest is the image's), and the
optimizer path every check's HostAdamW steps with (`optimizer`: the split layout's compiled
AdamW, carried in each kit's lib/, or torch operations where it is missing or does not load).
Exits non-zero if any of those imports fails, naming it: then no check could pass.

    python scripts/gpu_kit/machine.py [--device cuda|cpu]      (run by checks.py)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import traceback

# distribution -> a module of it the checks import
PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "numpy": "numpy",
    "protobuf": "google.protobuf",
    "grpcio": "grpc",
    "pydantic": "pydantic",
    "pydantic-settings": "pydantic_settings",
    "redis": "redis",
    "structlog": "structlog",
    "zstandard": "zstandard",
    "xxhash": "xxhash",
    "pytest": "pytest",
    "psutil": "psutil",
}
# rollstream's own modules the checks reach (the generated stubs check protobuf's version here).
ROLLSTREAM = [
    "rollstream.v1.rollout_pb2",
    "rollstream.core.deltas",
    "rollstream.trainer.step",
    "rollstream.trainer.optimizer",
    "rollstream.trainer.config",
    "rollstream.generator.backends",
]


def meminfo() -> dict[str, float]:
    with open("/proc/meminfo") as f:
        values = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)}
    return {
        "host_total_gib": round(values["MemTotal"] / 2**30, 1),
        "host_available_gib": round(values["MemAvailable"] / 2**30, 1),
    }


def nvidia_smi() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"


def optimizer_path() -> dict[str, object]:
    """The path a HostAdamW in the split layout (the trainer's default) steps with in this tree:
    HostAdamW.uses_split_kernel of one made here, the kernel's file, and its threads (its
    default: the process's torch threads; the trainer's are its `threads` setting)."""
    import torch

    from rollstream.trainer.optimizer import HostAdamW

    spec = importlib.util.find_spec("rollstream.trainer._split_adamw")
    opt = HostAdamW(
        {"probe": torch.nn.Parameter(torch.zeros(64))},
        lr=1e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        master_layout="split",
        moments_dtype="float32",
    )
    kernel = opt.uses_split_kernel
    return {
        "path": "split_kernel" if kernel else "torch",
        "uses_split_kernel": kernel,
        "kernel": spec.origin if spec is not None else None,
        "kernel_threads": torch.get_num_threads() if kernel else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    out: dict[str, object] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        **meminfo(),
    }
    failed = []
    packages = {}
    for dist, module in PACKAGES.items():
        try:
            imported = importlib.import_module(module)
            packages[dist] = {
                "version": importlib.metadata.version(dist),
                "from": os.path.dirname(imported.__file__ or ""),
            }
        except Exception as e:  # noqa: BLE001  (any import error is the finding)
            failed.append(f"{module}: {type(e).__name__}: {e}")
    out["packages"] = packages
    for module in ROLLSTREAM:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any import error is the finding
            failed.append(f"{module}:\n{traceback.format_exc(limit=3)}")
    if not failed:
        out["optimizer"] = optimizer_path()
    if "torch" in packages:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            out |= {
                "gpu": props.name,
                "capability": f"{props.major}.{props.minor}",
                "gpu_memory_gib": round(total / 2**30, 1),
                "gpu_free_gib": round(free / 2**30, 1),
                "nvidia_smi": nvidia_smi(),
            }
        elif args.device == "cuda":
            failed.append("torch sees no CUDA device (torch.cuda.is_available() is false)")
    out["import_failures"] = failed
    print(json.dumps(out, indent=1))
    for failure in failed:
        print(f"machine: {failure}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
