"""Trainer checkpoints: safetensors + JSON, written atomically, resumed exactly.

A checkpoint is one folder, `step-NNNNNNNN` by default:
  state.json             format, policy version, step, counters, the prompt feeder's position,
                         the stream consumer, model fingerprint, LoRA config, the settings
                         it was written with (minus the Redis URL, which may hold a password)
  optimizer.safetensors  the masters as the optimizer lays them out (HostAdamW.state_tensors):
                         master/<name> (fp32), or master_hi/<name> (bf16: the served weights)
                         and master_lo/<name> (int16) in the split layout, which load exactly
                         into either layout; exp_avg/<name>, exp_avg_sq/<name> (the moments'
                         dtype), for every trained parameter (LoRA: the adapters only)
  optimizer/             instead, from a trainer on N ranks: their shards of the same tensors
                         (torch.distributed.checkpoint's safetensors files, sharded_state.py),
                         which resume on any number of ranks, or joined in one process
  rng.safetensors        torch_cpu: torch's CPU generator state (uint8); cuda/<i> per GPU
The published bf16 weights are not stored apart: they are the masters' bf16 rounding (or,
with LoRA, the merge of the base model and the adapters), so they are derived on load. Python's and numpy's
global generators are not stored because the trainer never draws from them (the prompt
sources own seeded generators; their position is `prompts_fed`).

Atomic: everything is written into a hidden sibling folder, fsynced, and renamed into place,
so a crash never leaves a partial checkpoint under a checkpoint's name. No pickle: tensors
are safetensors, the rest JSON (state.json is a pydantic model, CheckpointState, validated
field by field on load).

Whose is what (docs/reliability.md, "Checkpoints"): only the `step-NNNNNNNN` folders at the
top of checkpoint_dir are the trainer's own: resumed from and pruned once verified (`scan`),
and refused to SaveCheckpoint (`confine`), so an operator's checkpoint can neither shadow nor
prune them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, model_validator
from safetensors import safe_open

from rollstream.core import deltas, progress, safetensors_io
from rollstream.trainer import folders, sharded_state
from rollstream.trainer.ranks import shard_rows

if TYPE_CHECKING:
    from rollstream.trainer.optimizer import HostAdamW

FORMAT: Final = "rollstream-trainer-checkpoint"
FORMAT_VERSION: Final = 1
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
SHARDED_DIR = "optimizer"  # N ranks: their shards, torch.distributed.checkpoint in safetensors (sharded_state.py)
RNG_FILE = "rng.safetensors"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
}


class CheckpointError(ValueError):
    pass


class CheckpointPathRefused(CheckpointError):
    """A checkpoint path asked for over gRPC that leads outside checkpoint_dir."""


class CheckpointNameRefused(CheckpointError):
    """A checkpoint path asked for over gRPC under one of the trainer's own names."""


class CheckpointState(BaseModel):
    """Everything in state.json: the non-tensor state of a trainer. Typed and validated when
    a file is read (`from_json`): a corrupt, foreign or too new file is a CheckpointError
    naming the field."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["rollstream-trainer-checkpoint"] = FORMAT
    format_version: Literal[1] = FORMAT_VERSION
    version: NonNegativeInt
    step: NonNegativeInt
    optimizer_steps: NonNegativeInt
    groups_trained: NonNegativeInt = 0
    groups_stale: NonNegativeInt = 0
    prompts_fed: NonNegativeInt = 0  # prompts drawn from the prompt source so far
    run: str = ""
    consumer: str = ""  # consumer name in the ready stream's group (its pending entries come back to it)
    consumer_group: str = ""
    model_fingerprint: str = ""
    base_weights_sha256: str = ""  # LoRA: the frozen base the adapters belong to
    lora: dict[str, Any] | None = None  # {rank, alpha, target_modules} or None
    moments_dtype: str = "float32"
    master_layout: str = "fp32"  # informational: load_state reads either layout
    # The trained log's last entry when this was written: the entries up to it are in these
    # weights, so once this is the oldest checkpoint a resume may fall back to, they go.
    trained_log_id: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        """Keys older trainers wrote that nothing reads any more: accepted, dropped."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in _RETIRED}
        return data

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> "CheckpointState":
        try:
            read = _StateFile.model_validate_json(text)
        except ValidationError as e:
            problems = "; ".join(_problem(err) for err in e.errors(include_url=False))
            if any(err["loc"][:1] in (("format",), ("format_version",)) for err in e.errors()):
                raise CheckpointError(f"not a {FORMAT} v{FORMAT_VERSION} state file: {problems}") from None
            raise CheckpointError(f"state file does not match this trainer: {problems}") from None
        return CheckpointState.model_validate(dict(read))

    def check_model(
        self, path: Path, published: Mapping[str, torch.Tensor], lora_base: Mapping[str, np.ndarray] | None, model: str
    ) -> None:
        """CheckpointError unless these weights are this checkpoint's model: the same names and
        shapes and, with LoRA (`lora_base` its frozen base bits), the same base weights."""
        if lora_base is not None and self.base_weights_sha256 != deltas.weights_sha256(lora_base):
            raise CheckpointError(f"{path}: its adapters belong to another base model than {model}")
        fingerprint = deltas.model_fingerprint({name: tuple(p.shape) for name, p in published.items()})
        if self.model_fingerprint != fingerprint:
            raise CheckpointError(f"{path}: checkpoint is for model {self.model_fingerprint}, {model} is {fingerprint}")


