"""TRL's GRPOTrainer on the demo task: the baseline side of benchmarks/vs_trl.py.

Runs in .venv-trl (scripts/install_trl.sh), not in the project's venv. The tasks are the
demo's (rollstream.trainer.prompts.arithmetic, the seed-0 stream, in order: TRL's shuffling
is off) and the reward is the reward service's own `arithmetic` recipe (answer + 0.1 x
format), imported from the installed packages, so both sides see the same prompts and the same
reward by construction. Prints one JSON line per optimizer step to stdout:

  {"step": 1, "reward": 0.2, "reward_std": ..., "t": seconds since start, "step_s": ...}

and a final {"done": true, "wall_s": ..., "load_s": ...}.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model MODEL_DIR --seed 0 --steps 15
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

STARTED = time.monotonic()


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder (vs_trl.py resolves the demo's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--lr-scheduler",
        default="linear",
        help="TRL's default (linear decay to 0 over --steps); 'constant' as rollstream",
    )
    p.add_argument("--loss-type", default="dapo", help="TRL 1.16's default")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: TRL's own choice of the GPU (accelerate), fp32 as on the CPU",
    )
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollstream.reward.recipes import Sample, build_recipes, default_specs
    from rollstream.trainer import prompts

    completions_per_step = args.group_size * args.groups_per_step
    if completions_per_step % args.micro_batch:
        sys.exit(f"--micro-batch {args.micro_batch} must divide {completions_per_step} completions a step")
    source = prompts.arithmetic(seed=0)
    # Enough tasks for every step; TRL repeats each prompt group_size times itself.
    tasks = [next(source) for _ in range(args.steps * args.groups_per_step)]
    data = Dataset.from_list(
        [
            {"prompt": [{"role": r, "content": c} for r, c in t.messages], "answer": t.answer, "task_kind": t.task_kind}
            for t in tasks
        ]
    )
    recipes = build_recipes(default_specs(), None)

    def reward(completions: list, answer: list[str], task_kind: list[str], **_: object) -> list[float]:
        return [
            recipes.score(k, Sample(completion=c[0]["content"], answer=a)).reward
            for c, a, k in zip(completions, answer, task_kind, strict=True)
        ]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.monotonic() - STARTED

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.last = time.monotonic()

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "reward" in logs:
                now = time.monotonic()
                emit(
                    {
                        "step": state.global_step,
                        "reward": logs["reward"],
                        "reward_std": logs.get("reward_std"),
                        "t": round(now - STARTED, 2),
                        "step_s": round(now - self.last, 2),
                    }
                )
                self.last = now

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out:
        config = GRPOConfig(
            output_dir=out,
            seed=args.seed,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type=args.lr_scheduler,
            beta=0.0,
            max_grad_norm=1.0,
            loss_type=args.loss_type,
            num_generations=args.group_size,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=completions_per_step // args.micro_batch,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            shuffle_dataset=False,
            use_cpu=args.device == "cpu",
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[Steps()],
        )
        trainer.train()
    emit({"done": True, "wall_s": round(time.monotonic() - STARTED, 2), "load_s": round(load_s, 2), "pid": os.getpid()})


if __name__ == "__main__":
    main()
