"""A trained model as a Hugging Face folder: from the live trainer (the end of a run) or from a
checkpoint (`rollstream export`).

What goes in (docs/design-notes.md, "Export"):
  full fine-tuning  config.json (with the weights' dtype), generation_config.json, the source
                    model's tokenizer files and chat template, model*.safetensors (sharded with
                    an index past `max_shard_size`), all written by transformers' and the
                    tokenizer's own save_pretrained;
  LoRA              the PEFT adapter folder (adapter_config.json + adapter_model.safetensors, by
                    peft's save_pretrained) and the tokenizer; `merge` writes the merged weights
                    as a full model instead;
  and rollstream-export.json: what was exported (step, version, dtype, kind, base model). It
  marks the folder as an export: only such a folder is ever replaced.
The weights: bfloat16 = the served bits of that step, bit for bit (the publisher's bits: with
LoRA the merge every generator holds); float32 = the optimizer's fp32 masters, and for weights
not trained (the LoRA base) the base model's own values, merged with peft's formula.

A checkpoint is read back the way a resuming trainer reads it (Trainer.__init__/_restore):
the model loaded by lora.load (with LoRA its base rounded to bf16 under the adapters), a
HostAdamW in the checkpoint's layout, optimizer.load_state; then the bits come from the
functions the trainer publishes with, so the export of a checkpoint equals the export of the
trainer that wrote it.

Atomic: written into a hidden sibling folder, every file fsynced, renamed into place; an
export already there is replaced only once the new one is whole. A crash, a full disk or a
Ctrl-C leaves nothing under the output name (a temp folder of a killed export is removed by
the next export to the same place).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from rollstream.core import logs, modeling
from rollstream.core.models import ModelNotFoundError, resolve_model
from rollstream.trainer import checkpoint, folders, lora
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW

if TYPE_CHECKING:
    from rollstream.trainer.trainer import Trainer

FORMAT = "rollstream-export"
FORMAT_VERSION = 1
MARKER = "rollstream-export.json"
MAX_SHARD_SIZE = "5GB"
Dtype = Literal["bfloat16", "float32"]
_TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(ValueError):
    """Bad input to an export, with the cause: not a run, no such step, a torn checkpoint, an
    output folder that is not an export."""


@dataclass
class Trained:
    """A trainer's weights as an export reads them: the live trainer's, or rebuilt from a
    checkpoint exactly as a resuming trainer builds them."""

    model_dir: str  # the source Hugging Face folder (config, tokenizer; the LoRA base)
    optimizer: HostAdamW  # the masters of the trained parameters (LoRA: the adapters)
    lora: lora.LoraModel | None
    served: Mapping[str, np.ndarray]  # the published bf16 bits by Hugging Face name (LoRA: merged)
    step: int
    version: int
    source: str  # "trainer" or the checkpoint folder


def from_trainer(trainer: "Trainer") -> Trained:
    """The live trainer's state (call between steps: the split layout's bits are rewritten in place by a step)."""
    trainer.optimizer.wait()  # an overlapped step's update makes the bits
    return Trained(
        trainer.model_dir,
        trainer.optimizer,
        trainer.lora,
        trainer.publisher.bits(),
        trainer.step,
        trainer.version,
        "trainer",
    )


def _setting(settings: Mapping[str, Any], name: str) -> Any:
    """A value of the settings a checkpoint was written with; the default for one it predates."""
    return settings.get(name, TrainerSettings.model_fields[name].default)


def from_checkpoint(path: Path) -> Trained:
    """Rebuild the trainer's weights from a checkpoint folder (verified first: a torn one is an
    ExportError saying what is missing)."""
    path = Path(path)
    try:
        state = checkpoint.verify(path)
    except checkpoint.CheckpointError as e:
        raise ExportError(str(e)) from None
    settings = state.settings
    try:
        model_dir = str(resolve_model(settings.get("model")))
    except ModelNotFoundError as e:
        raise ExportError(f"{path} was trained from model {settings.get('model')!r}, which is not here: {e}") from None
    spec = None
    if state.lora is not None:
        spec = lora.LoraSpec(int(state.lora["rank"]), float(state.lora["alpha"]), tuple(state.lora["target_modules"]))
    _model, _tokenizer, trained_lora, params = lora.load(model_dir, _setting(settings, "dtype"), spec=spec)
    published = trained_lora.base if trained_lora is not None else params
    try:
        state.check_model(path, published, trained_lora.base_bits if trained_lora is not None else None, model_dir)
    except checkpoint.CheckpointError as e:
        raise ExportError(str(e)) from None
    # state.json's strings, narrowed to the optimizer's choices (the trainer wrote them from its settings).
    moments: Literal["float32", "bfloat16"] = "bfloat16" if state.moments_dtype == "bfloat16" else "float32"
    layout: Literal["split", "fp32"] = (
        "split" if state.master_layout == "split" else "fp32"
    )  # load_state reads either layout
    optimizer = HostAdamW(
        params,
        lr=_setting(settings, "lr"),
        betas=tuple(_setting(settings, "betas")),
        weight_decay=_setting(settings, "weight_decay"),
        bucket_mb=_setting(settings, "bucket_mb"),
        moments_dtype=moments,
        master_layout=layout,
    )
    try:
        trained_bits = optimizer.load_state(checkpoint.optimizer_tensors(path), state.optimizer_steps)
    except (ValueError, KeyError) as e:
        raise ExportError(f"{path / checkpoint.OPTIMIZER_FILE}: {e}") from None
    # What Trainer._published_bits serves after this restore.
    served = trained_lora.merged_bits() if trained_lora is not None else trained_bits
    return Trained(model_dir, optimizer, trained_lora, served, state.step, state.version, str(path))


# -- which checkpoint -----------------------------------------------------------------------


def find_checkpoint(run_dir: Path, step: int | None = None) -> tuple[Path, list[str]]:
    """The checkpoint folder `rollstream export RUN_DIR [--step N]` means, and notes on what was
    skipped. RUN_DIR is an `up` run folder (its checkpoints/), a checkpoint_dir (step-N
    folders) or one checkpoint folder (state.json). Default step: the latest whole one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such folder")
    if (run_dir / checkpoint.STATE_FILE).is_file():
        try:
            state = checkpoint.verify(run_dir)
        except checkpoint.CheckpointError as e:
            raise ExportError(str(e)) from None
        if step is not None and state.step != step:
            raise ExportError(f"{run_dir} is the checkpoint of step {state.step}, not {step}")
        return run_dir, []
    root = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    found = checkpoint.scan(root)
    if not found.usable and not found.unusable:
        raise ExportError(
            f"{run_dir} is not a run: no checkpoints/ folder, no step-NNNNNNNN checkpoint folders and no {checkpoint.STATE_FILE} "
            "(give an `up` run folder, a checkpoint_dir or one checkpoint folder)"
        )
    torn = [f"{p.name}: {why}" for p, why in found.unusable]
    if step is None:
        if found.latest is None:
            raise ExportError(f"no checkpoint in {root} is whole: {'; '.join(torn)}")
        return found.latest.path, [f"skipped {t}" for t in torn]
    for f in found.usable:
        if f.state.step == step:
            return f.path, []
    named = root / checkpoint.step_dir_name(step)
    for p, why in found.unusable:
        if p == named:
            raise ExportError(f"the checkpoint of step {step} is not whole: {why}")
    steps = ", ".join(str(f.state.step) for f in found.usable) or "none whole"
    raise ExportError(f"{root} has no checkpoint of step {step}; the steps there are: {steps}")


