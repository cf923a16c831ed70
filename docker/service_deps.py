"""Print the third-party requirements of one rollstream service, one per line, read from
the pyproject files (the single source of truth for dependencies).

    python3 docker/service_deps.py <repo root> <service> [extra ...]

The Dockerfiles install these in a layer of their own, before the source is copied in, so
that editing code does not reinstall torch; scripts/build_images.sh uses the union over all
services to fill the wheelhouse. `rollstream-core[extras]` is expanded into core's own
dependencies plus those extras; other rollstream packages never appear.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_CORE = re.compile(r"rollstream-core(?:\[(?P<extras>[^\]]*)\])?\s*")


def project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text())["project"]


def requirements(root: Path, service: str, extras: list[str] | None = None) -> list[str]:
    core = project(root / "core" / "pyproject.toml")
    svc = project(root / "services" / service / "pyproject.toml")
    wanted = list(svc["dependencies"])
    for extra in extras or []:
        wanted += svc.get("optional-dependencies", {})[extra]  # KeyError names an unknown extra
    out: list[str] = []
    for dep in wanted:
        m = _CORE.fullmatch(dep)
        if m is None:
            out.append(dep)
            continue
        out += core["dependencies"]
        for core_extra in filter(None, (e.strip() for e in (m.group("extras") or "").split(","))):
            out += core["optional-dependencies"][core_extra]
    return list(dict.fromkeys(out))  # de-duplicated, order kept


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(Path(argv[0]), argv[1], argv[2:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
