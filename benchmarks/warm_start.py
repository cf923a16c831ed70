"""The demo from the raw model against the demo with `--warm-start N` (issue 46): steps and seconds to 0.85.

    .venv/bin/python benchmarks/warm_start.py --seeds 0 1 2 [--examples 300] [--steps 10] [--keep DIR]

Each seed runs `rollstream up` twice, as a user would (the demo profile: embedded Redis, the
trainer with the generator in its process, the reward service, SmolLM2-135M-Instruct), once
from the raw model and once with `--warm-start N` (launcher/warm_start.py: N generated examples
of the answer format, `rollstream sft`, then GRPO from its model), with `--generator.seed SEED`
(the warm start's SFT row order too). Seeds interleave and the arm that goes first alternates,
so drift in a shared machine's load favours neither. Per run: the mean reward by step, the
first step with mean reward >= 0.85 and the seconds from launch to its end (the warm start's
SFT included), the SFT's own seconds, and the held-out accuracy (greedy, 32 sums never in the
warm start's examples) before the first GRPO step (for the warm arm: after the SFT) and after
the last. Prints one JSON object; the load average beside each run. Not part of CI (minutes a run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_trl.py: the same step and held-out readers
from vs_trl import LEVELS, first_step_at, first_time_at, held_out_rounds, median_or_none


def run_up(seed: int, examples: int, steps: int, root: Path, up_args: list[str]) -> dict:
    """One `rollstream up` (examples 0: from the raw model) in root/<arm>-<seed>; its result."""
    arm = f"warm-{examples}" if examples else "raw"
    workdir = root / f"{arm}-{seed}"
    cmd = [sys.executable, "-m", "rollstream.launcher.cli", "up", "--trainer.steps", str(steps),
           "--generator.seed", str(seed), "--run", f"ws-{arm}-{seed}", "--workdir", str(workdir),
           *(["--warm-start", str(examples)] if examples else []), *up_args]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started_wall, started = time.time(), time.monotonic()
    with (root / f"{arm}-{seed}.log").open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - started
    steplog = workdir / "steps.jsonl"
    records = (
        [json.loads(line) for line in steplog.read_text().splitlines() if line.strip()] if steplog.exists() else []
    )
    if done.returncode != 0 or not records:
        raise RuntimeError(
            f"rollstream up exited with {done.returncode}: {' '.join(cmd)} (log: {root / arm}-{seed}.log)"
        )
    by_step = {int(r["step"]): r for r in records if "kind" not in r}  # a replayed step keeps its last record
    curve = [{"step": k, "reward": by_step[k]["reward_mean"], "t": round(by_step[k]["time"] - started_wall, 1)}
             for k in sorted(by_step)]  # fmt: skip
    record = workdir / "warm-start" / "warm-start.json"
    out: dict = {
        "arm": arm,
        "seed": seed,
        "reward_by_step": [round(s["reward"], 3) for s in curve],
        "wall_s": round(wall, 1),
        "sft_s": json.loads(record.read_text())["seconds"] if examples else 0.0,
        "load_avg": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "held_out_accuracy": {
            str(r["step"]): r["accuracy"] for r in held_out_rounds(records, workdir / "logs", started_wall)
        },
    }
    for level in LEVELS:
        out[f"step_at_{level}"] = first_step_at(curve, level)
        out[f"s_to_{level}"] = first_time_at(curve, level)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--examples", type=int, default=300, help="the warm start's examples (up --warm-start)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps of each run (the demo reaches 0.85 in 5-6)")
    parser.add_argument("--keep", default="", help="keep the runs' folders here (default: a temporary folder)")
    parser.add_argument("--only", choices=["raw", "warm"], default="", help="one arm (a seed's two arms run apart)")
    parser.add_argument("--up-arg", action="append", default=[], help="passed on to `rollstream up` (repeatable)")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(args.seeds):
            arms = [0, args.examples] if i % 2 == 0 else [args.examples, 0]
            arms = [a for a in arms if not args.only or (a > 0) == (args.only == "warm")]
            runs += [run_up(seed, examples, args.steps, root, args.up_arg) for examples in arms]
    by_arm: dict[str, dict] = {}
    for arm in sorted({r["arm"] for r in runs}):
        mine = [r for r in runs if r["arm"] == arm]
        by_arm[arm] = {
            f"median_{key}": median_or_none([r[key] for r in mine])
            for key in ("step_at_0.85", "s_to_0.85", "sft_s", "wall_s")
        }
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "examples": args.examples,
        "steps": args.steps,
        "runs": runs,
        "medians": by_arm,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