# held_groups: the ids of groups read but not trained when a checkpoint was written. Only
# ever informational (a resumed trainer gets them back as its consumer's pending entries),
# and never read on resume.
_RETIRED = frozenset({"held_groups"})


class _StateFile(CheckpointState):
    """state.json as read: it must say what it is, and a number is a JSON number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    format: Literal["rollstream-trainer-checkpoint"]
    format_version: Literal[1]


def _problem(err: Any) -> str:
    where = ".".join(str(part) for part in err["loc"]) or "(the file)"
    got = f" (got {err['input']!r:.80})" if err["type"] not in ("missing", "json_invalid") and "input" in err else ""
    return f"{where}: {err['msg']}{got}"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Stream CPU tensors into a safetensors file, one after the other, without building the
    whole file in memory (the optimizer state is 12 bytes per parameter). Tensors may be
    views sharing storage (safetensors' own writer refuses those)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{name}: dtype {t.dtype} cannot be stored")
        if t.device.type != "cpu":
            raise CheckpointError(f"{name}: tensor on {t.device}, expected the CPU")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data start to 8 bytes
    with open(path, "wb") as f, progress.task(f"saving {path.name}", offset, as_bytes=True) as advance:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                advance(t.numel() * t.element_size())


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """Tensors of a safetensors file, read one at a time on access (memory-mapped)."""

    def __init__(self, path: Path):
        self._file = safe_open(str(path), framework="pt")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda/{i}"] = s
    return state


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"].clone())
    cuda = sorted((k for k in state if k.startswith("cuda/")), key=lambda k: int(k.split("/")[1]))
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"checkpoint has {len(cuda)} CUDA generator states, this machine {torch.cuda.device_count()} GPUs"
            )
        torch.cuda.set_rng_state_all([state[k].clone() for k in cuda])


def save(
    path: Path,
    state: CheckpointState,
    optimizer: Mapping[str, torch.Tensor] | Callable[[Path], None],
    rng: Mapping[str, torch.Tensor],
    replace: bool = False,
) -> Path:
    """Write a checkpoint folder at `path` atomically. An existing one is an error, unless
    `replace`: then the new one takes its place once complete (for a moment between two
    renames neither is there; a partial one never is). `optimizer`: its state tensors, or
    what writes them into the folder (N ranks: save_sharded_optimizer on every rank)."""
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"checkpoint {path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(folder: Path) -> None:
        if callable(optimizer):
            optimizer(folder)
        else:
            write_optimizer(folder, optimizer)
        write_safetensors(folder / RNG_FILE, rng, {"format": FORMAT})
        # state.json last: a folder with it is complete (the rename makes that moot, but a
        # reader of a half-copied folder gets an error instead of a half state).
        (folder / STATE_FILE).write_text(state.to_json())

    pid = os.getpid()
    return folders.write_folder(
        path, write, path.parent / f".{path.name}.tmp-{pid}", path.parent / f".{path.name}.old-{pid}"
    )


def load_state(path: Path) -> CheckpointState:
    path = Path(path)
    try:
        text = (path / STATE_FILE).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_FILE})") from None
    try:
        return CheckpointState.from_json(text)
    except CheckpointError as e:
        raise CheckpointError(f"{path / STATE_FILE}: {e}") from None


def write_optimizer(folder: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One process's optimizer state: one safetensors file."""
    write_safetensors(folder / OPTIMIZER_FILE, tensors, {"format": FORMAT})


