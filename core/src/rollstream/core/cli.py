"""The `rollstream` command.

  rollstream up       the whole system as local processes: embedded redis-server (or
                      --redis-url), trainer, generator(s), reward, reference (when
                      beta > 0 and the trainer is not its own reference), with a live
                      progress display; Ctrl-C stops it all cleanly
  rollstream status   the pipeline of a run, read from Redis (--watch to follow)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from rollstream.core import codec, streams
from rollstream.core.redis_server import EmbeddedRedis
from rollstream.v1 import rollout_pb2


@dataclass
class Child:
    """One service process under `up`'s supervision; restarted if it dies unexpectedly."""

    name: str
    args: list[str]
    env: dict[str, str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / "logs" / f"{self.name}.log"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state" / f"{self.name}.json"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"rollstream.{self.args[0]}", *self.args[1:], "--state-file", str(self.state_file)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,  # Ctrl-C reaches `up` only
            )

    def grpc_address(self, timeout_s: float = 600.0) -> str:
        """Wait for the service's state file (written once it serves) and return its address."""
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start within {timeout_s}s; see {self.log_path}")
            time.sleep(0.2)
        return f"127.0.0.1:{json.loads(self.state_file.read_text())['grpc_port']}"

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Progress:
    steps: list[rollout_pb2.StepMetrics] = field(default_factory=list)
    last_id: bytes = b"0-0"

    def poll(self, client: redis.Redis, keys: streams.RunKeys) -> list[rollout_pb2.StepMetrics]:
        new = []
        for eid, fields in client.xrange(keys.metrics, min=b"(" + self.last_id, count=1000):
            self.last_id = eid
            new.append(codec.decode(fields, rollout_pb2.StepMetrics))
        self.steps.extend(new)
        return new


def _mean(xs: list[float], digits: int) -> float | None:
    """Rounded mean, or None (JSON null) when there is nothing to average."""
    return round(sum(xs) / len(xs), digits) if xs else None


def summary(steps: list[rollout_pb2.StepMetrics], wall_s: float) -> dict:
    rewards = [m.reward_mean for m in steps]
    return {
        "steps": len(steps),
        "wall_seconds": round(wall_s, 1),
        "reward_curve": [round(r, 4) for r in rewards],
        "first5_reward_mean": _mean(rewards[:5], 4),
        "last5_reward_mean": _mean(rewards[-5:], 4),
        "step_seconds": [round(m.step_seconds, 1) for m in steps],
        "train_tokens_per_s": _mean([m.train_tokens_per_s for m in steps], 1),
        "delta_fraction_of_dense": [round(m.delta_bytes / m.dense_bytes, 5) for m in steps if m.dense_bytes],
        "mean_staleness": _mean([m.mean_staleness for m in steps], 3),
    }


