"""The frozen reference model and the one thing it does: per-token log-probs of completions.

The model is loaded once, rounded to bf16 values, and never updated. Sequences are packed
into micro-batches of at most `token_budget` padded tokens, and the LM head runs in chunks
of `chunk_tokens` (rollstream.core.modeling), so memory stays bounded whatever arrives.

A group's completions share one prompt. With `share_prompts` (the default) completions of
the same prompt are computed together: the prompt runs once per micro-batch and its KV
cache serves them all, so the prompt's cost is paid once, not once per completion (with
group size 8 and prompts as long as completions, ~1.8x fewer tokens through the decoder).
The values equal the packed path's up to float rounding, as two packings of the packed
path already do; `share_prompts = False` computes exactly what the trainer computes for
the same micro-batches (tests/unit/test_reference_matches_trainer.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from rollstream.core import modeling, validation

# (prompt token ids, completion token ids)
TokenPair = tuple[Sequence[int], Sequence[int]]


@torch.no_grad()
def round_to_bf16_(model: torch.nn.Module) -> None:
    """Replace every weight by its bf16 rounding, kept in the model's own dtype.

    The trainer's version 0 (what the generator samples with, and what the KL starts from)
    is the bf16 rounding of the checkpoint. Rounding here too makes pi_ref equal to the
    version-0 policy, so the KL is exactly zero before the first update instead of
    measuring fp32-vs-bf16 rounding noise.
    """
    for p in modeling.named_weights(model).values():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))


@torch.inference_mode()
def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log pi(token | prefix) of several completions of one prompt, flat [N]: the
    prompt runs through the decoder once and its KV cache serves every completion, instead
    of once per completion. The same values as `modeling.completion_logprobs` up to float rounding
    (other matrix shapes). No gradients: this is for the reference model."""
    if not prompt:
        raise ValueError("empty prompt: the first completion token needs at least one prompt token before it")
    if not completions or any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token")
    device = next(model.parameters()).device
    decoder = model.get_decoder()  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
    first = decoder(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True)
    cache = first.past_key_values
    cache.batch_repeat_interleave(len(completions))
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    # The prompt's positions (in the cache) are real for every row; completions are right-padded.
    mask = torch.zeros((len(completions), len(prompt) + width), dtype=torch.long)
    mask[:, : len(prompt)] = 1
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, len(prompt) : len(prompt) + len(c)] = 1
    hidden = decoder(
        input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=cache, use_cache=True
    ).last_hidden_state
    # A completion's first token is predicted from the prompt's last position, token j > 0
    # from the completion's position j - 1.
    last = first.last_hidden_state[0, -1:]
    picked = torch.cat([torch.cat([last, hidden[i, : len(c) - 1]]) for i, c in enumerate(completions)])
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long, device=device)
    logp, _ = modeling.head_logprobs(model, picked, targets, chunk_tokens=chunk_tokens, temperature=temperature)
    return logp


class ReferenceModel:
    """Frozen causal LM computing log pi_ref(token | prefix) for completion tokens."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        *,
        token_budget: int,
        chunk_tokens: int,
        temperature: float = 1.0,
        share_prompts: bool = True,
    ):
        self.model = model.eval().requires_grad_(False)
        self.pad_id = pad_id
        self.token_budget = token_budget
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature
        self.share_prompts = share_prompts
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        # One forward at a time: the stream loop and gRPC calls share the model, and the
        # token budget bounds memory only if micro-batches do not run side by side.
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        token_budget: int = 8192,
        chunk_tokens: int = 1024,
        temperature: float = 1.0,
        share_prompts: bool = True,
    ) -> "ReferenceModel":
        model, tokenizer = modeling.load_model(path, dtype=dtype, device=device)
        round_to_bf16_(model)
        return cls(
            model,
            int(tokenizer.pad_token_id),
            token_budget=token_budget,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            share_prompts=share_prompts,
        )

    def check(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> None:
        """Raise ValueError (the message says what is wrong) for a pair the model cannot score."""
        if not prompt_ids:
            # The first completion token is predicted from the last prompt position; without
            # one there is nothing to condition on.
            raise ValueError("empty prompt: the first completion token needs at least one prompt token before it")
        too_big = [t for t in (*prompt_ids, *completion_ids) if t >= self.vocab_size]
        if too_big:
            raise ValueError(f"token id {too_big[0]} is outside the model's vocabulary of {self.vocab_size}")
        total = len(prompt_ids) + len(completion_ids)
        if self.max_positions and total > self.max_positions:
            raise ValueError(f"sequence of {total} tokens is longer than the model's context of {self.max_positions}")

    @torch.inference_mode()
    def logprobs(self, sequences: Sequence[TokenPair]) -> list[list[float]]:
        """log pi_ref of each completion token given everything before it, per sequence,
        floored at validation.MIN_LOGPROB: a token the reference finds less likely than
        float32 carries (a long run's policy far from it, a low temperature) bounds its KL
        term there instead of getting its group refused downstream. NaN stays NaN (refused).

        Callers check pairs with `check` first; an invalid pair raises from torch here.
        """
        out: list[list[float]] = [[] for _ in sequences]
        # Empty completions have nothing to score (and would leave a micro-batch with no
        # target tokens); they keep their empty list.
        todo = [i for i, (_, completion) in enumerate(sequences) if len(completion) > 0]
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        if self.share_prompts:
            for i in todo:
                by_prompt.setdefault(tuple(sequences[i][0]), []).append(i)
        shared = {prompt: indices for prompt, indices in by_prompt.items() if len(indices) > 1}
        alone = [i for i in todo if tuple(sequences[i][0]) not in shared]
        with self._lock:
            for prompt, indices in shared.items():
                self._score(indices, sequences, out, prompt)
            self._score(alone, sequences, out)
        return out

    def _score(
        self,
        indices: list[int],
        sequences: Sequence[TokenPair],
        out: list[list[float]],
        prompt: tuple[int, ...] | None = None,
    ) -> None:
        """The sequences at `indices`, packed into micro-batches of at most token_budget padded
        tokens. With `prompt` (all of theirs) it runs once per micro-batch and its KV cache
        serves every completion; packed as the whole sequences would be (each row holds the
        prompt's cache and its completion), so memory stays within the same token budget."""
        for packed in modeling.pack_by_tokens(
            [len(sequences[i][0]) + len(sequences[i][1]) for i in indices], self.token_budget
        ):
            pairs = [sequences[indices[k]] for k in packed]
            if prompt is None:
                batch = modeling.make_batch(pairs, self.pad_id, self.device)
                flat, _ = modeling.completion_logprobs(
                    self.model, batch, chunk_tokens=self.chunk_tokens, temperature=self.temperature
                )
            else:
                flat = shared_prompt_logprobs(
                    self.model,
                    prompt,
                    [c for _, c in pairs],
                    self.pad_id,
                    chunk_tokens=self.chunk_tokens,
                    temperature=self.temperature,
                )
            for k, values in zip(packed, flat.float().cpu().split([len(c) for _, c in pairs])):
                out[indices[k]] = values.clamp(min=validation.MIN_LOGPROB).tolist()
