"""TRL's SFTTrainer on a JSONL dataset: the baseline side of benchmarks/sft_vs_trl.py.

Runs in .venv-trl (scripts/install_trl.sh), not in the project's venv. SFTConfig as TRL
defaults it except where the comparison needs a setting: packing on (TRL's default strategy,
bfd: padding-free rows of `--max-length` with positions restarting at each example), fp32
compute (bf16=False; `--bf16` for TRL's CPU default, bf16 autocast), `--rows` packed rows a
step (per_device_train_batch_size 1, gradient accumulation `--rows`: one packed row a forward,
as the padding-free collator would otherwise concatenate several into one), the sampler
sequential (TRL's is random: a fixed order lets the other side train on the very same rows),
`--lr` with TRL's linear schedule, clip 1.0, AdamW (0.9, 0.999, 1e-8), no weight decay.

Prints one JSON line per optimizer step, {"step", "loss", "grad_norm", "t"}, where loss is the
Trainer's logged loss (logging every step: the sum of the micro-batches' losses, each
normalised by the step's count of trained tokens), and a final
{"done": true, "first_step_loss", "losses", "wall_s", "train_s", "train_cpu_s", "peak_rss_mb"}. With `--dump
FILE`, every micro-batch as the model saw it goes to FILE, one JSON line each: {"step",
"input_ids", "labels", "position_ids", "num_items_in_batch"}: what sft_vs_trl.py trains
rollstream's step on.

    .venv-trl/bin/python benchmarks/trl_sft.py --model MODEL_DIR --data FILE.jsonl --steps 8
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

STARTED = time.monotonic()


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def sft_config(args: argparse.Namespace, out: str):
    """TRL's defaults but for what the comparison sets (the module's docstring)."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=out,
        seed=args.seed,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        packing=True,
        max_length=args.max_length,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.rows,
        train_sampling_strategy="sequential",
        use_cpu=True,
        bf16=args.bf16,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
    )


def cpu_seconds() -> float:
    """This process's CPU time, user + system (sft_vs_trl.py's measure on a loaded machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local Hugging Face folder")
    p.add_argument("--data", required=True, help="a JSONL dataset (prompt/completion or messages, as TRL reads it)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5, help="TRL's default")
    p.add_argument("--lr-scheduler", default="linear", help="TRL's default")
    p.add_argument("--max-length", type=int, default=512, help="the packed rows' length")
    p.add_argument("--rows", type=int, default=4, help="packed rows a step (gradient accumulation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dump", default="", help="write every micro-batch here (JSON lines)")
    p.add_argument("--bf16", action="store_true", help="TRL's own default on the CPU: bf16 autocast over fp32 weights")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTTrainer

    data = load_dataset("json", data_files=args.data, split="train")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dump = open(args.dump, "w") if args.dump else None  # closed after training
    losses: list[float] = []

    class Recording(SFTTrainer):
        """SFTTrainer, writing each micro-batch's inputs down before its loss (nothing else changes)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if dump is not None and model.training:
                record = {
                    "step": self.state.global_step + 1,
                    **{k: inputs[k][0].tolist() for k in ("input_ids", "labels", "position_ids")},
                    "num_items_in_batch": int(num_items_in_batch) if num_items_in_batch is not None else None,
                }
                dump.write(json.dumps(record) + "\n")
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Steps(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                emit(
                    {
                        "step": state.global_step,
                        "loss": float(logs["loss"]),
                        "grad_norm": float(logs.get("grad_norm", 0.0)),
                        "t": round(time.monotonic() - STARTED, 2),
                    }
                )

    with tempfile.TemporaryDirectory(prefix="trl-sft-") as out:
        trainer = Recording(
            model=model, args=sft_config(args, out), train_dataset=data, processing_class=tokenizer, callbacks=[Steps()]
        )
        train_started, cpu_started = time.monotonic(), cpu_seconds()
        trainer.train()
        train_s, train_cpu_s = time.monotonic() - train_started, cpu_seconds() - cpu_started
    if dump is not None:
        dump.close()
    emit(
        {
            "done": True,
            "first_step_loss": losses[0] if losses else None,
            "losses": losses,
            "wall_s": round(time.monotonic() - STARTED, 2),
            "train_s": round(train_s, 2),
            "train_cpu_s": round(train_cpu_s, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    )


if __name__ == "__main__":
    main()
