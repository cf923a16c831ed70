"""A weight fleet no slow or lying member holds back (issue 42), against real in-process gRPC
servers: a PushNonce that never answers costs one short deadline once (the address is then
backed off), a relay's word that a generator below it applied a push is believed only with
that generator's own signed acknowledgement, a relay forwards the whole push to its targets
before its own apply has read it, a version is neither told nor served to pollers while
its push is going out, and a generator that stops reading its push or never answers it costs
a push (or a relay) push_stall_s, not push_timeout_s."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import pytest

from rollstream.core import credentials, grpc_auth, push_signing
from rollstream.core.config import load_settings
from rollstream.core.credentials import ROLES
from rollstream.core.deltas import PayloadInfo, encode_anchor
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import CHANNEL_OPTIONS
from rollstream.core.service import ServiceHost
from rollstream.generator.relay import PeerChannels, RelayedStream
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.fleet import AddressBackoff, GeneratorDirectory, PushOutcome
from rollstream.trainer.publisher import Published, WeightPublisher
from rollstream.trainer.servicer import CheckpointRequests, TrainerServicer
from rollstream.trainer.trainer import Trainer
from rollstream.v1 import generator_pb2, generator_pb2_grpc, trainer_pb2, weights_pb2
from synthetic import scored_groups

TOKENS = {role: f"{role}-token-{i}" for i, role in enumerate(ROLES)}
ROLE_TABLE = grpc_auth.parse_roles(json.dumps(credentials.roles_table(TOKENS)), "test")
T = TypeVar("T")
WAIT_S = 60.0  # for events: generous, never a measure of speed


@dataclass
class FakeGenerator(generator_pb2_grpc.GeneratorServicer):
    """PushNonce and PushWeights behind the real interceptor (signed pushes), with a prover of
    the generator's key. `hang_nonce`: PushNonce never answers (until the test ends);
    `hold`: PushWeights waits for it before answering (`fail_late`: then fails the call);
    `read_only`: PushWeights takes that many chunks, then reads no more until the test ends;
    `lie_about`: a relay's report that these addresses below it applied the push, forwarding
    nothing and with no ack of theirs."""

    nonces: push_signing.PushNonces
    hang_nonce: bool = False
    hold: threading.Event | None = None
    fail_late: bool = False
    read_only: int = 0
    lie_about: list[str] = field(default_factory=list)
    address: str = ""
    nonce_calls: int = 0
    push_calls: int = 0
    payloads: int = 0
    received: list[bytes] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)  # set at teardown

    def PushNonce(
        self, request: generator_pb2.PushNonceRequest, context: grpc.ServicerContext
    ) -> generator_pb2.PushNonceResponse:
        self.nonce_calls += 1
        if self.hang_nonce:
            self.released.wait()
        nonce = self.nonces.issue()
        proof = push_signing.GeneratorProver(TOKENS["generator"]).prove(request.challenge, nonce, self.address)
        return generator_pb2.PushNonceResponse(nonce=nonce, address=self.address, proof=proof)

    def PushWeights(
        self, request_iterator: Iterator[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.PushResult:
        self.push_calls += 1
        self.entered.set()
        header = None
        for chunk in request_iterator:
            header = chunk.header if header is None else header
            self.received.append(chunk.data)
            if len(self.received) == self.read_only:
                self.released.wait()
        if self.hold is not None:
            self.hold.wait()
            if self.fail_late:
                context.abort(grpc.StatusCode.UNAVAILABLE, "failed after holding the push")
        self.payloads += 1
        self.done.set()
        signed = push_signing.parse_signature(context.invocation_metadata())
        ack = (
            push_signing.GeneratorProver(TOKENS["generator"]).ack(signed[0], header)
            if signed and header is not None
            else b""
        )
        version = header.version if header is not None else 0
        lies = [
            weights_pb2.RelayedPush(address=a, applied=True, version=version, via=self.address) for a in self.lie_about
        ]
        return weights_pb2.PushResult(applied=True, version=version, ack=ack, relayed=lies)


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeGenerator]]:
    servers: list[tuple[grpc.Server, FakeGenerator]] = []

    def start(signed: bool = True, **kw: object) -> FakeGenerator:
        nonces = push_signing.PushNonces()
        gen = FakeGenerator(nonces, **kw)  # type: ignore[arg-type]  # FakeGenerator's keyword options, passed through
        interceptors = [grpc_auth.AuthInterceptor(ROLE_TABLE, nonces=nonces)] if signed else []
        # No BDP probing: the receive window stays small (64 KiB), so a receiver that stops
        # reading holds a chunk or two, as a real one's would with a few MiB of window.
        options = [*CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors, options=options)
        generator_pb2_grpc.add_GeneratorServicer_to_server(gen, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        gen.address = f"127.0.0.1:{port}"
        servers.append((server, gen))
        return gen

    yield start
    for server, gen in servers:
        gen.released.set()
        if gen.hold is not None:
            gen.hold.set()
        server.stop(0)


BITS = {"w": np.arange(64, dtype=np.uint16).reshape(8, 8)}


def next_bits(bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v + 1 for k, v in bits.items()}


def signed_publisher(nonce_timeout_s: float = 5.0, stall_s: float = 30.0) -> WeightPublisher:
    """`stall_s`: generous where no test of it (an honest generator must answer within it)."""
    return WeightPublisher(
        BITS,
        anchor_interval=100,
        creds=ClientCredentials(token=TOKENS["trainer"]),
        generator_key=ROLE_TABLE.generator_key,
        nonce_timeout_s=nonce_timeout_s,
        stall_s=stall_s,
    )


@pytest.mark.parametrize("fanout", [0, 1])
def test_a_pushnonce_that_never_answers_costs_one_short_deadline_once(
    serve: Callable[..., FakeGenerator], fanout: int
) -> None:
    """A registered stranger that accepts the call and never answers: left out of the push
    after nonce_timeout_s (not push_timeout_s), directly and in a relay tree, the honest
    generators get the push, and the next push does not ask the stranger at all."""
    honest, stranger, other = serve(), serve(hang_nonce=True), serve()
    addresses = [honest.address, stranger.address, other.address]
    publisher = signed_publisher()
    try:
        bits = BITS
        for version in (1, 2):
            bits = next_bits(bits)
            published, _ = publisher.publish(bits)
            outcomes = {o.address: o for o in publisher.fleet.push(addresses, published, timeout_s=300, fanout=fanout)}
            assert outcomes[honest.address].applied and outcomes[other.address].applied, [
                o.error for o in outcomes.values()
            ]
            assert not outcomes[stranger.address].applied
            assert ("no nonce" if version == 1 else "backed off") in outcomes[stranger.address].error
        assert stranger.nonce_calls == 1 and stranger.payloads == 0
        assert publisher.fleet.backoff.backed_off() == [stranger.address]
        assert (honest.payloads, other.payloads) == (2, 2)
    finally:
        publisher.close()


def test_a_relay_that_lies_about_its_subtree_is_not_believed(serve: Callable[..., FakeGenerator]) -> None:
    """A relay that forwards nothing yet reports the generator below it applied: without that
    generator's acknowledgement over its own nonce the claim counts as not reached (it
    catches up by itself), and the lying relay is left out of the next pushes."""
    child = serve()
    liar = serve(lie_about=[child.address])
    publisher = signed_publisher()
    try:
        published, _ = publisher.publish(next_bits(BITS))
        outcomes = {
            o.address: o
            for o in publisher.fleet.push([liar.address, child.address], published, timeout_s=300, fanout=1)
        }
        assert outcomes[liar.address].applied  # its own apply, acknowledged
        assert not outcomes[child.address].applied and "acknowledgement" in outcomes[child.address].error
        assert child.payloads == 0
        assert (
            liar.address in publisher.fleet.backoff.backed_off()
            and child.address not in publisher.fleet.backoff.backed_off()
        )
    finally:
        publisher.close()


def test_a_relay_forwards_the_whole_push_before_its_own_apply_reads_it(serve: Callable[..., FakeGenerator]) -> None:
    """The relay's apply has taken one chunk and waits (its weights lock, a batch being
    sampled): its target still gets every chunk and the end of the stream, and answers."""
    target = serve(signed=False)
    header = weights_pb2.WeightHeader(
        kind="delta", base_version=0, version=1, total_bytes=3, sha256="ab" * 32, model_fingerprint="f"
    )
    chunks = [
        weights_pb2.WeightChunk(header=header, data=b"a", forward=[weights_pb2.RelayTarget(address=target.address)]),
        weights_pb2.WeightChunk(data=b"b"),
        weights_pb2.WeightChunk(data=b"c"),
    ]
    peers = PeerChannels(ClientCredentials())
    stream = RelayedStream(iter(chunks), "relay", peers)
    try:
        applying = iter(stream)
        assert next(applying).data == b"a"
        assert target.done.wait(WAIT_S), "the target never got the whole push while the relay's apply waited"
        assert target.received == [b"a", b"b", b"c"]
        assert [c.data for c in applying] == [b"b", b"c"]
        [outcome] = stream.finish(read_rest=True)
        assert outcome.address == target.address and outcome.applied
    finally:
        peers.close()


def test_a_target_the_relay_could_not_reach_is_reported_unreachable(serve: Callable[..., FakeGenerator]) -> None:
    """A target that takes the stream and never answers: the relay's call to it ends at the
    relay's own deadline, and it is reported unreachable (the trainer leaves it out a while),
    not as a push it refused."""
    stuck = serve(signed=False, hold=threading.Event())
    header = weights_pb2.WeightHeader(
        kind="delta", base_version=0, version=1, total_bytes=1, sha256="ab" * 32, model_fingerprint="f"
    )
    chunks = [
        weights_pb2.WeightChunk(header=header, data=b"a", forward=[weights_pb2.RelayTarget(address=stuck.address)])
    ]
    peers = PeerChannels(ClientCredentials())
    stream = RelayedStream(iter(chunks), "relay", peers, time_left_s=3.5)  # the target's call: 1.5 s
    try:
        assert [c.data for c in stream] == [b"a"]
        [outcome] = stream.finish(read_rest=True)
        assert (
            outcome.address == stuck.address
            and not outcome.applied
            and outcome.unreachable
            and "DEADLINE_EXCEEDED" in outcome.error
        )
    finally:
        peers.close()


def fetched(servicer: TrainerServicer) -> list[int]:
    """The versions a generator holding version 0 gets from FetchWeights now."""
    chunks = servicer.FetchWeights(trainer_pb2.FetchWeightsRequest(have_version=0), None)
    return [c.header.version for c in chunks if c.HasField("header")]


def test_getstate_tells_no_version_while_its_push_is_going_out(
    serve: Callable[..., FakeGenerator], tiny_model_dir: Path, one_thread: None
) -> None:
    """The step commits and returns while its push is still going out (a generator holding
    it); meanwhile GetState reports the version before and FetchWeights would serve nothing
    newer, so no generator being pushed a version also fetches it. Once the push ends, both do."""
    hold = threading.Event()
    slow = serve(signed=False, hold=hold)
    settings = load_settings(
        TrainerSettings,
        [],
        model=str(tiny_model_dir),
        lr=1e-3,
        max_new_tokens=6,
        group_size=4,
        push_timeout_s=300,
        push_stall_s=300,
    )
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    servicer = TrainerServicer(trainer, GeneratorDirectory([]), CheckpointRequests())
    recorded: list[int] = []
    try:
        trainer.train_and_push(
            scored_groups(2, 4),
            lambda: [slow.address],
            False,
            lambda metrics, outcomes: recorded.append(metrics.version),
        )
        assert recorded == [1] and trainer.version == 1  # committed before the push ended
        assert slow.entered.wait(WAIT_S)
        assert servicer.GetState(trainer_pb2.TrainerStateRequest(), None).version == 0
        assert fetched(servicer) == []
        hold.set()
        [outcome] = trainer.publisher.pushes.wait()
        assert outcome.applied and outcome.version == 1
        assert servicer.GetState(trainer_pb2.TrainerStateRequest(), None).version == 1
        assert fetched(servicer) == [1]
    finally:
        hold.set()
        trainer.close()


def test_a_failed_address_is_left_out_longer_the_more_it_cost() -> None:
    """AddressBackoff on a clock of the test's own: 10 s after a cheap failure, doubled while
    it keeps failing, capped; ten times what a failure cost when that is longer (a stream held
    until push_timeout_s); forgotten once it answers, or once it leaves the list."""
    now = [0.0]
    backoff = AddressBackoff(clock=lambda: now[0])

    def fail(address: str, seconds: float) -> None:
        backoff.update([PushOutcome(address, False, -1, "no nonce", seconds, unreachable=True)], keep=["a", "b"])

    def left_out_for(address: str) -> float:
        """How long `address` is still left out, found by stepping the clock a second at a time."""
        start = now[0]
        while address in backoff.backed_off():
            now[0] += 1.0
        waited, now[0] = now[0] - start, start
        return waited

    fail("a", 0.5)
    assert left_out_for("a") == 10.0
    live, skipped = backoff.split(["a", "b"])
    assert live == ["b"] and [o.address for o in skipped] == ["a"] and skipped[0].error.startswith("backed off")
    for expected in (20.0, 40.0, 80.0, 160.0, 300.0, 300.0):
        fail("a", 0.5)
        assert left_out_for("a") == expected
    fail("b", 120.0)  # took its nonce, then held the stream until the push's deadline
    assert left_out_for("b") == 1200.0
    backoff.update([PushOutcome("a", True, 3, "", 0.1)], keep=["a", "b"])
    assert backoff.backed_off() == ["b"]
    backoff.update([], keep=["a"])
    assert backoff.backed_off() == []


def eventually(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within WAIT_S (for a callback on gRPC's own thread)."""
    end = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def in_background(push: Callable[[], list[T]]) -> tuple[threading.Event, list[T]]:
    """`push` on a thread; an event set when it returned, and its outcomes."""
    ended, outcomes = threading.Event(), list[T]()

    def run() -> None:
        outcomes.extend(push())
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    return ended, outcomes