def is_sharded(path: Path) -> bool:
    """Whether checkpoint `path` holds its optimizer state as N ranks' shards."""
    return (Path(path) / SHARDED_DIR).is_dir()


def optimizer_tensors(path: Path) -> Mapping[str, torch.Tensor]:
    """The optimizer state tensors of checkpoint `path`, whole (a sharded one's joined)."""
    if is_sharded(path):
        return sharded_state.read_whole(Path(path) / SHARDED_DIR)
    return SafetensorsReader(Path(path) / OPTIMIZER_FILE)


def save_sharded_optimizer(folder: Path, optimizer: HostAdamW, params: Mapping[str, torch.Tensor]) -> None:
    """Every rank: its shards of the optimizer state into folder/optimizer (collective)."""
    sharded_state.save(folder / SHARDED_DIR, sharded_state.as_dtensors(optimizer, params))


def load_sharded_optimizer(path: Path, optimizer: HostAdamW, params: Mapping[str, torch.Tensor], steps: int) -> None:
    """Every rank: its shards of checkpoint `path`'s optimizer state, saved on any number of
    ranks (in place: sharded_state.load_optimizer) or by one process (each rank reads its rows
    of the whole tensors: HostAdamW.load_state), then the served bits into the model."""
    if is_sharded(path):
        views = sharded_state.as_dtensors(optimizer, params)
        sharded_state.load_optimizer(Path(path) / SHARDED_DIR, optimizer, views, steps)
        return
    whole = SafetensorsReader(Path(path) / OPTIMIZER_FILE)
    optimizer.load_state(
        {key: shard_rows(whole[key], params[key.split("/", 1)[1]]) for key in optimizer.state_tensors()}, steps
    )


def rng_tensors(path: Path) -> SafetensorsReader:
    return SafetensorsReader(Path(path) / RNG_FILE)


def verify(path: Path) -> CheckpointState:
    """The state of a whole checkpoint, or a CheckpointError saying what is missing: state.json
    must be valid and each tensor file exactly as long as its header says. What this catches is
    a torn folder (a copy cut short, a file lost); a bit flipped inside the tensor data it does
    not (that would mean reading the whole optimizer state)."""
    path = Path(path)
    state = load_state(path)
    shards = sorted((path / SHARDED_DIR).glob("*.safetensors")) if is_sharded(path) else [path / OPTIMIZER_FILE]
    if not shards:
        raise CheckpointError(f"{path / SHARDED_DIR}: no safetensors shards")
    for file in [*shards, path / RNG_FILE]:
        _check_length(file)
    return state


def _check_length(path: Path) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, safetensors_io.MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: {size} bytes, too short for its safetensors header")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if size != 8 + n + end:
        raise CheckpointError(f"{path}: {size} bytes, its header says {8 + n + end}: torn")


@dataclass(frozen=True)
class Found:
    """A verified trainer checkpoint and what it records."""

    path: Path
    state: CheckpointState


@dataclass
class Scan:
    """The trainer's own checkpoints in checkpoint_dir: `usable` (verified), oldest first by
    recorded step; `unusable`, each with why (torn, or written by another trainer version)."""

    usable: list[Found] = field(default_factory=list)
    unusable: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def latest(self) -> Found | None:
        return self.usable[-1] if self.usable else None


def scan(checkpoint_dir: Path) -> Scan:
    """Verify every `step-N` folder at the top of `checkpoint_dir` and rank the whole ones by
    the step they record (the name's number is only a label: a rank taken from a name would
    let one wrong name outrank every real checkpoint)."""
    found = Scan()
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return found
    for child in sorted(checkpoint_dir.iterdir()):
        if not _STEP_DIR.match(child.name) or not child.is_dir():
            continue
        try:
            found.usable.append(Found(child, verify(child)))
        except CheckpointError as e:
            found.unusable.append((child, str(e)))
    found.usable.sort(key=lambda f: (f.state.step, f.path.name))
    return found


def latest(checkpoint_dir: Path) -> Path | None:
    """The verified trainer checkpoint with the highest recorded step in `checkpoint_dir`, if any."""
    newest = scan(checkpoint_dir).latest
    return newest.path if newest is not None else None


