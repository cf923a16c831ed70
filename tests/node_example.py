"""examples/custom_reward_node for the tests: its npm packages installed once into a cache
folder, and the service started as a real `node` process.

`install_node_example(work)` returns the folder to run it from: a copy of the example's
sources in `work` whose `node_modules` links to the packages of its package-lock.json,
installed once into a cache (npm_packages.py). It skips the test, saying why, where `node`
or `npm` is absent or the registry cannot be reached; nothing is written into the
repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from npm_packages import npm_packages
from procs import ChildProcess

NODE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_reward_node"
PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def install_node_example(work: Path) -> Path:
    if shutil.which("node") is None:
        pytest.skip("examples/custom_reward_node needs `node` and `npm` on PATH (Node.js >= 18)")
    installed = npm_packages(NODE_EXAMPLE, "examples/custom_reward_node")
    work.mkdir(parents=True, exist_ok=True)
    for source in NODE_EXAMPLE.glob("*.js"):
        shutil.copy2(source, work / source.name)
    shutil.copy2(NODE_EXAMPLE / "package.json", work / "package.json")  # "type": "module"
    link = work / "node_modules"
    if not link.exists():
        link.symlink_to(installed / "node_modules", target_is_directory=True)
    return work


def start_node_reward(
    folder: Path, log_path: Path, *args: str, env: dict[str, str] | None = None, name: str = "node reward"
) -> ChildProcess:
    """`node reward.js ARGS --proto-dir <repo>/proto`, output appended to `log_path`."""
    node = shutil.which("node")
    assert node is not None
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [node, str(folder / "reward.js"), "--proto-dir", str(PROTO_DIR), *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=folder,
        )  # fmt: skip
    return ChildProcess(name, proc, log_path)