BIG = {
    "w": np.random.default_rng(0).integers(0, 2**16, size=(4096, 4096), dtype=np.uint16)
}  # a 32 MiB anchor: 8 chunks


@pytest.mark.parametrize("fanout", [0, 1])
def test_a_generator_that_stops_reading_is_cut_after_push_stall_s(
    serve: Callable[..., FakeGenerator], fanout: int
) -> None:
    """A generator that answers its nonce, takes one chunk and reads no more: gRPC's flow
    control holds the trainer's sends to it, and the push cuts it once it has taken nothing for
    push_stall_s (push_timeout_s is 600 s), directly and as a relay's child; the others get
    the push, and the stalled address is backed off."""
    honest, stalled = serve(), serve(read_only=1)
    publisher = WeightPublisher(
        BIG,
        anchor_interval=100,
        creds=ClientCredentials(token=TOKENS["trainer"]),
        generator_key=ROLE_TABLE.generator_key,
        stall_s=10.0,
    )
    anchor = Published(PayloadInfo("anchor", 0, 0, publisher.fingerprint), encode_anchor(BIG, 0, publisher.fingerprint))
    try:
        ended, outcomes = in_background(
            lambda: publisher.fleet.push([honest.address, stalled.address], anchor, timeout_s=600, fanout=fanout)
        )
        assert ended.wait(WAIT_S), "the push still waits for the generator that stopped reading"
        by_address = {o.address: o for o in outcomes}
        assert by_address[honest.address].applied, by_address[honest.address].error
        assert not by_address[stalled.address].applied and "stalled" in by_address[stalled.address].error
        assert stalled.entered.is_set() and 1 <= len(stalled.received) < 8 and stalled.payloads == 0
        assert publisher.fleet.backoff.backed_off() == [stalled.address]
    finally:
        publisher.close()


