"""The split layout's compiled AdamW kernel (csrc/split_adamw.c through split_kernel.py)
against torch's fused CPU AdamW, bit for bit: masters, moments, the served bits before and
after. scripts/install.sh builds it (services/trainer/setup.py); a machine without a C
compiler runs the torch path, which test_split_masters.py covers."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.adamw import adamw as functional_adamw

from rollstream.trainer import split_kernel
from rollstream.trainer.split_kernel import AdamWStep

N = 4096 + 64 * 3  # whole vectors of torch's kernel: the optimizer sends it no tail


@pytest.fixture(scope="module")
def kernel() -> split_kernel.SplitKernel:
    loaded = split_kernel.load(threads=3)
    if loaded is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here: the split layout runs its torch path (test_split_masters.py)")
    assert loaded is not None, (
        "a C compiler is here but the kernel is not built: pip install -e services/trainer (scripts/install.sh)"
    )
    return loaded


def _masters(g: torch.Generator) -> torch.Tensor:
    """Ordinary weights, and the awkward ones: zeros of both signs, subnormals, huge, exact
    bf16 ties (low half 0x8000), values next to a bf16 rounding boundary, powers of two."""
    w = torch.randn(N, generator=g) * 0.02
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.5e-45, 3.0e38, -3.0e38, 1.0, -1.0, 2.0**-126, 65504.0, 1e-3])
    w[: special.numel()] = special
    bits = w.view(torch.int32)
    bits[100:200] = (bits[100:200] & ~0xFFFF) | 0x8000  # exact ties
    bits[200:300] = (bits[200:300] & ~0xFFFF) | 0x7FFF  # just under
    return w


def _split(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = w.view(torch.int32)
    return (bits + 0x8000).bitwise_right_shift(16).to(torch.int16), bits.to(torch.int16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return ((hi.to(torch.int32) << 16) + lo.to(torch.int32)).view(torch.float32)


@pytest.mark.parametrize("grads", [torch.float32, torch.bfloat16])  # bf16: as a GPU sends them down
@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("lr", "betas", "weight_decay", "clip"),
    [
        (1e-3, (0.9, 0.999), 0.0, 1.0),
        (1e-5, (0.9, 0.95), 0.1, 0.37),  # decay and clipping
        (3e-4, (0.3, 0.99), 0.01, 1.0),  # 1 - beta1 >= 0.5: torch's lerp takes its other branch
    ],
)
def test_twenty_steps_equal_torchs_fused_adamw(
    kernel: split_kernel.SplitKernel,
    moments: torch.dtype,
    grads: torch.dtype,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    clip: float,
) -> None:
    g = torch.Generator().manual_seed(0)
    reference = _masters(g)
    hi, lo = _split(reference)
    m_ref, v_ref = torch.zeros(N, dtype=moments), torch.zeros(N, dtype=moments)
    m, v = m_ref.clone(), v_ref.clone()
    out = torch.empty(N, dtype=torch.bfloat16)
    old = np.empty(N, dtype=np.uint16)
    for step in range(1, 21):
        scale = 10.0 ** float(torch.empty(1).uniform_(-8, 2, generator=g))
        grad = torch.randn(N, generator=g) * scale
        grad[:50] = 0.0
        grad[50:60] = torch.tensor([1e30, -1e30, 1e-40, -1e-40, 3e38, -3e38, 1e-30, 7.0, -7.0, 0.5])
        grad = grad.to(grads).float()  # the values a bf16 gradient can hold
        served_before = hi.clone()

        clipped = grad * clip if clip < 1.0 else grad.clone()
        m32, v32 = m_ref.float(), v_ref.float()
        functional_adamw(
            [reference],
            [clipped],
            [m32],
            [v32],
            [],
            [torch.tensor(float(step - 1))],
            fused=True,
            amsgrad=False,
            beta1=betas[0],
            beta2=betas[1],
            lr=lr,
            weight_decay=weight_decay,
            eps=1e-8,
            maximize=False,
        )
        m_ref.copy_(m32)
        v_ref.copy_(v32)

        settings = AdamWStep(
            lr=lr, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=weight_decay, step=step, clip=clip
        )
        kernel.step(hi, lo, m, v, grad.to(grads), old, out, settings)

        assert torch.equal(_join(hi, lo).view(torch.int32), reference.view(torch.int32)), (
            f"masters differ at step {step}"
        )
        assert torch.equal(_bits(m), _bits(m_ref)), f"exp_avg differs at step {step}"
        assert torch.equal(_bits(v), _bits(v_ref)), f"exp_avg_sq differs at step {step}"
        assert np.array_equal(old, served_before.numpy().view(np.uint16))
        assert torch.equal(out.view(torch.int16), hi)
        assert torch.equal(hi, _split(reference)[0]), "served bits are not the master's rounding"


def test_threads_cut_anywhere_and_give_the_same_bits(kernel: split_kernel.SplitKernel) -> None:
    """Ranges per thread are an implementation detail: 1, 2 and 5 threads, an odd length."""
    n = 10_007
    results = []
    for threads in (1, 2, 5):
        loaded = split_kernel.load(threads=threads)
        assert loaded is not None
        g = torch.Generator().manual_seed(3)
        hi, lo = _split(torch.randn(n, generator=g))
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        out, old = torch.empty(n, dtype=torch.int16), np.empty(n, dtype=np.uint16)
        for step in (1, 2):
            loaded.step(
                hi,
                lo,
                m,
                v,
                torch.randn(n, generator=g),
                old,
                out,
                AdamWStep(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step),
            )
        results.append((hi, lo, m.view(torch.int16), v.view(torch.int16)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_refuses_mismatched_buffers(kernel: split_kernel.SplitKernel) -> None:
    hi, lo = torch.zeros(64, dtype=torch.int16), torch.zeros(64, dtype=torch.int16)
    m = v = torch.zeros(64, dtype=torch.bfloat16)
    settings = AdamWStep(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="one length"):
        kernel.step(
            hi, lo, m, v, torch.zeros(63), np.empty(64, dtype=np.uint16), torch.empty(64, dtype=torch.int16), settings
        )
    with pytest.raises(ValueError, match="dtypes"):
        kernel.step(
            hi,
            lo,
            m,
            v,
            torch.zeros(64, dtype=torch.float16),
            np.empty(64, dtype=np.uint16),
            torch.empty(64, dtype=torch.int16),
            settings,
        )
    with pytest.raises(ValueError, match="one length"):
        kernel.step(
            hi[::2],
            lo[::2],
            m[::2],
            v[::2],
            torch.zeros(32),
            np.empty(32, dtype=np.uint16),
            torch.empty(32, dtype=torch.int16),
            settings,
        )


def test_a_library_that_does_not_load_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel file built for another machine (here: not a library at all) is reported and
    skipped; the optimizer then steps with torch operations."""
    broken = tmp_path / "_split_adamw.abi3.so"
    broken.write_bytes(b"not an ELF file")
    spec = importlib.util.spec_from_file_location("rollstream.trainer._split_adamw", broken)
    monkeypatch.setattr(split_kernel.importlib.util, "find_spec", lambda name: spec)
    with caplog.at_level(logging.WARNING, logger=split_kernel.__name__):
        assert split_kernel.load() is None
    assert "split_kernel_unusable" in caplog.text
