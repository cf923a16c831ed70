"""Who may import whom: services import core only, core imports no service and not the
launcher (so a service image needs neither the operator's tools nor the other services)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("generator", "reward", "reference", "trainer")


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {n for n in names if n.startswith("rollstream.")}


def package_of(name: str) -> str:
    return name.split(".")[1]


@pytest.mark.parametrize("package", ["core", *SERVICES])
def test_a_package_imports_only_what_it_may(package: str) -> None:
    root = REPO / ("core" if package == "core" else f"services/{package}") / "src" / "rollstream" / package
    allowed = {"core", "v1"} | ({package} if package != "core" else set())
    for path in sorted(root.rglob("*.py")):
        wrong = sorted(n for n in imported(path) if package_of(n) not in allowed)
        assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_the_launcher_is_what_imports_the_services() -> None:
    found = set()
    for path in (REPO / "launcher" / "src" / "rollstream" / "launcher").rglob("*.py"):
        found |= {package_of(n) for n in imported(path)}
    assert found >= {"core", *SERVICES}
