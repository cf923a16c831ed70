"""rollstream against TRL's GRPOTrainer on the same box: time to reward, side by side.

    bash scripts/install_trl.sh                      # once: TRL 1.16 in .venv-trl
    .venv/bin/python benchmarks/vs_trl.py --seeds 0 1 2 [--steps 15] [--only trl|rollstream]

Both sides train SmolLM2-135M-Instruct (fp32 compute) on the demo's task: the seed-0
arithmetic prompt stream in order, 8 prompts x 8 completions of up to 16 tokens a step,
lr 2e-5, beta 0, gradient clipping 1.0, 2 threads, the reward service's `arithmetic` recipe.
TRL runs benchmarks/trl_grpo.py in .venv-trl; rollstream runs `rollstream up` as a user
would (embedded Redis, the trainer with the generator in its process as the demo profile
colocates it, the reward service), with `--seed` as the generator's sampling seed. Any
`--up-arg` is passed on to `up` (for example `--up-arg=--colocate=off` for the separate
services, `--up-arg=--trainer.token-budget=384`); `rollstream config` shows what a run uses.

The systems run one after the other, alternating which goes first from seed to seed, so
slow drift in the machine's load does not favour one side. Every process's resident memory
is sampled every 0.25 s (psutil, the process and its descendants), with the kernel's own
peak (VmHWM), so a peak between two samples still counts. Prints one JSON object:
per system and seed the reward by step, the seconds from launch to the end of the first step
with mean reward >= 0.85 and >= 0.95 (model load included), seconds per step, the wall time and
the peak RSS of every process; then the medians over seeds. Not part of CI (minutes per run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
LEVELS = (0.85, 0.95)
# The trainer's step log fields that time an update (steplog.py).
UPDATE_TIMES = ("step_seconds", "forward_s", "backward_s", "optimizer_s", "delta_encode_s", "push_s", "commit_s")


@dataclass
class MemoryWatch:
    """Peak RSS by process (name + pid) of a process tree, sampled on a thread; with `gpu`,
    also each process's GPU memory as nvidia-smi reports it (its own allocations plus its
    CUDA context)."""

    root: int
    period_s: float = 0.25
    gpu: bool = False
    peaks: dict[str, int] = field(default_factory=dict)
    gpu_peaks: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "MemoryWatch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            on_gpu = gpu_memory() if self.gpu else {}
            for p in procs:
                try:
                    key = f"{label(p)}[{p.pid}]"
                    self.peaks[key] = max(self.peaks.get(key, 0), p.memory_info().rss, peak_rss(p.pid))
                    if p.pid in on_gpu:
                        self.gpu_peaks[key] = max(self.gpu_peaks.get(key, 0), on_gpu[p.pid])
                except psutil.Error:
                    pass


def gpu_memory() -> dict[int, int]:
    """Bytes of GPU memory by pid, from nvidia-smi; empty where it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    usage = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            usage[int(pid)] = int(mib) * 2**20
    return usage


def peak_rss(pid: int) -> int:
    """The kernel's own peak resident set of a process (VmHWM), in bytes: a peak shorter than
    the sampling period still counts. 0 where it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def label(p: psutil.Process) -> str:
    """A readable name: the rollstream service, redis-server, node, or the program."""
    cmd = p.cmdline()
    for service in ("trainer", "generator", "reward", "reference"):
        if service in cmd[1:4] or any(a.endswith(f"rollstream.{service}") for a in cmd[:4]):
            return service
    if cmd and "redis-server" in cmd[0]:
        return "redis-server"
    if any(a.endswith("trl_grpo.py") for a in cmd[:3]):
        return "trl"
    if any(a == "up" for a in cmd[1:4]):
        return "up"
    return Path(cmd[0]).name if cmd else p.name()


def json_object(line: str) -> dict | None:
    """A JSON object line of trl_grpo.py, or None (transformers prints its own dicts, not JSON)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def first_time_at(steps: list[dict], level: float) -> float | None:
    return next((s["t"] for s in steps if s["reward"] >= level), None)


def first_step_at(steps: list[dict], level: float) -> int | None:
    return next((s["step"] for s in steps if s["reward"] >= level), None)


