"""`rollstream sft`'s held-out score (trainer/sft_eval.py) on the demo's task: the model as
loaded and after a few SFT steps, on the same held-out prompts, with what a round costs.

    .venv/bin/python benchmarks/sft_held_out_score.py [--model smollm2-135m] [--examples 400] [--steps 6]

The dataset: `--examples` sums of prompts.arithmetic(seed 7), each a chat answered "The answer
is S." with `answer` S (the warm start's format, plus the answer). `rollstream sft` holds out
eval_fraction 0.2 of the packed rows, trains `--steps` steps and scores `--prompts` held-out
prompts after the last (the launcher's scorer: the reward's recipes in its worker pool). The
model as loaded then completes the same prompts (sft_eval.generate, the same batch) and the
reward recipes score them here. Prints one JSON object: the run's eval line, each step's
seconds, the raw model's score and generation seconds, and the load average. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def dataset(path: Path, n: int) -> list[dict[str, Any]]:
    from rollstream.trainer import prompts

    rows = []
    for p in prompts.arithmetic(7):
        turns = [{"role": r, "content": c} for r, c in p.messages]
        rows.append({"messages": [*turns, {"role": "assistant", "content": f"The answer is {p.answer}."}], "answer": p.answer})  # fmt: skip
        if len(rows) == n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def raw_score(model_dir: str, rows: list[dict[str, Any]], done: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    """The model as loaded on the run's held-out prompts, scored by the reward recipes here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.reward.recipes import Sample, build_recipes, default_specs
    from rollstream.trainer import sft_eval

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chats = [rows[d["row"]]["messages"][:-1] for d in done]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"] for c in chats]
    started = time.perf_counter()
    out = sft_eval.generate(model, tokenizer, ids, args.max_new_tokens, args.batch, "cpu")
    seconds = time.perf_counter() - started
    recipes = build_recipes(default_specs(), None)
    scores = [recipes.score("arithmetic", Sample(c.text, d["answer"])) for c, d in zip(out, done, strict=True)]
    right = [next(x.value for x in s.components if x.name == "answer") >= 1 for s in scores]
    return {
        "reward_mean": sum(s.reward for s in scores) / len(scores),
        "accuracy": sum(right) / len(right),
        "completion_tokens": sum(len(c.token_ids) for c in out) / len(out),
        "generate_s": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from rollstream.core.models import resolve_model
    from rollstream.launcher import cli

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory(prefix="sft-held-out-") as tmp:
        work = Path(tmp)
        rows = dataset(work / "data.jsonl", args.examples)
        flags = ["--sft.max-steps", args.steps, "--sft.eval-fraction", 0.2, "--sft.eval-every", args.steps,
                 "--sft.eval-prompts", args.prompts, "--sft.eval-max-new-tokens", args.max_new_tokens,
                 "--sft.eval-batch-size", args.batch, "--sft.threads", args.threads, "--sft.lr", 5e-5,
                 "--sft.batch-rows", 2, "--sft.max-length", 256]  # fmt: skip
        paths = ["--dataset", work / "data.jsonl", "--out", work / "out", "--workdir", work / "run"]
        code = cli.main_code([str(x) for x in ["sft", "--model", model_dir, *paths, *flags]])
        if code != 0:
            raise SystemExit(f"rollstream sft exited {code}")
        lines = [json.loads(line) for line in (work / "run" / "steps.jsonl").read_text().splitlines()]
        evals = [r for r in lines if r.get("kind") == "eval"]
        done_path = work / "run" / "held_out" / f"{evals[-1]['step']:08d}.jsonl"
        done = [json.loads(line) for line in done_path.read_text().splitlines()]
        raw = raw_score(model_dir, rows, done, args)
    report = {
        "model": model_dir,
        "eval": {k: v for k, v in evals[-1].items() if k.startswith("eval_")},
        "step_seconds": [r["seconds"] for r in lines if "kind" not in r],
        "raw": raw,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
