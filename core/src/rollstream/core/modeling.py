"""Torch helpers shared by the generator, reference and trainer (never imported by reward).

- Weights by Hugging Face name as bf16 bit patterns (uint16 numpy), the unit of weight sync.
- Completion log-probs computed through the LM head in token chunks: a full
  [tokens, vocab] fp32 logits tensor costs GBs at real vocabularies (49k for SmolLM2,
  152k for Qwen2), so only `chunk_tokens` rows of logits exist at a time, and under
  autograd each chunk is recomputed in backward instead of being stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load a local Hugging Face causal LM folder and its tokenizer (never downloads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars would interleave with service logs

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # transformers' decorator on .to() hides its signature
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def checkpoint_layers(model: torch.nn.Module, every: int = 1) -> int:
    """Activation checkpointing (non-reentrant: works with frozen inputs, LoRA, and with the
    checkpointed LM head) on every `every`-th decoder layer, the first included; the others
    keep their activations for backward. 1 is every layer (least memory, one more forward in
    backward); k > 1 trades (1 - 1/k) of that recompute for those layers' activations. Returns
    how many layers recompute."""
    if every < 1:
        raise ValueError(f"checkpoint every {every}-th layer: must be at least 1")
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0  # read by the layer's __call__ in training
    return sum(1 for layer in layers if layer.gradient_checkpointing)


def named_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by Hugging Face name; tied weights appear once (as the checkpoint has them)."""
    return dict(model.named_parameters(remove_duplicate=True))


def tensor_to_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 rounding of `t` as uint16 bit patterns (a copy on the host)."""
    return (
        t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16).copy()
    )


def bits_to_tensor(bits: np.ndarray) -> torch.Tensor:
    """uint16 bit patterns -> bf16 tensor sharing memory with `bits`."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def model_bits(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor_to_bits(p) for name, p in named_weights(model).items()}


def load_bits_(model: torch.nn.Module, bits: Mapping[str, np.ndarray]) -> None:
    """Copy bf16 weights (a subset of names is fine) into the model, in its own dtype."""
    copy_bits_(named_weights(model), bits)


@torch.no_grad()
def copy_bits_(params: Mapping[str, torch.Tensor], bits: Mapping[str, np.ndarray]) -> None:
    """Copy bf16 weights into the named tensors (converted to each tensor's dtype/device)."""
    for name, value in bits.items():
        p = params[name]
        p.copy_(bits_to_tensor(value).to(device=p.device, dtype=p.dtype).view(p.shape))


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in named_weights(model).items()}


@dataclass
class Batch:
    """Right-padded prompt+completion sequences and where each completion's tokens sit."""

    input_ids: torch.Tensor  # [B, T]
    # [B, T], or [B, 1, T, T] additive (make_shared_batch), or None: causal attention within
    # each run of position_ids counting up by one (sft_data.packed_batch; transformers finds the runs)
    attention_mask: torch.Tensor | None
    rows: torch.Tensor  # [N] batch row of each completion token
    cols: torch.Tensor  # [N] position whose hidden state predicts that token (t - 1)
    targets: torch.Tensor  # [N] the completion token ids
    lengths: list[int]  # completion length per sequence, to split [N] back
    position_ids: torch.Tensor | None = None  # [B, T] where a row is not one sequence (make_shared_batch)


def make_batch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, device: str | torch.device = "cpu"
) -> Batch:
    total = [len(p) + len(c) for p, c in sequences]
    width = max(total)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    rows, cols, targets, lengths = [], list[int](), list[int](), []
    for i, (prompt, completion) in enumerate(sequences):
        if not prompt:
            # The first completion token is predicted from the last prompt position.
            raise ValueError(f"sequence {i} has an empty prompt")
        seq = list(prompt) + list(completion)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
        start = len(prompt)
        rows.extend([i] * len(completion))
        cols.extend(range(start - 1, start - 1 + len(completion)))
        targets.extend(completion)
        lengths.append(len(completion))
    return _on(device, ids, mask, rows, cols, targets, lengths)


def _on(
    device: str | torch.device,
    ids: torch.Tensor,
    mask: torch.Tensor,
    rows: list[int],
    cols: list[int],
    targets: list[int],
    lengths: list[int],
    positions: torch.Tensor | None = None,
) -> Batch:
    """A Batch of these, on `device`."""
    return Batch(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        lengths=lengths,
        position_ids=positions.to(device) if positions is not None else None,
    )


