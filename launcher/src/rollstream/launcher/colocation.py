"""Colocation as a setting (issue 45): the run configuration's `colocate`, the checks that
decide whether the trainer and a generator can share a process, and that process's one file:
`colocate = "sync" | "async"`, a `[trainer]` and a `[generator]` table. The trainer half reads
its table the trainer's way (< ROLLSTREAM_* < flags: the process, its flags and state file are
the trainer's); the generator half reads the same environment under its table, which wins
(its own Redis user, token and ports beside the trainer's, in one container). Torch-free:
`rollstream config` and `up` check a colocated run without loading torch (colocated.py runs it).
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rollstream.core.config import ConfigError, config_path, load_settings
from rollstream.generator.config import GeneratorSettings
from rollstream.trainer.config import TrainerSettings

Colocate = Literal["off", "sync", "async"]


def refusal(trainer: TrainerSettings, generator: GeneratorSettings, colocate: Colocate = "sync") -> str:
    """Why these two cannot be colocated ('' when they can)."""
    if generator.backend == "vllm":
        if generator.tensor_parallel_size != 1:
            return "generator.tensor_parallel_size: a colocated engine runs in the trainer's process, on its one device: set it to 1"
        if generator.in_flight != "finish":
            return "generator.in_flight: a colocated engine is written between two batches, never inside one: set it to 'finish'"
        if generator.device != trainer.device:
            return f"generator.device: a colocated engine shares the trainer's device {trainer.device!r}, not {generator.device!r}"
    if trainer.lora_rank:
        return "trainer.lora_rank: with LoRA the published weights are merged after the step, not the model the generator would sample"
    if generator.model != trainer.model:
        return f"generator.model: {generator.model!r} is not the trainer's {trainer.model!r}"
    if colocate == "async" and trainer.max_staleness < 1:
        return "trainer.max_staleness: the asynchronous variant samples the next batch while the step runs, one version behind: set it to 1 or more"
    return ""


def vllm_missing(generator: GeneratorSettings) -> str:
    """Why this Python cannot run the generator's vLLM backend ('' when it can): said before
    anything is loaded, since every process `up` starts runs on this Python."""
    spec = importlib.util.find_spec("vllm")
    # origin None: a namespace package (a folder named vllm on sys.path), not vLLM.
    if generator.backend != "vllm" or (spec is not None and spec.origin is not None):
        return ""
    return f"generator.backend: 'vllm' needs the vllm package in {sys.executable} (CPU: bash scripts/install_vllm.sh, then .venv-vllm/bin/rollstream)"


class Colocated(BaseModel):
    """The colocated process's settings: which variant, and each half's."""

    model_config = ConfigDict(extra="forbid")

    colocate: Literal["sync", "async"]
    trainer: TrainerSettings
    generator: GeneratorSettings


def load(argv: list[str]) -> Colocated:
    """The colocated process's settings from its flags (`--config FILE` and the trainer's); a
    ConfigError names the field, or says why the two cannot share a process."""
    trainer = load_settings(TrainerSettings, argv, table="trainer")  # also: the file exists, parses, has the table
    if not (path := config_path(argv)):
        raise ConfigError("the colocated process reads one file: --config FILE (colocate, [trainer], [generator])")
    with open(path, "rb") as f:
        top = tomllib.load(f)
    generator = load_settings(GeneratorSettings, [], **top.get("generator", {}))  # its own table over the environment
    try:
        both = Colocated.model_validate({**top, "trainer": trainer, "generator": generator})
    except ValidationError as e:
        raise ConfigError(
            f"colocated configuration {path}: " + ", ".join(f"{err['loc'][0]}: {err['msg']}" for err in e.errors())
        ) from None
    why = refusal(trainer, generator, both.colocate) or vllm_missing(generator)
    if why:
        raise ConfigError(f"colocated configuration {path}: {why}")
    return both


def colocated_file(argv: list[str]) -> bool:
    """Whether the configuration file says `colocate` (docker/trainer_start.py runs the colocated
    process then); a file that does not read is the trainer's to report."""
    try:
        with open(config_path(argv), "rb") as f:
            return "colocate" in tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return False
