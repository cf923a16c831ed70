"""Probe how well the demo model already solves candidate demo tasks (CPU, fp32).

GRPO learns only where a prompt's samples disagree, so the demo task should start with a
mean reward well away from 0 and 1. This samples each prompt variant at temperature 1 and
prints a markdown table: mean reward (first integer in the completion == answer), greedy
accuracy, and time.

    python scripts/probe_demo_task.py [--prompts 8] [--samples 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.core.models import resolve_model

# name -> chat messages; "{a}"/"{b}" are filled in. Without a system message SmolLM2's chat
# template inserts its default one ("You are a helpful AI assistant named SmolLM, ...").
_Q = "What is {a} + {b}? Answer with just the number."
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "plain": [("user", "What is {a} + {b}?")],
    "just_number": [("user", _Q)],
    "just_number_first": [("user", "Answer with just the number. What is {a} + {b}?")],
    "equation": [("user", "{a} + {b} =")],
    "system_just_number": [("system", "Answer with just the number."), ("user", "What is {a} + {b}?")],
    "only_final": [("user", "Calculate {a} + {b}. Give only the final answer as a number.")],
    "answer_is": [("user", 'What is {a} + {b}? Reply with "The answer is" and the number.')],
    # Few-shot as earlier chat turns: shows the answer format instead of describing it.
    "fewshot1": [("user", "What is 2 + 3? Answer with just the number."), ("assistant", "5"), ("user", _Q)],
    "fewshot2": [
        ("user", "What is 2 + 3? Answer with just the number."),
        ("assistant", "5"),
        ("user", "What is 7 + 6? Answer with just the number."),
        ("assistant", "13"),
        ("user", _Q),
    ],
}
_INT = re.compile(r"-?\d+")


def first_int_reward(completion: str, answer: int) -> float:
    match = _INT.search(completion)
    return float(match is not None and int(match.group()) == answer)


def last_int_reward(completion: str, answer: int) -> float:
    found = _INT.findall(completion)
    return float(bool(found) and int(found[-1]) == answer)


def messages(variant: str, a: int, b: int) -> list[dict[str, str]]:
    return [{"role": role, "content": text.format(a=a, b=b)} for role, text in VARIANTS[variant]]


def describe(variant: str) -> str:
    return " / ".join(f"{role}: {text}" for role, text in VARIANTS[variant])


def generate(
    model, tok, prompts: list[str], *, sample: bool, max_new_tokens: int, seed: int, temperature: float = 1.0
) -> list[str]:
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    # top_k=0: transformers otherwise applies its global default top_k=50 even at temperature 1.
    kwargs = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **kwargs)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or 'smollm2-135m' (default)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--show", type=int, default=3, help="example completions printed per variant")
    args = parser.parse_args()

    path: Path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # decoder-only: pad on the left so every row ends at its prompt
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    rng = random.Random(args.seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(args.prompts)]
    print(f"model={path} pairs={pairs} samples/prompt={args.samples} max_new_tokens={args.max_new_tokens}\n")

    rows = []
    for variant in args.variants:
        prompts = [
            tok.apply_chat_template(messages(variant, a, b), add_generation_prompt=True, tokenize=False)
            for a, b in pairs
        ]
        answers = [a + b for a, b in pairs]
        started = time.monotonic()
        sampled = generate(
            model,
            tok,
            [p for p in prompts for _ in range(args.samples)],
            sample=True,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            temperature=args.temperature,
        )
        t_sample = time.monotonic() - started
        started = time.monotonic()
        greedy = generate(model, tok, prompts, sample=False, max_new_tokens=args.max_new_tokens, seed=args.seed)
        t_greedy = time.monotonic() - started
        sample_answers = [ans for ans in answers for _ in range(args.samples)]
        first = [first_int_reward(c, ans) for c, ans in zip(sampled, sample_answers)]
        last = [last_int_reward(c, ans) for c, ans in zip(sampled, sample_answers)]
        per_prompt = [sum(first[i * args.samples : (i + 1) * args.samples]) / args.samples for i in range(len(pairs))]
        mixed = sum(0 < m < 1 for m in per_prompt)
        g_acc = sum(first_int_reward(c, ans) for c, ans in zip(greedy, answers)) / len(pairs)
        text = describe(variant)
        rows.append((variant, text, sum(first) / len(first), sum(last) / len(last), mixed, g_acc, t_sample, t_greedy))
        print(f"--- {variant}: {text!r}")
        for c in sampled[: args.show]:
            print(f"   sample: {c!r}")
        for c in greedy[: args.show]:
            print(f"   greedy: {c!r}")

    print(
        "\n| variant | messages (chat template) | mean reward (first int) | mean reward (last int) "
        "| prompts with mixed rewards | greedy acc | sample time (s) | greedy time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for variant, text, r1, r2, mixed, g, ts, tg in rows:
        print(f"| {variant} | `{text}` | {r1:.3f} | {r2:.3f} | {mixed}/{len(pairs)} | {g:.3f} | {ts:.1f} | {tg:.1f} |")


if __name__ == "__main__":
    main()
