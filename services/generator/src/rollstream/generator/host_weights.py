"""The generator's host copy of the weights: bf16 bits by Hugging Face name, and its version.

Every payload is checked against this copy (model fingerprint, base version) before the
engine sees anything; a refused payload leaves both the copy and the engine as they were.
Where each payload's time went is ApplyTimings', whichever way it came (push, store, fetch).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rollstream.core import deltas


class HostWeights:
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
    """Where a weight stream's time went on this generator, seconds, summed over its payloads.
    PushResult carries them back, so a pusher can split its round trip into transfer and apply."""

    receive: float = 0.0  # reassembly + sha256 check (on a push: from the call's start)
    lock_wait: float = 0.0  # waiting for the weights lock (a batch being sampled)
    decode: float = 0.0  # checking + decoding against the host copy
    load: float = 0.0  # the backend's engine load + commit of the host copy