def make_shared_batch(
    units: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    pad_id: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> Batch:
    """Completions that share a prompt, one row per (prompt, completions) unit: the prompt
    once, then each completion after it, with the positions each would have after the prompt
    alone and a mask that lets each completion's tokens see the prompt and the tokens before
    them in their own completion, nothing else. So every completion token gets exactly the
    log-prob that make_batch's one sequence per completion gives (up to float rounding:
    other matrix shapes), while the prompt goes through the model once per unit instead of
    once per completion. The mask is additive, [B, 1, T, T] in `dtype`: it grows as T^2, so
    callers keep T (a unit's prompt plus its completions) within their token budget.
    Completions come out flat in unit order, as make_batch's sequences would."""
    widths = [len(p) + sum(len(c) for c in cs) for p, cs in units]
    width = max(widths)
    ids = torch.full((len(units), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(units), width), dtype=torch.long)
    segment = torch.full((len(units), width), -2, dtype=torch.long)  # -1: the prompt, k: completion k, -2: padding
    rows, cols, targets, lengths = [], [], list[int](), []
    for b, (prompt, completions) in enumerate(units):
        if not prompt:
            raise ValueError(
                f"unit {b} has an empty prompt"
            )  # its first completion token has nothing to be predicted from
        n = len(prompt)
        ids[b, :n] = torch.tensor(list(prompt), dtype=torch.long)
        positions[b, :n] = torch.arange(n)
        segment[b, :n] = -1
        at = n
        for k, completion in enumerate(completions):
            m = len(completion)
            ids[b, at : at + m] = torch.tensor(list(completion), dtype=torch.long)
            positions[b, at : at + m] = torch.arange(n, n + m)
            segment[b, at : at + m] = k
            # Token 0 is predicted from the prompt's last position, token j > 0 from j - 1.
            rows.extend([b] * m)
            cols.extend([n - 1, *range(at, at + m - 1)])
            targets.extend(completion)
            lengths.append(m)
            at += m
    return _on(device, ids, segment_mask(segment, dtype), rows, cols, targets, lengths, positions)


def segment_mask(segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [B, 1, T, T] in `dtype` of rows whose positions are
    labelled by segment [B, T]: k >= 0 a segment (a completion), -1 a prefix
    every later segment sees (a shared prompt), -2 padding. A position sees the positions at
    or before it in its own segment and in the prefix, nothing else: causal and block-diagonal.
    It grows as T^2, so callers keep T within their token budget."""
    width = segment.shape[1]
    index = torch.arange(width)
    causal = (index.unsqueeze(1) >= index.unsqueeze(0)).unsqueeze(0)  # [1, T, T]: query >= key
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)
    allowed = causal & ((key == -1) | (query == key)) & (key != -2) & (query != -2)
    # A padding position attends to itself: no row of all -inf, so no NaN in what backward touches.
    allowed |= torch.eye(width, dtype=torch.bool).unsqueeze(0)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temp: float,
    want_entropy: bool,
):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * inv_temp
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if not want_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def completion_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi(token | prefix) for every completion token, flat [N] (and entropy).

    Differentiable when grad is enabled; chunks are checkpointed so backward recomputes
    one chunk of logits at a time.
    """
    if batch.targets.numel() == 0:
        empty = torch.zeros(0, device=batch.input_ids.device)
        return empty, empty
    # No KV cache: nothing decodes after this forward, and with one transformers would not look
    # for packed rows in the positions (what a Batch without an attention mask relies on).
    hidden = model.get_decoder()(  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False
    ).last_hidden_state
    picked = hidden[batch.rows, batch.cols]  # [N, H]
    return head_logprobs(
        model, picked, batch.targets, chunk_tokens=chunk_tokens, temperature=temperature, with_entropy=with_entropy
    )


def head_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / temperature)[target] for each row of `hidden` [N, H], through
    the LM head `chunk_tokens` rows at a time: never a full [N, vocab] fp32 logits tensor."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
    inv_temp = 1.0 / temperature
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(
                _chunk_logprobs, h, head.weight, head.bias, t, inv_temp, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(h, head.weight, head.bias, t, inv_temp, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `budget` padded tokens.

    Longest first, so padding inside a micro-batch stays small; a sequence longer than
    the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        new_width = max(width, lengths[i])
        if current and new_width * (len(current) + 1) > budget:
            batches.append(current)
            current, new_width = [], lengths[i]
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches
