"""The trainer's CUDA path (issue 14): HostAdamW with bf16 weights and gradients on the GPU,
fp32 masters and moments on the host, pinned double-buffered staging and side streams.

  - the offloaded step gives the same weights as a plain fp32-master AdamW (torch's fused CPU
    AdamW on fp32 copies) on the same gradients: bit for bit without clipping (the arithmetic
    is the same: the same fused kernel, elementwise), in both master layouts (split: the
    masters as their served bf16 bits and a 16-bit remainder; fp32), the GPU's weights being
    the layout's served rounding of the masters (optimizer.served_bits); with clipping the
    norm is taken on the GPU (a tree reduction) and on the CPU (chunked) differently, so
    within a stated tolerance;
  - gradient offload gives the same result as without: bit for bit with one backward per
    step; with gradient accumulation the device path adds bf16 gradients in bf16 and the
    offload path in fp32 on the host, so within a stated tolerance;
  - the published delta, built on the way from each bucket's old and new bits (on_piece:
    DeltaEncoder.add_piece), decodes to exactly the weights the model computes with on the
    GPU, in both layouts;
  - a checkpoint taken on the GPU resumes exactly.

Skipped where torch sees no CUDA device (CI never has one); the GPU kit (docs/gpu.md) runs
this tier first on a GPU machine. ROLLSTREAM_GPU_TIER_DEVICE=cpu runs the same checks on
the CPU (bf16 weights there too, plain copies instead of pinned staging and streams): how
the tier itself was checked on a machine without a GPU. Deterministic kernels are required
(embedding backward uses atomics otherwise), so CUBLAS_WORKSPACE_CONFIG is set before CUDA
starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA init

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rollstream.core import deltas, modeling
from rollstream.trainer import checkpoint
from rollstream.trainer.grpo import LossConfig
from rollstream.trainer.optimizer import HostAdamW, MasterLayout, OnPiece, served_bits
from rollstream.trainer.step import StepConfig, train_step
from synthetic import scored_groups  # tests/synthetic.py

DEVICE = os.environ.get("ROLLSTREAM_GPU_TIER_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
    ),
]

LR, BETAS, WD = 1e-3, (0.9, 0.999), 0.01
BUCKET_MB = 0.05  # ~13k elements: the tiny model's 0.3M parameters cross many buckets


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def step_config(token_budget: int = 4096, max_grad_norm: float = 0.0) -> StepConfig:
    loss = LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0, tis_cap=0.0, max_completion_tokens=16)
    return StepConfig(
        loss,
        token_budget=token_budget,
        chunk_tokens=64,
        temperature=1.0,
        max_grad_norm=max_grad_norm,
        device=DEVICE,
        share_prompts=False,
    )


def load(
    model_dir: Path, grad_offload: bool = False, master_layout: MasterLayout = "split"
) -> tuple[torch.nn.Module, HostAdamW, int]:
    """The tiny model on the GPU in bf16 at version 0, and its host optimizer."""
    model, tokenizer = modeling.load_model(model_dir, dtype="bfloat16", device=DEVICE)
    model.train()
    opt = HostAdamW(
        modeling.named_weights(model),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=BUCKET_MB,
        grad_offload=grad_offload,
        master_layout=master_layout,
        moments_dtype="float32",
    )
    opt.sync_model()
    return model, opt, tokenizer.pad_token_id


def gpu_bits(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The weights the model computes with, read back from the GPU."""
    return modeling.model_bits(model)