def test_a_generator_that_never_answers_holds_no_step(
    serve: Callable[..., FakeGenerator], tiny_model_dir: Path, one_thread: None
) -> None:
    """A generator that takes every chunk of the step's push and never answers: the next step
    commits once push_stall_s has passed after its last chunk (push_timeout_s is 600 s), while
    that call is still open; the next push leaves it out (no second push open at it, so no
    version overtakes another there) and reaches the others; its answer, a failure when it
    comes, backs it off."""
    hold = threading.Event()
    silent, honest = serve(signed=False, hold=hold, fail_late=True), serve(signed=False)
    settings = load_settings(
        TrainerSettings,
        [],
        model=str(tiny_model_dir),
        lr=1e-3,
        max_new_tokens=6,
        group_size=4,
        push_timeout_s=600,
        push_stall_s=10,
    )
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    addresses = [silent.address, honest.address]
    try:
        trainer.train_and_push(scored_groups(2, 4), lambda: addresses, False, lambda metrics, outcomes: None)
        ended, outcomes = in_background(
            lambda: trainer.train_and_push(
                scored_groups(2, 4), lambda: addresses, False, lambda metrics, outcomes: None
            )[2]
        )
        assert ended.wait(WAIT_S), "the step still waits for the push of a generator that never answers"
        assert silent.entered.is_set() and not silent.done.is_set() and not hold.is_set()  # its call is still open
        first = {o.address: o for o in outcomes}
        assert first[honest.address].applied and first[silent.address].unanswered and not first[silent.address].applied
        second = {o.address: o for o in trainer.publisher.pushes.wait()}
        assert second[honest.address].applied and second[honest.address].version == 2
        assert second[silent.address].unanswered and "version 1 is not answered yet" in second[silent.address].error
        assert silent.push_calls == 1 and honest.payloads == 2
        assert trainer.publisher.fleet.backoff.backed_off() == []
        hold.set()
        assert eventually(lambda: trainer.publisher.fleet.backoff.backed_off() == [silent.address]), (
            "its late failure was not counted"
        )
        assert trainer.publisher.fleet.unanswered.open() == {}
    finally:
        hold.set()
        trainer.close()


