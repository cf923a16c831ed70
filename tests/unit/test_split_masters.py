"""The split master layout (rollstream.trainer.optimizer): an fp32 master kept as its served
bf16 bits and a 16-bit remainder is the same fp32 value, bit for bit, for every finite
pattern; 50 AdamW steps on it equal fp32-master AdamW's bit for bit on the same gradients;
its served bits are torch's bf16 rounding except on exact ties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollstream.trainer.optimizer import HostAdamW, MomentsDtype, host_bytes_per_parameter, served_bits

LR, BETAS, WD = 3e-3, (0.9, 0.999), 0.01


def _finite_patterns() -> torch.Tensor:
    """Edge patterns (zeros, subnormals, ties either way, binade crossings, the largest
    finite values that round to inf in bf16) and a million random finite ones."""
    edges = [
        0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x80008000,
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F807FFF, 0x3F808001, 0x3FFFFFFF, 0x3FFF8000,
        0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,
    ]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 2**32, (1_000_000,), generator=g, dtype=torch.int64)
    bits = torch.cat([torch.tensor(edges, dtype=torch.int64), rand]).to(torch.int32)  # wraps to the int32 pattern
    return bits.view(torch.float32)[torch.isfinite(bits.view(torch.float32))].clone()


def test_every_finite_master_is_kept_exactly_and_served_as_its_bf16_rounding() -> None:
    """Loaded from fp32 masters (a checkpoint of the fp32 layout), every finite value comes
    back bit for bit and is served as its bf16 rounding, ties away from zero."""
    values = _finite_patterns()
    param = torch.nn.Parameter(torch.zeros_like(values))
    opt = HostAdamW(
        {"w": param}, lr=LR, betas=BETAS, weight_decay=WD, master_layout="split", bucket_mb=0.5, moments_dtype="float32"
    )
    zeros = torch.zeros_like(values)
    served = opt.load_state({"master/w": values, "exp_avg/w": zeros, "exp_avg_sq/w": zeros}, 0)["w"]
    assert torch.equal(opt.master["w"].view(torch.int32), values.view(torch.int32))
    assert np.array_equal(served, served_bits(values, "split"))
    assert torch.equal(param.detach(), torch.from_numpy(served.view(np.int16).copy()).view(torch.bfloat16).float())
    nearest_even = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    ties = (values.view(torch.int32) & 0xFFFF).numpy() == 0x8000
    assert np.array_equal(served[~ties], nearest_even[~ties])  # the same rounding but on exact ties
    assert ties.sum() > 0 and (served[ties] != nearest_even[ties]).sum() > 0  # which this sample has
    # Ties go away from zero: the magnitude's bits round up.
    np.testing.assert_array_equal(
        served[ties] & 0x7FFF, ((values.view(torch.int32)[torch.from_numpy(ties)] >> 16) + 1).numpy() & 0x7FFF
    )


def test_version_0_is_torchs_rounding_of_the_model() -> None:
    """Read from the model, masters on a tie that nearest-even rounds down start one ulp
    lower, so the served bits are torch's bf16 rounding of every weight; the others are
    the model's values exactly."""
    values = _finite_patterns()
    opt = HostAdamW(
        {"w": torch.nn.Parameter(values.clone())},
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        master_layout="split",
        bucket_mb=0.5,
        moments_dtype="float32",
    )
    served = opt.sync_model()["w"]
    assert np.array_equal(served, values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    w = values.view(torch.int32)
    nudged = (w & 0x1FFFF) == 0x8000
    assert int(nudged.sum()) > 0
    master = opt.master["w"].view(torch.int32)
    assert torch.equal(master[~nudged], w[~nudged])
    assert torch.equal(master[nudged], w[nudged] - 1)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 23), torch.nn.LayerNorm(23)
    )  # 2,949 values: 2949 % 16 = 5


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_fifty_steps_equal_fp32_master_adamw_bit_for_bit(moments: MomentsDtype) -> None:
    """Both layouts run the same AdamW arithmetic on the same fp32 values (the split layout
    with its compiled kernel and, "split-torch", with torch operations): after each of 50 steps
    (clipped, buckets cutting through parameters, a last bucket with values that torch's
    kernel steps with scalar code) the masters and moments are identical."""
    runs = {}
    for run in ("split", "split-torch", "fp32"):
        model = _model(0)
        opt = HostAdamW(
            dict(model.named_parameters()),
            lr=LR,
            betas=BETAS,
            weight_decay=WD,
            moments_dtype=moments,
            master_layout=run.split("-")[0],
            bucket_mb=0.004,
            split_kernel=False if run == "split-torch" else None,
        )
        runs[run] = (model, opt)
    # The same starting masters (the split layout nudges exact ties when it reads a model).
    for run in ("fp32", "split-torch"):
        runs[run][1].load_state(runs["split"][1].state_tensors(), 0)
    runs["split"][1].sync_model()
    assert runs["split"][1].numel % 16
    assert len(runs["split"][1].buckets) > 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 48, generator=g)
    for step in range(50):
        target = torch.randn(32, 23, generator=g)
        # The same gradients for both (from the fp32 layout's model), as the issue asks.
        model, _ = runs["fp32"]
        loss = ((model(x) - target) ** 2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for layout, (m, opt) in runs.items():
            for p, grad in zip(m.parameters(), grads, strict=True):
                p.grad = grad.clone()
            runs[layout] = (m, opt)
            opt.step(max_grad_norm=0.5)
        fp32 = runs["fp32"][1]
        for split in (runs["split"][1], runs["split-torch"][1]):
            for name in fp32.layout:
                assert torch.equal(split.master[name].view(torch.int32), fp32.master[name].view(torch.int32)), (
                    f"step {step} {name}"
                )
            assert torch.equal(split.exp_avg.view(-1).float(), fp32.exp_avg.view(-1).float()), f"step {step}"
            assert torch.equal(split.exp_avg_sq.view(-1).float(), fp32.exp_avg_sq.view(-1).float()), f"step {step}"
    split_bits, fp32_bits = runs["split"][1].published_bits(), runs["fp32"][1].published_bits()
    for name, bits in split_bits.items():
        master = runs["fp32"][1].master[name]
        assert np.array_equal(bits, served_bits(master, "split"))
        assert np.array_equal(fp32_bits[name], served_bits(master, "fp32"))
        ties = (master.view(torch.int32) & 0xFFFF).numpy() == 0x8000
        assert np.array_equal(bits[~ties], fp32_bits[name][~ties])


def test_host_bytes_per_parameter() -> None:
    assert host_bytes_per_parameter("split", "bfloat16") == 8
    assert host_bytes_per_parameter("split", "float32") == 12
    assert host_bytes_per_parameter("fp32", "bfloat16") == 12
    assert host_bytes_per_parameter("fp32", "float32") == 16
    assert host_bytes_per_parameter("split", "bfloat16", grad_offload=True) == 12
    # The optimizer's own buffers hold what the function says (staging aside).
    model = _model(0)
    opt = HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        moments_dtype="bfloat16",
        master_layout="split",
    )
    held = sum(t.numel() * t.element_size() for t in (opt.hi, opt.lo, opt.flat_master, opt.exp_avg, opt.exp_avg_sq))
    assert held == 8 * opt.numel
