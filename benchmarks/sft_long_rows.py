"""An SFT row of one long example on the CPU: peak memory and time of its forward and backward
without an attention mask (sft_data.packed_batch: causal attention, SDPA's is_causal) against
the additive [1, 1, T, T] block-diagonal mask packed_batch built before (modeling.segment_mask),
the same row through the same model (issue 46).

    .venv/bin/python benchmarks/sft_long_rows.py --model smollm2-135m --lengths 4096,8192 --threads 2
    .venv/bin/python benchmarks/sft_long_rows.py --size tiny --lengths 8192,16384,32768

Each (length, attention) runs in a child process of its own, so that its peak resident set
(ru_maxrss) is its own: the model loaded, activation checkpointing on as the trainer has it,
one row of `length` random tokens, all trained, through the chunked LM head
(modeling.completion_logprobs), the loss's backward. Reports per run the peak RSS, its rise
over the loaded model, seconds, and the loss (equal between the two, to float rounding: the
same attention). Prints JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import torch

from rollstream.core import modeling
from rollstream.trainer.sft_data import PackedRow, packed_batch
from shapes import SIZES, build_model  # benchmarks/shapes.py

ATTENTION = ("none", "mask")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    """The model (float32, training with activation checkpointing) and its vocabulary size."""
    if args.model:
        from rollstream.core.models import resolve_model

        model, _ = modeling.load_model(resolve_model(args.model))
    else:
        model = build_model(args.size, torch.device("cpu"), torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, model.get_input_embeddings().weight.shape[0]


def child(args: argparse.Namespace) -> dict[str, Any]:
    model, vocab = load(args)
    loaded = peak_rss_gib()
    ids = torch.randint(0, vocab, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = packed_batch([PackedRow(ids, list(ids), [args.length], [0])], pad_id=0)
    if args.attention == "mask":  # what packed_batch passed before: one segment, padding none
        segment = torch.zeros((1, args.length), dtype=torch.long)
        batch = dataclasses.replace(batch, attention_mask=modeling.segment_mask(segment, torch.float32))
    start = time.perf_counter()
    logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=1024)
    loss = -logp.mean()
    loss.backward()
    seconds = time.perf_counter() - start
    peak = peak_rss_gib()
    return {
        "length": args.length,
        "attention": args.attention,
        "loss": round(float(loss), 6),
        "seconds": round(seconds, 2),
        "peak_rss_gib": round(peak, 3),
        "over_the_model_gib": round(peak - loaded, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or alias (rollstream.core.models)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="without --model: a random Qwen2 shape")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--attention", choices=ATTENTION, default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args)))
        return
    base = [sys.executable, __file__, "--size", args.size, "--threads", str(args.threads), "--child"]
    base += ["--model", args.model] if args.model else []
    runs = []
    for length in map(int, args.lengths.split(",")):
        for attention in ATTENTION:
            proc = subprocess.run(
                [*base, "--length", str(length), "--attention", attention], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:  # the killer's SIGKILL (-9) is how running out of memory ends
                runs.append(
                    {"length": length, "attention": attention, "failed": proc.returncode, "stderr": proc.stderr[-500:]}
                )
            else:
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    out = {
        "benchmark": "sft_long_rows",
        "model": args.model or args.size,
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "runs": runs,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
