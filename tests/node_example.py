"""examples/custom_reward_node for the tests: its npm packages installed once into a cache
folder, and the service started as a real `node` process.

`install_node_example(work)` returns the folder to run it from: a copy of the example's
sources in `work` whose `node_modules` links to `~/.cache/rollstream/npm/<lock hash>/`
(or $ROLLSTREAM_NPM_CACHE), where `npm ci` installed the packages of package-lock.json from
the npm registry (npm's own download cache beside it). The first run downloads (seconds); a
later one with the same lock file installs nothing. It skips the test, saying why, where
`node` or `npm` is absent or the registry cannot be reached; nothing is written into the
repository.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from procs import ChildProcess

NODE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_reward_node"
PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def npm_cache_root() -> Path:
    return Path(os.environ.get("ROLLSTREAM_NPM_CACHE") or Path.home() / ".cache" / "rollstream" / "npm")


def install_node_example(work: Path) -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("examples/custom_reward_node needs `node` and `npm` on PATH (Node.js >= 18)")
    lock = (NODE_EXAMPLE / "package-lock.json").read_bytes()
    root = npm_cache_root()
    installed = root / hashlib.sha256(lock).hexdigest()[:16]
    if not (installed / ".installed").exists():
        # Installed beside, then renamed into place: a second test session installing at the
        # same time (or one killed midway) never leaves a half-filled folder behind.
        staging = root / f"{installed.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy2(NODE_EXAMPLE / name, staging / name)
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--cache", str(root / "_npm-cache"), "--prefer-offline"],
            cwd=staging, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(f"npm ci for examples/custom_reward_node failed (is the npm registry reachable?): {(done.stderr or done.stdout)[-800:]}")
        (staging / ".installed").write_text("ok\n")
        try:
            staging.rename(installed)
        except OSError:  # another session got there first (or a stale folder without the marker)
            if not (installed / ".installed").exists():
                shutil.rmtree(installed, ignore_errors=True)
                staging.rename(installed)
            else:
                shutil.rmtree(staging, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for source in NODE_EXAMPLE.glob("*.js"):
        shutil.copy2(source, work / source.name)
    shutil.copy2(NODE_EXAMPLE / "package.json", work / "package.json")  # "type": "module"
    link = work / "node_modules"
    if not link.exists():
        link.symlink_to(installed / "node_modules", target_is_directory=True)
    return work


def start_node_reward(folder: Path, log_path: Path, *args: str, env: dict[str, str] | None = None, name: str = "node reward") -> ChildProcess:
    """`node reward.js ARGS --proto-dir <repo>/proto`, output appended to `log_path`."""
    node = shutil.which("node")
    assert node is not None
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [node, str(folder / "reward.js"), "--proto-dir", str(PROTO_DIR), *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=folder,
        )  # fmt: skip
    return ChildProcess(name, proc, log_path)
