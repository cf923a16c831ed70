"""The source files one rollout enters: how many rooms a reader follows from prompt to weight update.

    .venv/bin/python benchmarks/rollout_files.py [--model DIR] [--colocate off|sync|async] [--beta 0] [--workdir DIR]

Runs `rollstream up` for two steps (the tiny test model unless --model; the built-in reward) under
coverage in every process, and counts the rollstream files in which a line inside a function ran
while a service loop's `turn` was on the stack (coverage's dynamic context, this file's plugin):
what a rollout enters, not what starting and stopping the run does. The context is the whole
process's, so the lines other threads of a service run during a turn count too (the fleet's push
threads, the gRPC handlers that apply and serve weights: the rollout's way back as weights); the
work of other processes (the reward's scoring workers) does not.
Prints one JSON object: the count, by package, and the files. Issue 45 measured 35 at ccd171e,
the same way (docs/benchmarks.md, "Files one rollout enters").
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import coverage

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


class TurnContext(coverage.CoveragePlugin):
    """Lines run under a service loop's `turn` get the context "rollout"."""

    def dynamic_context(self, frame: FrameType) -> str | None:
        code = frame.f_code
        return "rollout" if code.co_name == "turn" and "/rollstream/" in code.co_filename else None


def coverage_init(reg: Any, options: dict[str, str]) -> None:
    reg.add_dynamic_context(TurnContext())


def function_lines(path: str) -> set[int]:
    """The lines inside function bodies (a module's top level runs at import, not in a rollout)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines |= set(range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def entered(data_file: Path) -> list[str]:
    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    data = cov.get_data()
    data.set_query_context("rollout")
    found = []
    for path in data.measured_files():
        if "_pb2" not in path and set(data.lines(path) or []) & function_lines(path):
            found.append(path.split("/rollstream/", 1)[1])
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a Hugging Face folder (default: the tests' tiny model, built)")
    parser.add_argument("--colocate", default="off", choices=["off", "sync", "async"])
    parser.add_argument("--beta", default="0")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rollout-files-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import build_tiny_model

        model = str(build_tiny_model(work / "tiny"))
    rc = work / "coveragerc"
    rc.write_text(
        f"[run]\nparallel = true\npatch = subprocess\ndata_file = {work / 'cov'}\n"
        "source_pkgs = rollstream\nplugins = rollout_files\n"
    )
    env = {
        **os.environ,
        "COVERAGE_RCFILE": str(rc),
        "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")]),
    }
    up = [sys.executable, "-m", "coverage", "run", "-m", "rollstream.launcher.cli", "up", "--model", model]
    up += [
        "--workdir",
        str(work / "run"),
        "--trainer.steps",
        "2",
        "--trainer.beta",
        args.beta,
        "--colocate",
        args.colocate,
    ]
    done = subprocess.run(up, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
        return done.returncode
    subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], env=env, check=True, cwd=work)
    files = entered(work / "cov")
    by_package: dict[str, int] = {}
    for f in files:
        by_package[f.split("/")[0]] = by_package.get(f.split("/")[0], 0) + 1
    print(
        json.dumps(
            {
                "colocate": args.colocate,
                "beta": args.beta,
                "files": len(files),
                "by_package": by_package,
                "entered": files,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
