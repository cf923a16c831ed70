#!/usr/bin/env bash
# Install TRL (the comparison baseline of benchmarks/vs_trl.py) into ./.venv-trl (idempotent).
#   bash scripts/install_trl.sh
# A venv of its own: the benchmark compares rollstream with TRL as people install it, and
# TRL's pins must not move the project's. Same torch and transformers as the project's CPU
# pins (constraints/cpu.txt), so the two sides differ only in the training loop. rollstream's
# core and trainer packages go in too, without their servers' dependencies mattering: the
# TRL side imports only the prompt source and the reward verifier, so both sides see the
# same tasks and the same reward by construction.
# ROLLSTREAM_TRL_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ROLLSTREAM_TRL_VENV:-.venv-trl}"
PY="${PYTHON:-python3}"
TRL_PIN="trl==1.16.0"

stamp="$VENV/.rollstream-installed"
inputs=$( (cat core/pyproject.toml services/reward/pyproject.toml services/trainer/pyproject.toml constraints/cpu.txt; echo "$TRL_PIN") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints/cpu.txt)
fi
"$VENV/bin/pip" install -q "${constraints[@]}" "$TRL_PIN" psutil -e "core[torch]" -e services/reward -e services/trainer
echo "$inputs" > "$stamp"
echo "installed into $VENV"
