"""README's table of what `bash scripts/test.sh` runs names the tiers the script runs, in its
order (the README once said "default suite, then containers, fault, slow and vLLM" while the
script also ran the browser, GPU and GPU-kit tiers, and --fast ran the browser tier too)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def script_tiers() -> list[str]:
    """The pytest marker expression of each pytest run in scripts/test.sh, in order."""
    text = (ROOT / "scripts" / "test.sh").read_text()
    runs = [m.group(1) for m in re.finditer(r'pytest -m ("[^"]+"|\S+)', text)]
    return ["default suite" if r.startswith('"not ') else r for r in runs]


def readme_tiers() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("What `bash scripts/test.sh` runs", 1)[1].split("\n\n", 2)[1]
    rows = [
        line.split("|")[1].strip()
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| step")
    ]
    return [r for r in rows if not r.startswith("installs")]


def test_the_readme_lists_the_tiers_the_script_runs_in_order() -> None:
    assert script_tiers() == [
        "default suite",
        "browser",
        "containers",
        "faults",
        "ranks",
        "gpu",
        "gpu_kit",
        "slow",
        "vllm",
    ]
    assert [t.lower() for t in readme_tiers()] == script_tiers()


def test_fast_runs_the_browser_tier_and_the_readme_says_so() -> None:
    text = (ROOT / "scripts" / "test.sh").read_text()
    # The browser tier (and chromium's install) sits outside the `if [ "$fast" = 0 ]` block.
    before_full_only = text.split('if [ "$fast" = 0 ]; then\n  # Images', 1)[0]
    assert (
        "pytest -m browser" in before_full_only
        and "apt-get install -y --no-install-recommends chromium" in before_full_only
    )
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`bash scripts/test.sh --fast` runs the default suite and then the browser tier" in readme