def run_trl(args: argparse.Namespace, model: str, seed: int) -> dict:
    python = Path(args.trl_python) if args.trl_python else REPO / args.trl_venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"{python} is missing: run `bash scripts/install_trl.sh` first")
    cmd = [
        str(python),
        str(REPO / "benchmarks" / "trl_grpo.py"),
        "--model",
        model,
        "--seed",
        str(seed),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--device",
        args.device,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    with MemoryWatch(proc.pid, gpu=args.device == "cuda") as watch:
        lines = [record for line in proc.stdout or [] if (record := json_object(line)) is not None]
        proc.wait()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"TRL exited with {proc.returncode}: {' '.join(cmd)}")
    steps = [
        {"step": s["step"], "reward": s["reward"], "t": s["t"], "step_s": s["step_s"]} for s in lines if "step" in s
    ]
    return result("trl", seed, steps, wall, watch.peaks, watch.gpu_peaks if args.device == "cuda" else None)


def run_rollstream(args: argparse.Namespace, model: str, seed: int, evaluate: bool = True) -> dict:
    """`rollstream up` on one seed; with evaluate False, held-out evaluation off (--eval-cost)."""
    python = sys.executable  # rollstream's side runs from the venv running this script
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as workdir:
        cmd = [
            python,
            "-m",
            "rollstream.launcher.cli",
            "up",
            "--model",
            model,
            "--trainer.steps",
            str(args.steps),
            "--generator.seed",
            str(seed),
            "--run",
            f"vs-trl-{seed}",
            "--workdir",
            workdir,
            "--trainer.max-new-tokens",
            str(args.max_new_tokens),
            *(f"--{service}.device={args.device}" for service in ("trainer", "generator", "reference")),
            *args.up_arg,
            *([] if evaluate else ["--trainer.eval-prompts=0"]),
        ]
        started_wall = time.time()
        started = time.monotonic()
        up_log = Path(workdir) / "up.log"
        with up_log.open("wb") as stderr:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ)
            with MemoryWatch(proc.pid, gpu=args.device == "cuda") as watch:
                proc.wait()
        wall = time.monotonic() - started
        log = Path(workdir) / "steps.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        if proc.returncode != 0 or not records:
            tail = "\n".join(up_log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(
                f"rollstream up exited with {proc.returncode} ({len(records)} steps): {' '.join(cmd)}\n{tail}"
            )
        held_out = held_out_rounds(records, Path(workdir) / "logs", started_wall)
    # The step log's wall time is the step's end; a replayed step (trainer restart) keeps the last record.
    # Held-out rounds are lines of their own ("kind": "eval", core/steplog.py): not steps.
    by_step = {int(r["step"]): r for r in records if "kind" not in r}
    steps, last = [], started_wall
    for k in sorted(by_step):
        r = by_step[k]
        steps.append(
            {
                "step": k,
                "reward": r["reward_mean"],
                "t": round(r["time"] - started_wall, 2),
                "step_s": round(r["time"] - last, 2),
                "staleness": r.get("mean_staleness"),
                # The update alone (step_s less this is the wait for groups) and its phases.
                **{key: r[key] for key in UPDATE_TIMES if key in r},
            }
        )
        last = r["time"]
    out = result(
        "rollstream", seed, steps, wall, watch.peaks, watch.gpu_peaks if args.device == "cuda" else None, held_out
    )
    out["eval"] = evaluate
    return out


def log_events(logs: Path, services: tuple[str, ...]) -> list[tuple[float, str, dict[str, str]]]:
    """The event lines of `services` in the run's logs (text format: `ts level service event k=v ...`),
    as (seconds since the epoch, event, fields), in time order."""
    events = []
    for path in sorted(logs.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            head = line.split(maxsplit=4)
            if len(head) < 4 or not head[0][:4].isdigit() or head[2] not in services:
                continue  # a traceback's, a library's or another service's line
            try:
                ts = time.mktime(time.strptime(head[0][:19], "%Y-%m-%dT%H:%M:%S")) + float(
                    head[0][19:] or 0
                )  # local time, as logs.py writes it
                fields = dict(kv.split("=", 1) for kv in shlex.split(head[4]) if "=" in kv) if len(head) > 4 else {}
            except ValueError:
                continue
            events.append((ts, head[3], fields))
    return sorted(events, key=lambda e: e[0])


def held_out_rounds(records: list[dict], logs: Path, started_wall: float) -> list[dict]:
    """The run's held-out rounds from the step log's eval lines, each with `t` (seconds from launch
    to its report) and `seconds`: from the generator's or trainer's last logged event before its
    first evaluation batch was written (the generator starts the batch then: a step's end, the
    batch before) to its `evaluated` line. None where the logs do not tell."""
    events = log_events(logs, ("generator", "trainer")) if logs.is_dir() else []
    rounds = []
    for r in sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"]):
        step = int(r["step"])
        marker = f"-eval-{step:08d}-"  # evaluation group ids: <run>-eval-<step>-<n> (trainer/evaluation.py)
        first = next(
            (i for i, (_, name, f) in enumerate(events) if name == "groups_written" and marker in f.get("groups", "")),
            None,
        )
        done = next((ts for ts, name, f in events if name == "evaluated" and f.get("step") == str(step)), None)
        seconds = round(done - events[first - 1][0], 2) if first and done is not None else None
        rounds.append(
            {
                "step": step,
                "version": r.get("eval_version"),
                "prompts": r.get("eval_prompts"),
                "samples": r.get("eval_samples"),
                "accuracy": r.get("eval_accuracy"),
                "reward": r.get("eval_reward_mean"),
                "pass_at_k": r.get("eval_pass_at_k"),
                "completion_tokens": r.get("eval_completion_tokens"),
                "t": round(r["eval_time"] - started_wall, 2) if "eval_time" in r else None,
                "seconds": seconds,
            }
        )
    return rounds


def result(
    system: str,
    seed: int,
    steps: list[dict],
    wall: float,
    peaks: dict[str, int],
    gpu_peaks: dict[str, int] | None = None,
    held_out: list[dict] | None = None,
) -> dict:
    out: dict = {
        "system": system,
        "seed": seed,
        "reward_by_step": [round(s["reward"], 3) for s in steps],
        "wall_s": round(wall, 1),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],  # a shared machine's load moves these figures
        "step_s": [s["step_s"] for s in steps],
        "peak_rss_gb": {k: round(v / 1e9, 2) for k, v in sorted(peaks.items(), key=lambda kv: -kv[1])},
        "steps": steps,
    }
    if gpu_peaks is not None:
        out["peak_gpu_gb"] = {k: round(v / 1e9, 2) for k, v in sorted(gpu_peaks.items(), key=lambda kv: -kv[1])}
    for level in LEVELS:
        out[f"step_at_{level}"] = first_step_at(steps, level)
        out[f"s_to_{level}"] = first_time_at(steps, level)
    if held_out is not None:
        out["held_out"] = held_out
        out["held_out_accuracy"] = {
            str(r["step"]): r["accuracy"] for r in held_out
        }  # by step: before (0) and after (the last)
        out["held_out_s"] = (
            round(sum(r["seconds"] for r in held_out), 2) if all(r["seconds"] is not None for r in held_out) else None
        )
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}), file=sys.stderr, flush=True)
    return out


