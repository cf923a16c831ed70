"""rollstream.trainer.optimizer.HostAdamW against torch.optim.AdamW (the for-each and the
fused implementation) run on an fp32 copy of the same parameters with the same gradients, in
both master layouts; its buckets, bf16 moments, gradient offload, the per-piece hand-over of
old and new bits (the delta built on the way), state round trip across layouts, gradient norm
and bits buffers. The split layout's own exactness: tests/unit/test_split_masters.py."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from rollstream.core import modeling
from rollstream.trainer.optimizer import HostAdamW, MasterLayout, served_bits

LR, BETAS, WD = 1e-2, (0.9, 0.99), 0.05
LAYOUTS: list[MasterLayout] = ["split", "fp32"]


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
    opt = torch.optim.AdamW(
        list(params.values()), lr=LR, betas=BETAS, weight_decay=WD, eps=1e-8, fused=False, foreach=False
    )
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


def _run_host(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], max_grad_norm: float, layout: MasterLayout):
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout=layout,
        moments_dtype="float32",
    )
    history = []
    for step in grads:
        for n, p in model.named_parameters():
            p.grad = step[n].clone()
        norm, bits = opt.step(max_grad_norm)
        # Copies: the split layout's bits are views of its masters, changed by the next step.
        history.append(
            (
                norm,
                {n: b.copy() for n, b in bits.items()},
                {n: m.clone() for n, m in opt.master.items()},
                {n: p.detach().clone() for n, p in model.named_parameters()},
            )
        )
        # The model's gradients were consumed.
        assert all(p.grad is None for p in model.parameters())
    return opt, history


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_masters_match_torch_adamw_and_model_holds_bf16_of_master(max_grad_norm: float, layout: MasterLayout) -> None:
    model = _model()
    grads = _grads(model, steps=3)
    ref_history, ref_norms = _reference(model, grads, max_grad_norm)
    _, history = _run_host(model, grads, max_grad_norm, layout)

    for k, ((norm, bits, masters, params), ref) in enumerate(zip(history, ref_history, strict=True)):
        assert norm == pytest.approx(ref_norms[k], rel=1e-6), f"step {k}"
        for name, m in masters.items():
            assert m.dtype == torch.float32 and m.device.type == "cpu"
            torch.testing.assert_close(m, ref[name], rtol=0, atol=1e-6, msg=f"step {k} {name}")
            # The model computes with exactly the served bf16 rounding of the master, and that
            # is what step() returns.
            expected = served_bits(m, layout)
            assert params[name].dtype == torch.float32
            assert np.array_equal(modeling.tensor_to_bits(params[name]), expected), f"step {k} {name}"
            assert np.array_equal(bits[name], expected), f"step {k} {name}"


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
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD, moments_dtype="float32")
    for n, p in model.named_parameters():
        p.grad = grads[0][n].clone()
    expected = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads[0].values()]).double()))
    norm, _ = opt.step(max_grad_norm=0.5)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert norm > 0.5


def test_missing_gradients_count_as_zero() -> None:
    model = _model()
    opt = HostAdamW(dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=0.0, moments_dtype="float32")
    before = {n: m.clone() for n, m in opt.master.items()}
    norm, _ = opt.step(max_grad_norm=1.0)  # no p.grad anywhere
    assert norm == 0.0
    for n, m in opt.master.items():
        assert torch.equal(m, before[n])  # zero grad, zero decay: AdamW leaves the masters alone


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_model_writes_bf16_of_master(layout: MasterLayout) -> None:
    model = _model()
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout=layout,
        moments_dtype="float32",
    )
    # At construction the masters are the model's fp32 weights, not yet rounded to bf16.
    assert all(torch.equal(opt.master[n], p.detach()) for n, p in model.named_parameters())
    bits = opt.sync_model()
    for n, p in model.named_parameters():
        assert np.array_equal(modeling.tensor_to_bits(p), served_bits(opt.master[n], layout))
        assert np.array_equal(bits[n], modeling.tensor_to_bits(p))
    assert bits.keys() == opt.published_bits().keys()


# --- buckets, bf16 moments, gradient offload, state --------------------------------------------

# 0.00025 MB = 65 fp32 elements -> 64-element buckets, 0.0004 MB -> 128 (multiples of 64): parameters are split
# across buckets and buckets hold pieces of several parameters.
BUCKET_SIZES = [0.00025, 0.0004, 32.0]


def _fused_reference(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], max_grad_norm: float):
    """torch.optim.AdamW(fused=True) on an fp32 copy, with torch's own clipping."""
    params = {n: p.detach().clone().float().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, weight_decay=WD, eps=1e-8, fused=True)
    history = []
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
        opt.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history, opt, params


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_bucketed_step_equals_fused_torch_adamw(max_grad_norm: float, layout: MasterLayout) -> None:
    """Bucket boundaries cut through parameters; AdamW is elementwise, so every bucket size
    gives the same fused kernel's result. Against torch's fused AdamW run per parameter, the
    masters and moments agree to the last bit or one: the CPU kernel runs SIMD lanes and a
    scalar tail, whose roundings can differ by an ulp, and a small parameter sits in the
    tail of its own tensor in torch's run but among the lanes of a bucket here."""
    model = _model()
    grads = _grads(model, steps=4)
    ref_history, ref_opt, ref_params = _fused_reference(model, grads, max_grad_norm)
    results = []
    for bucket_mb in BUCKET_SIZES:
        m = _model()
        opt = HostAdamW(
            dict(m.named_parameters()),
            lr=LR,
            betas=BETAS,
            weight_decay=WD,
            bucket_mb=bucket_mb,
            master_layout=layout,
            moments_dtype="float32",
        )
        if bucket_mb < 1:
            assert len(opt.buckets) > 1
            assert any(len(b.pieces) > 1 for b in opt.buckets)  # a bucket holds several parameters
            names = [pc.name for b in opt.buckets for pc in b.pieces]
            assert len(names) > len(set(names))  # a parameter spans several buckets
        for k, step in enumerate(grads):
            for n, p in m.named_parameters():
                p.grad = step[n].clone()
            opt.step(max_grad_norm)
            for n, master in opt.master.items():
                torch.testing.assert_close(master, ref_history[k][n], rtol=0, atol=1e-7, msg=f"step {k} {n}")
        state = opt.state_tensors()
        for n, p in ref_params.items():
            # With clipping, the factor itself can differ in its last bit: the total norm is
            # summed in another order (see staging._sum_of_squares).
            torch.testing.assert_close(state[f"exp_avg/{n}"], ref_opt.state[p]["exp_avg"], rtol=1e-6, atol=1e-8, msg=n)
            torch.testing.assert_close(
                state[f"exp_avg_sq/{n}"], ref_opt.state[p]["exp_avg_sq"], rtol=1e-6, atol=1e-9, msg=n
            )
            assert opt.step_count == int(ref_opt.state[p]["step"])
        if max_grad_norm == 0:
            # Most of it is bit-identical to torch's run.
            same = sum(int((opt.master[n] == ref_history[-1][n]).sum()) for n in opt.master)
            assert same >= 0.99 * opt.numel
        results.append({k: v.clone() for k, v in state.items()} | {f"joined/{n}": m for n, m in opt.master.items()})
    for other in results[1:]:
        for key, value in results[0].items():
            assert torch.equal(other[key], value), key  # bucket size changes nothing, bit for bit


