"""Forwarding a push down the relay tree (issue 30; the tree: rollstream.trainer.fleet).

A push whose first chunk names targets (`WeightChunk.forward`) is forwarded by its receiver
to each of them, chunk by chunk as the chunks arrive, each on a stream of its own, from a
reader thread of its own, while the receiver applies the push beside it: the targets'
streams end when the receiver's does, not after its apply, so a tree of depth d costs d
chunks of latency, not d applies. Each target gets the first chunk with its own subtree as `forward`, and the
trainer's signature made for it as its metadata, so it checks the push exactly as one from
the trainer. The receiver's answer (PushResult.relayed) carries every outcome of its
subtree, each with its generator's own acknowledgement (ack), which the trainer checks; a target that fails is reported with every generator below it as not reached (the
trainer pushes to those again, with fresh nonces: a relay holds no signature for them that
has not been spent or may not be).

A target that stops reading is cut after RELAY_STALL_S without taking a chunk, and one that has
every chunk is waited for RELAY_STALL_S per level of its subtree (weight_transfer.WatchedPush),
then cut too: both reported unreachable (the trainer leaves them out a while), so a stalled
child holds neither this relay's stream (its chunks queue beside it, bounded by the push's
max bytes) nor, past that deadline, this relay's answer to the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from rollstream.core import push_signing, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel, rpc_error_text
from rollstream.v1 import weights_pb2

RELAY_TIMEOUT_S = 120.0  # a forwarded push, as the trainer's own push_timeout_s default
RELAY_MARGIN_S = 2.0  # each level ends its targets' calls this much before its own deadline
# The trainer's push_stall_s default (a relay is not told the trainer's: a trainer set lower
# than this stops waiting for a relay whose child stalls before the relay reports it).
RELAY_STALL_S = 5.0
MAX_TARGETS = 64  # the trainer's push_fanout at most: a push naming more is malformed (a thread each)


class PeerChannels:
    """Channels to the generators this one forwards to, kept from one push to the next (a
    generator's children change only when the trainer's view of the registry does)."""

    def __init__(self, creds: ClientCredentials):
        self.creds = dataclasses.replace(creds, token="")  # no token ever goes to a generator: pushes are signed
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def push_call(self, address: str) -> grpc.StreamUnaryMultiCallable:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address, self.creds, server_name="generator")
            ch = self._channels[address]
        return weight_transfer.push_stream(ch)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


def not_reached(target: weights_pb2.RelayTarget, via: str, why: str) -> list[weights_pb2.RelayedPush]:
    """`target`, failed for `why`, and every generator below it, orphaned."""
    return [
        weights_pb2.RelayedPush(address=target.address, applied=False, error=why, via=via, unreachable=True),
        *orphans(target),
    ]


def orphans(target: weights_pb2.RelayTarget) -> list[weights_pb2.RelayedPush]:
    return [
        r
        for t in target.forward
        for r in (
            weights_pb2.RelayedPush(
                address=t.address,
                applied=False,
                error=f"not reached: {target.address} did not take the push",
                via=target.address,
                orphaned=True,
            ),
            *orphans(t),
        )
    ]


class Forwarder:
    """One push's forwarding: `send` every chunk as it arrives, `close`, then `outcomes`."""

    def __init__(
        self,
        targets: Sequence[weights_pb2.RelayTarget],
        via: str,
        peers: PeerChannels,
        timeout_s: float = RELAY_TIMEOUT_S,
    ):
        self.via = via
        self._legs = [_Leg(t, via, peers, timeout_s) for t in targets]

    def send(self, chunk: weights_pb2.WeightChunk, first: bool) -> None:
        if first:
            for leg in self._legs:
                own = weights_pb2.WeightChunk(header=chunk.header, data=chunk.data, forward=leg.target.forward)
                leg.put(own.SerializeToString())
            return
        data = chunk.SerializeToString()  # once for every leg
        for leg in self._legs:
            leg.put(data)

    def close(self, complete: bool = True) -> None:
        """End every leg's stream (cut short when not `complete`: the children refuse it)."""
        for leg in self._legs:
            leg.close(complete)

    def outcomes(self) -> list[weights_pb2.RelayedPush]:
        """Once closed: every leg's outcome, their subtrees' included."""
        return [r for leg in self._legs for r in leg.outcome()]


