"""The `rollstream` command.

  rollstream up       the whole system as local processes: embedded redis-server (or
                      --redis-url), trainer, generator(s), reward, reference (when
                      beta > 0 and the trainer is not its own reference), with a live
                      progress display; Ctrl-C stops it all cleanly. --reward external
                      starts no reward process and waits for one of your own
                      (docs/custom-reward.md)
  rollstream status   the pipeline of a run, read from Redis (--watch to follow), with a
                      line naming the bottleneck or the stuck stage (core/diagnose.py)
  rollstream plot     a run's curves (reward, KL, tokens/s, staleness, delta size) as a PNG
  rollstream secrets  write a credentials folder: gRPC tokens per role, Redis ACL users,
                      and with --tls a CA and a certificate per role (docs/security.md)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console
from rich.console import Group as RichGroup
from rich.live import Live
from rich.text import Text

from rollstream.core import codec, credentials, diagnose, procs, redis_acl, redis_policy, steplog, streams, validation
from rollstream.core import status as pipeline_status
from rollstream.core.config import NAME_PATTERN, CommonSettings
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.procs import die_with_parent, stop_process
from rollstream.core.redis_server import EmbeddedRedis, free_port
from rollstream.v1 import rollout_pb2


class ChildFailed(RuntimeError):
    """A service exited while `up` waited for it to serve."""

    def __init__(self, returncode: int, message: str):
        super().__init__(message)
        self.returncode = returncode


@dataclass
class Child:
    """One service process under `up`'s supervision; restarted if it dies unexpectedly."""

    name: str
    args: list[str]
    env: dict[str, str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.workdir / "logs" / f"{self.name}.log"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state" / f"{self.name}.json"

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"rollstream.{self.args[0]}", *self.args[1:], "--state-file", str(self.state_file)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,  # Ctrl-C reaches `up` only
                preexec_fn=die_with_parent,
            )

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def restart_delay_s(self) -> float:
        """A child that keeps dying right after its start is restarted ever more slowly (a
        crash loop must not eat the machine), one that ran a while at once."""
        ran = time.monotonic() - self.started_at
        return 0.0 if ran > 60 else min(2.0 ** min(self.restarts, 5), 30.0)

    def grpc_address(self, timeout_s: float = 600.0) -> str:
        """Wait for the service's state file (written once it serves) and return its address."""
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise ChildFailed(self.proc.returncode, f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start within {timeout_s}s; see {self.log_path}")
            time.sleep(0.2)
        return f"127.0.0.1:{json.loads(self.state_file.read_text())['grpc_port']}"

    def http_port(self) -> int:
        """The HTTP side's port (after grpc_address: the state file exists)."""
        return int(json.loads(self.state_file.read_text())["http_port"])

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)


def tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Progress:
    by_step: dict[int, rollout_pb2.StepMetrics] = field(default_factory=dict)
    last_id: bytes = b"0-0"

    @property
    def steps(self) -> list[rollout_pb2.StepMetrics]:
        return [self.by_step[k] for k in sorted(self.by_step)]

    def poll(self, client: redis_policy.Client, keys: streams.RunKeys) -> list[rollout_pb2.StepMetrics]:
        """New step metrics (an entry that does not decode or check is skipped: anyone can
        write to the stream, and the display must not die of it)."""
        new = []
        for eid, fields in client.xrange(keys.metrics, min=b"(" + self.last_id, count=1000):
            self.last_id = eid
            try:
                m = codec.decode(fields, rollout_pb2.StepMetrics)
                validation.check_metrics(m)
            except codec.EntryError:
                continue
            if m.step not in self.by_step:
                new.append(m)
            self.by_step[m.step] = m
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


def plain_console(**kwargs: object) -> Console:
    """A console that prints text as it is, never as rich markup: what `rollstream` prints
    holds what services, Redis streams and logs wrote (a rollout's group_id "evil[/]" in a
    log line raised MarkupError and ended `up`). Styles go in `style=` or rich.text.Text."""
    return Console(markup=False, **kwargs)  # type: ignore[arg-type]


def cmd_up(args: argparse.Namespace) -> int:
    # The run's data (the AOF's prompts and test answers, checkpoints, logs) is the owner's
    # alone: `up` and every service it starts create files 0600 and folders 0700.
    with procs.owner_only():
        return _up(args)