def test_buckets_cover_every_element_once() -> None:
    model = _model()
    opt = HostAdamW(
        dict(model.named_parameters()), lr=LR, betas=BETAS, weight_decay=WD, bucket_mb=0.0004, moments_dtype="float32"
    )
    covered = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in model.named_parameters()}
    for b in opt.buckets:
        assert b.start % 64 == 0 and b.size > 0
        assert sum(pc.count for pc in b.pieces) == b.size
        for pc in b.pieces:
            covered[pc.name][pc.param_start : pc.param_start + pc.count] += 1
            # The piece sits where the flat layout says.
            off = opt.layout[pc.name][0]
            assert b.start + pc.bucket_start == off + pc.param_start
    assert all(bool((c == 1).all()) for c in covered.values())
    assert opt.buckets[-1].end == opt.numel == sum(p.numel() for p in model.parameters())


def _bf16_moment_reference(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]]):
    """AdamW written out (PyTorch's AdamW formula), keeping the moments in bf16 between steps:
    what moments_dtype = bfloat16 promises."""
    b1, b2 = BETAS
    params = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    m = {n: torch.zeros_like(p, dtype=torch.bfloat16) for n, p in params.items()}
    v = {n: torch.zeros_like(p, dtype=torch.bfloat16) for n, p in params.items()}
    for t, step in enumerate(grads, start=1):
        for n, p in params.items():
            g = step[n]
            m32 = m[n].float() * b1 + (1 - b1) * g
            v32 = v[n].float() * b2 + (1 - b2) * g * g
            p.mul_(1 - LR * WD)
            denom = (v32 / (1 - b2**t)).sqrt() + 1e-8
            p.sub_(LR * (m32 / (1 - b1**t)) / denom)
            m[n], v[n] = m32.to(torch.bfloat16), v32.to(torch.bfloat16)
    return params, m, v


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_moments(layout: MasterLayout) -> None:
    model = _model()
    grads = _grads(model, steps=3)
    ref_params, ref_m, ref_v = _bf16_moment_reference(model, grads)
    fp32_history, _ = _reference(model, grads, max_grad_norm=0.0)
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        moments_dtype="bfloat16",
        bucket_mb=0.0004,
        master_layout=layout,
    )
    assert opt.exp_avg.dtype == torch.bfloat16 and opt.exp_avg_sq.dtype == torch.bfloat16
    assert opt.exp_avg.element_size() * opt.numel * 2 == 4 * opt.numel  # 4 bytes per parameter for both moments
    for step in grads:
        for n, p in model.named_parameters():
            p.grad = step[n].clone()
        opt.step(max_grad_norm=0.0)
    state = opt.state_tensors()
    for n, master in opt.master.items():
        torch.testing.assert_close(master, ref_params[n], rtol=0, atol=1e-6, msg=n)
        # bf16 moments: equal to the reference's up to one bf16 rounding step.
        torch.testing.assert_close(state[f"exp_avg/{n}"].float(), ref_m[n].float(), rtol=1e-2, atol=1e-6, msg=n)
        torch.testing.assert_close(state[f"exp_avg_sq/{n}"].float(), ref_v[n].float(), rtol=1e-2, atol=1e-8, msg=n)
    # And the option changes something: the fp32-moment run ends elsewhere.
    assert any(not torch.equal(opt.master[n], fp32_history[-1][n]) for n in opt.master)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).mean()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_gradient_offload_gives_the_same_step(max_grad_norm: float) -> None:
    """Gradients moved to host memory as backward produces them (and freed on the model),
    accumulated over micro-batches: the same masters, bit for bit, as keeping them on the model."""
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    runs = {}
    for offload in (False, True):
        model = _model()
        opt = HostAdamW(
            dict(model.named_parameters()),
            lr=LR,
            betas=BETAS,
            weight_decay=WD,
            grad_offload=offload,
            bucket_mb=0.0004,
            moments_dtype="float32",
        )
        norms = []
        for step in range(3):
            for x in xs[2 * step : 2 * step + 2]:  # two micro-batches per step
                _loss(model, x).backward()
                if offload:
                    assert all(p.grad is None for p in model.parameters())  # nothing left on the model
                    assert opt.grad_norm() > 0  # (waits for the host thread's adds)
            norm, _ = opt.step(max_grad_norm)
            norms.append(norm)
        runs[offload] = (norms, {n: m.clone() for n, m in opt.master.items()})
    assert runs[True][0] == runs[False][0]
    if max_grad_norm:
        assert all(n > max_grad_norm for n in runs[False][0])  # clipping was active
    for n, m in runs[False][1].items():
        assert torch.equal(runs[True][1][n], m), n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_piece_hands_over_every_piece_once_with_its_old_and_new_bits_as_its_bucket_is_stepped(
    layout: MasterLayout,
) -> None:
    model = _model()
    # Buckets of 64 elements, 220 parameters in all: the first weight (16 x 8) is complete
    # after bucket 1 of 4, so its pieces are handed over before the later buckets are stepped.
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=1e-2,
        betas=BETAS,
        weight_decay=0.0,
        bucket_mb=0.0004,
        master_layout=layout,
        moments_dtype="float32",
    )
    before = {n: b.copy() for n, b in opt.sync_model().items()}
    names = list(before)
    last = names[-1]
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # Adam's first step moves every entry by lr: all change
    calls: list[tuple[str, int, np.ndarray, np.ndarray, bool]] = []

    def on_piece(name: str, start: int, old: np.ndarray, new: np.ndarray) -> None:
        # Whether the last parameter was still at its old weights when this piece came.
        last_untouched = bool(np.array_equal(modeling.model_bits(model)[last], before[last]))
        calls.append((name, start, old, new.copy(), last_untouched))

    _, after = opt.step(max_grad_norm=0.0, on_piece=on_piece)
    assert list(dict.fromkeys(c[0] for c in calls)) == names  # in layout order
    for name in names:
        pieces = sorted((start, old, new) for n, start, old, new, _ in calls if n == name)
        assert [s for s, _, _ in pieces] == list(np.cumsum([0] + [len(o) for _, o, _ in pieces[:-1]]))  # contiguous
        np.testing.assert_array_equal(np.concatenate([o for _, o, _ in pieces]), before[name].reshape(-1))
        np.testing.assert_array_equal(
            np.concatenate([n for _, _, n in pieces]), after[name].reshape(-1)
        )  # final when handed over
    assert calls[0][4], "the first parameter was handed over only after the last bucket"
    assert not calls[-1][4]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delta_built_on_the_way_is_the_delta_after_the_step(layout: MasterLayout) -> None:
    """The publisher's DeltaEncoder fed by on_piece (on threads) gives the same payload bytes
    as encode_delta over the whole weights after the step: in the split layout from each
    bucket's old bits, copied just before AdamW overwrote them."""
    from concurrent.futures import ThreadPoolExecutor

    from rollstream.core import deltas

    model = _model()
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=0.0004,
        master_layout=layout,
        moments_dtype="float32",
    )
    base = opt.sync_model()
    kept = {n: b.copy() for n, b in base.items()}
    grads = _grads(model, steps=1)[0]
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    with ThreadPoolExecutor(2) as pool:
        encoder = deltas.DeltaEncoder(base, 0, 1, "fp", executor=pool, max_pending_bytes=64)
        _, after = opt.step(max_grad_norm=1.0, on_piece=encoder.add_piece)
        on_the_way, stats = encoder.finish()
    after_the_step, _ = deltas.encode_delta(kept, after, 0, 1, "fp")
    assert on_the_way == after_the_step
    assert stats.changed_values > 0
    _, decoded = deltas.decode(on_the_way, kept, 0, "fp")
    assert all(np.array_equal(decoded[n], after[n]) for n in decoded)


