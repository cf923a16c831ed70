#!/usr/bin/env bash
# The Python packages the GPU scripts need besides what the GPU machine has (torch with CUDA,
# transformers, peft), as wheels, built here (where PyPI is reachable) to travel there.
#
#   scripts/gpu_wheelhouse.sh OUTDIR [PYTHON_VERSION]     (default 3.11, e.g. 3.12)
#
# Downloads binary wheels for linux x86_64 and that Python version, with their dependencies,
# pinned as on CI (constraints/cpu.txt), and writes OUTDIR/SHA256SUMS. scripts/gpu_benchmarks.sh
# --wheelhouse OUTDIR installs them there with `pip --no-index` into a venv that sees the
# machine's own torch. Torch, transformers and their CUDA libraries are not included: the GPU
# machine's own are used. About 50 MB (well under the 64 MiB a device call carries).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [PYTHON_VERSION]" >&2
    exit 2
fi
out=$1
pyver=${2:-3.11}
PY="${ROLLSTREAM_VENV:-.venv}/bin/python"
mkdir -p "$out"
# Constraints without the torch stack (the GPU machine keeps its own).
constraints=$(mktemp)
grep -viE '^(torch|triton|nvidia|transformers|tokenizers|huggingface|safetensors|accelerate)' constraints/cpu.txt > "$constraints" || true
"$PY" -m pip download -q -d "$out" -c "$constraints" \
    --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --python-version "$pyver" --implementation cp \
    -r scripts/gpu_requirements.txt
rm -f "$constraints"
(cd "$out" && sha256sum ./*.whl > SHA256SUMS)
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
