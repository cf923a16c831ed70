"""rollstream's SFT step against TRL 1.16's SFTTrainer on the same rows: the first step's
loss, the loss curve, wall time and peak memory, side by side.

    bash scripts/install_trl.sh                      # once: TRL 1.16 in .venv-trl
    .venv/bin/python benchmarks/sft_vs_trl.py [--seeds 0 1] [--steps 6] [--examples 256]

Per seed, the dataset is the demo's arithmetic prompts (the seed's stream, in order) with
the answer in the format the `arithmetic` recipe wants, as TRL's conversational
prompt/completion JSONL. TRL (benchmarks/trl_sft.py, in .venv-trl) trains on it: packing
(bfd, `--max-length`), fp32, `--rows` packed rows a step, lr `--lr` linear to 0, clip 1.0,
AdamW (0.9, 0.999, 1e-8), and writes every micro-batch down as its model saw it. rollstream
then trains on those very rows (each a PackedRow, its examples from the restarting
positions) with trainer.sft_step.sft_step and HostAdamW as the trainer builds it (the
trainer's defaults: bf16 moments, and for a float32 model its parameters as the fp32 masters;
the same lr schedule; the first step on the checkpoint's weights as loaded, as TRL's), in a process of its own (`--ours DUMP`). So the two sides differ only in the step: the loss, its normalisation
(TRL's num_items_in_batch against our count of trained tokens, step by step), the forward
and the optimizer. TRL runs first each seed: our side needs its rows (until sft_data's own
rows are compared, this cannot alternate).

Prints one JSON object: per seed each side's first-step loss, losses, grad norms, wall and
train seconds and peak RSS (the process's own ru_maxrss), the first step's relative loss
difference (the bar: 1e-5), and whether the token counts agreed. Not part of CI (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STARTED = time.monotonic()


def write_dataset(path: Path, seed: int, examples: int) -> None:
    """The demo's arithmetic tasks as TRL's conversational prompt/completion rows."""
    from rollstream.trainer import prompts

    source = prompts.arithmetic(seed=seed)
    with path.open("w") as f:
        for _ in range(examples):
            task = next(source)
            row = {
                "prompt": [{"role": role, "content": content} for role, content in task.messages],
                "completion": [{"role": "assistant", "content": f"The answer is {task.answer}."}],
            }
            f.write(json.dumps(row) + "\n")


def dumped_steps(path: Path) -> tuple[list[list], list[int | None]]:
    """trl_sft.py's micro-batches grouped by step as PackedRows (an example starts wherever
    the position goes back to 0), and TRL's num_items_in_batch of each step."""
    from rollstream.trainer.sft_data import PackedRow

    steps: dict[int, list[PackedRow]] = {}
    counts: dict[int, int | None] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        starts = [t for t, p in enumerate(record["position_ids"]) if p == 0] + [len(record["position_ids"])]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        row = PackedRow(record["input_ids"], record["labels"], lengths, list(range(len(lengths))))
        steps.setdefault(record["step"], []).append(row)
        counts[record["step"]] = record["num_items_in_batch"]
    order = sorted(steps)
    return [steps[k] for k in order], [counts[k] for k in order]