@pytest.mark.parametrize(("saved", "loaded"), [(a, b) for a in LAYOUTS for b in LAYOUTS])
def test_state_round_trip_continues_identically(saved: MasterLayout, loaded: MasterLayout) -> None:
    """A state saved in either layout loads exactly into either: the masters are the same
    fp32 values, so the runs go on bit for bit (the served bits differ only on exact ties
    between layouts, so those are compared within a layout)."""
    model_a, model_b = _model(), _model(seed=5)  # b starts elsewhere: everything comes from the state
    grads = _grads(model_a, steps=4)
    a = HostAdamW(
        dict(model_a.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=0.0004,
        master_layout=saved,
        moments_dtype="float32",
    )
    for step in grads[:2]:
        for n, p in model_a.named_parameters():
            p.grad = step[n].clone()
        a.step(1.0)
    b = HostAdamW(
        dict(model_b.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=0.002,
        master_layout=loaded,
        moments_dtype="float32",
    )
    bits = b.load_state({k: v.clone() for k, v in a.state_tensors().items()}, a.step_count)
    assert all(torch.equal(b.master[n], m) for n, m in a.master.items())
    assert all(np.array_equal(bits[n], served_bits(m, loaded)) for n, m in a.master.items())
    if saved == loaded:
        assert all(np.array_equal(bits[n], x) for n, x in a.published_bits().items())
        assert all(
            torch.equal(p.detach(), dict(model_a.named_parameters())[n].detach()) for n, p in model_b.named_parameters()
        )
    for step in grads[2:]:
        for model, opt in ((model_a, a), (model_b, b)):
            for n, p in model.named_parameters():
                p.grad = step[n].clone()
            opt.step(1.0)
    for n in a.master:
        assert torch.equal(a.master[n], b.master[n]), n
    with pytest.raises(ValueError, match="does not match"):
        b.load_state({k: v for k, v in a.state_tensors().items() if not k.startswith("exp_avg_sq/")}, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_norm_is_accurate_on_large_tensors(dtype: torch.dtype) -> None:
    """The clip factor comes from this norm: over millions of elements it stays within 1e-6 of
    the fp64 value (a plain fp32 CPU reduction drifts by ~1e-3 at this size), whatever the
    bucket size."""
    g = torch.Generator().manual_seed(0)
    big = torch.nn.Linear(2048, 2500 + 3, bias=False)  # 5.1M elements, not a multiple of a row
    big.weight.data = big.weight.data.to(dtype)
    big.weight.grad = (torch.randn(big.weight.shape, generator=g) + 0.5).to(dtype)
    exact = float(torch.linalg.vector_norm(big.weight.grad.double()))
    norms = []
    for bucket_mb in (0.01, 32.0):
        opt = HostAdamW(
            dict(big.named_parameters()),
            lr=LR,
            betas=BETAS,
            weight_decay=0.0,
            bucket_mb=bucket_mb,
            moments_dtype="float32",
        )
        norms.append(opt.grad_norm())
    assert norms[0] == norms[1]
    assert norms[0] == pytest.approx(exact, rel=1e-6)


def test_bits_handed_out_stay_valid_and_free_buffers_are_reused() -> None:
    """The bits buffer of two steps ago is reused only when nobody holds a view of it."""
    model = _model()
    grads = _grads(model, steps=6)
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        spare_bits=True,
        master_layout="fp32",
        moments_dtype="float32",
    )

    def step(k: int) -> dict[str, np.ndarray]:
        for n, p in model.named_parameters():
            p.grad = grads[k][n].clone()
        return opt.step(1.0)[1]

    kept = step(0)
    snapshot = {n: b.copy() for n, b in kept.items()}
    for k in (1, 2, 3):
        latest = step(k)
    # `kept` was held all along: never written over.
    assert all(np.array_equal(kept[n], snapshot[n]) for n in kept)
    assert all(np.array_equal(latest[n], b) for n, b in opt.published_bits().items())
    # Nothing held: the steady state alternates between two buffers (weak references, so
    # that the test itself holds nothing).
    del kept, latest
    buffers = []
    for k in (4, 5):
        bits = step(k)
        buffers.append(weakref.ref(next(iter(bits.values())).base))
        del bits
    bits = step(0)
    assert buffers[0]() is not None and buffers[0]() is not buffers[1]()
    assert next(iter(bits.values())).base is buffers[0]()


def test_on_a_cpu_only_machine_the_previous_bits_are_freed_once_nobody_holds_them() -> None:
    """Without a GPU the host peak is forward and backward: no spare bits buffer is kept
    through them (the published base of the next delta is the only one). fp32 layout: the
    split layout keeps no bits buffer at all."""
    model = _model()
    grads = _grads(model, steps=3)
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout="fp32",
        moments_dtype="float32",
    )

    def step(k: int) -> dict[str, np.ndarray]:
        for n, p in model.named_parameters():
            p.grad = grads[k][n].clone()
        return opt.step(1.0)[1]

    first = weakref.ref(next(iter(step(0).values())).base)
    second = step(1)
    assert first() is None  # freed by the step that replaced it: nothing held it
    kept = weakref.ref(next(iter(second.values())).base)
    snapshot = {n: b.copy() for n, b in second.items()}
    latest = step(2)
    # Held by the test: still there and unchanged; the newest bits are the masters' rounding.
    assert kept() is not None and all(np.array_equal(second[n], snapshot[n]) for n in second)
    assert all(np.array_equal(latest[n], b) for n, b in opt.published_bits().items())
