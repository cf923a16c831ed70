"""The optimizer's state on N ranks as one checkpoint folder that any number of ranks loads.

Why: on N ranks (ranks.py) each rank's HostAdamW holds only its dim-0 shard of every master and
moment. Saving rank files as they are would tie a checkpoint to N; here each state tensor is a
DTensor (`as_dtensors`: the local views with their parameter's mesh, placements and global
shape, no copies), written with torch.distributed.checkpoint in safetensors files whose header
records each chunk's offset in the whole tensor (DCP's "DCP_SHARDING_INFO"), so that `load`
on M ranks (1, 2, 4, ...) reads the pieces each of its shards overlaps (DCP's resharding).

No pickle on disk or on the wire (the product's rule): DCP's default FileSystemWriter writes a
pickled `.metadata` file, and its collective save and load exchange pickled plans between
ranks (gather_object). So every rank runs DCP on its own (`no_dist=True`), writing one
safetensors file in the layout of DCP's HuggingFaceStorageWriter (`shard-<rank+1>-model-00001-
of-00001.safetensors`, each chunk's offset in its header; no metadata file: the reader
rebuilds the metadata from the headers), streamed from the optimizer's views
(_RankShardWriter), and every rank reads what its shards need with HuggingFaceStorageReader.
The only collectives are barriers and one all-reduced flag (tensors), through which every
rank learns whether any rank failed, so that all raise together and none waits forever for
a rank that gave up.

The folder is written as checkpoint.py writes one: into a hidden sibling, fsynced, then
renamed by rank 0 (folders.write_folder), so that its name never holds a partial save.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    SAVED_OFFSETS_KEY,
    _gen_file_name,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.futures import Future

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
    out: dict[str, DTensor] = {}
    for key, view in optimizer.state_tensors().items():
        _kind, name = key.split("/", 1)
        p = params.get(name)
        if not isinstance(p, DTensor):
            raise TypeError(f"{key}: parameter {name!r} is not a DTensor (got {type(p).__name__})")
        mesh = p.device_mesh if p.device_mesh.device_type == view.device.type else _mesh_on(p.device_mesh, view.device)
        t = DTensor.from_local(view, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        if view.numel() and t.to_local().data_ptr() != view.data_ptr():
            raise RuntimeError(f"{key}: DTensor.from_local copied the optimizer's view")
        out[key] = t
    return out


# The CPU meshes made for CUDA meshes' state (as_dtensors): one a mesh for the process's life,
# since making one may create process groups (a mesh of more than one dimension).
_MESHES: dict[tuple[str, tuple[int, ...], tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = {}


def _mesh_on(mesh: DeviceMesh, device: torch.device) -> DeviceMesh:
    """A mesh of `mesh`'s ranks, in its shape and names, of `device`'s type."""
    key = (device.type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device.type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    return _MESHES[key]


class _RankShardWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer, one file a rank, streamed: DCP plans what this rank holds
    (each chunk's offset in the whole tensor), this writes it as HuggingFaceStorageWriter
    would (the same file name and header: HuggingFaceStorageReader reads it) but with
    checkpoint.write_safetensors, straight from the optimizer's views. Its own write clones
    every view and builds the whole file in memory: 3x the rank's state at its peak (measured:
    +2.3 GB for 763 MB), where this adds nothing. No plans are gathered (no_dist), so the file
    is numbered by the rank given, not by the plan's place among the gathered ones."""

    def __init__(self, path: Path, rank: int):
        super().__init__(str(path), save_distributed=True)
        self._file = _gen_file_name(1, 1, rank + 1)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from rollstream.trainer.checkpoint import write_safetensors  # (checkpoint imports this module)

        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, dict[str, list[int]]] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:  # DCP would pickle it
                raise ValueError(f"{item.index.fqn}: not a tensor (only tensors are saved)")
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            tensors[item.index.fqn] = t.detach()
            offsets[item.index.fqn] = {SAVED_OFFSETS_KEY: list(item.tensor_data.chunk.offsets)}
            results.append(WriteResult(item.index, t.numel() * t.element_size(), self._file))
        path = Path(self.path) / self._file
        meta = {
            CUSTOM_METADATA_KEY: json.dumps(offsets),
            DCP_VERSION_KEY: str(HF_DCP_VERSION),
            FORMAT_KEY: FORMAT_VALUE,
        }
        write_safetensors(path, tensors, meta)
        folders.fsync_path(path)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


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
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it (_agree), then it is raised
            error = _unwrapped(e)
        _agree(error, f"saving {folder}")

    # Three agreements, (1) the hidden folder is made, (2) every rank wrote its file, (3) rank 0
    # renamed it: a failure on any rank at any of them raises on every rank at that one.
    what = f"saving {folder}"
    if rank != 0:
        _agree(None, what)  # (1)
        write_shards(tmp)  # (2)
        _agree(None, what)  # (3)
        return
    stage = 1

    def write(where: Path) -> None:  # folders.write_folder's: `where` (= tmp) is made, empty
        nonlocal stage
        _agree(None, what)  # (1)
        stage = 2
        write_shards(where)  # (2)
        stage = 3

    error: BaseException | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folders.write_folder(folder, write, tmp, old)  # (it removes `tmp` if anything fails)
    except Exception as e:  # told to the others at the agreement they wait at
        if stage == 2:  # (2) failed: every rank raised there already
            raise
        error = e
    _agree(error, what)  # (1) when making the folder failed, else (3)


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


def load(folder: Path, into: Mapping[str, torch.Tensor], together: bool = True) -> None:
    """Collective: fill `into` (as_dtensors' DTensors at any world size, or plain tensors in a
    plain process: the whole tensors) in place from `folder`, saved by `save` on any number of
    ranks. Before anything is written: every key of `into` must be saved, with its dtype and
    whole shape, its chunks covering it, and nothing else saved; else ValueError naming the key
    and the folder (every rank finds the same). Every rank raises if any failed; without
    `together`, this process alone reads (no collective: read_whole)."""
    folder = Path(folder)
    error: BaseException | None = None
    try:
        reader = _reader(folder)
        _check(folder, reader, into)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(dict(into), storage_reader=reader, no_dist=True)
    except ValueError as e:
        error = e
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it (_agree), then it is raised
        cause = _unwrapped(e)
        error = ValueError(f"{folder}: reading the saved shards failed: {cause!r}")
        error.__cause__ = cause
    if together:
        _agree(error, f"loading {folder}")
    elif error is not None:
        raise error


def _unwrapped(e: BaseException) -> BaseException:
    """DCP's CheckpointException (a BaseException, not an Exception) holds each rank's error:
    here the one rank's (no_dist), which keeps its traceback."""
    if isinstance(e, CheckpointException) and e.failures:
        exc, _trace = next(iter(e.failures.values()))
        return exc
    return e


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
    """Every tensor of a sharded save in `folder`, whole, read by this process alone, whether
    or not it is a rank (a one-process resume, `rollstream export`, rank 0's float32 export at
    the end of a run, while the other ranks wait for its next command)."""
    metadata = _reader(Path(folder)).read_metadata().state_dict_metadata
    into = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    load(folder, into, together=False)
    return into
