"""The generator's host copy of the weights: bf16 bits by Hugging Face name, and its version.

Every payload is checked against this copy (model fingerprint, base version) before the
engine sees anything; a refused payload leaves both the copy and the engine as they were.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

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
