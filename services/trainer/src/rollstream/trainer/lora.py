"""LoRA through peft, published as merged weights.

The trainer wraps its model with peft's LoRA adapters and trains only those (the optimizer
holds just the adapters). Generators stay plain Hugging Face models: what the trainer
publishes is, for every base weight an adapter touches, bf16(W + scale * B @ A) under the
base weight's Hugging Face name, computed in fp32 exactly as peft's merge does it
(`(B @ A) * scale` added to W), and the untouched weights as they are. So a delta applies
to any generator, and version 0 equals the full fine-tuning path's version 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollstream.core import modeling

ADAPTER = "default"  # peft's adapter name


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def peft_targets(self) -> str | list[str]:
        # peft takes the special value as a string, not inside a list.
        return "all-linear" if self.target_modules == ("all-linear",) else list(self.target_modules)

    def as_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


class LoraModel:
    """A peft-wrapped model and the map from its LoRA layers to base weight names."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec):
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        self.spec = spec
        # The base weights by Hugging Face name, taken before wrapping: peft keeps the same
        # Parameter objects inside each wrapped layer's `base_layer`.
        self.base: dict[str, torch.nn.Parameter] = modeling.named_weights(model)
        name_of = {id(p): name for name, p in self.base.items()}
        config = LoraConfig(
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft says int; a float scales the same (alpha / r)
            r=spec.rank,
            target_modules=spec.peft_targets(),
            lora_dropout=0.0,
            bias="none",
            use_rslora=False,
            use_dora=False,
        )
        self.model = get_peft_model(model, config)
        self.layers: dict[str, LoraLinear] = {}
        for module_name, module in self.model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, LoraLinear):
                raise ValueError(
                    f"{module_name}: only Linear layers are supported for LoRA here, got {type(module).__name__}"
                )
            self.layers[name_of[id(module.get_base_layer().weight)]] = module
        if not self.layers:
            raise ValueError(f"LoRA target_modules {list(spec.target_modules)} matched no layer")
        self.adapters: dict[str, torch.nn.Parameter] = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad
        }
        self.base_bits: dict[str, np.ndarray] = {}  # set by round_base_to_bf16

    def round_base_to_bf16(self) -> None:
        """Round the frozen base to bf16 in place (version 0 is bf16(checkpoint), as without
        LoRA) and remember its bits."""
        self.base_bits = {name: modeling.tensor_to_bits(p) for name, p in self.base.items()}
        modeling.copy_bits_(self.base, self.base_bits)

    @torch.no_grad()
    def merged_weight(self, name: str) -> torch.Tensor:
        """W + (B @ A) * scale in fp32, as peft's merge computes it on an fp32 model."""
        layer = self.layers[name]
        a = layer.lora_A[ADAPTER].weight.float()
        b = layer.lora_B[ADAPTER].weight.float()
        delta = b @ a  # type: ignore[operator]  # nn.Module's __getattr__ types peft's layers as Tensor | Module
        if layer.fan_in_fan_out:
            delta = delta.T
        return layer.get_base_layer().weight.float() + delta * layer.scaling[ADAPTER]

    def merged_bits(self) -> dict[str, np.ndarray]:
        """The published weights: every base weight, merged where an adapter touches it."""
        if not self.base_bits:
            raise RuntimeError("round_base_to_bf16() first")
        out = dict(self.base_bits)
        for name in self.layers:
            out[name] = modeling.tensor_to_bits(self.merged_weight(name))
        return out


def load(
    model_dir: str,
    dtype: str,
    device: str = "cpu",
    spec: LoraSpec | None = None,
    checkpointing: bool = False,
    checkpointing_every: int = 1,
) -> tuple[Any, Any, LoraModel | None, dict[str, torch.nn.Parameter]]:
    """The model as the trainer trains it (and an export of its checkpoint rebuilds it), its tokenizer,
    the LoraModel (None without a spec) and the trained parameters: all the weights, or the adapters
    over a base rounded to bf16."""
    model, tokenizer = modeling.load_model(model_dir, dtype=dtype, device=device)
    if checkpointing:
        modeling.checkpoint_layers(model, checkpointing_every)
    if spec is None:
        return model, tokenizer, None, modeling.named_weights(model)
    wrapped = LoraModel(model, spec)
    wrapped.round_base_to_bf16()
    return wrapped.model, tokenizer, wrapped, wrapped.adapters
