"""Attention within each example of a packed row, example by example, with no [B, 1, T, T] mask.

A packed row (sft_data.packed_batch) holds several examples, its positions restarting at
each. transformers' SDPA path turns those restarts into a block-diagonal bool mask and
attends over the whole row: T^2 scores a row, most of them masked, and a T^2 mask in memory.
Here each example (a run of positions counting up by one; a row's padding is a run too) is
attended as a sequence of its own: the runs are grouped by length (within a factor of 2:
lengths in (2^(k-1), 2^k]), each group gathered into one [n, L, H, D] batch right-padded to
its longest run, and attended in one causal SDPA call (a padded slot comes after every real
query of its run, so causality already hides it; its output is dropped). Scores a row:
about the sum of its runs' squared lengths, at most 4x that, never a mask. The arithmetic
rows of benchmarks/sft_vs_trl.py (8 examples of ~59 tokens a row) train 7 % faster on the
CPU (SmolLM2-135M, six seeds: docs/benchmarks.md); on a GPU each group can take SDPA's flash
kernel, which a mask rules out.

`rollstream sft` switches its model to it (use) for training and held-out losses, and back
to SDPA for generation (unpacked): it refuses a padding mask or a KV cache rather than
attend across them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

NAME = "rollstream_packed"
# Model families whose attention is plain causal attention over q, k, v (a sliding window
# at most): the others (soft-capping, sinks, ...) keep SDPA and transformers' mask.
PLAIN = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})


def use(model: torch.nn.Module) -> bool:
    """Register this attention with transformers (with no mask to build: flash attention's
    mask function, which builds none for unpadded rows) and switch `model` to it. False where
    its family is not PLAIN or it cannot switch (transformers then warns): SDPA stays, the
    same results."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    hf: Any = model  # (a transformers model: nn.Module's __getattr__ hides its methods from mypy)
    if hf.config.model_type not in PLAIN:
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    hf.set_attn_implementation(NAME)
    return hf.config._attn_implementation == NAME


@contextmanager
def unpacked(model: torch.nn.Module) -> Iterator[None]:
    """SDPA for the duration (generation: a padding mask and a KV cache), then as before."""
    hf: Any = model
    before = hf.config._attn_implementation
    hf.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        hf.set_attn_implementation(before)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [B, H, T, D], key and value
    [B, H_kv, T, D] (H a multiple of H_kv) -> output [B, T, H, D]."""
    if attention_mask is not None or key.shape[2] != query.shape[2]:
        raise ValueError("packed attention takes rows with no padding mask and no KV cache (generate under unpacked())")
    unsupported = sorted(k for k in ("softcap", "s_aux") if kwargs.get(k) is not None)
    if unsupported:
        raise ValueError(f"packed attention does not implement this model's {', '.join(unsupported)}")
    b, heads, t, d = query.shape
    gqa = key.shape[1] != heads
    runs = _runs(position_ids, b, t)
    window = kwargs.get("sliding_window")
    if isinstance(window, int) and (longest := max(n for _, n in runs)) > window:  # (shorter: no key is out of it)
        raise ValueError(
            f"packed attention: an example of {longest} tokens is longer than the sliding window ({window})"
        )
    if len(runs) == b:  # one example a row: plain causal attention, nothing to gather
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2), None
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value)]  # [B*T, h, D]
    pieces, order = [], []
    for index, real in _groups(runs, query.device):
        q, k, v = (x[index].transpose(1, 2) for x in flat)  # [n, h, L, D]
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        pieces.append(out.transpose(1, 2)[real])  # [tokens, H, D]
        order.append(index[real])
    # Every position is in exactly one run: put the outputs back in row order.
    inverse = torch.argsort(torch.cat(order))
    return torch.cat(pieces)[inverse].view(b, t, heads, d), None


def _runs(position_ids: torch.Tensor | None, rows: int, width: int) -> list[tuple[int, int]]:
    """(start in the flattened [B*T] rows, length) of every run of positions counting up by
    one, rows never joined."""
    if position_ids is None:  # (where the examples are is only in them: never guess)
        raise ValueError("packed attention needs the position ids, and this model did not pass them on")
    flat = position_ids.expand(rows, width).reshape(-1)
    breaks = torch.ones_like(flat, dtype=torch.bool)
    breaks[1:] = flat[1:] != flat[:-1] + 1
    breaks[::width] = True
    starts = torch.nonzero(breaks).flatten().tolist()  # (one sync a layer on a GPU)
    ends = [*starts[1:], rows * width]
    return [(s, e - s) for s, e in zip(starts, ends, strict=True)]


def _groups(runs: list[tuple[int, int]], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per group of runs with lengths in (2^(k-1), 2^k]: the flat positions of each run's
    slots [n, L] (a padded slot repeats its run's start: any real position will do) and which
    slots are real."""
    grouped: dict[int, list[tuple[int, int]]] = {}
    for start, length in runs:
        grouped.setdefault((length - 1).bit_length(), []).append((start, length))
    for group in grouped.values():
        longest = max(length for _, length in group)
        slots = torch.arange(longest)
        lengths = torch.tensor([length for _, length in group])
        real = slots[None, :] < lengths[:, None]
        starts = torch.tensor([start for start, _ in group])
        index = starts[:, None] + torch.where(real, slots[None, :], 0)
        yield index.to(device), real.to(device)
