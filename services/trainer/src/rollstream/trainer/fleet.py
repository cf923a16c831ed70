"""Pushing a published version to every generator: nonces, the relay tree, watched streams.

Nothing is done once per generator that can be done once per payload. A payload
is encoded once and its header (with the sha256 of the whole payload) made once; every
generator gets its own concurrent stream over a channel kept from one push to the next
(no connection, HTTP/2 or TLS handshake per step); the pool has a thread per generator up
to MAX_PUSH_STREAMS, so pushes do not queue behind each other in waves; the chunks are
serialized once per push and the same bytes go to every stream (gRPC is given them as they
are), so a stream costs the trainer gRPC's own send and no copy or protobuf encode of ours.
An anchor kept in a file (anchor_dir) is the exception: it is as large as the bf16 weights,
so it is written to its file tensor by tensor (hashed as it is written) and each stream
reads its chunks from the file as it sends them (the page cache serves the other streams);
it is never whole in the trainer's memory.

A payload goes out one of the WAYS, by name: "push" (a stream from the trainer to each
generator) or "relay" (down a tree); both relay.py's, over what every push shares (push.py:
nonces, signatures by core/push_signing.py, watched calls, back-off). The trainer pushes in
the background (BackgroundPush), telling pollers a version only once its push has ended.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.core.push_signing import PushSigner
from rollstream.trainer import relay
from rollstream.trainer.push import (
    NONCE_TIMEOUT_S,
    STALL_S,
    AddressBackoff,
    PushCall,
    PushGate,
    PushOutcome,
    PushParts,
    Unanswered,
    Watch,
    push_call,
)

if TYPE_CHECKING:
    from rollstream.trainer.publisher import Published

log = logging.getLogger(__name__)
MAX_PUSH_STREAMS = 64  # concurrent pushes; past ~16 generators the design relays instead
# The ways a payload goes out to many generators, by name (as vLLM registers its weight-transfer
# engines): each is handed the pool, the addresses to reach, the push's shared parts, the
# deadline and the fan-out, and gives one outcome per address.
WAYS: dict[str, Callable[[ThreadPoolExecutor, Sequence[str], PushParts, float, int], list[PushOutcome]]] = {
    "push": relay.direct,
    "relay": relay.push_down,
}


class BackgroundPush:
    """The step's push on a thread of its own: the loop commits a step, hands its payload over
    and trains the next one while it goes out. Pushes stay ordered and one is in flight at a
    time (`start` waits for the one before), so at most two payloads are held: the one going
    out and the one the step just made. A push ends once every generator has answered, been
    cut, or taken every chunk and not answered within the stall deadline (Watch): a call
    still open then holds no payload, only its address out of the next pushes (Unanswered). `version`: the newest version whose push has ended,
    all that pollers are told and served (the trainer's GetState and FetchWeights): a
    generator being pushed a version never fetches it too, and one the push missed fetches it
    once the push is over."""

    def __init__(self, version: int):
        self._version = version
        self._thread: threading.Thread | None = None
        self._ended: list[PushOutcome] = []  # the last push's outcomes, until `wait` hands them over
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def reached(self, version: int) -> None:
        """`version` may be told and served now (pushed to no one: a replayed step, an anchor pushed at once)."""
        with self._lock:
            self._version = version

    def start(self, version: int, push: Callable[[], list[PushOutcome]]) -> list[PushOutcome]:
        """Wait for the push in flight, then start `push` (of `version`); the outcomes of the one
        waited for ([] if none or handed over already)."""
        before = self.wait()
        self._thread = threading.Thread(target=self._run, args=(version, push), name=f"push-v{version}", daemon=True)
        self._thread.start()
        return before

    def _run(self, version: int, push: Callable[[], list[PushOutcome]]) -> None:
        outcomes: list[PushOutcome] = []
        try:
            outcomes = push()
        except Exception:  # never expected (failures are outcomes); the version is over all the same
            log.exception("push_failed: version %d", version)
        with self._lock:
            self._version = version
            self._ended = outcomes

    def wait(self) -> list[PushOutcome]:
        """Wait for the push in flight; its outcomes, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            ended, self._ended = self._ended, []
        return ended


class Fleet:
    """The generators a trainer pushes to: a channel to each kept from one push to the next, a
    thread per stream (up to MAX_PUSH_STREAMS), the addresses backed off and the calls left
    unanswered. `creds`: the trainer's token, which signs pushes and is never sent (generators
    accept PushWeights by the trainer's signature only), and TLS material; None pushes
    unsigned in the clear (generators without grpc_auth_file). `generator_key`:
    roles.json's generator_proof_key; with it, nothing is pushed to an address whose PushNonce
    answer does not prove a generator's token, and no generator is believed to have applied a
    push without its acknowledgement. `nonce_timeout_s`: how long a generator has to answer
    PushNonce before it is left out of that push. `stall_s`: how long a push waits for a
    generator that takes no chunk (then it is cut and backed off), and for its answer once it
    has every chunk (then the push ends without it: Unanswered)."""

    def __init__(
        self,
        creds: ClientCredentials | None = None,
        generator_key: Ed25519PublicKey | None = None,
        nonce_timeout_s: float = NONCE_TIMEOUT_S,
        stall_s: float = STALL_S,
    ):
        self.signer = PushSigner(creds.token) if creds is not None and creds.token else None
        self.creds = dataclasses.replace(creds, token="") if creds is not None else None
        self.generator_key = generator_key
        self.nonce_timeout_s = nonce_timeout_s
        self.stall_s = stall_s
        self.backoff = AddressBackoff()
        self.unanswered = Unanswered(self.backoff)
        self._pool = ThreadPoolExecutor(max_workers=MAX_PUSH_STREAMS, thread_name_prefix="push")
        self._channels: dict[str, grpc.Channel] = {}  # by address, kept between pushes
        self._channels_lock = threading.Lock()

    def push(
        self,
        addresses: Sequence[str],
        published: Published,
        timeout_s: float,
        from_registry: bool = False,
        fanout: int = 0,
    ) -> list[PushOutcome]:
        """Push one payload to every generator concurrently (each as a stream of chunks).
        `from_registry`: the addresses come from the generator registry, which a lesser role
        writes, so each generator must prove the address it was dialed at. `fanout` >= 1 with
        more generators than that: down a relay tree (relay.py), the trainer sending to
        `fanout` of them only; one outcome per address either way. Each nonce is asked within
        nonce_timeout_s, not `timeout_s`; an address that failed is left out while it is backed
        off (AddressBackoff), counted as not applied: it catches up by itself."""
        wire = published.wire_chunks()  # hashed here, once; serialized once too unless in a file
        calls = self._calls(addresses)
        gate = PushGate(self.signer, self.generator_key, from_registry)
        live, skipped = self.backoff.split(addresses)
        live, busy = self.unanswered.split(live)
        parts = PushParts(
            calls, wire, published.header(), gate, Watch(self.stall_s, self.unanswered), self.nonce_timeout_s
        )
        done = WAYS["relay" if 1 <= fanout < len(live) else "push"](self._pool, live, parts, timeout_s, fanout)
        self.backoff.update(done, keep=addresses)
        by_address = {o.address: o for o in [*skipped, *busy, *done]}
        return [by_address[a] for a in addresses]

    def _calls(self, addresses: Sequence[str]) -> dict[str, PushCall]:
        """PushWeights over the kept channels, taking serialized chunks as they are (no
        request serializer). Channels to addresses no longer pushed to are closed
        (generators come and go with discovery); a kept channel reconnects by itself when
        its generator restarts at the same address."""
        with self._channels_lock:
            for gone in set(self._channels) - set(addresses):
                self._channels.pop(gone).close()
            for a in addresses:
                if a not in self._channels:
                    self._channels[a] = channel(a, self.creds, server_name="generator")
            return {a: push_call(self._channels[a]) for a in addresses}

    def close(self) -> None:
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)
