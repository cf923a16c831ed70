"""`rollstream up`: the whole system as local processes, from one run configuration.

An embedded redis-server (or `redis_url`), the trainer, generator(s), the reward service (or
none: `external_reward`, docs/custom-reward.md) and the reference service when the KL needs
one, each started with its section of the run's configuration (run_config.py) as its
`--config` TOML, restarted when it dies, with a live progress display; Ctrl-C stops it all
cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import tomli_w
from rich.console import Console
from rich.text import Text

from rollstream.core import codec, credentials, redis_acl, redis_policy, run_keys, steplog, validation
from rollstream.core import status as pipeline_status
from rollstream.core.config import ENV_PREFIX, CommonSettings
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.launcher import procs
from rollstream.launcher.cli import plain_console
from rollstream.launcher.procs import Child, ChildFailed, tail
from rollstream.launcher.redis_server import SOCKET_NAME, EmbeddedRedis, check_socket_length
from rollstream.launcher.run_config import CREDENTIALS, SECTIONS, RunConfig, child_toml, derived, run_workdir, trainer_folders
from rollstream.v1 import rollout_pb2


StepM = TypeVar("StepM", rollout_pb2.StepMetrics, rollout_pb2.EvalMetrics)


@dataclass
class Progress:
    by_step: dict[int, rollout_pb2.StepMetrics] = field(default_factory=dict)
    last_id: bytes = b"0-0"
    evals: dict[int, rollout_pb2.EvalMetrics] = field(default_factory=dict)  # held-out rounds by step
    evals_last_id: bytes = b"0-0"

    @property
    def steps(self) -> list[rollout_pb2.StepMetrics]:
        return [self.by_step[k] for k in sorted(self.by_step)]

    def poll(self, client: redis_policy.Client, keys: run_keys.RunKeys) -> list[rollout_pb2.StepMetrics]:
        """New step metrics (an entry that does not decode or check is skipped: anyone can
        write to the stream, and the display must not die of it)."""
        self.last_id, new = read_by_step(client, keys.metrics, self.last_id, rollout_pb2.StepMetrics, self.by_step, validation.check_metrics)
        return new

    def poll_evals(self, client: redis_policy.Client, keys: run_keys.RunKeys) -> list[rollout_pb2.EvalMetrics]:
        """New held-out rounds (one that does not decode is skipped, as in `poll`)."""
        self.evals_last_id, new = read_by_step(client, keys.evals, self.evals_last_id, rollout_pb2.EvalMetrics, self.evals)
        return new


def read_by_step(client: redis_policy.Client, stream: str, after: bytes, message: type[StepM], by_step: dict[int, StepM],
                 check: Callable[[StepM], None] | None = None) -> tuple[bytes, list[StepM]]:
    """The entries of `stream` after id `after`, decoded as `message` (and checked), into
    `by_step`; returns the last id read and the messages of steps not seen before."""
    new = []
    for eid, fields in client.xrange(stream, min=b"(" + after, count=1000):
        after = eid
        try:
            m = codec.decode(fields, message)
            if check is not None:
                check(m)
        except codec.EntryError:
            continue
        if m.step not in by_step:
            new.append(m)
        by_step[m.step] = m
    return after, new


def _mean(xs: list[float], digits: int) -> float | None:
    """Rounded mean, or None (JSON null) when there is nothing to average."""
    return round(sum(xs) / len(xs), digits) if xs else None


def summary(steps: list[rollout_pb2.StepMetrics], wall_s: float, evals: Sequence[rollout_pb2.EvalMetrics] = ()) -> dict:
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
        "held_out": [
            {"step": m.step, "accuracy": round(m.accuracy, 4), "pass_at_k": round(m.pass_at_k, 4), "reward_mean": round(m.reward_mean, 4),
             "prompts": m.prompts, "samples": m.samples, "version": m.version, "version_max": m.version_max}
            for m in evals
        ],
    }


def cmd_up(cfg: RunConfig) -> int:
    # The run's data (the AOF's prompts and test answers, checkpoints, logs) is the owner's
    # alone: `up` and every service it starts create files 0600 and folders 0700.
    with procs.owner_only():
        return _up(cfg)


def child_env(service: str, values: dict[str, Any]) -> dict[str, str]:
    """`up`'s environment for a child, less the ROLLSTREAM_* variables that would override its
    configuration file (the run configuration read them already). Credentials `up` does not
    set stay: with an external Redis they are the operator's (docs/security.md)."""
    fields = {ENV_PREFIX + name.upper() for name in SECTIONS[service].model_fields if name not in CREDENTIALS or name in values}
    env = {k: v for k, v in os.environ.items() if k not in fields | {ENV_PREFIX + "CONFIG"}}
    return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def configured_child(name: str, service: str, values: dict[str, Any], flags: list[str], workdir: Path) -> Child:
    """A child started with its section as WORKDIR/config/<name>.toml (and its credentials as
    flags: paths of files, never the secrets)."""
    path = workdir / "config" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(values))
    return Child(name, [service, "--config", str(path), *flags], child_env(service, values), workdir)


