"""vLLM colocated with the trainer on CUDA (launcher/colocated.py; VllmBackend.follow_trainer's
device-to-device path: the trainer's tensors handed to the model's own load_weights, in
process). On a GPU nothing is prepacked, so every engine parameter is read back and compared
with the trainer's published bits, bit for bit, after every step; the write's seconds (the
step's push_s, which holds the after-step hooks) are printed.

NOT RUN on the project's machines (no GPU; marked vllm_cuda, so the vLLM tier's `-m vllm`
leaves it out). On a GPU machine with CUDA vLLM:

    python -m pytest -p no:cacheprovider -o addopts=-ra -q -s -m vllm_cuda tests/vllm/test_vllm_colocated_cuda.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tier_helpers import assert_engine_holds

from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.vllm_backend import VllmBackend
from rollstream.launcher.colocated import EngineWeights, sampler_for
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import scored_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # shapes.py: the model folder

pytestmark = [
    pytest.mark.vllm_cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shapes

    return Path(shapes.save_model_folder("tiny", str(tmp_path_factory.mktemp("qwen-tiny"))))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_colocated_engine_holds_the_trainers_bits_after_every_step(model_dir: Path, asynchronous: bool) -> None:
    settings = load_settings(
        TrainerSettings, [], model=str(model_dir), device="cuda", lr=1e-3, max_new_tokens=6, group_size=4
    )
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    generator = GeneratorSettings(
        backend="vllm",
        device="cuda",
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.25,
        max_model_len=1024,
        model=str(model_dir),
    )
    engine, weights = sampler_for(trainer, generator, asynchronous=asynchronous)
    assert isinstance(engine, VllmBackend) and isinstance(weights, EngineWeights)
    assert (weights.lock is trainer.weights_lock) != asynchronous
    assert_engine_holds(engine, trainer.publisher.bits())
    start = {name: bits.copy() for name, bits in trainer.publisher.bits().items()}
    writes = []
    for seed in (1, 2, 3):
        trainer.train_and_push(
            scored_groups(seed, 2), targets=list, from_registry=False, record=lambda metrics, outcomes: None
        )
        assert weights.version == trainer.version == seed
        assert_engine_holds(engine, trainer.publisher.bits())
        writes.append(round(trainer.last_phases["push_s"], 4))
    moved = [name for name, bits in trainer.publisher.bits().items() if not np.array_equal(start[name], bits)]
    assert moved, "the weights never moved: the check would prove nothing"
    print(
        f"\ncolocated vLLM on CUDA ({'async' if asynchronous else 'sync'}): engine written in {writes} s per step; {len(moved)} tensors moved"
    )
