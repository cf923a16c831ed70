"""Trainer checkpoints: safetensors + JSON, written atomically, resumed exactly.

A checkpoint is one folder, `step-NNNNNNNN` by default:
  state.json             format, policy version, step, counters, the prompt feeder's position,
                         the stream consumer, model fingerprint, LoRA config, the settings
                         it was written with (minus the Redis URL, which may hold a password)
  optimizer.safetensors  master/<name> (fp32), exp_avg/<name>, exp_avg_sq/<name> (the moments'
                         dtype), for every trained parameter (LoRA: the adapters only)
  rng.safetensors        torch_cpu: torch's CPU generator state (uint8); cuda/<i> per GPU
The published bf16 weights are not stored: they are bf16(master) (or, with LoRA, the merge
of the base model and the adapters), so they are derived on load. Python's and numpy's
global generators are not stored because the trainer never draws from them (the prompt
sources own seeded generators; their position is `prompts_fed`).

Atomic: everything is written into a hidden sibling folder, fsynced, and renamed into place,
so a crash never leaves a partial checkpoint under a checkpoint's name, and `latest()` only
ever sees complete ones. No pickle: tensors are safetensors, the rest JSON (state.json is a
pydantic model, CheckpointState, validated field by field on load).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, model_validator
from safetensors import safe_open

from rollstream.core import progress

FORMAT = "rollstream-trainer-checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}


class CheckpointError(ValueError):
    pass


class CheckpointPathRefused(CheckpointError):
    """A checkpoint path asked for over gRPC that leads outside checkpoint_dir."""


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
    settings: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        """Keys older trainers wrote that nothing reads any more: accepted, dropped."""
        if isinstance(data, dict) and any(k in data for k in _RETIRED):
            data = {k: v for k, v in data.items() if k not in _RETIRED}
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


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
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
        f.flush()
        os.fsync(f.fileno())


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
            raise CheckpointError(f"checkpoint has {len(cuda)} CUDA generator states, this machine {torch.cuda.device_count()} GPUs")
        torch.cuda.set_rng_state_all([state[k].clone() for k in cuda])


def save(path: Path, state: CheckpointState, optimizer_tensors: Mapping[str, torch.Tensor], rng: Mapping[str, torch.Tensor], replace: bool = False) -> Path:
    """Write a checkpoint folder at `path` atomically. An existing one is an error, unless
    `replace`: then the new one takes its place once complete (for a moment between two
    renames neither is there; a partial one never is)."""
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"checkpoint {path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crash of this very process id: never a complete checkpoint
    tmp.mkdir()
    try:
        write_safetensors(tmp / OPTIMIZER_FILE, optimizer_tensors, {"format": FORMAT})
        write_safetensors(tmp / RNG_FILE, rng, {"format": FORMAT})
        # state.json last: a folder with it is complete (the rename makes that moot, but a
        # reader of a half-copied folder gets an error instead of a half state).
        with open(tmp / STATE_FILE, "w") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if path.exists():
            os.rename(path, old)  # a directory cannot be renamed over a non-empty one
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def optimizer_tensors(path: Path) -> SafetensorsReader:
    return SafetensorsReader(Path(path) / OPTIMIZER_FILE)


def rng_tensors(path: Path) -> SafetensorsReader:
    return SafetensorsReader(Path(path) / RNG_FILE)


def latest(checkpoint_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step in `checkpoint_dir`, if any."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return None
    found = []
    for child in checkpoint_dir.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None


def prune(checkpoint_dir: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest step checkpoints in `checkpoint_dir` (0: keep all).
    A resume needs only the latest; the trained log covers the steps after it."""
    if keep <= 0 or not Path(checkpoint_dir).is_dir():
        return []
    steps = sorted(
        (int(m.group(1)), child) for child in Path(checkpoint_dir).iterdir() if (m := _STEP_DIR.match(child.name)) and (child / STATE_FILE).is_file()
    )
    gone = [path for _, path in steps[:-keep]]
    # Half-written folders of a process killed mid-save (this process's own are in use).
    gone += [p for p in Path(checkpoint_dir).glob(".step-*") if not p.name.endswith(f"-{os.getpid()}")]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def resolve(spec: str, checkpoint_dir: str) -> Path | None:
    """`--resume` value -> checkpoint folder: a path, or 'latest' in checkpoint_dir; 'auto' is
    'latest' when there is one, else None (start from the model)."""
    if spec == "auto":
        return latest(Path(checkpoint_dir)) if checkpoint_dir else None
    if spec == "latest":
        found = latest(Path(checkpoint_dir))
        if found is None:
            raise CheckpointError(f"resume = 'latest' but {checkpoint_dir} holds no checkpoint")
        return found
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_FILE})")
    return path


def confine(path: str, checkpoint_dir: str) -> Path:
    """Where SaveCheckpoint may write `path`: inside checkpoint_dir, nowhere else (a caller
    must not make the trainer write where it pleases). A relative path is taken inside
    checkpoint_dir; any path is resolved (symlinks, `..`) before it is checked, and the
    resolved one is returned, so what is checked is what is written."""
    if not checkpoint_dir:
        raise CheckpointError("no checkpoint_dir configured: SaveCheckpoint writes only inside it")
    root = Path(checkpoint_dir).resolve()
    given = Path(path)
    target = (given if given.is_absolute() else root / given).resolve()
    if target == root or not target.is_relative_to(root):
        raise CheckpointPathRefused(f"checkpoint path {path!r} resolves to {target}, outside the checkpoint folder {root}")
    return target


class CheckpointRequests:
    """SaveCheckpoint calls arrive on gRPC threads; the training loop serves them between
    steps, so a checkpoint never sees half a step (or a feeder mid top-up)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Future[tuple[Path, int]]]] = queue.Queue()
        self._lock = threading.Lock()  # a request is either queued before close() or refused
        self._closed = False

    def request(self, path: str, timeout_s: float | None) -> tuple[Path, int]:
        """Ask the loop for a checkpoint (at `path`, or the default one); wait for it."""
        future: Future[tuple[Path, int]] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the trainer is stopping")
            self._queue.put((path, future))
        return future.result(timeout=timeout_s)

    def serve(self, save: Callable[[str], tuple[Path, int]]) -> None:
        while True:
            try:
                path, future = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(save(path))
            except Exception as e:  # noqa: BLE001 - the caller gets the error over gRPC
                future.set_exception(e)

    def close(self) -> None:
        """Refuse new requests and fail the waiting ones."""
        with self._lock:
            self._closed = True
        while True:
            try:
                _path, future = self._queue.get_nowait()
            except queue.Empty:
                return
            future.set_exception(RuntimeError("the trainer is stopping"))
