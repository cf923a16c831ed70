"""The optimizer's sharded state (sharded_state.py) saved on 2 ranks and resumed on 1, 2 and 4
ranks and in a plain process: the resumed steps give the uninterrupted one-process run's
masters, moments and published bits, bit for bit (GRPO steps of the tiny model, bf16, clipping
on: test_rank_steps' program). The folder holds safetensors and JSON only, and a bad one fails
with a ValueError naming the key and the folder, on every rank."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ranks import launch
from ranks.test_rank_steps import assert_as_one_process
from rollstream.trainer import sharded_state

pytestmark = pytest.mark.ranks

SAVE_AT, STEPS, DTYPE = 5, 10, "bfloat16"


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted one-process run to STEPS, and 2 ranks' run to SAVE_AT, saved there."""
    root = tmp_path_factory.mktemp("sharded")
    one, two, saved = root / "one", root / "two", root / "saved" / "step-5"
    launch.run("rank_steps.py", [str(model), str(one), "--steps", str(STEPS), "--dtype", DTYPE])
    launch.run(
        "rank_steps.py",
        [str(model), str(two), "--steps", str(SAVE_AT), "--dtype", DTYPE, "--save-at", str(SAVE_AT), str(saved)],
        nproc=2,
        log=root / "two.log",
    )
    return {"one": one, "two": two, "saved": saved}


def test_two_ranks_before_the_save_as_one_process(runs: dict[str, Path]) -> None:
    ours = json.loads((runs["two"] / "steps.json").read_text())
    theirs = json.loads((runs["one"] / "steps.json").read_text())
    assert [a["bits"] for a in ours] == [b["bits"] for b in theirs[:SAVE_AT]]
    assert sharded_state.read_state(runs["saved"]) == {"step": SAVE_AT, "optimizer_steps": SAVE_AT}


@pytest.mark.parametrize("nproc", [0, 1, 2, 4], ids=["plain", "1rank", "2ranks", "4ranks"])
def test_resume_as_one_process(model: Path, runs: dict[str, Path], tmp_path: Path, nproc: int) -> None:
    """nproc 0: a plain process (no torchrun, no process group) loads the 2 ranks' save."""
    out = tmp_path / "out"
    launch.run(
        "rank_steps.py",
        [str(model), str(out), "--steps", str(STEPS), "--dtype", DTYPE, "--resume", str(runs["saved"])],
        nproc=nproc,
        log=tmp_path / "log",
    )
    assert_as_one_process(out, max(nproc, 1), runs["one"], list(range(SAVE_AT + 1, STEPS + 1)))


def test_no_pickle_in_the_folder(runs: dict[str, Path]) -> None:
    """Every file is safetensors (an 8-byte little-endian header length, then a JSON header
    starting with '{') or JSON; one shard file a rank; no temporary sibling left."""
    files = sorted(p for p in runs["saved"].rglob("*"))
    assert [p.name for p in files] == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
        "state.json",
    ]
    for path in files:
        data = path.read_bytes()
        if path.suffix == ".json":
            json.loads(data)
            continue
        (length,) = struct.unpack("<Q", data[:8])
        assert data[8:9] == b"{" and 8 + length <= len(data), path
        header = json.loads(data[8 : 8 + length])
        assert "DCP_SHARDING_INFO" in header["__metadata__"]
    assert sorted(p.name for p in runs["saved"].parent.iterdir()) == ["step-5"]


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "master_hi/w": torch.arange(15, dtype=torch.float32).reshape(5, 3).to(torch.bfloat16),
        "master_lo/w": torch.arange(15, dtype=torch.int16).reshape(5, 3),
        "exp_avg/b": torch.linspace(0, 1, 7),
    }


def test_save_and_load_in_a_plain_process(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    sharded_state.save(folder, _tensors(), {"step": 3})
    into = {k: torch.zeros_like(t) for k, t in _tensors().items()}
    sharded_state.load(folder, into)
    for key, t in _tensors().items():
        assert torch.equal(into[key], t), key
    sharded_state.save(folder, {k: t + 1 for k, t in _tensors().items()})  # replaces the folder
    sharded_state.load(folder, into)
    assert torch.equal(into["exp_avg/b"], _tensors()["exp_avg/b"] + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update({"exp_avg_sq/b": torch.zeros(7)}), "exp_avg_sq/b is not saved"),
        (lambda d: d.pop("exp_avg/b"), "exp_avg/b is saved but not expected"),
        (lambda d: d.update({"exp_avg/b": torch.zeros(8)}), r"exp_avg/b is saved as torch.float32\(7,\), expected"),
        (lambda d: d.update({"master_lo/w": torch.zeros(5, 3)}), r"master_lo/w is saved as torch.int16\(5, 3\)"),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_load_refuses_another_state(
    tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], object], message: str
) -> None:
    folder = tmp_path / "ck"
    sharded_state.save(folder, _tensors())
    into = {k: torch.zeros_like(t) for k, t in _tensors().items()}
    change(into)
    before = {k: t.clone() for k, t in into.items()}
    with pytest.raises(ValueError, match=message) as e:
        sharded_state.load(folder, into)
    assert str(folder) in str(e.value)
    for key, t in before.items():
        assert torch.equal(into[key], t), f"{key} was written before the refusal"


def test_load_refuses_a_missing_shard_file(runs: dict[str, Path], tmp_path: Path) -> None:
    """A rank's file gone: some tensors are not covered (or shorter), in a plain process."""
    folder = tmp_path / "step-5"
    shutil.copytree(runs["saved"], folder)
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    state = load_file(runs["one"] / "rank0.safetensors")  # (the keys, dtypes and whole shapes)
    with pytest.raises(ValueError, match="the saved chunks hold") as e:
        sharded_state.load(folder, {k: torch.zeros_like(t) for k, t in state.items()})
    assert str(folder) in str(e.value)
    with pytest.raises(ValueError, match="no .safetensors files"):
        sharded_state.load(tmp_path, {})


def test_every_rank_refuses_a_bad_folder(model: Path, runs: dict[str, Path], tmp_path: Path) -> None:
    """2 ranks resuming from a folder missing a rank's file: both raise the ValueError (none
    waits for the other), and torchrun reports the failure."""
    folder = tmp_path / "step-5"
    shutil.copytree(runs["saved"], folder)
    (folder / "shard-00002-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(AssertionError) as e:
        launch.run(
            "rank_steps.py",
            [str(model), str(tmp_path / "out"), "--steps", str(STEPS), "--dtype", DTYPE, "--resume", str(folder)],
            nproc=2,
        )
    assert "ValueError" in str(e.value) and str(folder) in str(e.value)


def test_save_refuses_what_is_not_a_tensor(tmp_path: Path) -> None:
    """DCP would write a non-tensor value with torch.save (a pickle): refused, nothing left."""
    with pytest.raises(ValueError, match="step: not a tensor"):
        sharded_state.save(tmp_path / "ck", {**_tensors(), "step": 3})  # type: ignore[dict-item]  # (on purpose)
    assert list(tmp_path.iterdir()) == []


def test_every_rank_raises_when_one_fails_to_save(tmp_path: Path) -> None:
    """Rank 1 refuses its state: rank 0 raises too (none waits for the other), and neither the
    folder nor its hidden sibling is left."""
    done = launch.run("save_fails.py", [str(tmp_path / "ck")], nproc=2)
    assert "1 raised ValueError: step: not a tensor" in done.stdout
    assert "0 raised RuntimeError: saving " in done.stdout
    assert list(tmp_path.iterdir()) == []