def delta_text(m: rollout_pb2.StepMetrics) -> str:
    """The step's delta for the console: an encoded one always has bytes (a header at least),
    so 0 is a step whose delta nobody would read (the step log's delta_skipped)."""
    return f"delta {100 * m.delta_bytes / max(m.dense_bytes, 1):.2f}% of dense" if m.delta_bytes else "no delta (no reader)"


def colocated_child(cfg: RunConfig, trainer_values: dict[str, Any], own: Callable[[str], list[str]], workdir: Path, **generator_values: Any) -> Child:
    """The trainer and the generator in one process (launcher/colocated.py), named `trainer`:
    its gRPC and HTTP sides and its state file are the trainer's. The generator's settings go
    in their own file, its credentials' files as --generator-flag pairs."""
    from rollstream.launcher.colocated import ASYNC  # imported already by RunConfig's check

    trainer_path = workdir / "config" / "trainer.toml"
    generator_path = workdir / "config" / "generator-0.toml"
    generator_values = child_toml(cfg.generator, "generator", **generator_values, **derived(cfg.trainer)["generator"], consumer="generator-0")
    trainer_path.parent.mkdir(parents=True, exist_ok=True)
    trainer_path.write_text(tomli_w.dumps(trainer_values))
    generator_path.write_text(tomli_w.dumps(generator_values))
    flags = own("generator")
    generator_flags = [a for name, value in zip(flags[::2], flags[1::2]) for a in ("--generator-flag", name, value)]
    variant = [ASYNC] if cfg.colocate_async else []
    args = ["launcher.colocated", *variant, "--config", str(trainer_path), *own("trainer"), "--generator-config", str(generator_path), *generator_flags]
    env = child_env("trainer", trainer_values)
    kept = child_env("generator", generator_values)
    return Child("trainer", args, {k: v for k, v in env.items() if k in kept}, workdir)