class _Leg:
    """One target's stream, fed from a queue by the thread that reads the push."""

    def __init__(self, target: weights_pb2.RelayTarget, via: str, peers: PeerChannels, timeout_s: float):
        self.target = target
        self.via = via
        self._chunks: queue.Queue[bytes | None] = queue.Queue()
        self._cancelled = threading.Event()
        self._failed = threading.Event()  # the call ended in an error: take no more chunks
        self._result: list[weights_pb2.RelayedPush] = []
        self._thread = threading.Thread(
            target=self._run, args=(peers, timeout_s), name=f"relay-{target.address}", daemon=True
        )
        self._thread.start()

    def put(self, data: bytes) -> None:
        if not self._failed.is_set():
            self._chunks.put(data)

    def close(self, complete: bool) -> None:
        if not complete:
            self._cancelled.set()
        self._chunks.put(None)  # also after a failure: a request iterator may still wait on the queue

    def outcome(self) -> list[weights_pb2.RelayedPush]:
        self._thread.join()
        return self._result

    def _requests(self) -> Iterator[bytes]:
        while (data := self._chunks.get()) is not None:
            yield data
        if self._cancelled.is_set():  # an incomplete stream: end the call with an error instead
            raise RuntimeError("the relay's own stream was cut short")

    def _run(self, peers: PeerChannels, timeout_s: float) -> None:
        start = time.perf_counter()
        metadata = ((push_signing.METADATA_KEY, self.target.signature),) if self.target.signature else ()
        leg = weight_transfer.WatchedPush(peers.push_call(self.target.address), self._requests(), timeout_s, metadata)
        answer_s = RELAY_STALL_S * height(self.target)
        ended = leg.wait(RELAY_STALL_S, answer_s)
        why = ""
        if ended is weight_transfer.Leg.STALLED:
            why = f"stalled: took no chunk for {RELAY_STALL_S:g} s"
        elif ended is weight_transfer.Leg.UNANSWERED and leg.future.cancel():
            why = f"no answer within {answer_s:g} s of its last chunk"
        else:
            try:
                result = leg.future.result()
            except grpc.RpcError as e:
                why = rpc_error_text(e)
        if why:
            self._result = not_reached(self.target, self.via, f"relay {self.via} -> {self.target.address}: {why}")
            self._failed.set()
            with contextlib.suppress(queue.Empty):  # the chunks queued for it are freed
                while True:
                    self._chunks.get_nowait()
            return
        seconds = time.perf_counter() - start
        self._result = [
            weights_pb2.RelayedPush(
                address=self.target.address,
                applied=result.applied,
                version=result.version,
                error=result.error,
                seconds=seconds,
                via=self.via,
                ack=result.ack,
            ),
            *result.relayed,
        ]


def height(target: weights_pb2.RelayTarget) -> int:
    """The levels of `target`'s subtree (1: it forwards to none)."""
    return 1 + max((height(t) for t in target.forward), default=0)


