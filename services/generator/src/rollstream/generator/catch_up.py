"""Catching up: how a generator's weights reach the trainer's version when no push brings
them (at its start, after a refused push, after a miss). The sync thread reads anchor +
deltas from the weight store (a volume shared with the trainer, rollstream.core.weight_transfer)
or fetches them from the trainer (FetchWeights); both end in the generator's one apply
(Generator.apply_stream), as a push does. Everything it catches up from is signed by the
trainer and checked (CatchUp.check_stream), and the sync thread outlives any failure of an
attempt: it backs off and tries again, with readiness red while the generator is too far
behind (CatchUpHealth)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import deltas, logs, push_signing, weight_transfer
from rollstream.core.grpc_auth import load_roles
from rollstream.core.grpc_utils import channel, rpc_error_text
from rollstream.core.service import ServiceHost
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc, weights_pb2

if TYPE_CHECKING:
    from rollstream.generator.generator import Generator


class CatchUpRefused(weight_transfer.TransferRefused):
    """A catch-up payload or version claim the trainer did not sign, or one that would take
    the generator back: never applied, the stream cut where it is."""


# Failed catch-up attempts wait twice as long each time, up to 16 sync intervals (32 s at
# the default 2 s) and never more than this: a volume or trainer back is noticed soon.
MAX_SYNC_BACKOFF_S = 30.0


class CatchUpHealth:
    """The generator's readiness: its stage joined (`sampling`), and not more than
    max_staleness versions behind the trainer. The trainer's version is the latest word of
    each source (its signed GetState, the store's signed chain, Redis's current version),
    the highest of them: whichever is ahead is what this generator must reach."""

    def __init__(self, host: ServiceHost, max_staleness: int):
        self.host = host
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._trainer: dict[str, int] = {}  # source -> the trainer's version it last gave
        self._sampling = ""  # what /readyz says when all is well; "": not sampling yet
        self._error = ""  # the last catch-up attempt's failure, "" once one succeeds

    def sampling(self, detail: str, held: int | None) -> None:
        with self._lock:
            self._sampling = detail
        self.publish(held)

    def trainer_at(self, source: str, version: int, held: int | None) -> None:
        with self._lock:
            self._trainer[source] = version
        self.publish(held)

    def attempt(self, error: str, held: int | None) -> None:
        with self._lock:
            self._error = error
        self.publish(held)

    def publish(self, held: int | None) -> None:
        with self._lock:
            sampling, error = self._sampling, self._error
            trainer, source = max(((v, k) for k, v in self._trainer.items()), default=(0, ""))
        if not sampling:
            return  # not ready until the stage is joined (service.sample_forever)
        lag = trainer - (held or 0)
        if lag > self.max_staleness:
            detail = f"behind the trainer: holds version {held or 0}, the trainer is at {trainer} ({source}), max_staleness {self.max_staleness}"
            self.host.set_ready(False, detail + (f"; catching up fails: {error}" if error else ""))
        else:
            self.host.set_ready(True, sampling)


class CatchUp:
    """A generator's catch-up (the store, then the trainer) and the thread that runs it every
    sync_interval_s or when woken (`wake`: a refused push, a newer version in Redis)."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self.settings = gen.settings
        # The trainer's public key (roles.json): with an auth file, every catch-up payload and
        # GetState answer must carry the trainer's signature (check_stream); without one
        # (auth off, as for pushes) nothing is signed.
        self.signed = bool(self.settings.grpc_auth_file)
        self.trainer_key = load_roles(self.settings.grpc_auth_file).push_key if self.settings.grpc_auth_file else None
        self.health = CatchUpHealth(gen.host, self.settings.max_staleness)
        self.wake = threading.Event()

    def once(self) -> bool:
        """Bring the weights to the trainer's version: from the weight store when there is one
        (the trainer sends nothing), then from the trainer (FetchWeights) for whatever the
        store could not give. Returns True if in sync."""
        store_error = self.from_store(Path(self.settings.weight_store)) if self.settings.weight_store else ""
        if not self.settings.trainer_address:
            if store_error:
                raise weight_transfer.StoreUnreadable(store_error)  # nobody else to ask: the attempt failed
            return True
        with channel(self.settings.trainer_address, self.gen.creds, server_name="trainer") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            challenge = os.urandom(push_signing.CHALLENGE_BYTES)
            state = stub.GetState(trainer_pb2.TrainerStateRequest(challenge=challenge), timeout=10)
            self.check_state(challenge, state)
            have = self.gen.weights.version
            self.health.trainer_at("trainer", state.version, have)
            if have == state.version:
                return True
            logs.event(self.gen.log, "catching_up", have=have, trainer=state.version, source="trainer")
            fingerprint = self.gen.weights.fingerprint
            self._restarting("fetching the anchor", lambda anchor: self.fetch(
                stub, trainer_pb2.FetchWeightsRequest(have_version=-1 if anchor or have is None else have, model_fingerprint=fingerprint), state.version, skip_held=not anchor,
            ))  # fmt: skip
            return True

    def _restarting(self, action: str, apply: Callable[[bool], object], restart: bool = True) -> None:
        """`apply(False)`: what is needed beyond our version, deltas held skipped. When it is
        refused (our version number is in the chain but our weights are not its: a trainer
        that restarted from scratch), and `restart`, start over from the anchor: `apply(True)`.
        An oversized or unsigned stream, or an unreadable store, is the error as it is."""
        try:
            apply(False)
        except (weight_transfer.TransferRefused, weight_transfer.StoreUnreadable):
            raise
        except deltas.DeltaError as e:
            if not restart:
                raise
            logs.event(self.gen.log, "catch_up_refused_deltas", logging.WARNING, action=action, error=str(e))
            apply(True)

    def check_state(self, challenge: bytes, state: trainer_pb2.TrainerState) -> None:
        """Raises CatchUpRefused unless GetState's answer is the trainer's, over our challenge
        (with signed catch-up). A forged one would cost at most a fetch, whose payloads are
        checked in turn; this one makes the version a rollback may trust (check_stream)."""
        why = self._unsigned(
            state.signature,
            lambda key: push_signing.verify_state(
                key, self.settings.run, challenge, state.version, state.model_fingerprint, state.signature
            ),
        )
        if why:
            self.gen.metrics.payloads_refused.inc()
            logs.event(
                self.gen.log,
                "trainer_state_refused",
                logging.WARNING,
                address=self.settings.trainer_address,
                reason=why,
                claimed_version=state.version,
            )
            raise CatchUpRefused(f"GetState from {self.settings.trainer_address}: {why}")

    def check_stream(
        self, chunks: Iterable[weights_pb2.WeightChunk], source: str, trainer_version: int | None
    ) -> Iterator[weights_pb2.WeightChunk]:
        """`chunks` as they come, each payload's header checked before any of its bytes are
        used: signed by the trainer for this run (with signed catch-up; from_chunks then
        checks the bytes against the header's sha256), and no anchor below the version held
        unless the trainer's own signed `trainer_version` is below it too (a trainer resumed
        from an older checkpoint). So a replayed chain of the trainer's can move a generator
        forward only; the store, with no live word from the trainer, only forward.
        Raises CatchUpRefused, logged, naming the payload and why."""
        for chunk in chunks:
            if chunk.HasField("header"):
                why = self._refusal(chunk.header, chunk.signature, trainer_version)
                if why:
                    h = chunk.header
                    self.gen.metrics.payloads_refused.inc()
                    logs.event(
                        self.gen.log,
                        "catch_up_payload_refused",
                        logging.WARNING,
                        source=source,
                        kind=h.kind,
                        version=h.version,
                        reason=why,
                    )
                    raise CatchUpRefused(f"{source}: {h.kind} of version {h.version}: {why}")
            yield chunk

    def _refusal(self, header: weights_pb2.WeightHeader, signature: bytes, trainer_version: int | None) -> str:
        why = self._unsigned_payload(header, signature)
        if why:
            return why
        held = self.gen.weights.version
        if (
            header.kind == "anchor"
            and held is not None
            and header.version < held
            and not (trainer_version is not None and trainer_version < held)
        ):
            return f"would take this generator back from version {held}"
        return ""

    def _unsigned_payload(self, header: weights_pb2.WeightHeader, signature: bytes) -> str:
        """Why `signature` is not the trainer's over `header` for this run ("": it is, or
        catch-up is not signed here)."""
        return self._unsigned(
            signature, lambda key: push_signing.verify_payload(key, self.settings.run, header, signature)
        )

    def _unsigned(self, signature: bytes, valid: Callable[[Ed25519PublicKey], bool]) -> str:
        """Why `signature` is not the trainer's ("": `valid` says it is, or catch-up is not
        signed here)."""
        if not self.signed:
            return ""
        if self.trainer_key is None:
            return "roles.json has no trainer_push_key: run `rollstream secrets` again"
        if not signature:
            return "unsigned"
        if not valid(self.trainer_key):
            return "its signature is not the trainer's"
        return ""

    def from_store(self, directory: Path) -> str:
        """Apply what the store's chain holds beyond our version, checked as a fetched stream
        is (signature, size, sha256, base version, fingerprint). A store that cannot be read,
        a file a newer chain replaced meanwhile or a payload refused is logged and left to the
        trainer or the next sync: returns why ("" when nothing failed)."""
        try:
            anchor, chain = weight_transfer.read_manifest(directory)
            have = self.gen.weights.version
            last = chain[-1] if chain else anchor
            newest = last.header.version
            if not self._unsigned_payload(last.header, last.signature):  # a forged chain.json claims nothing
                self.health.trainer_at("store", newest, have)
            if have == newest:
                return ""
            if anchor.header.model_fingerprint != self.gen.weights.fingerprint:
                raise weight_transfer.StoreUnreadable(
                    f"{directory}: the chain is for model {anchor.header.model_fingerprint}, this generator's is {self.gen.weights.fingerprint}"
                )
            needed = weight_transfer.catch_up_chain(-1 if have is None else have, anchor, chain, lambda p: p.info)
            logs.event(self.gen.log, "catching_up", have=have, store=newest, source="store", payloads=len(needed))
            self._restarting(
                "reading the anchor",
                lambda from_anchor: self.gen.apply_stream(
                    self.check_stream(
                        weight_transfer.store_chunks(directory, [anchor, *chain] if from_anchor else needed),
                        "store",
                        None,
                    ),
                    skip_held=not from_anchor,
                ),
                restart=not (needed[0] is anchor or (have is not None and anchor.header.version < have)),
            )  # not when the anchor was tried, or would take us back
        except CatchUpRefused as e:
            return str(e)  # logged: left to the trainer, whose signed word may allow what the store's does not
        except weight_transfer.TransferRefused:
            raise  # oversized for this model: nothing else in the store is smaller
        except deltas.DeltaError as e:
            logs.event(self.gen.log, "store_catch_up_failed", logging.WARNING, store=str(directory), error=str(e))
            return str(e)
        return ""

    def fetch(
        self,
        stub: trainer_pb2_grpc.TrainerStub,
        request: trainer_pb2.FetchWeightsRequest,
        trainer_version: int,
        skip_held: bool = False,
    ) -> None:
        """FetchWeights and apply what it streams, each payload checked (check_stream); a
        refused stream is cancelled, not drained."""
        responses = stub.FetchWeights(request, timeout=600)
        try:
            self.gen.apply_stream(self.check_stream(responses, "trainer", trainer_version), skip_held=skip_held)
        finally:
            responses.cancel()  # no-op once the stream has ended

    def forever(self) -> None:
        """Catch up every sync_interval_s, or when woken, until stopped. No failure of an
        attempt ends it (a weight store's EIO or ESTALE, a truncated file, a gRPC error, a
        backend's): it is logged and the next attempt waits twice as long as the last, up to
        16 sync intervals or MAX_SYNC_BACKOFF_S, or less when woken (a refused push)."""
        delay = self.settings.sync_interval_s
        while not self.gen.host.stop.is_set():
            try:
                self.once()
            except Exception as e:  # noqa: BLE001 - whatever it was, the next attempt may succeed
                error = rpc_error_text(e) if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
                delay = min(
                    2 * delay,
                    16 * self.settings.sync_interval_s,
                    max(self.settings.sync_interval_s, MAX_SYNC_BACKOFF_S),
                )
                logs.event(self.gen.log, "catch_up_failed", logging.WARNING, error=error, retry_in_s=round(delay, 1))
                self.health.attempt(error, self.gen.weights.version)
            else:
                delay = self.settings.sync_interval_s
                self.health.attempt("", self.gen.weights.version)
            self.wake.wait(delay)
            self.wake.clear()
