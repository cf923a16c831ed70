"""Gradient offload (rollstream.trainer.staging.GradOffload, HostAdamW(grad_offload=True)) on the
CPU: the staging ring and the host thread run as on a GPU, with plain copies. The
accumulator holds the bits of the synchronous offload (each gradient widened to fp32 and
added in the hook), and the step is the one fed those gradients; discarding, a refused step
and a failure in the host thread leave nothing pending, and the failure is raised."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from rollstream.trainer import staging
from rollstream.trainer.optimizer import HostAdamW, MasterLayout, NonFiniteStep

LR, BETAS, WD = 1e-2, (0.9, 0.99), 0.05
MAX_NORM = 0.05  # below every step's norm here: clipping is active
# 64-element buckets, so staging slots of 256 bytes: 128 bf16 or 64 fp32 gradient values.
TINY_BUCKET_MB = 0.0001


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 64)  # 512 weights: 4 slots' worth in bf16, 8 in fp32 (more than the ring)
        self.out = torch.nn.Linear(64, 4)
        self.unused = torch.nn.Linear(4, 4)  # never in the graph: no gradient, no hook call
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.out(torch.tanh(self.inp(x))))


def _net(dtype: torch.dtype = torch.float32) -> _Net:
    torch.manual_seed(0)
    return _Net().to(dtype)


def _loss(model: _Net, x: torch.Tensor) -> torch.Tensor:
    return (model(x.to(model.inp.weight.dtype)).float() ** 2).mean()


def _xs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 8, generator=g) * (1 + k) for k in range(n)]


def _offloaded(model: torch.nn.Module, layout: MasterLayout = "split") -> HostAdamW:
    return HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout=layout,
        grad_offload=True,
        bucket_mb=TINY_BUCKET_MB,
        moments_dtype="float32",
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["split", "fp32"])
def test_accumulator_and_step_have_the_bits_of_the_synchronous_offload(
    layout: MasterLayout, dtype: torch.dtype
) -> None:
    model = _net(dtype)
    twin = copy.deepcopy(model)  # the same model without hooks: the synchronous reference
    opt = _offloaded(model, layout)
    per_slot = opt._grad_offload.slot_bytes // model.inp.weight.element_size() if opt._grad_offload else 0
    assert 0 < per_slot < model.inp.weight.numel()  # the big weight goes down in slices
    # The reference step: a HostAdamW on fp32 copies of the weights, fed the synchronously
    # accumulated gradients as plain .grad.
    ref_params = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    ref_opt = HostAdamW(
        ref_params,
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout=layout,
        bucket_mb=TINY_BUCKET_MB,
        moments_dtype="float32",
    )
    xs = _xs(12)
    for step in range(4):
        acc = {n: torch.zeros(p.numel()) for n, p in twin.named_parameters()}
        for x in xs[3 * step : 3 * step + 3]:  # three micro-batches a step
            _loss(model, x).backward()
            assert all(p.grad is None for p in model.parameters())  # nothing left on the model
            _loss(twin, x).backward()
            for n, p in twin.named_parameters():
                if p.grad is not None:
                    acc[n].add_(p.grad.reshape(-1).to(torch.float32))  # what the synchronous hook did
                    p.grad = None
        norm = opt.grad_norm()  # waits for the host thread
        assert opt.host_grad is not None
        for n, (off, count, _shape) in opt.layout.items():
            assert torch.equal(_bits(opt.host_grad[off : off + count]), _bits(acc[n])), f"step {step}: {n}"
        assert not acc["unused.weight"].any() and acc["inp.weight"].count_nonzero() > 256

        for n, p in ref_params.items():
            p.grad = acc[n].view(p.shape)
        ref_norm, ref_bits = ref_opt.step(MAX_NORM)
        got_norm, bits = opt.step(MAX_NORM)
        assert got_norm == norm == ref_norm and norm > MAX_NORM
        assert opt.host_grad.count_nonzero() == 0  # cleared for the next step
        for n, p in model.named_parameters():
            assert np.array_equal(bits[n], ref_bits[n]), f"step {step}: {n}"
            assert torch.equal(_bits(opt.master[n]), _bits(ref_opt.master[n])), f"step {step}: {n}"
            served = p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(served, bits[n]), f"step {step}: {n}"  # the model computes with them
        with torch.no_grad():
            for (_, t), p in zip(twin.named_parameters(), model.parameters()):
                t.copy_(p)


def test_offload_under_the_overlapped_step_gives_the_sequential_bits() -> None:
    """HostAdamW.step with the model runs the update on its own thread while the next
    micro-batches' forward starts; their backward waits for it (as step._accumulate does),
    so the hooks never add into an accumulator the update is still reading or clearing."""
    masters = {}
    for overlap in (False, True):
        model = _net(torch.bfloat16)
        opt = _offloaded(model)
        xs = _xs(12)
        for step in range(4):
            for x in xs[3 * step : 3 * step + 3]:
                if overlap:
                    opt.wait()
                _loss(model, x).backward()
            opt.step(MAX_NORM, model=model if overlap else None)
        opt.wait()
        masters[overlap] = {n: m.clone() for n, m in opt.master.items()}
    for n, m in masters[False].items():
        assert torch.equal(_bits(masters[True][n]), _bits(m)), n


SMALL_BUCKET_MB = 0.02  # one bucket, and a staging slot that holds the small model's weight


def _small() -> torch.nn.Module:
    """Two gradient slices a micro-batch (weight and bias), fewer than the ring's slots:
    backward hands two micro-batches over without waiting for the host thread."""
    torch.manual_seed(0)
    return torch.nn.Linear(64, 64)


def _small_xs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 64, generator=g) for _ in range(n)]


def _small_offloaded(model: torch.nn.Module) -> HostAdamW:
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        grad_offload=True,
        bucket_mb=SMALL_BUCKET_MB,
        moments_dtype="float32",
    )
    assert opt._grad_offload is not None and opt._grad_offload.slot_bytes >= 4 * 64 * 64
    return opt


def _loss_small(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).mean()


def _fresh_step(xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model = _small()
    opt = _small_offloaded(model)
    for x in xs:
        _loss_small(model, x).backward()
    opt.step(MAX_NORM)
    return {n: m.clone() for n, m in opt.master.items()}


def _hold_host_thread(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The host thread waits at each add until the returned event is set."""
    gate = threading.Event()
    add = staging._add

    def held_add(dst: torch.Tensor, src: torch.Tensor) -> None:
        assert gate.wait(timeout=300), "the test never let the host thread go on"
        add(dst, src)

    monkeypatch.setattr(staging, "_add", held_add)
    return gate


