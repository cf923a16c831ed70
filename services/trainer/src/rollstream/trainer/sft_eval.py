"""The held-out score of `rollstream sft`: where held-out rows carry an answer, the model's
greedy completions of their prompts scored by the reward service's own recipes, beside the
held-out loss.

  prompts    the held-out examples (those of the held-out packed rows: eval_fraction's, or
             eval_dataset's) whose `answer_field` is set, the first `eval_prompts` by row:
             the same ones every round. A row's prompt is its conversation before its last
             assistant turn, or its `prompt`, rendered as the data path renders it (the chat
             template with the generation prompt; a plain prompt as is)
  generate   the model's own `generate`, greedy, eval_batch_size prompts at a time (left
             padded), at most eval_max_new_tokens each, on the compute device, in eval mode
             (no dropout, a KV cache) and without gradients; the update in flight is waited
             for by the model's own hooks, as any forward
  score      each completion as a reward_pb2.ScoreItem (task_kind, the completion's text,
             the answer, metadata), scored by a `Scorer`: what the reward service's Score RPC
             does (rollstream.reward.items.ItemScorer: the recipes in its worker pool, each
             component under its time limit). The trainer package does not depend on the
             reward package: the `rollstream` launcher, which depends on both, builds the
             scorer and hands it to sft.run
  report     GRPO's held-out definitions (trainer/evaluation.py): reward_mean the mean reward,
             accuracy the share with full marks (evaluation.full_marks: the `answer`
             component at 1), completion_tokens the mean length; steps.jsonl's eval line as
             eval_<name>, the trackers' as eval/<name>; every completion with its score in
             WORKDIR/held_out/<step>.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rollstream.trainer import evaluation, packed_attention, sft_data
from rollstream.trainer.config import SftSettings
from rollstream.trainer.prompts import metadata_json
from rollstream.trainer.sft_data import PackedRow, Problem, SftDataError
from rollstream.v1 import reward_pb2, rollout_pb2

FOLDER = "held_out"  # in the workdir: each round's completions and their scores


class Scorer(Protocol):
    """Scores completions as the reward service's Score RPC does: items in, scores in order."""

    @property
    def kinds(self) -> tuple[str, ...]: ...

    def score(self, items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]: ...


@dataclass(frozen=True)
class EvalPrompt:
    row: int  # the example's row in its dataset
    prompt_ids: list[int]
    answer: str
    metadata_json: str


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the EOS that ended it included, as a generator counts it
    text: str  # without special tokens
    finish_reason: str  # "stop" (an EOS) or "length" (eval_max_new_tokens)


def eval_prompts(s: SftSettings, held_out: Sequence[PackedRow], tokenizer: Any) -> list[EvalPrompt]:
    """The held-out examples with an answer, the first eval_prompts by row (none when
    eval_prompts is 0, answer_field empty, or no held-out row has the field). A row's answer
    or metadata of the wrong type is refused, naming the row and field."""
    if not s.eval_prompts or not s.answer_field or not held_out:
        return []
    source = Path(s.eval_dataset or s.dataset)
    rows, lines = sft_data.read_rows(source, s.split)  # as `prepare` numbered them
    out: list[EvalPrompt] = []
    problems: list[Problem] = []
    for i in sorted({r for packed in held_out for r in packed.rows}):
        row, line = rows[i], lines[i] if lines else None
        answer = row.get(s.answer_field)
        if answer is None:
            continue
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            why = f"a string or number expected, got {type(answer).__name__}"
            problems.append(Problem(i, s.answer_field, why, line))
            continue
        try:
            metadata = metadata_json(row.get(s.metadata_field)) if s.metadata_field else ""
        except ValueError as e:
            problems.append(Problem(i, s.metadata_field, str(e), line))
            continue
        out.append(EvalPrompt(i, _prompt_ids(row, tokenizer), str(answer), metadata))
    if problems:
        raise SftDataError(problems, str(source))
    return out[: s.eval_prompts]


def _prompt_ids(row: Mapping[str, Any], tokenizer: Any) -> list[int]:
    """What the model is asked, rendered as sft_data renders a prompt (the row was validated
    there): a conversation up to its last assistant turn, or the row's prompt."""
    if "messages" in row:
        messages = row["messages"]
        last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        messages = messages[:last]
    else:
        messages = row["prompt"]
        if isinstance(messages, str):
            return list(tokenizer(text=messages)["input_ids"])
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    return list(rendered["input_ids"])


