"""HostAdamW with `in_model` (masters.ModelMasters, `rollstream sft`'s float32 run): the
model's float32 parameters are the fp32 masters, stepped in place; against the fp32 layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_optimizer import BETAS, LR, WD, _grads, _model

from rollstream.trainer.optimizer import HostAdamW, MasterLayout


def _in_model(model: torch.nn.Module, bucket_mb: float = 0.0004, layout: MasterLayout = "fp32") -> HostAdamW:
    return HostAdamW(
        dict(model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=bucket_mb,
        master_layout=layout,
        moments_dtype="bfloat16",
        in_model=True,
    )


@pytest.mark.parametrize("overlapped", [False, True])
def test_masters_in_the_model_step_the_model_itself_as_the_fp32_layout_steps_its_masters(overlapped: bool) -> None:
    """in_model: the float32 parameters are views of the fp32 masters' vector, so after each
    step (sequential, or overlapped and waited for) the model holds the fp32 layout's masters
    bit for bit, and no bits are made; the state is the fp32 layout's, in and out."""
    model, ref_model = _model(), _model()
    grads = _grads(model, steps=4)
    opt = _in_model(model)
    assert len(opt.buckets) > 1 and any(len(b.pieces) > 1 for b in opt.buckets)
    ref = HostAdamW(
        dict(ref_model.named_parameters()),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        bucket_mb=0.0004,
        master_layout="fp32",
        moments_dtype="bfloat16",
    )
    base = opt.flat_master.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in model.parameters())
    for step in grads:
        for m in (model, ref_model):
            for n, p in m.named_parameters():
                p.grad = step[n].clone()
        norm, bits = opt.step(1.0, model=model if overlapped else None)
        opt.wait()
        assert bits == {} and norm == ref.step(1.0)[0]
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), ref.master[n]), n
            assert torch.equal(opt.master[n], ref.master[n]), n
        assert all(p.grad is None for p in model.parameters())
    assert all(np.array_equal(opt.published_bits()[n], b) for n, b in ref.published_bits().items())
    # Its state is the fp32 layout's: loaded into another model's parameters, in place.
    other = _model(seed=5)
    again = _in_model(other, bucket_mb=32.0)
    assert again.load_state({k: v.clone() for k, v in opt.state_tensors().items()}, opt.step_count) == {}
    assert all(torch.equal(p.detach(), ref.master[n]) for n, p in other.named_parameters())
    for n, p in model.named_parameters():
        p.grad = grads[0][n].clone()
    with pytest.raises(RuntimeError, match="no bits"):  # a delta is of served bits
        opt.step(1.0, on_piece=lambda *_: None)


def test_masters_in_the_model_refuse_what_they_cannot_be() -> None:
    with pytest.raises(ValueError, match="fp32 layout"):
        _in_model(_model(), layout="split")
    with pytest.raises(ValueError, match="float32 CPU parameters"):
        _in_model(_model().to(torch.bfloat16))
