"""The vLLM CUDA tier: VllmBackend on a GPU, run by GPU kit 3 (docs/gpu.md).

    python -m pytest -m vllm_cuda tests/vllm_cuda

Every module here is marked `vllm_cuda`; this conftest skips its tests, with the reason,
where vllm is not installed or torch sees no CUDA device (every CI machine and the project's
CPU machine), so the tier costs nothing there. The model is a small Qwen2 shape with random
weights built from a config (benchmarks/shapes.py): nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from helpers import skip_folder

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # shapes.py: the model folder
sys.path.insert(0, str(ROOT / "tests" / "vllm"))  # tier_helpers.py


def _reason() -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # tests/vllm is a namespace package named "vllm"
        return "vllm is not installed (GPU kit 3 installs it on a GPU machine: docs/gpu.md)"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


SKIP_REASON = _reason()
# The in-process engine: the tests read the engine's weights back (VllmBackend.engine_bits).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SKIP_REASON:
        return
    skip_folder(items, Path(__file__).parent, SKIP_REASON)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shapes

    return Path(shapes.save_model_folder("tiny", str(tmp_path_factory.mktemp("qwen-tiny"))))