@pytest.mark.parametrize("stall", ["stops reading", "never answers"])
def test_a_relay_child_that_stalls_holds_neither_the_relay_stream_nor_its_answer(
    serve: Callable[..., FakeGenerator], stall: str
) -> None:
    """A relay's target that takes one chunk and reads no more, or takes every chunk and never
    answers, with 600 s left on the relay's own call: the relay's apply still reads its whole
    stream, and its answer reports the target unreachable after RELAY_STALL_S, not at the
    relay's deadline (120 s)."""
    target = (
        serve(signed=False, read_only=1) if stall == "stops reading" else serve(signed=False, hold=threading.Event())
    )
    header = weights_pb2.WeightHeader(
        kind="delta", base_version=0, version=1, total_bytes=8 * 4 << 20, sha256="ab" * 32, model_fingerprint="f"
    )
    data = b"x" * (4 << 20)
    chunks = [
        weights_pb2.WeightChunk(header=header, data=data, forward=[weights_pb2.RelayTarget(address=target.address)])
    ]
    chunks += [weights_pb2.WeightChunk(data=data) for _ in range(7)]
    peers = PeerChannels(ClientCredentials())
    stream = RelayedStream(iter(chunks), "relay", peers, time_left_s=600)
    try:
        assert len(list(stream)) == 8  # the relay's own stream is not held by its target
        ended, outcomes = in_background(lambda: stream.finish(read_rest=True))
        assert ended.wait(WAIT_S), f"the relay's answer still waits for a target that {stall}"
        [outcome] = outcomes
        assert outcome.address == target.address and not outcome.applied and outcome.unreachable
        assert ("stalled" if stall == "stops reading" else "no answer within") in outcome.error
    finally:
        peers.close()
