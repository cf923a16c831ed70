"""Which checkpoints a trainer keeps, resumes from and prunes (issue 27), on real checkpoint
folders (checkpoint.save with small tensors: the same files a trainer writes, in a few ms).

- rank comes from the step a checkpoint's state.json records, never from the number in its
  name (the F1 failure: a folder named step-99999999 holding step 2 outranked every real one);
- the trainer's own are the top-level step-N folders; SaveCheckpoint may not use those names,
  so an operator's checkpoint is neither resumed from by `auto` nor pruned;
- pruning keeps `keep` whole checkpoints and never more than `keep` on disk while a new one is
  written; a torn one (a tensor file cut short, one missing) is skipped by resume, never
  counted, never deleted; `auto` refuses to start over when none is whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rollstream.trainer import checkpoint

PARAMS = 1000  # fp32 master + two fp32 moments: 12 kB of optimizer state


def write(path: Path, step: int, log_id: str = "", replace: bool = True) -> Path:
    """A real checkpoint at `path` recording `step` (and the trained log's end)."""
    state = checkpoint.CheckpointState(version=step, step=step, optimizer_steps=step, trained_log_id=log_id)
    tensors = {f"{kind}/w": torch.full((PARAMS,), float(step)) for kind in ("master", "exp_avg", "exp_avg_sq")}
    return checkpoint.save(path, state, tensors, checkpoint.rng_state(), replace=replace)


def own(root: Path, step: int, keep: int, peaks: list[int] | None = None) -> list[Path]:
    """The trainer's own save at `step` (checkpoint.save_own, as Trainer.save_own_checkpoint calls it);
    `peaks` gets the number of whole checkpoints on disk while the new one is being written."""

    def writer(target: Path) -> Path:
        if peaks is not None:
            peaks.append(len(checkpoint.scan(root).usable) + 1)
        return write(target, step, log_id=f"{step}-0")

    _saved, removed = checkpoint.save_own(root, step, keep, writer)
    return removed


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def tear(path: Path, file: str = checkpoint.OPTIMIZER_FILE) -> None:
    with open(path / file, "r+b") as f:
        f.truncate((path / file).stat().st_size - 100)


def test_rank_is_the_recorded_step_not_the_name(tmp_path: Path) -> None:
    """F1 at the file level: what SaveCheckpoint("step-99999999") used to write at step 2 (a
    whole checkpoint recording step 2, under that name), then the trainer's own at 4 and 6."""
    root = tmp_path / "ckpt"
    write(root / "step-00000002", 2)
    shutil.copytree(root / "step-00000002", root / "step-99999999")
    for step in (4, 6):
        own(root, step, keep=2)
    assert checkpoint.latest(root) == root / "step-00000006"
    assert checkpoint.resolve("auto", str(root)) == root / "step-00000006"
    assert [f.state.step for f in checkpoint.scan(root).usable] == [4, 6]
    assert names(root) == ["step-00000004", "step-00000006"]  # the step-2 copies went first, by what they hold


@pytest.mark.parametrize(("keep", "kept"), [(1, [8]), (2, [7, 8]), (3, [6, 7, 8]), (0, [1, 2, 3, 4, 5, 6, 7, 8])])
def test_after_n_saves_the_newest_keep_remain_and_never_more_on_disk(
    tmp_path: Path, keep: int, kept: list[int]
) -> None:
    root = tmp_path / "ckpt"
    peaks: list[int] = []
    for step in range(1, 9):
        own(root, step, keep, peaks)
    assert names(root) == [checkpoint.step_dir_name(s) for s in kept]
    # While a checkpoint is written the disk holds at most `keep` (the latest stays until the
    # new one is whole, so 2 with keep = 1).
    assert max(peaks) == (max(keep, 2) if keep else 8)
    found = checkpoint.scan(root)
    assert checkpoint.fallback(found, keep).state.step == (8 if keep == 1 else 7)  # the trained log reaches back to it


@pytest.mark.parametrize(("keep", "back_to"), [(1, 3), (2, None), (0, None)])
def test_with_one_checkpoint_the_log_reaches_back_to_the_start_unless_keep_is_1(
    tmp_path: Path, keep: int, back_to: int | None
) -> None:
    """The first checkpoint has no spare but the model itself: with a spare wanted, the
    trained log is kept whole until there are two (a run that checkpoints only at its end
    keeps its whole log)."""
    root = tmp_path / "ckpt"
    own(root, 3, keep)
    found = checkpoint.fallback(checkpoint.scan(root), keep)
    assert (found.state.step if found is not None else None) == back_to


def test_an_operators_checkpoint_is_neither_resumed_nor_pruned(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    own(root, 2, keep=1)
    operator = write(checkpoint.confine("saved/step-99999999", str(root)), 2, replace=False)
    late = write(checkpoint.confine("nested/late", str(root)), 50, replace=False)
    for step in (4, 6):
        own(root, step, keep=1)
    assert checkpoint.latest(root) == root / "step-00000006"
    assert names(root) == ["nested", "saved", "step-00000006"]
    assert checkpoint.verify(operator).step == 2 and checkpoint.verify(late).step == 50
    assert checkpoint.resolve(str(operator), str(root)) == operator  # named, it resumes


@pytest.mark.parametrize(
    "path",
    [
        "step-99999999",
        "step-00000006",
        "STEP-00000006",
        "./step-1",
        "x/../step-7",
        "step-x/inner",
        ".step-00000009.tmp-1",
        ".hidden",
    ],
)
def test_savecheckpoint_may_not_use_the_trainers_names(tmp_path: Path, path: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    with pytest.raises(checkpoint.CheckpointNameRefused, match="trainer's own checkpoints"):
        checkpoint.confine(path, str(root))
    with pytest.raises(checkpoint.CheckpointNameRefused):
        checkpoint.confine(str(root / path), str(root))


@pytest.mark.parametrize("path", ["saved/step-99999999", "manual", "nested/step-00000001", "steps", "my.step-1"])
def test_other_names_inside_are_the_operators(tmp_path: Path, path: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    assert checkpoint.confine(path, str(root)) == root.resolve() / path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: tear(p), "torn"),
        (lambda p: tear(p, checkpoint.RNG_FILE), "torn"),
        (lambda p: (p / checkpoint.OPTIMIZER_FILE).unlink(), "missing"),
        (lambda p: (p / checkpoint.OPTIMIZER_FILE).write_bytes(b"\x01"), "too short"),
        (lambda p: (p / checkpoint.STATE_FILE).write_text('{"format": "rollstream-trainer-checkpoint"'), "state.json"),
        (lambda p: (p / checkpoint.STATE_FILE).unlink(), "no state.json"),
    ],
    ids=["optimizer-cut", "rng-cut", "optimizer-missing", "optimizer-stub", "state-cut", "state-missing"],
)
def test_a_torn_latest_is_skipped_counted_out_and_kept(tmp_path: Path, damage, reason: str) -> None:
    root = tmp_path / "ckpt"
    for step in (5, 10):
        own(root, step, keep=2)
    damage(root / "step-00000010")
    found = checkpoint.scan(root)
    assert [f.state.step for f in found.usable] == [5]
    assert [p.name for p, _ in found.unusable] == ["step-00000010"] and reason in found.unusable[0][1]
    # Resume takes the spare (the trained log reaches back to it: fallback), not the torn one.
    assert checkpoint.resolve("auto", str(root)) == root / "step-00000005"
    assert checkpoint.resolve("latest", str(root)) == root / "step-00000005"
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.resolve(str(root / "step-00000010"), str(root))
    # The next saves keep the spare and the new ones; the torn folder is reported, not deleted
    # (it could be a newer trainer's), and never counted among the kept.
    own(root, 15, keep=2)
    assert names(root) == ["step-00000005", "step-00000010", "step-00000015"]
    own(root, 20, keep=2)
    assert names(root) == ["step-00000010", "step-00000015", "step-00000020"]


def test_the_trainer_resumed_from_the_spare_writes_the_torn_step_again(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (5, 10):
        own(root, step, keep=2)
    tear(root / "step-00000010")
    assert checkpoint.resolve("auto", str(root)) == root / "step-00000005"
    own(root, 10, keep=2)  # replayed up to step 10 again: its folder is replaced, whole
    assert checkpoint.verify(root / "step-00000010").step == 10
    assert names(root) == ["step-00000005", "step-00000010"]


def test_auto_refuses_to_start_over_when_no_checkpoint_is_whole(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert checkpoint.resolve("auto", str(root)) is None  # nothing there: start from the model
    own(root, 3, keep=1)
    tear(root / "step-00000003")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in .* is whole .*torn"):
        checkpoint.resolve("auto", str(root))
    # Half-written folders of killed saves are neither checkpoints nor kept.
    (root / ".step-00000004.tmp-999999").mkdir()
    assert checkpoint.prune(root, 0) == [root / ".step-00000004.tmp-999999"]
    assert names(root) == ["step-00000003"]


def test_disk_bytes_counts_every_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    own(root, 1, keep=0)
    own(root, 2, keep=0)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert checkpoint.disk_bytes(root) == sum(p.stat().st_size for p in files) > 2 * 12 * PARAMS
