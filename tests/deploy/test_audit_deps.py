"""scripts/audit_deps.sh, with a stand-in pip-audit (no network, no install): it fails on a
vulnerable pin, passes on a clean set, and when no database answers it says so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deploy_files import REPO

SCRIPT = REPO / "scripts/audit_deps.sh"

# Answers like pip-audit's --format json, by FAKE_AUDIT mode and --vulnerability-service.
FAKE = r"""#!PYTHON
import json, os, sys
args = sys.argv[1:]
service = args[args.index("--vulnerability-service") + 1]
requirements = open(args[args.index("--requirement") + 1]).read()
open(os.environ["FAKE_AUDIT_SEEN"], "a").write(json.dumps({"service": service, "requirements": requirements}) + "\n")
pins = [line.split("==") for line in requirements.split()]
mode = os.environ["FAKE_AUDIT"]
if mode == "offline" and service == "osv":
    print("requests.exceptions.ConnectionError: Failed to resolve 'api.osv.dev'", file=sys.stderr)
    sys.exit(1)
deps = []
for name, version in pins:
    if mode == "offline":
        deps.append({"name": name, "skip_reason": f"Dependency not found on PyPI and could not be audited: {name} ({version})"})
    elif mode == "vulnerable" and name == "redis":
        deps.append({"name": name, "version": version, "vulns": [{"id": "PYSEC-0000-1", "fix_versions": ["9.9.9"], "aliases": ["CVE-0000-1"], "description": "x"}]})
    else:
        deps.append({"name": name, "version": version, "vulns": []})
open(args[args.index("--output") + 1], "w").write(json.dumps({"dependencies": deps, "fixes": []}))
sys.exit(1 if any(d.get("vulns") for d in deps) else 0)
"""


def audit(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    fake = tmp_path / "pip-audit"
    fake.write_text(FAKE.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\nredis==8.1.0\ntorch==2.13.0+cpu  # the CPU wheel\nPyYAML==6.0.3\n")
    seen = tmp_path / "seen.jsonl"
    env = {
        **os.environ,
        "PIP_AUDIT": str(fake),
        "FAKE_AUDIT": mode,
        "FAKE_AUDIT_SEEN": str(seen),
        # the last-resort lookup goes to a closed port on loopback: refused at once
        "ROLLSTREAM_AUDIT_PYPI_JSON": "http://127.0.0.1:9/pypi",
        "ROLLSTREAM_AUDIT_TIMEOUT": "5",
    }
    done = subprocess.run(["bash", str(SCRIPT), str(constraints)], env=env, capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []
    return done, calls


def test_vulnerable_pin_fails_and_names_the_fix(tmp_path: Path) -> None:
    done, calls = audit(tmp_path, "vulnerable")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "redis==8.1.0: PYSEC-0000-1 (CVE-0000-1); fixed in: 9.9.9" in done.stdout
    assert "3 of 3 pinned packages against the pypi database: 1 known vulnerability" in done.stdout
    # Audited as pinned: comments gone, torch's local version dropped (PyPI knows 2.13.0).
    assert [c["service"] for c in calls] == ["pypi"]
    assert calls[0]["requirements"].split() == ["redis==8.1.0", "torch==2.13.0", "PyYAML==6.0.3"]


def test_clean_set_passes(tmp_path: Path) -> None:
    done, _ = audit(tmp_path, "clean")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 known vulnerabilities" in done.stdout and "skipped" not in done.stdout


def test_no_database_is_a_clear_skip_not_a_failure(tmp_path: Path) -> None:
    done, calls = audit(tmp_path, "offline")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("dependency audit skipped: ") and done.stdout.count("\n") == 1, done.stdout
    assert "pypi: none of the 3 pins could be audited" in done.stdout and "osv: pip-audit exited 1" in done.stdout
    assert "pypi project JSON: " in done.stdout
    assert [c["service"] for c in calls] == ["pypi", "osv"]


def test_missing_constraints_file_is_an_error(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "nope.txt")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file" in done.stderr
