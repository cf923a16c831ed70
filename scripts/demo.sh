#!/usr/bin/env bash
# Install (idempotent) and run the demo: the whole system on an embedded redis-server and
# SmolLM2-135M-Instruct, learning single-digit addition. Arguments go to `rollstream up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${ROLLSTREAM_VENV:-.venv}/bin/rollstream" up "$@"
