#!/usr/bin/env bash
# The one device call of a GPU kit (docs/gpu.md), from the repository root:
#
#   bash .gpu-kit/trainer/run.sh        (carry [".gpu-kit/trainer"])  kit 1, at most 8 minutes
#   bash .gpu-kit/system/run.sh         (carry [".gpu-kit/system"])   kit 2, right after kit 1
#   bash .gpu-kit/trainer/run.sh --only largest_split_14b --budget-s 300
#                                       (carry [".gpu-kit/trainer"])  14B alone, ~5 minutes
#
# Exit status: 0 every row ok (or skipped for a reason that is not time: GPU only, another
# kit's packages, installed already); 1 a row failed or timed out; 2 not run from a checkout
# (below) or bad arguments; 3 every row ok but the budget skipped a check: summary.json's
# `skipped` names it and why, run it alone with --only NAME.
#
# scripts/gpu_kit/build.py copies this file into each kit. Everything else is
# scripts/gpu_kit/checks.py (standard library only, so that it reports even an install
# that failed): checksums, `pip install --no-index --no-deps --target` onto PYTHONPATH (no
# venv: the machine's python3 is itself one), the machine, then the checks, each under its own
# time cap, leaving $OUT/summary.json and $OUT/results.tar.gz after every one.
# ROLLSTREAM_PY: the Python (default python3); ROLLSTREAM_REPO: the checkout (default: here).
set -u
kit=$(cd "$(dirname "$0")" && pwd)
repo=${ROLLSTREAM_REPO:-$PWD}
if [ ! -f "$repo/scripts/gpu_kit/checks.py" ]; then
    echo "run.sh: $repo is not a rollstream checkout: run from the repository root or set ROLLSTREAM_REPO" >&2
    exit 2
fi
exec "${ROLLSTREAM_PY:-python3}" "$repo/scripts/gpu_kit/checks.py" --kit "$kit" --repo "$repo" "$@"
