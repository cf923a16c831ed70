"""npm packages for the tests, installed once into a cache folder.

`npm_packages(folder, label)` returns `~/.cache/rollstream/npm/<lock hash>/` (or
$ROLLSTREAM_NPM_CACHE), where `npm ci` installed the packages of `folder`'s package-lock.json
from the npm registry (npm's own download cache beside it); its `node_modules` is what a
test runs. The first run downloads (seconds); a later one with the same lock file installs
nothing. It skips the test, saying why, where `npm` is absent or the registry cannot be
reached; nothing is written into the repository.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def npm_cache_root() -> Path:
    return Path(os.environ.get("ROLLSTREAM_NPM_CACHE") or Path.home() / ".cache" / "rollstream" / "npm")


def npm_packages(folder: Path, label: str) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"{label} needs `npm` on PATH (Node.js >= 18)")
    lock = (folder / "package-lock.json").read_bytes()
    root = npm_cache_root()
    installed = root / hashlib.sha256(lock).hexdigest()[:16]
    if not (installed / ".installed").exists():
        # Installed beside, then renamed into place: a second test session installing at the
        # same time (or one killed midway) never leaves a half-filled folder behind.
        staging = root / f"{installed.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy2(folder / name, staging / name)
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--cache", str(root / "_npm-cache"), "--prefer-offline"],
            cwd=staging, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(
                f"npm ci for {label} failed (is the npm registry reachable?): {(done.stderr or done.stdout)[-800:]}"
            )
        (staging / ".installed").write_text("ok\n")
        try:
            staging.rename(installed)
        except OSError:  # another session got there first (or a stale folder without the marker)
            if not (installed / ".installed").exists():
                shutil.rmtree(installed, ignore_errors=True)
                staging.rename(installed)
            else:
                shutil.rmtree(staging, ignore_errors=True)
    return installed