def prune(checkpoint_dir: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` verified trainer checkpoints with the highest recorded steps
    (0: keep all), and the hidden folders of saves killed half-way. Never anything else: not
    an operator's checkpoint (another name), not a folder that does not verify (it may be a
    newer trainer's; `scan` reports it, the trainer logs it)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    gone = [f.path for f in scan(checkpoint_dir).usable[:-keep]] if keep > 0 else []
    # Half-written folders of a process killed mid-save (this process's own are in use).
    gone += [p for p in checkpoint_dir.glob(".step-*") if not p.name.endswith(f"-{os.getpid()}")]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def save_own(checkpoint_dir: Path, step: int, keep: int, write: Callable[[Path], Path]) -> tuple[Path, list[Path]]:
    """The trainer's own checkpoint at `step`, written by `write(folder)` (which must replace a
    folder already there: after a resume from an earlier step it holds the abandoned
    lineage's state). With keep >= 2 room is made first, so that the disk never holds more
    than `keep` while the new one is written (the latest stays until the new one is whole);
    then all but `keep` go. Returns the folder and what was removed."""
    target = Path(checkpoint_dir) / step_dir_name(step)
    removed = prune(checkpoint_dir, keep - 1) if keep >= 2 and not target.exists() else []
    saved = write(target)
    return saved, removed + prune(checkpoint_dir, keep)


def fallback(found: Scan, keep: int) -> Found | None:
    """The oldest checkpoint a resume may still need: the latest, or with a spare kept
    (keep != 1) the one before it, which a torn latest falls back to. The trained log must
    reach back to it; what is older is in its weights. None: back to the start (a spare is
    wanted and there is none yet, so the model itself is the spare)."""
    if keep == 1:
        return found.latest
    return found.usable[-2] if len(found.usable) >= 2 else None


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path` (symbolic links not followed: rglob does not enter them)."""
    return sum(p.lstat().st_size for p in Path(path).rglob("*") if p.is_symlink() or not p.is_dir())


def resolve(spec: str, checkpoint_dir: str) -> Path | None:
    """`--resume` value -> checkpoint folder: a path (verified), or 'latest' in checkpoint_dir;
    'auto' is 'latest' when there is one, else None (start from the model). 'latest' and
    'auto' refuse a folder holding trainer checkpoints none of which verifies: starting over
    would quietly drop the run."""
    if spec in ("auto", "latest"):
        found = scan(Path(checkpoint_dir)) if checkpoint_dir else Scan()
        if found.latest is not None:
            return found.latest.path
        if found.unusable:
            why = "; ".join(reason for _, reason in found.unusable)
            raise CheckpointError(
                f"resume = {spec!r}: no checkpoint in {checkpoint_dir} is whole ({why}); move them away to start over"
            )
        if spec == "latest":
            raise CheckpointError(f"resume = 'latest' but {checkpoint_dir} holds no checkpoint")
        return None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_FILE})")
    verify(path)
    return path


def confine(path: str, checkpoint_dir: str) -> Path:
    """Where SaveCheckpoint may write `path`: inside checkpoint_dir, nowhere else (a caller
    must not make the trainer write where it pleases), and not under the trainer's own names
    (a top-level `step-*` folder or a hidden one: those are what resume and pruning act on).
    A relative path is taken inside checkpoint_dir; any path is resolved (symlinks, `..`)
    before it is checked, and the resolved one is returned, so what is checked is what is
    written."""
    if not checkpoint_dir:
        raise CheckpointError("no checkpoint_dir configured: SaveCheckpoint writes only inside it")
    root = Path(checkpoint_dir).resolve()
    given = Path(path)
    target = (given if given.is_absolute() else root / given).resolve()
    if target == root or not target.is_relative_to(root):
        raise CheckpointPathRefused(
            f"checkpoint path {path!r} resolves to {target}, outside the checkpoint folder {root}"
        )
    top = target.relative_to(root).parts[0]
    # casefold: on a case-insensitive file system STEP-00000007 is the trainer's step-00000007.
    if top.casefold().startswith(("step-", ".")):
        raise CheckpointNameRefused(
            f"checkpoint path {path!r}: {top!r} at the top of the checkpoint folder is a name of the trainer's own checkpoints "
            f"(step-* and hidden folders: resumed from and pruned); choose another, e.g. 'saved/{top.lstrip('.')}'"
        )
    return target
