"""benchmarks/shapes.py builds its random-weight models on the meta device and allocates them
with to_empty, which leaves every buffer uninitialised: the rotary inv_freq must be computed
again (garbage there gave NaN losses in 3 of 6 GPU benchmark runs, issue 26)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes  # benchmarks/shapes.py


def test_rotary_buffers_are_those_of_a_model_built_normally() -> None:
    from transformers import Qwen2ForCausalLM

    built = shapes.build_model("tiny", torch.device("cpu"), dtype=torch.float32)
    reference = Qwen2ForCausalLM(shapes.config("tiny"))
    buffers = {n: b for n, b in built.named_buffers() if "inv_freq" in n}
    assert buffers, "the model has rotary buffers"
    for name, buffer in reference.named_buffers():
        if "inv_freq" in name:
            assert buffers[name].dtype == torch.float32
            torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0)
    ids = torch.arange(4, 36).unsqueeze(0)
    assert torch.isfinite(built(input_ids=ids, labels=ids).loss)