@torch.no_grad()
def generate(
    model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int, device: str
) -> list[Completion]:
    """Greedy completions of `prompts`, batch_size at a time, left-padded; each ends at its
    first EOS (the model's generation config's and the tokenizer's) or at max_new_tokens."""
    from transformers import GenerationConfig

    configured = model.generation_config.eos_token_id
    eos = sorted({*(configured if isinstance(configured, list) else [configured]), tokenizer.eos_token_id} - {None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    # Its own config, not the model folder's: that may ask for sampling (temperature, top_p).
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, use_cache=True
    )
    was_training = model.training
    model.eval()  # no dropout, and checkpointing off: generate keeps its KV cache
    out: list[Completion] = []
    with packed_attention.unpacked(model):  # a padding mask and a KV cache: SDPA's
        try:
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for b, p in enumerate(chunk):
                    ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                    mask[b, width - len(p) :] = 1
                new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
                for tokens in new[:, width:].tolist():
                    end = next((k for k, t in enumerate(tokens) if t in eos), None)
                    kept = tokens if end is None else tokens[: end + 1]
                    text = tokenizer.decode(kept, skip_special_tokens=True)
                    out.append(Completion(kept, text, "length" if end is None else "stop"))
        finally:
            model.train(was_training)
    return out


def score_items(
    s: SftSettings, prompts: Sequence[EvalPrompt], completions: Sequence[Completion]
) -> list[reward_pb2.ScoreItem]:
    return [
        reward_pb2.ScoreItem(
            task_kind=s.task_kind,
            completion=c.text,
            answer=p.answer,
            metadata_json=p.metadata_json,
            num_tokens=len(c.token_ids),
            finish_reason=c.finish_reason,
        )  # fmt: skip
        for p, c in zip(prompts, completions, strict=True)
    ]


def full_marks(score: reward_pb2.ItemScore) -> bool:
    """evaluation.full_marks, GRPO's held-out definition, of a scored completion."""
    return evaluation.full_marks(rollout_pb2.Completion(reward=score.reward, reward_components=score.components))


@dataclass
class HeldOutScore:
    """The held-out prompts of a run and how to score them; `evaluate` runs one round."""

    settings: SftSettings
    prompts: list[EvalPrompt]
    scorer: Scorer
    folder: Path  # WORKDIR/held_out

    def evaluate(self, model: Any, tokenizer: Any, step: int) -> dict[str, float]:
        """One round after `step`: steps.jsonl's fields without their eval_ prefix."""
        s = self.settings
        started = time.perf_counter()
        ids = [p.prompt_ids for p in self.prompts]
        completions = generate(model, tokenizer, ids, s.eval_max_new_tokens, s.eval_batch_size, s.device)
        generated = time.perf_counter()
        try:
            scores = self.scorer.score(score_items(s, self.prompts, completions))
        except (RuntimeError, TimeoutError, OSError) as e:  # the reward's pool broke or ran out of time
            # A round without its score costs less than the run: the loss is still reported.
            print(f"sft: step {step}: the held-out score failed ({e}); this round has the loss only", file=sys.stderr)
            return {}
        scored = time.perf_counter()
        correct = [full_marks(x) for x in scores]
        self.write(step, completions, scores, correct)
        n = len(scores)
        return {
            "prompts": n,
            "reward_mean": float(f"{sum(x.reward for x in scores) / n:.7g}"),  # float32 rewards, as GRPO's line
            "accuracy": sum(correct) / n,
            "completion_tokens": sum(len(c.token_ids) for c in completions) / n,
            "generate_s": round(generated - started, 6),
            "score_s": round(scored - generated, 6),
        }

    def write(
        self, step: int, completions: Sequence[Completion], scores: Sequence[reward_pb2.ItemScore], correct: list[bool]
    ) -> None:
        """The round's completions, one JSON line each: what was asked, written and scored."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps(
                {
                    "row": p.row,
                    "answer": p.answer,
                    "completion": c.text,
                    "finish_reason": c.finish_reason,
                    "tokens": len(c.token_ids),
                    "reward": x.reward,
                    "correct": ok,
                    "components": {k.name: k.value for k in x.components},
                }
            )  # fmt: skip
            for p, c, x, ok in zip(self.prompts, completions, scores, correct, strict=True)
        ]
        (self.folder / f"{step:08d}.jsonl").write_text("".join(line + "\n" for line in lines))


def held_out_score(
    s: SftSettings, held_out: Sequence[PackedRow], tokenizer: Any, scorer: Scorer | None, workdir: Path
) -> HeldOutScore | None:
    """The run's held-out score, or None where there is nothing to score (no answers, no
    scorer: the held-out loss alone); said on stderr either way."""
    prompts = eval_prompts(s, held_out, tokenizer)
    if not prompts:
        return None
    if scorer is None:
        print("sft: held-out rows have answers but no scorer was given: the held-out loss only", file=sys.stderr)
        return None
    # An unknown kind would score 0 every round with an "unknown task_kind" status: it would read
    # as wrong answers. Refused now, before the model loads.
    if s.task_kind not in scorer.kinds:
        raise ValueError(f"task_kind {s.task_kind!r}: no reward recipe of that name (known: {', '.join(scorer.kinds)})")
    print(
        f"sft: held-out score: {len(prompts)} prompts, greedy, at most {s.eval_max_new_tokens} new tokens, "
        f"recipe {s.task_kind!r}",
        file=sys.stderr,
    )
    return HeldOutScore(s, prompts, scorer, workdir / FOLDER)
