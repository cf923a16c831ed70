"""AdamW with the fp32 master weights and moments in host memory.

The model on the compute device holds bf16-valued weights (in its compute dtype); the
optimizer holds fp32 masters and moments on the CPU and runs torch's fused CPU AdamW.
A step: gradients to host, clip, AdamW on the masters, bf16 rounding of the masters back
into the model. The bf16 bits of every parameter are returned, because they are what gets
published: generators hold exactly these values.

On a CPU-only machine the "offload" is just where the tensors already live; the GPU
version (issue 4) keeps this interface and adds pinned buffers, buckets and overlap.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rollstream.core import modeling


class HostAdamW:
    def __init__(self, params: Mapping[str, torch.nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8):
        self.params = dict(params)
        pin = any(p.is_cuda for p in self.params.values())
        self.master: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            m = p.detach().to(device="cpu", dtype=torch.float32).clone()
            self.master[name] = m.pin_memory() if pin else m
        self.opt = torch.optim.AdamW(list(self.master.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    def published_bits(self) -> dict[str, np.ndarray]:
        """bf16 rounding of the masters: the weights the model computes with and publishes."""
        return {name: modeling.tensor_to_bits(m) for name, m in self.master.items()}

    @torch.no_grad()
    def sync_model(self) -> dict[str, np.ndarray]:
        """Write bf16(master) into the model's parameters; return those bits."""
        bits = self.published_bits()
        modeling.copy_bits_(self.params, bits)
        return bits

    @torch.no_grad()
    def step(self, max_grad_norm: float) -> tuple[float, dict[str, np.ndarray]]:
        """One AdamW step from the model's accumulated gradients. Returns (grad norm, new bits)."""
        for name, p in self.params.items():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self.master[name].grad = grad.to(device="cpu", dtype=torch.float32)
            p.grad = None
        grads = [m.grad for m in self.master.values()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(list(self.master.values()), max_grad_norm, norm)
        self.opt.step()
        for m in self.master.values():
            m.grad = None
        return float(norm), self.sync_model()

