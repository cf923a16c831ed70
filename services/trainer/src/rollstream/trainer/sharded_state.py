"""The optimizer's state on N ranks as one checkpoint folder that any number of ranks loads.

Why: on N ranks (ranks.py) each rank's HostAdamW holds only its dim-0 shard of every master and
moment. Saving rank files as they are would tie a checkpoint to N; here each state tensor is a
DTensor (`as_dtensors`: the local views with their parameter's mesh, placements and global
shape, no copies), written with torch.distributed.checkpoint in safetensors files whose header
records each chunk's offset in the whole tensor (DCP's "DCP_SHARDING_INFO"), so that `load`
on M ranks (1, 2, 4, ...) reads the pieces each of its shards overlaps (DCP's resharding).

No pickle on disk or on the wire (the product's rule): DCP's default FileSystemWriter writes a
pickled `.metadata` file, and its collective save and load exchange pickled plans between
ranks (gather_object). So every rank runs DCP on its own (`no_dist=True`): the writer is DCP's
HuggingFaceStorageWriter (safetensors, no metadata file: the reader rebuilds the metadata
from the safetensors headers), one file per rank (`shard-<rank+1>-model-00001-of-00001`),
and every rank reads what its shards need from those headers. The only collectives are
barriers and one all-reduced flag (tensors), through which every rank learns whether any rank
failed, so that all raise together and none waits forever for a rank that gave up.

The folder is written as checkpoint.py writes one: into a hidden sibling, fsynced, then
renamed by rank 0 (folders.write_folder), so that its name never holds a partial save.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rollstream.trainer import folders
from rollstream.trainer.optimizer import HostAdamW

STATE_FILE = "state.json"  # rank 0's JSON beside the shards (`save`'s `state`)
SHARD_SUFFIX = ".safetensors"
# DCP warns that it "assumes the intent is to load in a single process" whenever no_dist is
# set: here every rank does so on purpose (the module's docstring).
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def as_dtensors(optimizer: HostAdamW, params: Mapping[str, torch.Tensor]) -> dict[str, DTensor]:
    """`optimizer.state_tensors()` (views of the local shards) as DTensors laid out as their
    parameters in `params` are: the same mesh ranks and placements, the parameter's global
    shape and stride (given, not inferred: FSDP2's last shards may be shorter, even empty). No
    copies: each DTensor's local tensor is the optimizer's view, so a load writes the state.
    The mesh is the parameter's, or on GPUs a CPU mesh over the same ranks (the state lives in
    host memory; DTensor.from_local would copy a CPU view onto a CUDA mesh's device)."""
    meshes: dict[int, DeviceMesh] = {}
    out: dict[str, DTensor] = {}
    for key, view in optimizer.state_tensors().items():
        _kind, name = key.split("/", 1)
        p = params.get(name)
        if not isinstance(p, DTensor):
            raise TypeError(f"{key}: parameter {name!r} is not a DTensor (got {type(p).__name__})")
        mesh = p.device_mesh
        if mesh.device_type != view.device.type:
            if id(mesh) not in meshes:
                meshes[id(mesh)] = DeviceMesh(view.device.type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
            mesh = meshes[id(mesh)]
        t = DTensor.from_local(view, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        if view.numel() and t.to_local().data_ptr() != view.data_ptr():
            raise RuntimeError(f"{key}: DTensor.from_local copied the optimizer's view")
        out[key] = t
    return out


class _RankShardWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer, one file per rank without the collective plan exchange:
    HuggingFaceStorageWriter numbers the files by the rank's plan among the gathered plans,
    which a no_dist save does not gather (every rank would write shard 1)."""

    def __init__(self, path: Path, rank: int):
        super().__init__(str(path), save_distributed=True)
        self._shard_index = rank + 1

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data={"shard_index": self._shard_index}) for plan in plans]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(error: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (`error`: this rank's failure, or None). A plain
    process (no process group) raises its own error."""
    failed = error is not None
    if dist.is_initialized():
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is None and flag.item() > 0:
            raise RuntimeError(f"{what}: another rank failed (its own error is in its output)")
    if error is not None:
        raise error


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(folder: Path, tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any] | None = None) -> None:
    """Collective (every rank calls it, with the same keys): write `tensors` (as_dtensors'
    DTensors, or plain tensors in a plain process) into `folder` in safetensors files, one a
    rank, each chunk with its offset in the whole tensor; `state` (rank 0's; JSON) goes into
    `folder`/state.json. Atomic: written into a hidden sibling and renamed by rank 0 once every
    rank wrote its file; an existing `folder` is replaced. Every rank raises if any failed."""
    folder = Path(folder)
    rank = _rank()
    tmp = folder.parent / f".{folder.name}.tmp-sharded"
    old = folder.parent / f".{folder.name}.old-sharded"

    def write_shards(where: Path) -> None:
        error: BaseException | None = None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                dcp.save(dict(tensors), storage_writer=_RankShardWriter(where, rank), no_dist=True)
            if rank == 0 and state is not None:
                (where / STATE_FILE).write_text(json.dumps(dict(state), indent=1))
        except Exception as e:  # noqa: BLE001 - every rank must learn of it (_agree), then it is raised
            error = e
        _agree(error, f"saving {folder}")

    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        error: BaseException | None = None
        try:

            def write(where: Path) -> None:
                _barrier()  # (1) `where` is made, empty: the others may write into it
                write_shards(where)

            folders.write_folder(folder, write, tmp, old)
        except Exception as e:  # noqa: BLE001 - the others wait for the rename's outcome (_agree)
            error = e
        _agree(error, f"saving {folder}")  # (3) renamed, or every rank raises
    else:
        _barrier()  # (1)
        write_shards(tmp)  # (2) inside: every rank wrote its file, or all raise
        _agree(None, f"saving {folder}")  # (3)


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a sharded save in `folder`."""
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(SHARD_SUFFIX))


def read_state(folder: Path) -> dict[str, Any]:
    """`folder`/state.json (`save`'s `state`); ValueError naming the folder if missing or not JSON."""
    path = Path(folder) / STATE_FILE
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: no readable {STATE_FILE}: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: not a JSON object")
    return loaded


def load(folder: Path, into: Mapping[str, torch.Tensor]) -> None:
    """Collective: fill `into` (as_dtensors' DTensors at any world size, or plain tensors in a
    plain process: the whole tensors) in place from `folder`, saved by `save` on any number of
    ranks. Before anything is written: every key of `into` must be saved, with its dtype and
    whole shape, its chunks covering it, and nothing else saved; else ValueError naming the key
    and the folder (every rank finds the same). Every rank raises if any failed."""
    folder = Path(folder)
    error: BaseException | None = None
    try:
        reader = _reader(folder)
        _check(folder, reader, into)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(dict(into), storage_reader=reader, no_dist=True)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it (_agree), then it is raised
        error = e
    _agree(error, f"loading {folder}")


def _reader(folder: Path) -> HuggingFaceStorageReader:
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such checkpoint folder")
    if not shard_files(folder):
        raise ValueError(f"{folder}: no {SHARD_SUFFIX} files (not a sharded optimizer state)")
    return HuggingFaceStorageReader(str(folder))


def _check(folder: Path, reader: HuggingFaceStorageReader, into: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless the saved tensors are `into`'s: keys, dtypes, whole shapes, covered."""
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged header of any kind: named with the folder
        raise ValueError(f"{folder}: unreadable shard headers: {e}") from None
    missing = sorted(set(into) - set(saved))
    if missing:
        raise ValueError(f"{folder}: {missing[0]} is not saved ({len(missing)} keys missing)")
    extra = sorted(set(saved) - set(into))
    if extra:
        raise ValueError(f"{folder}: {extra[0]} is saved but not expected ({len(extra)} unexpected keys)")
    for key, t in into.items():
        md = saved[key]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{folder}: {key} is not saved as a tensor")
        if md.properties.dtype != t.dtype or tuple(md.size) != tuple(t.shape):
            raise ValueError(
                f"{folder}: {key} is saved as {md.properties.dtype}{tuple(md.size)}, expected {t.dtype}{tuple(t.shape)}"
            )
        chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
        covered = sum(math.prod(sizes) for _offsets, sizes in chunks)
        if covered != math.prod(t.shape):  # a rank's file missing (the whole shape is the largest chunk end)
            raise ValueError(f"{folder}: {key}: the saved chunks hold {covered} of its {math.prod(t.shape)} elements")


def load_optimizer(
    folder: Path, optimizer: HostAdamW, into: Mapping[str, torch.Tensor], step_count: int
) -> dict[str, np.ndarray]:
    """`load` into `into` (as_dtensors(optimizer, params), or plain processes'
    optimizer.state_tensors(): views of the optimizer's state, so `load` writes the masters and
    moments themselves), then the step count and the model's weights (sync_model: what
    load_state does after its copies, without copying the state a second time). Returns the
    served bits (HostAdamW.load_state's return)."""
    load(folder, into)
    optimizer.step_count = step_count
    return optimizer.sync_model()


def read_whole(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded save in `folder`, whole, in this process (no process group:
    what a one-process resume and `rollstream export` read)."""
    metadata = _reader(Path(folder)).read_metadata().state_dict_metadata
    into = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    load(folder, into)
    return into
