"""The dashboard's page and script are package data of rollstream-core: every file under
rollstream/core/static matches the package-data patterns of core/pyproject.toml (so a wheel,
and `pip install`, carry it), and the page loads the script by a relative URL."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from rollstream.core import dashboard

CORE = Path(__file__).resolve().parents[2] / "core"


def test_static_files_are_package_data() -> None:
    patterns = tomllib.loads((CORE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "rollstream.core"
    ]
    static = CORE / "src" / "rollstream" / "core" / "static"
    files = sorted(p.name for p in static.iterdir() if p.is_file())
    assert files == ["dashboard.html", "dashboard.js"]
    for name in files:
        assert any(fnmatch.fnmatch(f"static/{name}", pat) for pat in patterns), name


def test_page_loads_its_script_relatively() -> None:
    page = dashboard.static_text("dashboard.html")
    assert '<script src="dashboard.js"></script>' in page
    script = dashboard.static_text("dashboard.js")
    assert 'getJSON("api/pipeline")' in script and "innerHTML" not in script  # text is set with textContent only
