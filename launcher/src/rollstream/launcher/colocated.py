"""The trainer and a generator in one process on one device, sharing one copy of the weights
(issue 31; `rollstream up --colocate`).

The generator samples from the trainer's own model (TransformersBackend.sharing) and stamps
its groups with the trainer's version (TrainerWeights): nothing is pushed, fetched or
decoded between them, and the process holds the weights once. Everything else is the two
services as they are: the same streams, reward and reference services, ledger, checkpoints
and exactly-once accounting (the generator's loop is generator/service.py's sample_forever,
the trainer's is trainer/service.py's serve). The trainer still encodes and publishes each
delta, so remote generators registered for the run are pushed to as usual.

Synchronous: sampling and a training step take turns on the device (the generator samples
under the trainer's weights lock, which the step holds), each with every core. This is the
variant that helps a small machine: two processes on the same cores only take them from
each other (docs/benchmarks.md, "Colocated"). The asynchronous variant (a memory split of a
GPU, sampling the next batch while the step runs) and vLLM's sleep/wake on CUDA are not
built yet.

    python -m rollstream.launcher.colocated --config trainer.toml [trainer flags] \\
        --generator-config generator.toml [--generator-flag NAME VALUE ...]

The trainer's settings come from its flags as for `python -m rollstream.trainer`; the
generator's from its own file, plus `--generator-flag` pairs for its credentials' files.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping

import numpy as np

from rollstream.core import deltas, logs, redis_policy
from rollstream.core.config import load_or_exit
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import TransformersBackend
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.generator import Generator
from rollstream.generator.host_weights import HostWeights
from rollstream.generator.service import sample_forever
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.service import serve
from rollstream.trainer.trainer import Trainer

GENERATOR_CONFIG = "--generator-config"
GENERATOR_FLAG = "--generator-flag"


class TrainerWeights(HostWeights):
    """What the colocated generator holds: the trainer's published bits and version, read at
    each use, under the trainer's weights lock (a batch is sampled by one version, and a
    step never changes the weights under it). Nothing is ever applied here."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        self.fingerprint = trainer.publisher.fingerprint
        self.lock = trainer.weights_lock

    @property  # type: ignore[override]
    def version(self) -> int:
        return self._trainer.version

    @property  # type: ignore[override]
    def bits(self) -> dict[str, np.ndarray]:
        return self._trainer.publisher.bits()

    def decode(self, payload: bytes) -> tuple[deltas.PayloadInfo, dict[str, np.ndarray]]:
        raise deltas.DeltaError("a colocated generator takes no weight payloads: its weights are the trainer's")

    def commit(self, info: deltas.PayloadInfo, touched: Mapping[str, np.ndarray]) -> None:
        raise deltas.DeltaError("a colocated generator takes no weight payloads: its weights are the trainer's")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the trainer's argv, the generator's argv) from this process's argv."""
    trainer: list[str] = []
    generator: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == GENERATOR_CONFIG and i + 1 < len(argv):
            generator += ["--config", argv[i + 1]]
            i += 2
        elif argv[i] == GENERATOR_FLAG and i + 2 < len(argv):
            generator += [argv[i + 1], argv[i + 2]]
            i += 3
        else:
            trainer.append(argv[i])
            i += 1
    return trainer, generator


def refusal(trainer: TrainerSettings, generator: GeneratorSettings) -> str:
    """Why these two cannot share one model ('' when they can)."""
    if generator.backend != "transformers":
        return f"generator.backend: colocation samples with the trainer's own model (transformers), not {generator.backend!r}"
    if trainer.lora_rank:
        return "trainer.lora_rank: with LoRA the published weights are merged after the step, not the model the generator would sample"
    if generator.model != trainer.model:
        return f"generator.model: {generator.model!r} is not the trainer's {trainer.model!r}"
    return ""


def main(argv: list[str] | None = None) -> int:
    trainer_argv, generator_argv = split_argv(sys.argv[1:] if argv is None else argv)
    trainer_settings = load_or_exit(TrainerSettings, trainer_argv)
    generator_settings = load_or_exit(GeneratorSettings, generator_argv)
    why = refusal(trainer_settings, generator_settings)
    if why:
        print(f"rollstream colocated: {why}", file=sys.stderr)
        return 2
    return run(trainer_settings, generator_settings)


def run(trainer_settings: TrainerSettings, generator_settings: GeneratorSettings) -> int:
    failed = threading.Event()
    with ServiceHost("trainer", trainer_settings) as trainer_host, ServiceHost("generator", generator_settings) as generator_host:
        trainer_host.install_signal_handlers()
        trainer = Trainer(trainer_settings, trainer_host)
        gen = Generator(generator_settings, generator_host, shared=(TransformersBackend.sharing(trainer.model, trainer.tokenizer), TrainerWeights(trainer)))
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