# -- writing ----------------------------------------------------------------------------------


def export(
    trained: Trained,
    out: Path,
    dtype: Dtype = "bfloat16",
    merge: bool = False,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write `trained` to the folder `out` (atomically; an earlier export there is replaced) and return it."""
    if dtype not in _TORCH_DTYPES:
        raise ExportError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, not {dtype!r}")
    if merge and trained.lora is None:
        raise ExportError("merge is for LoRA runs: this one trained every weight, its export is already a full model")
    out = Path(out).absolute()
    check_output(out)
    kind = "full" if trained.lora is None else "lora-merged" if merge else "lora-adapter"
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "dtype": dtype,
        "step": trained.step,
        "version": trained.version,
        "source": trained.source,
        "base_model": trained.model_dir,
    }

    def write(folder: Path) -> None:
        if trained.lora is not None and not merge:
            _save_adapter(trained.lora, _adapter_weights(trained, dtype), folder)
        else:
            _save_model(trained.model_dir, _model_weights(trained, dtype), _TORCH_DTYPES[dtype], folder, max_shard_size)
        _save_tokenizer(trained.model_dir, folder)
        (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")

    return write_atomically(out, write)


def _model_weights(trained: Trained, dtype: Dtype) -> dict[str, torch.Tensor]:
    """Every weight of the model by Hugging Face name (tied ones once), in `dtype`."""
    if dtype == "bfloat16":
        # Copies: the served bits are views of the optimizer's buffer (split layout), and
        # safetensors refuses tensors that share memory.
        return {name: modeling.bits_to_tensor(bits).clone() for name, bits in trained.served.items()}
    if trained.lora is None:
        return {name: master.clone() for name, master in trained.optimizer.master.items()}
    # The base as the base model has it (the trainer holds its bf16 rounding) and the adapters'
    # fp32 masters, merged by lora.py's merged_weight (peft's formula, in fp32).
    base, _tokenizer = modeling.load_model(trained.model_dir, dtype="float32")
    fresh = lora.LoraModel(base, trained.lora.spec)
    with torch.no_grad():
        for name, master in trained.optimizer.master.items():
            fresh.adapters[name].copy_(master)
    return {
        name: fresh.merged_weight(name) if name in fresh.layers else p.detach().clone()
        for name, p in fresh.base.items()
    }


def _adapter_weights(trained: Trained, dtype: Dtype) -> dict[str, torch.Tensor]:
    """The adapters by their peft name: their served bits (bf16) or fp32 masters."""
    if dtype == "bfloat16":
        return {
            name: modeling.bits_to_tensor(bits).clone() for name, bits in trained.optimizer.published_bits().items()
        }
    return {name: master.clone() for name, master in trained.optimizer.master.items()}


def _save_model(
    model_dir: str, weights: dict[str, torch.Tensor], dtype: torch.dtype, folder: Path, max_shard_size: int | str
) -> None:
    """transformers' save_pretrained on an empty (meta) model of the source's config: config.json
    records `dtype`, the generation config is the source's, tied weights are transformers' business."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (Path(model_dir) / "generation_config.json").is_file():
        shell.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    shell.save_pretrained(folder, state_dict=weights, max_shard_size=max_shard_size)


def _save_adapter(trained_lora: lora.LoraModel, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """peft's save_pretrained: adapter_config.json and adapter_model.safetensors (what
    peft.PeftModel.from_pretrained loads), the adapters' values given by `weights`."""
    # Embedding layers are never LoRA targets here (lora.LoraModel takes Linear layers only);
    # "auto" would look the base model up (on the Hub for a name).
    trained_lora.model.save_pretrained(str(folder), state_dict=weights, save_embedding_layers=False)


def _save_tokenizer(model_dir: str, folder: Path) -> None:
    """The source model's tokenizer as it is there (chat template included), not the trainer's
    copy (load_model gives one without a pad token the eos token as pad)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(str(folder))


# -- the folder ---------------------------------------------------------------------------


def is_export(path: Path) -> bool:
    """Whether `path` is a folder an export wrote (its rollstream-export.json says so)."""
    try:
        return json.loads((Path(path) / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_output(out: Path) -> None:
    """An output path may be new, an empty folder or an earlier export; anything else is refused
    (it could be the base model's own folder)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise ExportError(
            f"--out {out} exists, is not empty and is not an export (no {MARKER}): choose another folder or empty it"
        )


def _temp_names(out: Path) -> tuple[Path, Path]:
    return out.parent / f".{out.name}.export-tmp-{os.getpid()}", out.parent / f".{out.name}.export-old-{os.getpid()}"


def _remove_leftovers(out: Path) -> None:
    """The temp folders of exports to `out` whose process is gone (killed mid-write)."""
    for stale in out.parent.glob(f".{out.name}.export-*-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(folder)` on a hidden sibling of `out`, fsync what it wrote, and rename it to
    `out` (an export there is moved aside first and removed once the new one is in place)."""
    check_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    return folders.write_folder(out, write, *_temp_names(out))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _at_end(trainer: "Trainer") -> Trained:
    """The live trainer's weights; on N ranks in float32, its last checkpoint's (rank 0 holds
    every parameter's bf16 bits but only its own shard of the fp32 masters)."""
    s = trainer.settings
    if trainer.team is None or s.export_dtype == "bfloat16":
        return from_trainer(trainer)
    newest = checkpoint.scan(Path(s.checkpoint_dir)).latest if s.checkpoint_dir else None
    if newest is None or newest.state.step != trainer.step:
        raise ExportError(
            f"a float32 export on N ranks is read from the checkpoint of the last step ({trainer.step}), and "
            "checkpoint_dir holds none: `rollstream export` one, or export in bfloat16"
        )
    return from_checkpoint(newest.path)


def export_at_end(trainer: "Trainer", log: logging.Logger) -> None:
    """The trained model as a Hugging Face folder in export_dir, when the trainer's loop ends
    with steps trained, finished or stopped. A failure is logged and the run goes on
    (`rollstream export` writes the folder from a checkpoint)."""
    s = trainer.settings
    if not s.export_dir or trainer.step == 0:  # nothing trained: the model is the base model
        return
    try:
        path = export(_at_end(trainer), Path(s.export_dir), s.export_dtype)
    except Exception as e:  # noqa: BLE001 - a full disk, a folder in the way: never the run's end
        logs.event(log, "export_failed", logging.ERROR, path=s.export_dir, step=trainer.step, error=str(e))
        return
    logs.event(
        log,
        "exported",
        path=str(path),
        step=trainer.step,
        version=trainer.version,
        dtype=s.export_dtype,
        mb=round(folder_bytes(path) / 1e6, 1),
    )