class Capturing:
    """`opt` as train_step uses it, keeping the gradients of the last step as HostAdamW is
    about to read them (fp32, on the host) and every reported norm: a reference optimizer
    then gets the very same gradients."""

    def __init__(self, model: torch.nn.Module, opt: HostAdamW):
        self.model, self.opt = model, opt
        self.grads: dict[str, torch.Tensor] = {}
        self.norms: list[float] = []

    def step(
        self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None
    ) -> tuple[float, dict[str, np.ndarray]]:
        self.grads = {
            n: p.grad.detach().to(device="cpu", dtype=torch.float32)
            for n, p in modeling.named_weights(self.model).items()
        }
        norm, bits = self.opt.step(max_grad_norm, on_piece, model)
        self.norms.append(norm)
        return norm, bits

    def discard_grads(self) -> None:
        self.opt.discard_grads()

    def wait(self) -> None:
        self.opt.wait()


def fp32_reference(opt: HostAdamW) -> tuple[dict[str, torch.Tensor], torch.optim.AdamW]:
    """Plain fp32-master AdamW: copies of HostAdamW's masters and torch's fused CPU AdamW."""
    masters = {n: m.clone().requires_grad_(True) for n, m in opt.master.items()}
    return masters, torch.optim.AdamW(list(masters.values()), lr=LR, betas=BETAS, weight_decay=WD, eps=1e-8, fused=True)


@pytest.mark.parametrize("layout", ["split", "fp32"])
def test_offloaded_step_is_fp32_master_adamw_bit_for_bit(tiny_model_dir: Path, layout: MasterLayout) -> None:
    model, opt, pad = load(tiny_model_dir, master_layout=layout)
    assert opt._copier.cuda == (DEVICE == "cuda") and len(opt.buckets) > 4  # on CUDA: pinned staging, side streams
    masters, reference = fp32_reference(opt)
    capturing = Capturing(model, opt)
    cfg = step_config()
    for step in range(3):
        train_step(model, capturing, scored_groups(step, 4), cfg, pad_id=pad)  # type: ignore[arg-type]  # Capturing wraps HostAdamW's calls, it is not one
        for n, m in masters.items():
            m.grad = capturing.grads[n]
        reference.step()
        got = gpu_bits(model)
        for n, m in masters.items():
            assert torch.equal(opt.master[n], m.detach()), f"step {step}: master {n}"
            assert np.array_equal(got[n], served_bits(m, layout)), f"step {step}: GPU weights {n}"


def test_clipped_offloaded_step_is_within_tolerance_of_torch_clipping(tiny_model_dir: Path) -> None:
    """The clip factor comes from the GPU's norm (fp32 tree reduction) here and from torch's
    CPU clip_grad_norm_ in the reference: equal to ~1e-6 relative, so the updates agree to a
    few fp32 ulps of the update (1e-7 absolute at lr 1e-3), and a master can still round to
    the neighbouring fp32 value: one ulp of the master itself, 1.19e-7 for a norm gain just
    above 1.0 (the H100's first run failed there, 2026-11-27, on atol 1e-7 alone). Stated:
    1e-7 absolute plus 2 ulps (2**-22) relative, and the norm 1e-5 relative."""
    model, opt, pad = load(tiny_model_dir)
    masters, reference = fp32_reference(opt)
    capturing = Capturing(model, opt)
    for step in range(3):
        train_step(model, capturing, scored_groups(step, 4), step_config(max_grad_norm=1e-3), pad_id=pad)  # type: ignore[arg-type]  # Capturing wraps HostAdamW's calls, it is not one
        for n, m in masters.items():
            m.grad = capturing.grads[n]
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(masters.values()), 1e-3))
        assert ref_norm > 1e-3, "clipping must be active for this test to mean anything"
        assert capturing.norms[-1] == pytest.approx(ref_norm, rel=1e-5)
        reference.step()
        for n, m in masters.items():
            where = f"step {step}: master {n}"
            torch.testing.assert_close(
                opt.master[n], m.detach(), rtol=2**-22, atol=1e-7, msg=lambda text: f"{where}: {text}"
            )


