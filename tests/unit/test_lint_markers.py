"""Every `# noqa` and `# type: ignore` in the tracked Python files says why after its codes (ruff's
PGH003/PGH004 make it name the codes, RUF100 and mypy's warn_unused_ignores make it still needed):
a marker without its reason is a check switched off that nobody can judge later. mypy takes
nothing after `# type: ignore[...]` but another comment, so its reason follows a second `#`."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The marker and its codes; what follows them, less separators, is the reason.
MARKER = re.compile(r"(?:noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(?:\[[^\]]*\])?)")


def unexplained(source: str) -> list[int]:
    """The lines of `source` whose comment holds a marker with no reason after it."""
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        for marker in MARKER.finditer(token.string):
            # one reason after two markers on a line explains both
            reason = MARKER.sub("", token.string[marker.end() :])
            if marker.group().startswith("type"):
                reason = reason if reason.lstrip().startswith("#") else ""
            if not re.search(r"[A-Za-z]{2}", reason):
                lines.append(token.start[0])
    return lines


def test_every_marker_in_the_tracked_files_says_why() -> None:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    offenders = [
        f"{path}:{line}"
        for path in files.stdout.split()
        if "_pb2" not in path  # protoc's output
        for line in unexplained((ROOT / path).read_text())
    ]
    assert not offenders, "a `# noqa` / `# type: ignore` without its reason after the codes: " + ", ".join(offenders)


def test_a_bare_marker_is_found_and_an_explained_one_is_not() -> None:
    source = (
        "import os  # noqa: F401\n"
        "x: int = 'a'  # type: ignore[assignment]\n"
        "y = 1  # type: ignore\n"
        "import sys  # noqa: F401 - re-exported for the tests\n"
        "z: int = 'b'  # type: ignore[assignment]  # a str on purpose\n"
        "s = '# noqa'\n"
        "w: int = 'c'  # type: ignore[assignment] - mypy reads no reason here\n"
    )
    assert unexplained(source) == [1, 2, 3, 7]
