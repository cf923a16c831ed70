"""The trainer's step on 2 and 4 ranks (FSDP2 on gloo, ranks.py) against one process: 20
GRPO steps with clipping on, in fp32 and in bf16, give the same masters, moments and published
bits, bit for bit, and the same gradient norms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ranks import launch

pytestmark = pytest.mark.ranks

STEPS = 20


def joined(out: Path, n: int) -> dict[str, torch.Tensor]:
    """Every rank's state tensors, joined along dim 0 in rank order (FSDP2's dim-0 shards)."""
    parts = [load_file(out / f"rank{r}.safetensors") for r in range(n)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def assert_as_one_process(out: Path, n: int, ref: Path, steps: list[int]) -> None:
    """rank_steps' output in `out` (n ranks) is the one-process run's in `ref` at `steps` (the
    steps `out` ran, which `ref` ran too), bit for bit, and its final state and bits are `ref`'s."""
    ours = json.loads((out / "steps.json").read_text())
    theirs = {b["step"]: b for b in json.loads((ref / "steps.json").read_text())}
    assert [a["step"] for a in ours] == steps
    for a in ours:
        b = theirs[a["step"]]
        assert a["bits"] == b["bits"], f"step {a['step']}: the published bits differ"
        assert a["tokens"] == b["tokens"]
        # The norm's fp64 sum of squares is added in another grouping: equal to fp64 rounding.
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    state, want = joined(out, n), joined(ref, 1)
    assert state.keys() == want.keys()
    for key, t in want.items():
        assert torch.equal(state[key], t), key
    assert load_file(out / "bits.safetensors").keys() == load_file(ref / "bits.safetensors").keys()
    for key, t in load_file(ref / "bits.safetensors").items():
        assert torch.equal(load_file(out / "bits.safetensors")[key], t), key


@pytest.fixture(scope="module")
def one_process(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path_factory.mktemp(f"one-{dtype}")
        launch.run("rank_steps.py", [str(model), str(out), "--steps", str(STEPS), "--dtype", dtype])
        runs[dtype] = out
    return runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [2, 4])
def test_n_ranks_step_as_one_process(
    model: Path, one_process: dict[str, Path], tmp_path: Path, n: int, dtype: str
) -> None:
    out = tmp_path / "out"
    launch.run(
        "rank_steps.py", [str(model), str(out), "--steps", str(STEPS), "--dtype", dtype], nproc=n, log=tmp_path / "log"
    )
    assert_as_one_process(out, n, one_process[dtype], list(range(1, STEPS + 1)))


def test_a_non_finite_step_is_refused_on_every_rank(model: Path, tmp_path: Path) -> None:
    """A NaN behaviour log-prob in one group at step 2: every rank refuses the step (the finite
    check is agreed before any backward: a rank going on alone would wait forever in FSDP's
    collectives), the probe blames that group alone on every rank, and the other groups train:
    one process's bits and blame, on 2 ranks."""
    args = [str(model), "--steps", "3", "--nan-at", "2"]
    launch.run("rank_steps.py", [args[0], str(tmp_path / "one"), *args[1:]])
    launch.run("rank_steps.py", [args[0], str(tmp_path / "two"), *args[1:]], nproc=2, log=tmp_path / "log")
    ours = json.loads((tmp_path / "two" / "steps.json").read_text())
    theirs = json.loads((tmp_path / "one" / "steps.json").read_text())
    assert [s.get("blamed") for s in theirs] == [None, [3], None]
    assert [(s["bits"], s.get("blamed")) for s in ours] == [(s["bits"], s.get("blamed")) for s in theirs]