def run_ours(args: argparse.Namespace) -> None:
    """The rollstream side, in this process: the dumped rows, step by step."""
    import torch

    from rollstream.core import cpu_runtime
    from rollstream.core.models import resolve_model
    from rollstream.trainer import lora, packed_attention
    from rollstream.trainer.config import TrainerSettings
    from rollstream.trainer.sft_step import SftStepConfig, sft_step

    cpu_runtime.fixed_mmap_threshold()  # as the trainer does
    torch.set_num_threads(args.threads)
    s = TrainerSettings()
    steps, counts = dumped_steps(Path(args.ours))
    model, tokenizer, _, params = lora.load(
        str(resolve_model(args.model)), args.dtype, "cpu", None, args.checkpointing, args.checkpoint_every
    )
    if not args.sdpa:
        packed_attention.use(model)  # as `rollstream sft`: each example attended on its own
    model.train()
    # As `rollstream sft` builds it on the CPU (the shared settings' host_adamw; their betas,
    # decay and eps are TRL's): a float32 model's parameters are the fp32 masters (stepped in
    # place), a bfloat16 one computes on their bf16 rounding (split masters).
    moments = {"moments_dtype": args.moments_dtype} if args.moments_dtype else {}
    optimizer = s.model_copy(update={"lr": args.lr, **moments}).host_adamw(params, in_model=args.dtype == "float32")
    # No sync_model: the first step computes with the checkpoint's weights as loaded, as TRL's
    # does (the masters hold them exactly). (GRPO rounds at version 0 so that the generator
    # computes with the same weights; an SFT run has no generator. SmolLM2's converted weights
    # are not all bf16-exact: rounded first, the first loss differs from TRL's by 0.7 %.)
    cfg = SftStepConfig(token_budget=args.token_budget, chunk_tokens=s.chunk_tokens, max_grad_norm=1.0, device="cpu")
    records = []
    train_started, cpu_started = time.monotonic(), cpu_seconds()
    for k, (rows, count) in enumerate(zip(steps, counts)):
        optimizer.lr = args.lr * (len(steps) - k) / len(steps)  # TRL's linear schedule, no warmup
        # As `rollstream sft` runs it: the update overlapped with the next step's forward.
        r = sft_step(model, optimizer, rows, cfg, pad_id=tokenizer.pad_token_id, background=True)
        records.append(
            {
                "step": k + 1,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "tokens": r.tokens,
                "trl_tokens": count,
                "micro_batches": r.micro_batches,
                "forward_s": round(r.forward_s, 3),
                "backward_s": round(r.backward_s, 3),
                "optimizer_s": round(r.optimizer_s, 3),
            }
        )
        print(json.dumps(records[-1]), flush=True)
    optimizer.wait()  # the last update, overlapped with nothing
    train_s, train_cpu_s = time.monotonic() - train_started, cpu_seconds() - cpu_started
    result = {
        "done": True,
        "first_step_loss": records[0]["loss"],
        "losses": [x["loss"] for x in records],
        "grad_norms": [x["grad_norm"] for x in records],
        "tokens_agree": all(x["tokens"] == x["trl_tokens"] for x in records),
        "wall_s": round(time.monotonic() - STARTED, 2),
        "train_s": round(train_s, 2),
        "train_cpu_s": round(train_cpu_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(result), flush=True)


def cpu_seconds() -> float:
    """This process's CPU time (user + system, all threads): on a loaded machine a steadier
    measure of the work than wall time, which counts the time other processes held the cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def last_json(stdout: str, what: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("done"):
                return record
    raise RuntimeError(f"{what} printed no result")


def per_step(stdout: str, key: str) -> list[float]:
    return [json.loads(x)[key] for x in stdout.splitlines() if x.startswith('{"step"')]


def run_child(cmd: list[str], threads: int, what: str) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return last_json(done.stdout, what), done.stdout


def one_seed(args: argparse.Namespace, model: str, seed: int, folder: Path) -> dict:
    data, dump = folder / f"data-{seed}.jsonl", folder / f"rows-{seed}.jsonl"
    write_dataset(data, seed, args.examples)
    common = ["--model", model, "--steps", str(args.steps), "--lr", str(args.lr), "--threads", str(args.threads)]
    trl_python = REPO / args.trl_venv / "bin" / "python"
    if not trl_python.exists():
        sys.exit(f"{trl_python} is missing: run `bash scripts/install_trl.sh` first")
    trl, trl_out = run_child(
        [
            str(trl_python),
            str(REPO / "benchmarks" / "trl_sft.py"),
            *common,
            "--data",
            str(data),
            "--max-length",
            str(args.max_length),
            "--rows",
            str(args.rows),
            "--dump",
            str(dump),
            *(["--bf16"] if args.trl_bf16 else []),
        ],
        args.threads,
        "TRL",
    )
    trl["grad_norms"] = per_step(trl_out, "grad_norm")
    ours_cmd = [sys.executable, __file__, *common, "--ours", str(dump), "--token-budget", str(args.token_budget)]
    ours_cmd += ["--checkpointing", "--checkpoint-every", str(args.checkpoint_every)] if args.checkpointing else []
    ours_cmd += ["--dtype", args.dtype] + (["--sdpa"] if args.sdpa else [])
    ours_cmd += ["--moments-dtype", args.moments_dtype] if args.moments_dtype else []
    ours, _ = run_child(ours_cmd, args.threads, "rollstream")
    first = abs(ours["first_step_loss"] - trl["first_step_loss"]) / abs(trl["first_step_loss"])
    return {"seed": seed, "trl": trl, "rollstream": ours, "first_step_loss_rel_diff": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="a local Hugging Face folder (default: the demo's SmolLM2-135M-Instruct)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--rows", type=int, default=2, help="packed rows a step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=4096, help="rollstream's padded tokens per micro-batch")
    p.add_argument(
        "--checkpointing", action="store_true", help="rollstream with activation checkpointing (TRL's default)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="with --checkpointing: recompute every k-th decoder layer only (modeling.checkpoint_layers)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="rollstream's compute dtype (bfloat16: the model's weights and activations, as TRL's --trl-bf16 autocasts)",
    )
    p.add_argument(
        "--moments-dtype", choices=["float32", "bfloat16"], default=None, help="rollstream's (the trainer's default)"
    )
    p.add_argument(
        "--sdpa", action="store_true", help="rollstream on transformers' SDPA and its block-diagonal mask instead"
    )
    p.add_argument(
        "--trl-bf16", action="store_true", help="TRL at its CPU default, bf16 autocast (its first loss then differs)"
    )
    p.add_argument("--trl-venv", default=".venv-trl")
    p.add_argument("--ours", default="", help=argparse.SUPPRESS)  # the rollstream side's child: trl_sft.py's dump
    args = p.parse_args()
    if args.ours:
        run_ours(args)
        return
    from rollstream.core.models import resolve_model

    model = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory(prefix="sft-vs-trl-") as folder:
        runs = [one_seed(args, model, seed, Path(folder)) for seed in args.seeds]
    print(json.dumps({"runs": runs, "settings": {k: v for k, v in vars(args).items() if k != "ours"}}, indent=1))


if __name__ == "__main__":
    main()