def test_gradient_offload_matches_the_device_path(tiny_model_dir: Path) -> None:
    """One micro-batch per step, no clipping: bit for bit. Several micro-batches, clipped:
    the device adds bf16 gradients in bf16 and the offload path adds them in fp32 on the host
    (more precise), and the norm is taken on the device in one case and on the host in the
    other. AdamW moves a weight by about lr a step, by the sign of its gradient early on, so
    stated: fewer than 1% of the masters differ by more than 5% of lr per step taken (0.24%
    at most per tensor when this was written, checked on the CPU), and none by more than
    2 lr per step (a near-zero accumulated gradient whose sign the bf16 additions flipped)."""
    for budget, max_grad_norm, exact in ((4096, 0.0, True), (24, 1e-3, False)):
        runs = {}
        for offload in (False, True):
            model, opt, pad = load(tiny_model_dir, grad_offload=offload)
            for step in range(3):
                r = train_step(
                    model,
                    opt,
                    scored_groups(step, 4),
                    step_config(token_budget=budget, max_grad_norm=max_grad_norm),
                    pad_id=pad,
                )
                if not exact:
                    assert r.grad_norm > max_grad_norm  # clipping active
            runs[offload] = ({n: m.clone() for n, m in opt.master.items()}, gpu_bits(model))
        if exact:
            for n, m in runs[False][0].items():
                assert torch.equal(runs[True][0][n], m), n
                assert np.array_equal(runs[True][1][n], runs[False][1][n]), n
        else:
            diff = torch.cat([(runs[True][0][n] - m).abs().reshape(-1) for n, m in runs[False][0].items()])
            assert float((diff > 0.05 * LR * 3).float().mean()) < 0.01
            assert float(diff.max()) <= 2 * LR * 3 * 1.01


@pytest.mark.parametrize("layout", ["split", "fp32"])
def test_delta_built_on_the_way_decodes_to_the_gpu_weights(tiny_model_dir: Path, layout: MasterLayout) -> None:
    model, opt, pad = load(tiny_model_dir, master_layout=layout)
    held = {n: b.copy() for n, b in gpu_bits(model).items()}
    fingerprint = deltas.model_fingerprint({n: b.shape for n, b in held.items()})
    for step in range(3):
        encoder = deltas.DeltaEncoder(held, step, step + 1, fingerprint)
        r = train_step(model, opt, scored_groups(step, 4), step_config(), pad_id=pad, on_piece=encoder.add_piece)
        payload, stats = encoder.finish()
        assert stats.changed_values > 0
        info, changed = deltas.decode(payload, held, step, fingerprint)
        held = {**held, **changed}
        computing = gpu_bits(model)
        assert r.trained_bits is not None
        for n in held:
            assert np.array_equal(held[n], computing[n]), f"step {step}: {n}"
            assert np.array_equal(r.trained_bits[n], computing[n]), f"step {step}: {n}"


def test_checkpoint_taken_on_the_gpu_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = step_config(max_grad_norm=1.0)
    model, opt, pad = load(tiny_model_dir)
    for step in range(2):
        train_step(model, opt, scored_groups(step, 4), cfg, pad_id=pad)
    state = checkpoint.CheckpointState(version=2, step=2, optimizer_steps=opt.step_count)
    path = checkpoint.save(tmp_path / "ckpt", state, opt.state_tensors(), checkpoint.rng_state())

    resumed, opt2, _ = load(tiny_model_dir)
    bits = opt2.load_state(checkpoint.optimizer_tensors(path), checkpoint.load_state(path).optimizer_steps)
    assert all(np.array_equal(bits[n], b) for n, b in gpu_bits(model).items())
    for step in range(2, 4):
        train_step(model, opt, scored_groups(step, 4), cfg, pad_id=pad)
        train_step(resumed, opt2, scored_groups(step, 4), cfg, pad_id=pad)
    a, b = gpu_bits(model), gpu_bits(resumed)
    for n in a:
        assert np.array_equal(a[n], b[n]), n
    for n, m in opt.master.items():
        assert torch.equal(opt2.master[n], m), n
