"""Helpers for the vLLM tier's tests (a module, not conftest: imported by name)."""

from __future__ import annotations

import numpy as np
import torch

from rollstream.core import modeling


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