def _up(cfg: RunConfig) -> int:
    console = plain_console(stderr=True)
    if cfg.colocated:
        from rollstream.launcher.colocated import vllm_missing  # imported already by RunConfig's check

        missing = vllm_missing(cfg.generator)
        if missing:  # said now, not by the colocated process once the trainer has loaded
            console.print(missing, style="red")
            return 2
    workdir = run_workdir(cfg.workdir, cfg.run)
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)  # also a workdir an older run left open to others
    # Every gRPC server and the embedded Redis listen on unix sockets in the run's 0700
    # folders, never on a TCP port: a port a restarting server gives up can be bound by any
    # local user, who then hears every password and token sent to it (issue 42).
    sockets = workdir / "sockets"
    sockets.mkdir(exist_ok=True)
    sockets.chmod(0o700)
    try:
        for longest in (sockets / "reference-0.sock", sockets / f"generator-{cfg.generators - 1}.sock", workdir / "redis" / SOCKET_NAME):
            check_socket_length(longest)
    except ValueError as e:
        console.print(str(e), style="red")
        return 2
    checkpoints = Path(cfg.trainer.checkpoint_dir)
    step_log = workdir / steplog.FILE_NAME
    steps = cfg.trainer.steps  # 0: until stopped
    if cfg.fresh:
        if checkpoints.exists():
            shutil.rmtree(checkpoints)  # a fresh run must not resume the last one's checkpoints
        step_log.unlink(missing_ok=True)  # nor append to the last one's curve
        (workdir / "restarts.json").unlink(missing_ok=True)
    # Resolve (and on first use convert) the model once, before any service races to do it;
    # the conversion in a child process, so that `up` stays small for the whole run.
    from rollstream.core.models import ModelNotFoundError, resolve_model_in_child

    console.print(Text("rollstream up", style="bold"), f"run={cfg.run} workdir={workdir}{'' if cfg.fresh else ' (continuing the run)'}")
    try:
        model = str(resolve_model_in_child(cfg.model))
    except ModelNotFoundError as e:
        console.print(str(e), style="red")
        return 2
    console.print(f"model: {model}")
    # Every service gets its own credentials (docs/security.md): a gRPC token per role, and
    # on the embedded server a Redis ACL user per role. Kept across runs in the workdir.
    creds = workdir / "credentials"
    tokens = credentials.ensure_grpc_tokens(creds)
    admin = ClientCredentials(token=tokens["admin"])
    embedded = None
    admin_redis: tuple[str | None, str | None] = (None, None)  # an external URL brings its own
    if cfg.redis_url:
        redis_url = cfg.redis_url
    else:
        # With a reference stage, `ready` is the reference's alone: the reward user cannot write it.
        passwords = redis_acl.ensure_redis_credentials(creds, reference_stage=cfg.with_reference)
        admin_redis = (redis_acl.ADMIN, passwords[redis_acl.ADMIN])
        embedded = EmbeddedRedis(
            workdir / "redis", aclfile=redis_acl.acl_file(creds), admin_password=passwords[redis_acl.ADMIN], state_file=workdir / "state" / "redis.json",
            unix_socket=True,
        ).start()
        redis_url = embedded.url
        console.print(f"embedded redis-server: {redis_url} (data in {workdir / 'redis'}, AOF on, ACL users per service in {creds})")
    keys = run_keys.RunKeys(cfg.run)
    try:
        client = redis_policy.connect(redis_url, *admin_redis)
        if cfg.fresh:
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
    max_staleness = cfg.trainer.max_staleness
    cores = os.cpu_count() or 2
    trainer_threads = cfg.threads or cores
    side_threads = cfg.threads or max(1, cores // 2)
    shared = {"run": cfg.run, "redis_url": redis_url, "log_json": cfg.log_json}

    def own(role: str) -> list[str]:
        return credentials.service_flags(creds, role, redis_acl=embedded is not None)

    def socket(name: str) -> str:
        """A child's gRPC socket: the same path across its restarts (the trainer's keeps the
        generators' catch-up address), in a folder only this user can enter."""
        return str(sockets / f"{name}.sock")

    trainer_values = child_toml(
        cfg.trainer, "trainer", **shared, model=model, threads=trainer_threads, grpc_socket=socket("trainer"), consumer="trainer-0",
        **trainer_folders(workdir), metrics_file=str(step_log),
    )
    if cfg.colocated:
        trainer = colocated_child(
            cfg, trainer_values, own, workdir, **shared, model=model, threads=trainer_threads, seed=cfg.generator.seed, grpc_socket=socket("generator-0")
        )
    else:
        trainer = configured_child("trainer", "trainer", trainer_values, own("trainer"), workdir)
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
        trainer_address = trainer.grpc_address()
        for i in range(0 if cfg.colocated else cfg.generators):
            generator_values = child_toml(
                cfg.generator, "generator", **shared, **derived(cfg.trainer)["generator"], model=model, threads=trainer_threads if max_staleness == 0 else side_threads,
                trainer_address=trainer_address, weight_store=trainer_values["anchor_dir"], consumer=f"generator-{i}",
                seed=cfg.generator.seed + i, grpc_socket=socket(f"generator-{i}"),
            )
            children.append(configured_child(f"generator-{i}", "generator", generator_values, own("generator"), workdir))
        output_stage = "scored" if cfg.with_reference else "ready"
        external: ExternalReward | None = None
        if cfg.external_reward:
            external = ExternalReward(
                redis_url=redis_url, keys=keys, group=cfg.reward.group, output_stage=output_stage,
                username=REWARD_ROLE if embedded is not None else "",
                password_file=redis_acl.password_file(creds, REWARD_ROLE) if embedded is not None else None,
            )
        else:
            reward_values = child_toml(cfg.reward, "reward", **shared, output_stage=output_stage, consumer="reward-0", grpc_socket=socket("reward-0"))
            children.append(configured_child("reward-0", "reward", reward_values, own("reward"), workdir))
        if cfg.with_reference:
            reference_values = child_toml(
                cfg.reference, "reference", **shared, **derived(cfg.trainer)["reference"], model=model, threads=side_threads, consumer="reference-0", grpc_socket=socket("reference-0")
            )
            children.append(configured_child("reference-0", "reference", reference_values, own("reference"), workdir))
        for child in children[1:]:
            child.start()
        for child in children[1:]:
            child.grpc_address()
        names = [c.name for c in children]  # the trainer first
        if cfg.colocated:
            engine = ", vLLM" if cfg.generator.backend == "vllm" else ""
            names[0] += f" (with generator-0 in its process{engine}{', asynchronous' if cfg.colocate_async else ''})"
        console.print(f"services up: {', '.join(names)}; logs in {workdir / 'logs'}")
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
                for child in children:
                    if child.exited():
                        code = child.proc.returncode if child.proc is not None else None
                        if child is trainer and code == 0:
                            # steps 0 runs until stopped: an exit of 0 then came from outside (SIGTERM).
                            console.print(f"the trainer exited before step {steps}" if steps else "the trainer was stopped from outside", style="red")
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
                        # GRPO's loss is ~1e-8 when the mean advantage is 0 (+0.0000 at 4
                        # decimals): 3 significant digits, and the gradient norm, which moves.
                        console.print(
                            f"step {m.step:>3}/{steps or '-'}  reward {m.reward_mean:.3f} ±{m.reward_std:.3f}  "
                            f"loss {m.loss:+.3g}  grad norm {m.grad_norm:.3g}  length {m.tokens / max(m.completions, 1):.1f} tokens  "
                            f"staleness {m.mean_staleness:.2f}  {delta_text(m)}  "
                            f"{m.step_seconds:.1f}s  {m.train_tokens_per_s:.0f} tok/s"
                        )
                    for held_out in progress.poll_evals(client, keys):
                        console.print(pipeline_status.eval_line(held_out))
                    stats = run_keys.read_counters(client, keys)[0]
                    if redis_down:
                        console.print("Redis answers again", style="green")
                        redis_down = False
                except redis_policy.ERRORS as e:
                    if not redis_down:
                        console.print(f"Redis unavailable ({redis_policy.short(e)}); the services wait and retry", style="yellow")
                        redis_down = True
                    time.sleep(1.0)
                    continue
                # The trainer reports the round after the last step before it stops training.
                trained = cfg.trainer.eval_only or (steps and progress.by_step and max(progress.by_step) >= steps)
                if trained and (not cfg.trainer.eval_prompts or (progress.evals if cfg.trainer.eval_only else steps in progress.evals)):
                    finished = True
                    break
                status.update(
                    Text(
                        reward_line
                        or f"steps {len(progress.by_step)}/{steps or '-'}  elapsed {time.monotonic() - started:.0f}s  "
                        f"generated {stats.get('generated', 0)}  trained {stats.get('trained', 0)}  stale {stats.get('stale', 0)}  "
                        f"evaluated {stats.get('evaluated', 0)}"
                    )
                )
                time.sleep(0.5)
        if finished:
            versions = settle_versions(trainer, [c for c in children if c.name.startswith("generator-")], admin)
    except ChildFailed as e:  # at start: a bad setting (2) or a broken install; nothing to restart
        console.print(str(e), style="red")
        return 2 if e.returncode == 2 else 1
    finally:
        if trainer.proc is not None and trainer.proc.poll() is None and not finished:
            console.print("stopping: the trainer finishes its current step first (Ctrl-C again does not hurry it)")
        for child in reversed(children):
            # A step on CPU can take a minute; killed mid-step it would lose nothing (its groups
            # are not acknowledged), but a clean exit flushes its logs and metrics.
            child.stop(timeout_s=120.0 if child is trainer else 30.0)
        wall = time.monotonic() - started
        result = summary(progress.steps, wall, [progress.evals[k] for k in sorted(progress.evals)])
        result["versions"] = versions
        result["restarts"] = {c.name: c.restarts for c in children if c.restarts}
        try:
            result["stats"] = run_keys.read_counters(client, keys)[0]
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
        if len(progress.evals) >= 2:
            first, last = progress.evals[min(progress.evals)], progress.evals[max(progress.evals)]
            console.print(f"held-out accuracy: {100 * first.accuracy:.0f}% at step {first.step} -> {100 * last.accuracy:.0f}% at step {last.step}")
        elif stopping:
            console.print("stopped before the first step")
        if checkpoints.is_dir():
            # What resume needs (docs/reliability.md, "Checkpoints"): the trainer prunes the rest.
            held = sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file())
            console.print(f"checkpoints: {held / 1e9:.2f} GB in {checkpoints} ({', '.join(sorted(p.name for p in checkpoints.iterdir())) or 'none'})")
        if (exported := Path(trainer_values["export_dir"])).is_dir():  # the trained model (trainer/export.py)
            console.print(f"model: {exported}", soft_wrap=True)
        if step_log.exists() and not cfg.trainer.eval_only:
            _plot_curve(step_log, workdir / "curves.png", console)
    return 0