def test_adds_land_in_the_order_the_hooks_fired(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-batches' adds queued behind a held host thread, onto an accumulator that
    already holds one: fp32 addition is not associative, so only the hooks' order gives the
    synchronous bits (a + g2) + g3."""
    gate = _hold_host_thread(monkeypatch)
    gate.set()
    model = _small()
    twin = copy.deepcopy(model)
    opt = _small_offloaded(model)
    xs = _small_xs(3, seed=11)
    _loss_small(model, xs[0]).backward()
    opt.grad_norm()  # the first micro-batch is in the accumulator
    gate.clear()
    for x in xs[1:]:
        _loss_small(model, x).backward()
    assert opt._grad_offload is not None and opt._grad_offload.pending == 4
    gate.set()
    opt.grad_norm()
    acc = {n: torch.zeros(p.numel()) for n, p in twin.named_parameters()}
    for x in xs:
        _loss_small(twin, x).backward()
        for n, p in twin.named_parameters():
            assert p.grad is not None
            acc[n].add_(p.grad.reshape(-1))
            p.grad = None
    assert opt.host_grad is not None
    for n, (off, count, _shape) in opt.layout.items():
        assert torch.equal(_bits(opt.host_grad[off : off + count]), _bits(acc[n])), n


@pytest.mark.parametrize("how", ["discard_grads", "non-finite step"])
def test_dropped_gradients_leave_nothing_pending_and_the_next_step_is_exact(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host thread is held at its first add, so that the adds are certainly pending when
    the gradients are dropped: dropping them must wait for those adds, or they would land in
    the next step's accumulator."""
    gate = _hold_host_thread(monkeypatch)
    model = _small()
    opt = _small_offloaded(model)
    assert opt._grad_offload is not None and opt.host_grad is not None
    x = _small_xs(1, seed=7)[0]
    if how == "non-finite step":
        x[0, 0] = float("inf")
    _loss_small(model, x).backward()
    assert opt._grad_offload.pending == 2 and opt.host_grad.count_nonzero() == 0
    gate.set()
    if how == "discard_grads":
        opt.discard_grads()
    else:
        with pytest.raises(NonFiniteStep):
            opt.step(MAX_NORM)
    assert opt._grad_offload.pending == 0 and opt.host_grad.count_nonzero() == 0 and opt.step_count == 0

    _next_step_is_a_fresh_one(model, opt)


def _next_step_is_a_fresh_one(model: torch.nn.Module, opt: HostAdamW) -> None:
    """After a dropped accumulation, a step from two micro-batches is a fresh optimizer's, bit for bit."""
    xs = _small_xs(2, seed=3)
    for x in xs:
        _loss_small(model, x).backward()
    opt.step(MAX_NORM)
    for n, m in _fresh_step(xs).items():
        assert torch.equal(_bits(opt.master[n]), _bits(m)), n


def test_a_failure_in_the_host_thread_is_raised_by_the_step_which_applies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    add = staging._add
    calls = []

    def failing_add(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(src.numel())
        if len(calls) == 2:
            raise OSError("injected: the second add failed")
        add(dst, src)

    monkeypatch.setattr(staging, "_add", failing_add)
    model = _small()
    opt = _small_offloaded(model)
    before = {n: m.clone() for n, m in opt.master.items()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for x in _small_xs(2, seed=5):
        _loss_small(model, x).backward()  # the failure is the host thread's: backward goes on
    with pytest.raises(
        RuntimeError, match="gradient offload: adding a gradient into the host accumulator failed"
    ) as raised:
        opt.step(MAX_NORM)
    assert isinstance(raised.value.__cause__, OSError)
    assert len(calls) == 2  # the adds after the failure were skipped, not attempted
    assert opt.step_count == 0
    assert opt._grad_offload is not None and opt._grad_offload.pending == 0
    assert opt.host_grad is not None and opt.host_grad.count_nonzero() == 0  # the broken accumulation dropped
    for n, p in model.named_parameters():
        assert torch.equal(opt.master[n], before[n]) and torch.equal(p.detach(), weights[n]), n

    monkeypatch.setattr(staging, "_add", add)
    _next_step_is_a_fresh_one(model, opt)


def test_the_offloader_is_freed_with_the_optimizer_and_model() -> None:
    """The host thread lives as long as the process but holds slices only while it adds
    them: the accumulator and the staging ring go with the optimizer."""
    model = _small()
    opt = _small_offloaded(model)
    _loss_small(model, _small_xs(1, seed=0)[0]).backward()
    opt.grad_norm()
    gone = weakref.ref(opt._grad_offload) if opt._grad_offload is not None else None
    assert gone is not None and gone() is not None
    del opt, model
    gc.collect()
    assert gone() is None


def test_bad_staging_sizes_are_refused() -> None:
    params = dict(_small().named_parameters())
    layout = {"weight": (0, 4096, (64, 64)), "bias": (4096, 64, (64,))}
    with pytest.raises(ValueError, match="at least one staging slot"):
        staging.GradOffload(params, layout, slot_bytes=256, slots=0)
    with pytest.raises(ValueError, match="must hold at least 8 bytes"):
        staging.GradOffload(params, layout, slot_bytes=4)