def _up(args: argparse.Namespace) -> int:
    console = plain_console(stderr=True)
    if args.kl_reference == "lora_base" and not args.lora_rank:
        console.print("--kl-reference lora_base needs --lora-rank > 0: the reference is the base under the LoRA adapters", style="red")
        return 2
    if args.redis_url:
        try:
            redis_policy.check_url(args.redis_url)
        except ValueError as e:
            console.print(f"--redis-url: {e}", style="red")
            return 2
    if args.max_staleness < 0:
        console.print(f"--max-staleness: {args.max_staleness} is negative (0: synchronous, 1: the next batch sampled during the step)", style="red")
        return 2
    problem = check_reward_args(args)
    if problem:
        console.print(problem, style="red")
        return 2
    workdir = Path(args.workdir or f"runs/{args.run}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)  # also a workdir an older run left open to others
    checkpoints = workdir / "checkpoints"
    step_log = workdir / steplog.FILE_NAME
    if args.fresh:
        if checkpoints.exists():
            shutil.rmtree(checkpoints)  # a fresh run must not resume the last one's checkpoints
        step_log.unlink(missing_ok=True)  # nor append to the last one's curve
        (workdir / "restarts.json").unlink(missing_ok=True)
    # Resolve (and on first use convert) the model once, before any service races to do it;
    # the conversion in a child process, so that `up` stays small for the whole run.
    from rollstream.core.models import ModelNotFoundError, resolve_model_in_child

    console.print(Text("rollstream up", style="bold"), f"run={args.run} workdir={workdir}{'' if args.fresh else ' (continuing the run)'}")
    try:
        model = str(resolve_model_in_child(args.model))
    except ModelNotFoundError as e:
        console.print(str(e), style="red")
        return 2
    console.print(f"model: {model}")
    # The reference service runs only where the KL needs it and the trainer is not its own
    # reference (LoRA with kl_reference = lora_base: the base under the adapters).
    with_reference = args.beta > 0 and args.kl_reference == "service"
    # Every service gets its own credentials (docs/security.md): a gRPC token per role, and
    # on the embedded server a Redis ACL user per role. Kept across runs in the workdir.
    creds = workdir / "credentials"
    tokens = credentials.ensure_grpc_tokens(creds)
    admin = ClientCredentials(token=tokens["admin"])
    embedded = None
    admin_redis: tuple[str | None, str | None] = (None, None)  # an external URL brings its own
    if args.redis_url:
        redis_url = args.redis_url
    else:
        # With a reference stage, `ready` is the reference's alone: the reward user cannot write it.
        passwords = redis_acl.ensure_redis_credentials(creds, reference_stage=with_reference)
        admin_redis = (redis_acl.ADMIN, passwords[redis_acl.ADMIN])
        embedded = EmbeddedRedis(workdir / "redis", aclfile=redis_acl.acl_file(creds), admin_password=passwords[redis_acl.ADMIN]).start()
        redis_url = embedded.url
        _write_redis_state(workdir, embedded)
        console.print(f"embedded redis-server: {redis_url} (data in {workdir / 'redis'}, AOF on, ACL users per service in {creds})")
    keys = streams.RunKeys(args.run)
    try:
        client = redis_policy.connect(redis_url, *admin_redis)
        if args.fresh:
            stale_keys = list(client.scan_iter(match=keys.prefix + "*"))
            if stale_keys:
                client.delete(*stale_keys)
    except redis_policy.ERRORS as e:
        console.print(f"Redis at {redis_policy.redact(redis_url)} does not answer: {redis_policy.short(e)}", style="red")
        if embedded is not None:
            embedded.stop()
        return 1
    # The trainer's step is the long pole: it gets every core. With max_staleness >= 1 the
    # next batch is sampled while the trainer trains, so the generators (and the reference)
    # get half; synchronous (0), sampling and training take turns and both get every core.
    cores = os.cpu_count() or 2
    trainer_threads = str(args.threads or cores)
    side_threads = str(args.threads or max(1, cores // 2))
    generator_threads = trainer_threads if args.max_staleness == 0 else side_threads
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["--redis-url", redis_url, "--run", args.run, "--log-json" if args.log_json else "--no-log-json"]
    model_args = ["--model", model, "--threads", side_threads]
    # A fixed port: generators keep the trainer's address across its restarts (catch-up).
    trainer_port = free_port()

    def own(role: str) -> list[str]:
        return credentials.service_flags(creds, role, redis_acl=embedded is not None)

    trainer_args = [
        "trainer", *common, *own("trainer"), "--model", model, "--threads", trainer_threads, "--grpc-port", str(trainer_port),
        "--steps", str(args.steps), "--lr", str(args.lr), "--beta", str(args.beta),
        "--group-size", str(args.group_size), "--groups-per-step", str(args.groups_per_step),
        "--max-new-tokens", str(args.max_new_tokens), "--token-budget", str(args.token_budget), "--consumer", "trainer-0",
        "--max-staleness", str(args.max_staleness), "--loss", args.loss, "--tis-cap", str(args.tis_cap), "--moments-dtype", args.moments_dtype,
        "--master-layout", args.master_layout,
        "--lora-rank", str(args.lora_rank), "--kl-reference", args.kl_reference,
        # Checkpoints by default; a restarted trainer resumes from the latest and replays the
        # steps trained after it. It lingers after the last step so generators can catch up.
        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(args.checkpoint_every), "--resume", "auto", "--linger",
        # The anchor (the whole model in bf16, read when a generator catches up) on disk, not in the trainer's memory.
        "--anchor-dir", str(workdir / "anchor"),
        "--metrics-file", str(step_log),
    ]
    trainer = Child("trainer", trainer_args, env, workdir)
    children: list[Child] = [trainer]
    started = time.monotonic()
    stopping = False

    def on_sigint(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    progress = Progress()
    finished = False
    versions: dict[str, int] = {}
    try:
        trainer.start()
        console.print("starting trainer (loading the model)...")
        try:
            trainer_address = trainer.grpc_address()
        except ChildFailed as e:  # at start: a bad setting (2) or a broken install; nothing to restart
            console.print(str(e), style="red")
            return 2 if e.returncode == 2 else 1
        for i in range(args.generators):
            # max_staleness + 1 steps' worth of groups in flight: with 1, the next batch is
            # sampled while the trainer trains on this one; with 0, a batch is sampled only
            # once the last one is trained (the trainer acknowledges its groups with the new
            # version, in one transaction). More would only be dropped as stale.
            generator_args = [
                "--trainer-address", trainer_address, "--consumer", f"generator-{i}",
                "--max-inflight-groups", str((args.max_staleness + 1) * args.groups_per_step), "--max-staleness", str(args.max_staleness),
                "--seed", str(args.seed + i), "--model", model, "--threads", generator_threads,
            ]
            children.append(Child(f"generator-{i}", ["generator", *common, *own("generator"), *generator_args], env, workdir))
        output_stage = "scored" if with_reference else "ready"
        external: ExternalReward | None = None
        if args.reward == "external":
            external = ExternalReward(
                redis_url=redis_url, keys=keys, group=args.reward_group, output_stage=output_stage,
                username=REWARD_ROLE if embedded is not None else "",
                password_file=redis_acl.password_file(creds, REWARD_ROLE) if embedded is not None else None,
            )
        else:
            reward_args = ["reward", *common, *own("reward"), "--output-stage", output_stage, "--consumer", "reward-0", "--group", args.reward_group]
            if args.scorer_address:
                reward_args += ["--scorer-address", args.scorer_address]
            children.append(Child("reward-0", reward_args, env, workdir))
        if with_reference:
            children.append(Child("reference-0", ["reference", *common, *own("reference"), *model_args, "--consumer", "reference-0"], env, workdir))
        for child in children[1:]:
            child.start()
        try:
            for child in children[1:]:
                child.grpc_address()
        except ChildFailed as e:
            console.print(str(e), style="red")
            return 2 if e.returncode == 2 else 1
        console.print(f"services up: {', '.join(c.name for c in children)}; logs in {workdir / 'logs'}")
        console.print(f"dashboard: http://127.0.0.1:{trainer.http_port()}/dashboard (metrics: /metrics on each service's HTTP port)")
        if external is not None:
            console.print(external.instructions())
            external.write(workdir / EXTERNAL_REWARD_FILE)
            console.print(external.waiting_line())  # a line in the log too: the spinner is not kept
        redis_down = False
        # Text: a spinner's str is read as markup whatever the console says.
        with console.status(Text(external.waiting_line() if external is not None else "waiting for the first step...")) as status:
            while not stopping:
                if embedded is not None and embedded.proc is not None and embedded.proc.poll() is not None:
                    console.print(f"redis-server exited with {embedded.proc.returncode}; restarting it on its AOF", style="yellow")
                    embedded.stop()
                    _restart_redis(embedded, console)
                    _write_redis_state(workdir, embedded)
                for child in children:
                    if child.exited():
                        code = child.proc.returncode if child.proc is not None else None
                        if child is trainer and code == 0:
                            console.print(f"the trainer exited before step {args.steps}", style="red")
                            return 1
                        if code == 2:  # a bad setting: restarting would fail the same way
                            console.print(Text(f"{child.name} refused its configuration:", style="red"), tail(child.log_path, 10), sep="\n")
                            return 2
                        # Every service restarts under the same consumer name and resumes its own
                        # pending entries; the trainer from its latest checkpoint.
                        delay = child.restart_delay_s()
                        child.restarts += 1
                        _write_restarts(workdir, children)  # `rollstream status --workdir` shows a crash loop
                        console.print(
                            Text(f"{child.name} exited with {code}; restarting ({child.restarts}) in {delay:.0f}s", style="yellow"), tail(child.log_path, 10), sep="\n"
                        )
                        time.sleep(delay)
                        child.start()
                try:
                    reward_line = external.poll(client, console) if external is not None else ""
                    for m in progress.poll(client, keys):
                        console.print(
                            f"step {m.step:>3}/{args.steps}  reward {m.reward_mean:.3f} ±{m.reward_std:.3f}  "
                            f"loss {m.loss:+.4f}  staleness {m.mean_staleness:.2f}  delta {100 * m.delta_bytes / max(m.dense_bytes, 1):.2f}% of dense  "
                            f"{m.step_seconds:.1f}s  {m.train_tokens_per_s:.0f} tok/s"
                        )
                    stats = _stats(client, keys)
                    if redis_down:
                        console.print("Redis answers again", style="green")
                        redis_down = False
                except redis_policy.ERRORS as e:
                    if not redis_down:
                        console.print(f"Redis unavailable ({redis_policy.short(e)}); the services wait and retry", style="yellow")
                        redis_down = True
                    time.sleep(1.0)
                    continue
                if progress.by_step and max(progress.by_step) >= args.steps:
                    finished = True
                    break
                status.update(
                    Text(
                        reward_line
                        or f"steps {len(progress.by_step)}/{args.steps}  elapsed {time.monotonic() - started:.0f}s  "
                        f"generated {stats.get('generated', 0)}  trained {stats.get('trained', 0)}  stale {stats.get('stale', 0)}"
                    )
                )
                time.sleep(0.5)
        if finished:
            versions = settle_versions(trainer, children[1 : 1 + args.generators], admin)
    finally:
        if trainer.proc is not None and trainer.proc.poll() is None and not finished:
            console.print("stopping: the trainer finishes its current step first (Ctrl-C again does not hurry it)")
        for child in reversed(children):
            # A step on CPU can take a minute; killed mid-step it would lose nothing (its groups
            # are not acknowledged), but a clean exit flushes its logs and metrics.
            child.stop(timeout_s=120.0 if child is trainer else 30.0)
        wall = time.monotonic() - started
        result = summary(progress.steps, wall)
        result["versions"] = versions
        result["restarts"] = {c.name: c.restarts for c in children if c.restarts}
        try:
            result["stats"] = _stats(client, keys)
        except redis_policy.ERRORS as e:
            console.print(f"could not read the run's counters: {redis_policy.short(e)}", style="yellow")
        client.close()
        if embedded is not None:
            embedded.stop()
        (workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        if progress.steps:
            console.print(
                Text.assemble(("done", "bold"), f": {result['steps']} steps in {result['wall_seconds']}s; mean reward first 5 steps "
                f"{result['first5_reward_mean']}, last 5 steps {result['last5_reward_mean']} (summary: {workdir / 'summary.json'})")
            )
        elif stopping:
            console.print("stopped before the first step")
        if checkpoints.is_dir():
            # What resume needs (docs/reliability.md, "Checkpoints"): the trainer prunes the rest.
            held = sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file())
            console.print(f"checkpoints: {held / 1e9:.2f} GB in {checkpoints} ({', '.join(sorted(p.name for p in checkpoints.iterdir())) or 'none'})")
        if step_log.exists():
            _plot_curve(step_log, workdir / "curves.png", console)
    return 0


def _plot_curve(step_log: Path, out: Path, console: Console) -> None:
    """The run's curves at the end of `up` (a plotting failure is reported, never fatal)."""
    from rollstream.core import plot

    try:
        path, log = plot.render(step_log, out)
    except plot.PlotError as e:
        console.print(f"no curve: {e}", style="yellow", soft_wrap=True)
        return
    console.print(f"curves: {path}" + (f" ({len(log.skipped)} unreadable lines of {step_log} skipped)" if log.skipped else ""), soft_wrap=True)


REWARD_CHOICES = ("builtin", "external")
REWARD_ROLE = "reward"  # the credentials role (gRPC token, Redis ACL user) of any reward stage
# Written by `up --reward external` into the workdir: what the outside service needs, as JSON.
EXTERNAL_REWARD_FILE = "external-reward.json"
_GROUP_NAME = re.compile(NAME_PATTERN)


def check_reward_args(args: argparse.Namespace) -> str:
    """Why the reward flags cannot be used together ("" when they can), naming the flag."""
    if not _GROUP_NAME.fullmatch(args.reward_group):
        return f"--reward-group: {args.reward_group!r} is not a consumer group name (letters, digits, '_', '.', '-')"
    if args.reward == "external" and args.scorer_address:
        return "--scorer-address: only with --reward builtin (the built-in stage calls the scorer; an external reward service scores by itself)"
    return ""


@dataclass
class ExternalReward:
    """`up --reward external`: no built-in reward process. What an outside reward service must
    use (printed, and written to WORKDIR/external-reward.json), and whether one has joined:
    a consumer in `group` on the rollouts stream (docs/custom-reward.md)."""

    redis_url: str
    keys: streams.RunKeys
    group: str
    output_stage: str
    username: str  # the Redis ACL user of the reward role ("" for an external Redis: its URL decides)
    password_file: Path | None
    joined: bool = False
    warned_groups: set[str] = field(default_factory=set)

    @property
    def source(self) -> str:
        return self.keys.stream("rollouts")

    def waiting_line(self) -> str:
        return f"waiting for a reward consumer on {self.source} (consumer group {self.group})"

    def as_dict(self) -> dict[str, object]:
        return {
            "redis_url": redis_policy.redact(self.redis_url),
            "redis_username": self.username,
            "redis_password_file": str(self.password_file) if self.password_file else "",
            "run": self.keys.run,
            "input_stream": self.source,
            "consumer_group": self.group,
            "output_stream": self.keys.stream(self.output_stage),
            "output_stage": self.output_stage,
            "dead_stream": self.keys.dead,
            "stats_hash": self.keys.stats,
            "max_deliveries": CommonSettings.model_fields["max_deliveries"].default,
            "claim_idle_ms": CommonSettings.model_fields["claim_idle_ms"].default,
        }

    def instructions(self) -> str:
        d = self.as_dict()
        auth = (
            f"  redis user:     {d['redis_username']} (password in {d['redis_password_file']}: read the file, never put it on a command line)\n"
            if self.username
            else "  redis user:     whatever the URL above gives (an external Redis: its own ACL)\n"
        )
        return (
            "reward: external (no built-in reward process; docs/custom-reward.md is the contract)\n"
            f"  redis:          {d['redis_url']}\n{auth}"
            f"  read:           {d['input_stream']} as consumer group {d['consumer_group']} (one stable consumer name per process)\n"
            f"  write:          {d['output_stream']} (dead letters: {d['dead_stream']}, counters: {d['stats_hash']})\n"
            f"  max deliveries: {d['max_deliveries']}; take over entries idle {d['claim_idle_ms']} ms on another consumer\n"
            f"  the same as JSON: {EXTERNAL_REWARD_FILE} in the workdir"
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    def poll(self, client: redis_policy.Client, console: Console) -> str:
        """The status line while no consumer of `group` reads the rollouts ("" once one has),
        and a warning, once each, for any other consumer group there: it would score every
        group a second time, and it holds back trimming and the generators while it lags."""
        try:
            groups = client.xinfo_groups(self.source) if client.exists(self.source) else []
        except redis.ResponseError as e:  # WRONGTYPE: someone else's key; the display must not die of it
            return f"{self.waiting_line()}: {redis_policy.short(e)}"
        consumers = 0
        created = False
        for g in groups:
            name = g["name"].decode(errors="replace") if isinstance(g["name"], bytes) else str(g["name"])
            if name == self.group:
                created, consumers = True, int(g["consumers"])
            elif name not in self.warned_groups:
                self.warned_groups.add(name)
                console.print(
                    f"consumer group {name!r} on {self.source} is not {self.group!r}: every group reads every entry, "
                    f"so it scores them twice, and while it lags it holds back trimming and the generators "
                    f"(XGROUP DESTROY {self.source} {name} if it is left over)",
                    style="yellow",
                )
        if consumers and not self.joined:
            self.joined = True
            console.print(f"a reward consumer joined consumer group {self.group} on {self.source}", style="green")
        if self.joined:
            return ""
        # Redis 6.2 lists a consumer only once it has been handed an entry: a service blocked
        # on an empty stream shows as its group alone until the first group is generated.
        return self.waiting_line() + (": the group exists, no consumer has taken an entry yet" if created else "")


def _stats(client: redis_policy.Client, keys: streams.RunKeys) -> dict[str, int]:
    """The run's counters; a field that is not an integer (someone wrote to the hash) is skipped."""
    out = {}
    for k, v in client.hgetall(keys.stats).items():
        try:
            out[k.decode(errors="replace")] = int(v)
        except ValueError:
            continue
    return out


def _write_restarts(workdir: Path, children: list[Child]) -> None:
    """WORKDIR/restarts.json: service -> restarts so far (written whole, then renamed)."""
    path = workdir / "restarts.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({c.name: c.restarts for c in children if c.restarts}))
    tmp.replace(path)


def _write_redis_state(workdir: Path, embedded: EmbeddedRedis) -> None:
    path = workdir / "state" / "redis.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    assert embedded.proc is not None
    path.write_text(json.dumps({"pid": embedded.proc.pid, "url": embedded.url}))


def _restart_redis(embedded: EmbeddedRedis, console: Console) -> None:
    """Start the embedded redis-server again on its port and data folder (it replays its AOF)."""
    delay = 0.5
    while True:
        try:
            embedded.start(timeout_s=60.0)
            return
        except RuntimeError as e:
            console.print(f"redis-server did not start again ({str(e).splitlines()[0]}); retrying in {delay:.0f}s", style="yellow")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def settle_versions(trainer: Child, generators: list[Child], creds: ClientCredentials, timeout_s: float = 60.0) -> dict[str, int]:
    """After the last step: wait until every generator serves the trainer's version (a push
    that missed is caught up within a few seconds), and return each one's version. Asks as
    `creds` (the admin role)."""
    from rollstream.core.grpc_utils import channel
    from rollstream.v1 import generator_pb2, generator_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    def trainer_version() -> int:
        with channel(trainer.grpc_address(timeout_s=30.0), creds, server_name="trainer") as ch:
            return int(trainer_pb2_grpc.TrainerStub(ch).GetState(trainer_pb2.TrainerStateRequest(), timeout=10).version)

    def generator_version(g: Child) -> int:
        with channel(g.grpc_address(timeout_s=30.0), creds, server_name="generator") as ch:
            return int(generator_pb2_grpc.GeneratorStub(ch).GetState(generator_pb2.GetStateRequest(), timeout=10).policy_version)

    deadline = time.monotonic() + timeout_s
    versions: dict[str, int] = {}
    while True:
        try:
            versions = {"trainer": trainer_version(), **{g.name: generator_version(g) for g in generators}}
        except Exception:  # noqa: BLE001 - a child restarting; try again until the deadline
            versions = {}
        if versions and len(set(versions.values())) == 1 or time.monotonic() > deadline:
            return versions
        time.sleep(1.0)


def status_table(client: redis_policy.Client, keys: streams.RunKeys) -> RichGroup:
    """The run's pipeline as `rollstream status` shows it once (core/status.py), no rates."""
    snap, extra = pipeline_status.collect(client, keys)
    return pipeline_status.render(keys, snap, extra)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def redis_down_line(redis_url: str, error: Exception, workdir: Path | None, redis_pid: int) -> str:
    """What `status` says when Redis does not answer. An `up` run's embedded Redis stops with
    `up`: once its process is gone the run is over, and the line says where its results are
    rather than showing a refused connection to a port nobody serves any more."""
    if workdir is not None and redis_pid and not _pid_alive(redis_pid):
        return (
            f"this run's embedded Redis (pid {redis_pid}, {redis_policy.redact(redis_url)}) stopped with `rollstream up`: "
            f"the run is not running. Its results: {workdir / steplog.FILE_NAME} (a line per step), {workdir / 'summary.json'}, "
            f"{workdir / 'curves.png'} (`rollstream plot {workdir}` draws it again) and the services' logs in {workdir / 'logs'}; "
            f"`rollstream up --no-fresh --workdir {workdir} --run <run>` continues the run."
        )
    return f"Redis at {redis_policy.redact(redis_url)}: {redis_policy.short(error)}"


def cmd_status(args: argparse.Namespace) -> int:
    console = plain_console()
    redis_pid = 0  # the embedded Redis's, for an `up` run's --workdir
    if args.workdir:  # the embedded Redis of an `up` run, as its admin user
        workdir = Path(args.workdir)
        try:
            recorded = json.loads((workdir / "state" / "redis.json").read_text())
            args.redis_url, redis_pid = recorded["url"], int(recorded.get("pid", 0))
        except (OSError, ValueError, KeyError) as e:
            console.print(f"--workdir: no embedded Redis recorded in {workdir / 'state' / 'redis.json'} ({e})", style="red")
            return 2
        args.redis_username = args.redis_username or redis_acl.ADMIN
        args.redis_password_file = args.redis_password_file or str(redis_acl.password_file(workdir / "credentials", redis_acl.ADMIN))
    try:
        redis_policy.check_url(args.redis_url)
    except ValueError as e:
        console.print(f"--redis-url: {e}", style="red")
        return 2
    try:
        username, password = redis_policy.credentials(args.redis_url, args.redis_username, args.redis_password_file, os.environ.get("ROLLSTREAM_REDIS_PASSWORD", ""))
    except ValueError as e:
        console.print(str(e), style="red")
        return 2
    keys = streams.RunKeys(args.run)
    workdir = Path(args.workdir) if args.workdir else None
    thresholds = diagnose.Thresholds(idle_s=args.idle_s, max_staleness=args.max_staleness)
    if not console.is_terminal:
        console.width = max(console.width, 180)  # piped: no wrapping of the stream names
    client = None
    prev = None
    live = Live(console=console, auto_refresh=False, transient=False) if args.watch and console.is_terminal else None
    if args.watch:
        # Ctrl-C and SIGTERM end the watch. Said explicitly: a process started from a
        # non-interactive shell's background job inherits SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler (it watched on forever after a SIGINT).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if live is not None:
            live.start()
        while True:
            try:
                client = client or redis_policy.connect(args.redis_url, username, password)
                snap, extra = pipeline_status.collect(client, keys, workdir)
                view = pipeline_status.render(keys, snap, extra, prev, thresholds)
                prev = snap
            except redis_policy.ERRORS as e:
                view = Text(redis_down_line(args.redis_url, e, workdir, redis_pid), style="yellow")
                if not args.watch:
                    console.print(view)
                    return 1
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
        if client is not None:
            client.close()


def cmd_plot(args: argparse.Namespace) -> int:
    from rollstream.core import plot

    console = plain_console(stderr=True)
    run = Path(args.run)
    try:
        log_path = plot.resolve_log(run)
        out = Path(args.output) if args.output else (run if run.is_dir() else run.parent) / "curves.png"
        path, log = plot.render(log_path, out, title=args.title)
    except plot.PlotError as e:
        console.print(str(e), style="red", soft_wrap=True)
        return 1
    for number, why in log.skipped:
        console.print(f"warning: {log_path}:{number} skipped: {why}", style="yellow", soft_wrap=True)
    print(path)
    return 0


def cmd_secrets(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if (args.namespace or args.dns) and not args.tls:
        print("--namespace and --dns name certificates: add --tls", file=sys.stderr)
        return 2
    credentials.ensure_grpc_tokens(root)
    redis_acl.ensure_redis_credentials(root, reference_stage=args.reference)
    if args.tls:
        credentials.ensure_tls(root, namespace=args.namespace, extra_names=tuple(args.dns))
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        print(path)
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default after its help line, except an empty one (None, "",
    False, []): there the help line says what empty means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        empty = action.default is None or action.default is False or action.default == "" or action.default == []  # 0 is a default
        if not action.option_strings or "%(default)" in text or empty or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollstream", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # The defaults below are written once, here; --help shows them (HelpFormatter).
    up = sub.add_parser("up", help="run the whole system locally (demo)", formatter_class=HelpFormatter)
    up.add_argument("--model", default="smollm2-135m", help="a local Hugging Face folder, or smollm2-135m (the demo model, converted once from its GGUF)")
    up.add_argument("--steps", type=int, default=15, help="optimizer steps to train; `up` stops after the last")
    up.add_argument("--run", default="demo", help="the run's name: its Redis keys (rs:{<run>}:...) and the default workdir; it does not change the samples")
    up.add_argument("--redis-url", default="", help="use this Redis instead of an embedded redis-server (empty: embedded, in the workdir)")
    up.add_argument("--workdir", default="", help="logs, redis data, checkpoints, steps.jsonl and summary.json (empty: runs/<run>)")
    up.add_argument("--generators", type=int, default=1, help="generator processes (generator i samples with seed + i)")
    up.add_argument("--lr", type=float, default=2e-5, help="the trainer's AdamW learning rate")
    up.add_argument("--beta", type=float, default=0.0, help="KL weight; > 0 also starts the reference service (unless --kl-reference lora_base)")
    up.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank; 0: full fine-tuning")
    up.add_argument(
        "--kl-reference", choices=["service", "lora_base"], default="service",
        help="with --beta > 0: pi_ref from the reference service, or (LoRA only) from the trainer's base with the adapters off, with no reference service",
    )
    up.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt (the group GRPO normalizes rewards in)")
    up.add_argument("--groups-per-step", type=int, default=8, help="prompt groups trained per optimizer step")
    up.add_argument("--max-new-tokens", type=int, default=16, help="the longest completion, in tokens")
    up.add_argument(
        "--token-budget", type=int, default=512,
        help="the trainer's padded tokens per micro-batch, which sets its activation memory (about 1.8 MiB a token on the demo model; docs/benchmarks.md)",
    )
    # The demo's defaults below are measured on a 2-core box against TRL (docs/benchmarks.md,
    # issue 18): where the generator and the trainer share the same cores, sampling ahead
    # saves little time and costs learning per step, so `up` runs synchronous.
    up.add_argument(
        "--max-staleness", type=int, default=0,
        help="how many versions the generators may sample ahead of the trainer (0: synchronous, "
        "sampling and training take turns on the same cores; 1: the next batch is sampled during the step)",
    )
    up.add_argument(
        "--moments-dtype", choices=["float32", "bfloat16"], default="bfloat16",
        help="the trainer's AdamW moments in host memory (bfloat16: half their memory, 0.5 GB less on the demo; "
        "float32: exact AdamW, docs/benchmarks.md)",
    )
    up.add_argument(
        "--master-layout", choices=["split", "fp32"], default="split",
        help="the trainer's fp32 masters in host memory (split: the served bf16 bits plus a 16-bit remainder, exact, "
        "4 bytes a parameter; fp32: 8 bytes; rollstream/trainer/optimizer.py)",
    )
    up.add_argument("--loss", choices=["grpo", "dr_grpo", "dapo", "gspo"], default="grpo", help="the trainer's policy loss (rollstream/trainer/grpo.py)")
    up.add_argument(
        "--tis-cap", type=float, default=0.0,
        help="truncated importance sampling against the generators' log-probs, weights capped here, instead of the ratio clip; 0: the clip",
    )
    up.add_argument(
        "--seed", type=int, default=0,
        help="sampling seed of the generators (generator i gets seed + i): with the data and the settings it decides the samples, "
        "whatever the run's name; the prompt stream stays the same",
    )
    up.add_argument("--threads", type=int, default=0, help="torch threads per service; 0: all cores for the trainer, half for the others")
    up.add_argument(
        "--checkpoint-every", type=int, default=5,
        help="trainer checkpoint every N steps (WORKDIR/checkpoints, newest 2 kept); steps after it are replayed on a restart",
    )
    up.add_argument(
        "--fresh", action=argparse.BooleanOptionalAction, default=True,
        help="delete the run's keys and checkpoints first; --no-fresh continues the run (the trainer resumes its latest checkpoint)",
    )
    up.add_argument(
        "--reward", choices=REWARD_CHOICES, default="builtin",
        help="builtin: start the reward service; external: start none, print what an outside reward service must use "
        "(docs/custom-reward.md) and wait for it",
    )
    up.add_argument("--reward-group", default="reward", help="the reward stage's consumer group on the rollouts stream")
    up.add_argument("--scorer-address", default="", help="with --reward builtin: host:port of a Reward/Score server the built-in stage scores with")
    up.add_argument("--log-json", action="store_true", help="the services log JSON lines instead of text (in WORKDIR/logs)")
    up.set_defaults(func=cmd_up)
    st = sub.add_parser("status", help="show a run's streams, consumer groups and counters", formatter_class=HelpFormatter)
    st.add_argument("--redis-url", default=os.environ.get("ROLLSTREAM_REDIS_URL", "redis://127.0.0.1:6379/0"), help="the run's Redis (env ROLLSTREAM_REDIS_URL)")
    st.add_argument("--run", default=os.environ.get("ROLLSTREAM_RUN", "demo"), help="the run's name (env ROLLSTREAM_RUN)")
    st.add_argument("--workdir", default="", help="an `up` run's workdir: its embedded Redis, as admin (instead of --redis-url)")
    st.add_argument("--redis-username", default=os.environ.get("ROLLSTREAM_REDIS_USERNAME", ""), help="Redis ACL user (under `up`: admin; empty: the URL's or none)")
    st.add_argument(
        "--redis-password-file", default=os.environ.get("ROLLSTREAM_REDIS_PASSWORD_FILE", ""),
        help="its password's file (under `up`: WORKDIR/credentials/redis/admin.password; empty: env ROLLSTREAM_REDIS_PASSWORD or the URL's)",
    )
    st.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds (a live view; rates are per second between refreshes); 0: show once")
    st.add_argument("--idle-s", type=float, default=300.0, help="consumers idle this long with a backlog (and no progress) count as not reading")
    st.add_argument("--max-staleness", type=int, default=1, help="the run's max_staleness: generators further behind the trainer are flagged")
    st.set_defaults(func=cmd_status)
    pl = sub.add_parser("plot", help="render a run's curves (reward, KL, tokens/s, staleness, delta size) as a PNG", formatter_class=HelpFormatter)
    pl.add_argument("run", help=f"an `up` run folder (its {steplog.FILE_NAME}) or a step log file")
    pl.add_argument("-o", "--output", default="", help="the PNG (default: curves.png in the run folder)")
    pl.add_argument("--title", default="", help="the run's name in the title (default: from the log)")
    pl.set_defaults(func=cmd_plot)
    se = sub.add_parser("secrets", help="write a credentials folder for compose, Kubernetes or your own deployment", formatter_class=HelpFormatter)
    se.add_argument("dir", help="the folder (created; existing secrets in it are kept: delete a file to rotate it)")
    se.add_argument("--tls", action="store_true", help="also a CA and a certificate per role (mTLS)")
    se.add_argument(
        "--reference", action="store_true",
        help="the deployment runs a reference stage (beta > 0): the reward's Redis user may not write ready (run it again without to drop one)",
    )
    se.add_argument("--namespace", default="", help="with --tls: add the Kubernetes Service names <role>.<namespace>.svc")
    se.add_argument("--dns", action="append", default=[], help="with --tls: another name every certificate carries (repeatable)")
    se.set_defaults(func=cmd_secrets)
    return parser


def main_code(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status (for tests: main() exits with it)."""
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv: list[str] | None = None) -> None:
    sys.exit(main_code(argv))


if __name__ == "__main__":
    main()
