"""rollstream.trainer.optimizer.HostAdamW against torch.optim.AdamW (the for-each
implementation) run on an fp32 copy of the same parameters with the same gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollstream.core import modeling
from rollstream.trainer.optimizer import HostAdamW

LR, BETAS, WD = 1e-2, (0.9, 0.99), 0.05


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4), torch.nn.LayerNorm(4))


def _grads(model: torch.nn.Module, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # A different scale per step, so that clipping (a per-step factor) changes Adam's result.
    return [
        {n: torch.randn(p.shape, generator=g) * (0.5 + 2.0 * k) for n, p in model.named_parameters()}
        for k in range(steps)
    ]


def _reference(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], max_grad_norm: float):
    """fp32 copy + torch.optim.AdamW(fused=False); returns masters and norms after each step."""
    params = {n: p.detach().clone().float().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, weight_decay=WD, eps=1e-8, fused=False, foreach=False)
    history, norms = [], []
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone()
        if max_grad_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params.values()])))
        opt.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history, norms


def _run_host(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], max_grad_norm: float):
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD)
    history = []
    for step in grads:
        for n, p in model.named_parameters():
            p.grad = step[n].clone()
        norm, bits = opt.step(max_grad_norm)
        history.append((norm, bits, {n: m.clone() for n, m in opt.master.items()}, {n: p.detach().clone() for n, p in model.named_parameters()}))
        # The model's gradients were consumed.
        assert all(p.grad is None for p in model.parameters())
    return opt, history


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_masters_match_torch_adamw_and_model_holds_bf16_of_master(max_grad_norm: float) -> None:
    model = _model()
    grads = _grads(model, steps=3)
    ref_history, ref_norms = _reference(model, grads, max_grad_norm)
    _, history = _run_host(model, grads, max_grad_norm)

    for k, ((norm, bits, masters, params), ref) in enumerate(zip(history, ref_history, strict=True)):
        assert norm == pytest.approx(ref_norms[k], rel=1e-6), f"step {k}"
        for name, m in masters.items():
            assert m.dtype == torch.float32 and m.device.type == "cpu"
            torch.testing.assert_close(m, ref[name], rtol=0, atol=1e-6, msg=f"step {k} {name}")
            # The model computes with exactly bf16(master), and that is what step() returns.
            expected = m.to(torch.bfloat16).float()
            assert params[name].dtype == torch.float32
            assert torch.equal(params[name], expected), f"step {k} {name}"
            assert np.array_equal(bits[name], modeling.tensor_to_bits(m)), f"step {k} {name}"


def test_clipping_is_active_and_changes_the_result() -> None:
    """The clipped run above is only a check of clipping if clipping changed something."""
    model = _model()
    grads = _grads(model, steps=3)
    clipped, norms = _reference(model, grads, max_grad_norm=1.0)
    unclipped, _ = _reference(model, grads, max_grad_norm=0.0)
    assert all(n > 1.0 for n in norms)  # every step was clipped
    diff = max(float((clipped[-1][n] - unclipped[-1][n]).abs().max()) for n in clipped[-1])
    assert diff > 1e-4


def test_reported_norm_is_the_total_norm_before_clipping() -> None:
    model = _model()
    grads = _grads(model, steps=1)
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD)
    for n, p in model.named_parameters():
        p.grad = grads[0][n].clone()
    expected = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads[0].values()]).double()))
    norm, _ = opt.step(max_grad_norm=0.5)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert norm > 0.5


def test_missing_gradients_count_as_zero() -> None:
    model = _model()
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=0.0)
    before = {n: m.clone() for n, m in opt.master.items()}
    norm, _ = opt.step(max_grad_norm=1.0)  # no p.grad anywhere
    assert norm == 0.0
    for n, m in opt.master.items():
        assert torch.equal(m, before[n])  # zero grad, zero decay: AdamW leaves the masters alone


def test_sync_model_writes_bf16_of_master() -> None:
    model = _model()
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD)
    # At construction the masters are the model's fp32 weights, not yet rounded to bf16.
    assert all(torch.equal(opt.master[n], p.detach()) for n, p in model.named_parameters())
    bits = opt.sync_model()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), opt.master[n].to(torch.bfloat16).float())
        assert np.array_equal(bits[n], modeling.tensor_to_bits(p))
    assert bits.keys() == opt.published_bits().keys()