class RelayedStream:
    """A push's chunks as the servicer applies them, forwarded on receipt when the first chunk
    names targets. A thread of its own reads the push: each chunk goes to the targets as it
    arrives and into a queue the servicer's apply reads from, so the apply (its lock wait,
    decode, engine load) runs beside the forwarding, and the targets' streams end when this
    one ends, not when this generator has applied it: a hop costs a chunk. `finish` once,
    whatever happened: it returns the targets' outcomes (after reading the rest of the push
    for them), or cuts their streams short."""

    def __init__(
        self,
        chunks: Iterator[weights_pb2.WeightChunk],
        via: str,
        peers: PeerChannels,
        time_left_s: float | None = None,
        max_bytes: int = 0,
    ):
        """`time_left_s`: what the caller's deadline leaves (None: no deadline). The targets'
        calls end a little before it, so that this call can still answer with their outcomes.
        `max_bytes`: what the reader takes at most (0: no limit), the apply's own limit, so a
        stream the apply has stopped reading cannot fill the queue."""
        self._chunks = iter(chunks)
        self._via = via
        self._peers = peers
        self._max_bytes = max_bytes
        self._timeout_s = (
            RELAY_TIMEOUT_S if time_left_s is None else max(1.0, min(RELAY_TIMEOUT_S, time_left_s - RELAY_MARGIN_S))
        )
        self._forwarder: Forwarder | None = None
        self._received: queue.Queue[weights_pb2.WeightChunk | BaseException | None] = queue.Queue()
        self._stop = threading.Event()  # the push was refused: read no further, cut the targets
        self._whole = threading.Event()  # read to its end, and the targets' streams ended whole
        self._legs_lock = threading.Lock()
        self._legs_closed = False
        self._reader: threading.Thread | None = None
        self._outcomes: list[weights_pb2.RelayedPush] | None = None
        self.header: weights_pb2.WeightHeader | None = None  # the first chunk's, once read

    def __iter__(self) -> Iterator[weights_pb2.WeightChunk]:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name=f"push-reader-{self._via}", daemon=True)
            self._reader.start()
        while (item := self._received.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _read(self) -> None:
        """The reader thread: every chunk to the targets and to the apply, as it arrives."""
        whole, taken = False, 0
        try:
            for chunk in self._chunks:
                if self._stop.is_set():
                    break
                if self.header is None:
                    if len(chunk.forward) > MAX_TARGETS:
                        raise weight_transfer.TransferRefused(
                            f"a push naming {len(chunk.forward)} targets to forward it to; at most {MAX_TARGETS}"
                        )
                    self.header = chunk.header
                    if chunk.forward:
                        self._forwarder = Forwarder(chunk.forward, self._via, self._peers, self._timeout_s)
                    first = True
                else:
                    first = False
                taken += len(chunk.data)
                if self._max_bytes and taken > self._max_bytes:
                    raise weight_transfer.PayloadTooLarge(f"a push of over {self._max_bytes} bytes")
                if self._forwarder is not None:
                    self._forwarder.send(chunk, first)
                self._received.put(chunk)
            else:
                whole = True
        except BaseException as e:  # noqa: BLE001 - the apply raises it (a broken or refused stream)
            self._received.put(e)
        finally:
            if whole and not self._stop.is_set():
                self._whole.set()
            self._close_legs(self._whole.is_set())
            self._received.put(None)

    def _close_legs(self, complete: bool) -> None:
        with self._legs_lock:
            if self._legs_closed or self._forwarder is None:
                return
            self._legs_closed = True
            self._forwarder.close(complete)

    def finish(self, read_rest: bool) -> list[weights_pb2.RelayedPush]:
        """`read_rest`: the push was good as far as this generator could tell (applied, or
        refused for its base only: the targets may hold the right one), so the rest of it is
        read for the targets and their outcomes are awaited. Else the targets' streams are
        cut short, at once, unless the push has been read whole already."""
        if self._outcomes is not None:
            return self._outcomes
        if not read_rest and not self._whole.is_set():
            self._stop.set()
            self._close_legs(False)
            self._outcomes = []
            return self._outcomes
        if self._reader is None:  # the apply never started reading: read for the targets alone
            with contextlib.suppress(Exception):  # a broken push: the targets got it cut short
                for _ in self:
                    pass
        assert self._reader is not None
        self._reader.join()
        self._outcomes = self._forwarder.outcomes() if self._forwarder is not None else []
        return self._outcomes
