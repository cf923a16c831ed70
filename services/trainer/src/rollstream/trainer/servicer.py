"""The trainer's faces to readers of its weights: `TrainerServicer`, its gRPC service (GetState,
FetchWeights, SaveCheckpoint, whose requests `CheckpointRequests` hands to the loop), and
`WeightsView`, the weights as a reader in its process sees them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from rollstream.core import deltas, push_signing
from rollstream.trainer import checkpoint
from rollstream.trainer.fleet import GeneratorDirectory
from rollstream.trainer.publisher import WeightPublisher
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc, weights_pb2

if TYPE_CHECKING:
    from rollstream.trainer.trainer import Trainer


@dataclass(frozen=True)
class WeightsView:
    """The trainer's weights, read-only, for a reader in its process (the colocated generator):
    the version and bits last published, the model's fingerprint, and hooks it calls in its own
    thread after each step has changed them (nothing else writes the weights, so a hook reads
    them without the weights lock)."""

    _publisher: WeightPublisher
    _hooks: list[Callable[[], None]]

    @property
    def version(self) -> int:
        return self._publisher.version

    @property
    def fingerprint(self) -> str:
        return self._publisher.fingerprint

    def bits(self) -> dict[str, np.ndarray]:
        return self._publisher.bits()

    def after_step(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)


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

    def _queued(self) -> Iterator[tuple[str, Future[tuple[Path, int]]]]:
        """The requests waiting now, each taken off the queue."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def serve(self, save: Callable[[str], tuple[Path, int]]) -> None:
        for path, future in self._queued():
            try:
                future.set_result(save(path))
            except Exception as e:  # noqa: BLE001 - the caller gets the error over gRPC
                future.set_exception(e)

    def close(self) -> None:
        """Refuse new requests and fail the waiting ones."""
        with self._lock:
            self._closed = True
        for _path, future in self._queued():
            future.set_exception(RuntimeError("the trainer is stopping"))


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer, generators: GeneratorDirectory, checkpoints: CheckpointRequests):
        self.trainer = trainer
        self.generators = generators
        self.checkpoints = checkpoints

    def GetState(
        self, request: trainer_pb2.TrainerStateRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerState:
        t = self.trainer
        # The newest version whose push has ended (BackgroundPush): a generator being pushed
        # one must not fetch it too. With the sha256: the bits and version of the last step.
        sha, version = "", t.publisher.pushes.version
        if request.with_weights_sha256:
            with t.weights_lock:  # the bits and the version of one published step
                t.optimizer.wait()  # ... whose update has ended (an overlapped step's goes on after it)
                sha, version = deltas.weights_sha256(t.publisher.bits()), t.version
        if len(request.challenge) > push_signing.MAX_CHALLENGE_BYTES:  # sign nothing large
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"challenge over {push_signing.MAX_CHALLENGE_BYTES} bytes")
        signer = t.publisher.catch_up_signer
        # Signed over the caller's fresh challenge: a version claim nobody can replay, so a
        # generator acts only on the trainer's own, current word (generator.catch_up).
        signature = (
            signer.state(request.challenge, version, t.publisher.fingerprint)
            if signer is not None and request.challenge
            else b""
        )
        return trainer_pb2.TrainerState(
            version=version,
            step=t.step,
            model=t.model_dir,
            model_fingerprint=t.publisher.fingerprint,
            groups_trained=t.groups_trained,
            groups_stale=t.groups_stale,
            generators=self.generators.last,
            weights_sha256=sha,
            signature=signature,
        )

    def FetchWeights(
        self, request: trainer_pb2.FetchWeightsRequest, context: grpc.ServicerContext
    ) -> Iterator[weights_pb2.WeightChunk]:
        publisher = self.trainer.publisher
        try:
            publisher.check_fingerprint(request.model_fingerprint)  # before anything costly
            # A fetch is a reader (publisher.Readers): after skipped deltas the anchor is written first.
            publisher.readers.fetched()
            self.trainer.reanchor("a FetchWeights")
            payloads = publisher.catch_up_payloads(request.have_version, request.model_fingerprint)
        except deltas.DeltaError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        # Not a version still being pushed (BackgroundPush.version): its push brings it.
        payloads = [p for p in payloads if p.info.version <= publisher.pushes.version]
        yield from publisher.catch_up_chunks(payloads)  # each payload signed

    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResult:
        """Saved by the loop after the step in progress (empty path: checkpoint_dir/step-N;
        any other path must lie inside checkpoint_dir, a relative one is taken there, and it
        may not be one of the trainer's own names: checkpoint.confine)."""
        target = ""
        if request.path:
            try:
                target = str(checkpoint.confine(request.path, self.trainer.settings.checkpoint_dir))
            except checkpoint.CheckpointPathRefused as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            except checkpoint.CheckpointNameRefused as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except checkpoint.CheckpointError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        try:
            path, version = self.checkpoints.request(target, context.time_remaining())
        except FileExistsError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except TimeoutError:
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the step in progress did not finish in time; the checkpoint is still queued",
            )
        except (ValueError, OSError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return trainer_pb2.SaveCheckpointResult(path=str(path), version=version)