def median_or_none(values: list[float | None]) -> float | None:
    """The median, counting a run that never got there as slower than any that did."""
    if not values or sum(v is None for v in values) * 2 >= len(values):
        return None
    return statistics.median([v if v is not None else float("inf") for v in values])


def eval_cost(runs: list[dict]) -> dict:
    """What held-out evaluation costs the time to 0.85, seed by seed: seconds with it and without,
    their ratio, and the held-out accuracy before and after; then the median ratio. Both runs of
    a seed train the same bits, so the step-0 round's own seconds are what evaluation adds before
    0.85; `round_0_share` is them over the rest of the evaluated run's time to 0.85, a figure that
    a shared machine's load moves far less than the ratio of two runs minutes apart."""
    by_seed = []
    for seed in sorted({r["seed"] for r in runs if r["system"] == "rollstream"}):
        on = next((r for r in runs if r["system"] == "rollstream" and r["seed"] == seed and r["eval"]), None)
        off = next((r for r in runs if r["system"] == "rollstream" and r["seed"] == seed and not r["eval"]), None)
        if on is None or off is None:
            continue
        s_on, s_off = on["s_to_0.85"], off["s_to_0.85"]
        accuracy = list(on.get("held_out_accuracy", {}).values())
        first = next((r["seconds"] for r in on.get("held_out", []) if r["step"] == 0), None)
        by_seed.append(
            {
                "seed": seed,
                "s_to_0.85_eval": s_on,
                "s_to_0.85_no_eval": s_off,
                "ratio": round(s_on / s_off, 3) if s_on is not None and s_off else None,
                "step_at_0.85": [on["step_at_0.85"], off["step_at_0.85"]],
                "held_out_accuracy_before": accuracy[0] if accuracy else None,
                "held_out_accuracy_after": accuracy[-1] if len(accuracy) > 1 else None,
                "held_out_s": on.get("held_out_s"),
                "round_0_s": first,
                "round_0_share": round(first / (s_on - first), 3) if first is not None and s_on is not None else None,
            }
        )
    ratios = [s["ratio"] for s in by_seed if s["ratio"] is not None]
    shares = [s["round_0_share"] for s in by_seed if s["round_0_share"] is not None]
    return {
        "by_seed": by_seed,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "max_ratio": max(ratios, default=None),
        "max_round_0_share": max(shares, default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a local Hugging Face folder (default: the demo's SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="the generation budget of both sides (larger: generation outweighs training)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="TRL's torch threads (rollstream's follow `up`'s own rule)"
    )
    parser.add_argument("--only", choices=["trl", "rollstream"], default=None)
    parser.add_argument(
        "--eval-cost",
        action="store_true",
        help="rollstream twice a seed: held-out evaluation as set, and off (--trainer.eval-prompts=0)",
    )
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="passed on to `rollstream up` (repeatable; use --up-arg=--flag=value)",
    )
    parser.add_argument("--trl-venv", default=".venv-trl")
    parser.add_argument(
        "--trl-python",
        default="",
        help="run TRL with this Python instead of --trl-venv's (a machine where one Python has both)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: TRL on the GPU, and every rollstream service (--<service>.device); each process's GPU memory too (nvidia-smi)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "core" / "src"))
    from rollstream.core.models import resolve_model

    model = str(resolve_model(args.model))
    runs = []
    for i, seed in enumerate(args.seeds):
        order: list[str] = ["trl", "rollstream"] if i % 2 == 0 else ["rollstream", "trl"]
        for system in order:
            if args.only and system != args.only:
                continue
            if system == "trl":
                runs.append(run_trl(args, model, seed))
                continue
            # --eval-cost: evaluation on, then off at even seeds' turn, off then on at odd ones.
            for evaluate in ([True, False] if i % 2 == 0 else [False, True]) if args.eval_cost else [True]:
                runs.append(run_rollstream(args, model, seed, evaluate))
    summary = {}
    groups = {
        "trl": [r for r in runs if r["system"] == "trl"],
        "rollstream": [r for r in runs if r["system"] == "rollstream" and r["eval"]],
        "rollstream_eval_off": [r for r in runs if r["system"] == "rollstream" and not r["eval"]],
    }
    for system, mine in groups.items():
        if not mine:
            continue
        summary[system] = {
            **{f"median_s_to_{level}": median_or_none([r[f"s_to_{level}"] for r in mine]) for level in LEVELS},
            **{f"median_step_at_{level}": median_or_none([r[f"step_at_{level}"] for r in mine]) for level in LEVELS},
            "median_wall_s": statistics.median(r["wall_s"] for r in mine),
            "median_step_s": statistics.median(s for r in mine for s in r["step_s"][1:])
            if any(len(r["step_s"]) > 1 for r in mine)
            else None,
            "peak_rss_gb_max_process": max(max(r["peak_rss_gb"].values(), default=0) for r in mine),
        }
    if args.eval_cost:
        summary["eval_cost"] = eval_cost(runs)
    print(
        json.dumps(
            {
                "benchmark": "vs_trl",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "load_avg_at_end": os.getloadavg(),
                "steps": args.steps,
                "seeds": args.seeds,
                "max_new_tokens": args.max_new_tokens,
                "up_args": args.up_arg,
                "device": args.device,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
