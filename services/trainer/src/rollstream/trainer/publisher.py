"""Publishing policy versions: exact deltas, periodic anchors, pushes to every generator.

The publisher keeps the bits it last published (the base of the next delta), the latest
anchor and every delta since it, so a generator holding any version from that anchor on
(or nothing at all) can be brought to the current version by FetchWeights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from rollstream.core import deltas, weight_transfer
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.v1 import generator_pb2_grpc


@dataclass
class PushOutcome:
    address: str
    applied: bool
    version: int
    error: str
    seconds: float


@dataclass
class Published:
    info: deltas.PayloadInfo
    payload: bytes


class WeightPublisher:
    def __init__(
        self, bits: Mapping[str, np.ndarray], anchor_interval: int, version: int = 0, creds: ClientCredentials | None = None,
        encode_threads: int = 0,
    ):
        """`creds`: the trainer's token (generators accept PushWeights from the trainer role
        only) and TLS material; None pushes without either. `encode_threads`: threads that
        encode a delta's tensors while the step still runs (0: on the caller's thread)."""
        self.fingerprint = deltas.model_fingerprint({k: v.shape for k, v in bits.items()})
        self.anchor_interval = anchor_interval
        self.creds = creds
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="push")
        self._encode_pool = ThreadPoolExecutor(max_workers=encode_threads, thread_name_prefix="delta") if encode_threads else None
        self._set_anchor(dict(bits), version)

    @property
    def version(self) -> int:
        return self._version

    def bits(self) -> dict[str, np.ndarray]:
        return self._bits

    def _set_anchor(self, bits: dict[str, np.ndarray], version: int) -> None:
        payload = deltas.encode_anchor(bits, version, self.fingerprint)
        with self._lock:
            self._bits = bits
            self._version = version
            self._anchor = Published(deltas.PayloadInfo("anchor", version, version, self.fingerprint), payload)
            self._deltas: list[Published] = []

    def begin_delta(self) -> deltas.DeltaEncoder:
        """An encoder for the next version's delta, to be fed tensor by tensor as the step
        produces them (HostAdamW.step's on_tensor) and handed to publish()."""
        return deltas.DeltaEncoder(self._bits, self._version, self._version + 1, self.fingerprint, executor=self._encode_pool)

    def publish(self, new_bits: Mapping[str, np.ndarray], encoder: deltas.DeltaEncoder | None = None) -> tuple[Published, deltas.DeltaStats]:
        """Encode the delta from the last published version (the tensors not yet given to
        `encoder`, from begin_delta, are added now); every anchor_interval versions also
        start a new anchor (older deltas are then no longer needed)."""
        base = self._version
        if encoder is None:
            encoder = self.begin_delta()
        elif encoder.base_version != base or encoder.base is not self._bits:
            raise deltas.DeltaError(f"the encoder's base is version {encoder.base_version}, the last published is {base}")
        for name in sorted(new_bits):
            if name not in encoder:
                encoder.add(name, new_bits[name])
        payload, stats = encoder.finish()
        delta = Published(deltas.PayloadInfo("delta", base, base + 1, self.fingerprint), payload)
        if (base + 1) % self.anchor_interval == 0:
            self._set_anchor(dict(new_bits), base + 1)
        else:
            with self._lock:
                self._bits = dict(new_bits)
                self._version = base + 1
                self._deltas.append(delta)
        return delta, stats

    def catch_up_payloads(self, have_version: int, fingerprint: str) -> list[Published]:
        """What a generator holding `have_version` (-1: nothing) needs, in order."""
        if fingerprint and fingerprint != self.fingerprint:
            raise deltas.DeltaError(f"generator model {fingerprint} is not the trainer's {self.fingerprint}")
        with self._lock:
            anchor, chain = self._anchor, list(self._deltas)
        current = chain[-1].info.version if chain else anchor.info.version
        if anchor.info.version <= have_version <= current:
            return [d for d in chain if d.info.base_version >= have_version]
        # Older than the anchor, nothing held (-1), or *ahead* of us (weights from an earlier
        # run of a trainer that restarted from scratch): start over from the anchor.
        return [anchor, *chain]

    def push(self, addresses: Sequence[str], published: Published, timeout_s: float) -> list[PushOutcome]:
        """Push one payload to every generator concurrently (each as a stream of chunks)."""
        futures = [self._pool.submit(_push_one, a, published, timeout_s, self.creds) for a in addresses]
        return [f.result() for f in futures]


def _push_one(address: str, published: Published, timeout_s: float, creds: ClientCredentials | None) -> PushOutcome:
    start = time.perf_counter()
    try:
        with channel(address, creds, server_name="generator") as ch:
            stub = generator_pb2_grpc.GeneratorStub(ch)
            result = stub.PushWeights(weight_transfer.to_chunks(published.payload, published.info), timeout=timeout_s)
        return PushOutcome(address, result.applied, result.version, result.error, time.perf_counter() - start)
    except grpc.RpcError as e:
        return PushOutcome(address, False, -1, f"{e.code().name}: {e.details()}", time.perf_counter() - start)  # type: ignore[attr-defined]