def cmd_up(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.kl_reference == "lora_base" and not args.lora_rank:
        console.print("[red]--kl-reference lora_base needs --lora-rank > 0: the reference is the base under the LoRA adapters[/]")
        return 2
    workdir = Path(args.workdir or f"runs/{args.run}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # Resolve (and on first use convert) the model once, before any service races to do it.
    from rollstream.core.models import resolve_model

    console.print(f"[bold]rollstream up[/] run={args.run} workdir={workdir}")
    model = str(resolve_model(args.model))
    console.print(f"model: {model}")
    embedded = None
    if args.redis_url:
        redis_url = args.redis_url
    else:
        embedded = EmbeddedRedis(workdir / "redis").start()
        redis_url = embedded.url
        console.print(f"embedded redis-server: {redis_url} (data in {workdir / 'redis'})")
    client = streams.connect(redis_url)
    keys = streams.RunKeys(args.run)
    if args.fresh:
        stale_keys = list(client.scan_iter(match=f"rs:{args.run}:*"))
        if stale_keys:
            client.delete(*stale_keys)
    # The trainer's step is the long pole: it gets every core. Generation of the next batch
    # overlaps with it, so the generators (and the reference) get half.
    cores = os.cpu_count() or 2
    trainer_threads = str(args.threads or cores)
    side_threads = str(args.threads or max(1, cores // 2))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["--redis-url", redis_url, "--run", args.run, "--log-json" if args.log_json else "--no-log-json"]
    model_args = ["--model", model, "--threads", side_threads]
    trainer_args = [
        "trainer", *common, "--model", model, "--threads", trainer_threads,
        "--steps", str(args.steps), "--lr", str(args.lr), "--beta", str(args.beta),
        "--group-size", str(args.group_size), "--groups-per-step", str(args.groups_per_step),
        "--max-new-tokens", str(args.max_new_tokens), "--consumer", "trainer-0",
        "--lora-rank", str(args.lora_rank), "--kl-reference", args.kl_reference,
    ]
    # The reference service runs only where the KL needs it and the trainer is not its own
    # reference (LoRA with kl_reference = lora_base: the base under the adapters).
    with_reference = args.beta > 0 and args.kl_reference == "service"
    children: list[Child] = [Child("trainer", trainer_args, env, workdir)]
    started = time.monotonic()
    stopping = False

    def on_sigint(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    progress = Progress()
    try:
        children[0].start()
        console.print("starting trainer (loading the model)...")
        trainer_address = children[0].grpc_address()
        for i in range(args.generators):
            # Two steps' worth of groups in flight: the next batch is sampled while the trainer
            # trains on this one (staleness <= 1); more would only be dropped as stale.
            generator_args = ["--trainer-address", trainer_address, "--consumer", f"generator-{i}", "--max-inflight-groups", str(2 * args.groups_per_step)]
            children.append(Child(f"generator-{i}", ["generator", *common, *model_args, *generator_args], env, workdir))
        output_stage = "scored" if with_reference else "ready"
        children.append(Child("reward-0", ["reward", *common, "--output-stage", output_stage, "--consumer", "reward-0"], env, workdir))
        if with_reference:
            children.append(Child("reference-0", ["reference", *common, *model_args, "--consumer", "reference-0"], env, workdir))
        for child in children[1:]:
            child.start()
        for child in children[1:]:
            child.grpc_address()
        console.print(f"services up: {', '.join(c.name for c in children)}; logs in {workdir / 'logs'}")
        with console.status("waiting for the first step...") as status:
            while not stopping:
                for m in progress.poll(client, keys):
                    console.print(
                        f"step {m.step:>3}/{args.steps}  reward {m.reward_mean:.3f} ±{m.reward_std:.3f}  "
                        f"loss {m.loss:+.4f}  staleness {m.mean_staleness:.2f}  delta {100 * m.delta_bytes / max(m.dense_bytes, 1):.2f}% of dense  "
                        f"{m.step_seconds:.1f}s  {m.train_tokens_per_s:.0f} tok/s"
                    )
                trainer = children[0].proc
                assert trainer is not None
                if trainer.poll() is not None:
                    if trainer.returncode != 0:
                        console.print(f"[red]trainer exited with {trainer.returncode}[/]\n{tail(children[0].log_path)}")
                        return 1
                    progress.poll(client, keys)
                    break
                for child in children[1:]:
                    if child.proc is not None and child.proc.poll() is not None:
                        # A dead stage restarts under the same consumer name and resumes its own pending entries.
                        child.restarts += 1
                        console.print(f"[yellow]{child.name} exited with {child.proc.returncode}; restarting ({child.restarts})[/]")
                        child.start()
                stats = {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
                status.update(
                    f"steps {len(progress.steps)}/{args.steps}  elapsed {time.monotonic() - started:.0f}s  "
                    f"generated {stats.get('generated', 0)}  trained {stats.get('trained', 0)}  stale {stats.get('stale', 0)}"
                )
                time.sleep(0.5)
    finally:
        if children[0].proc is not None and children[0].proc.poll() is None:
            console.print("stopping: the trainer finishes its current step first (Ctrl-C again does not hurry it)")
        for child in reversed(children):
            # A step on CPU can take a minute; killed mid-step it would lose nothing (its groups
            # are not acknowledged), but a clean exit flushes its logs and metrics.
            child.stop(timeout_s=120.0 if child is children[0] else 20.0)
        wall = time.monotonic() - started
        result = summary(progress.steps, wall)
        try:
            result["stats"] = {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
        except redis.RedisError as e:
            console.print(f"[yellow]could not read the run's counters: {e}[/]")
        client.close()
        if embedded is not None:
            embedded.stop()
        (workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        if progress.steps:
            console.print(
                f"[bold]done[/]: {result['steps']} steps in {result['wall_seconds']}s; mean reward first 5 steps "
                f"{result['first5_reward_mean']}, last 5 steps {result['last5_reward_mean']} (summary: {workdir / 'summary.json'})"
            )
        elif stopping:
            console.print("stopped before the first step")
    return 0


def status_table(client: redis.Redis, keys: streams.RunKeys) -> Table:
    table = Table(title=f"run {keys.run}: policy version {streams.current_version(client, keys)}")
    table.add_column("stream")
    table.add_column("length", justify="right")
    table.add_column("groups (pending)")
    for stage in (*streams.STAGES, "dead"):
        key = keys.stream(stage)
        try:
            groups = client.xinfo_groups(key)
        except redis.ResponseError:
            groups = []
        described = ", ".join(f"{g['name'].decode()} ({g['pending']})" for g in groups) or "-"
        table.add_row(key, str(client.xlen(key)), described)
    stats = {k.decode(): v.decode() for k, v in client.hgetall(keys.stats).items()}
    table.caption = "  ".join(f"{k}={v}" for k, v in sorted(stats.items())) or "no counters yet"
    last = client.xrevrange(keys.metrics, count=1)
    if last:
        m = codec.decode(last[0][1], rollout_pb2.StepMetrics)
        table.caption += f"\nlast step {m.step}: reward {m.reward_mean:.3f}, loss {m.loss:+.4f}, {m.step_seconds:.1f}s"
    generators = {k.decode(): v.decode() for k, v in client.hgetall(keys.generators).items()}
    if generators:
        table.caption += "\ngenerators: " + ", ".join(f"{k}@{v}" for k, v in generators.items())
    return table


def cmd_status(args: argparse.Namespace) -> int:
    console = Console()
    client = streams.connect(args.redis_url)
    keys = streams.RunKeys(args.run)
    try:
        while True:
            console.print(status_table(client, keys))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollstream", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the whole system locally (demo)")
    up.add_argument("--model", default="smollm2-135m", help="local Hugging Face folder, or smollm2-135m (default)")
    up.add_argument("--steps", type=int, default=15)
    up.add_argument("--run", default="demo")
    up.add_argument("--redis-url", default="", help="use this Redis instead of an embedded redis-server")
    up.add_argument("--workdir", default="", help="logs, redis data and summary.json (default runs/<run>)")
    up.add_argument("--generators", type=int, default=1)
    up.add_argument("--lr", type=float, default=2e-5)
    up.add_argument("--beta", type=float, default=0.0, help="KL weight; > 0 also starts the reference service (unless --kl-reference lora_base)")
    up.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)")
    up.add_argument(
        "--kl-reference", choices=["service", "lora_base"], default="service",
        help="with --beta > 0: pi_ref from the reference service, or (LoRA only) from the trainer's base with the adapters off, with no reference service",
    )
    up.add_argument("--group-size", type=int, default=8)
    up.add_argument("--groups-per-step", type=int, default=8)
    up.add_argument("--max-new-tokens", type=int, default=16)
    up.add_argument("--threads", type=int, default=0, help="torch threads per service (default: all cores for the trainer, half for the others)")
    up.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=True, help="delete the run's keys first")
    up.add_argument("--log-json", action="store_true")
    up.set_defaults(func=cmd_up)
    st = sub.add_parser("status", help="show a run's streams, consumer groups and counters")
    st.add_argument("--redis-url", default=os.environ.get("ROLLSTREAM_REDIS_URL", "redis://127.0.0.1:6379/0"))
    st.add_argument("--run", default=os.environ.get("ROLLSTREAM_RUN", "demo"))
    st.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds")
    st.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