def _plot_curve(step_log: Path, out: Path, console: Console) -> None:
    """The run's curves at the end of `up` (a plotting failure is reported, never fatal)."""
    from rollstream.launcher import plot

    try:
        path, log = plot.render(step_log, out)
    except plot.PlotError as e:
        console.print(f"no curve: {e}", style="yellow", soft_wrap=True)
        return
    console.print(f"curves: {path}" + (f" ({len(log.skipped)} unreadable lines of {step_log} skipped)" if log.skipped else ""), soft_wrap=True)


REWARD_ROLE = "reward"  # the credentials role (gRPC token, Redis ACL user) of any reward stage
# Written by `up --external-reward` into the workdir: what the outside service needs, as JSON.
EXTERNAL_REWARD_FILE = "external-reward.json"


@dataclass
class ExternalReward:
    """`up --external-reward`: no built-in reward process. What an outside reward service must
    use (printed, and written to WORKDIR/external-reward.json), and whether one has joined:
    a consumer in `group` on the rollouts stream (docs/custom-reward.md)."""

    redis_url: str
    keys: run_keys.RunKeys
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
            "stats_hash": self.keys.counters("reward"),
            "task_map": self.keys.tasks,  # what to score against (docs/custom-reward.md)
            "max_deliveries": CommonSettings.model_fields["max_deliveries"].default,
            "claim_idle_ms": CommonSettings.model_fields["claim_idle_ms"].default,
        }

    def instructions(self) -> str:
        return (
            "reward: external (no built-in reward process; docs/custom-reward.md is the contract). What an outside service "
            f"uses, also in WORKDIR/{EXTERNAL_REWARD_FILE} (read the password from its file, never put it on a command line):\n"
            + json.dumps(self.as_dict(), indent=2)
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


def _write_restarts(workdir: Path, children: list[Child]) -> None:
    """WORKDIR/restarts.json: service -> restarts so far (written whole, then renamed)."""
    path = workdir / "restarts.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({c.name: c.restarts for c in children if c.restarts}))
    tmp.replace(path)


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
