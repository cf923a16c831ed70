"""`rollstream up`: the whole system as local processes, from one run configuration: a plan
(plan.py: which children, with what configuration) and the supervisor that runs it.

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
from typing import Any, Generic, TypeVar

import tomli_w
from rich.console import Console
from rich.text import Text

from rollstream.core import credentials, redis_acl, redis_policy, run_keys, steplog, validation
from rollstream.core import status as pipeline_status
from rollstream.core.config import ENV_PREFIX
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.launcher import procs, warm_start
from rollstream.launcher.cli import plain_console
from rollstream.launcher.colocation import vllm_missing
from rollstream.launcher.plan import EXTERNAL_REWARD_FILE, Plan, plan, redis_url_of
from rollstream.launcher.procs import Child, ChildFailed, tail
from rollstream.launcher.redis_server import EmbeddedRedis, check_socket_length
from rollstream.launcher.run_config import CREDENTIALS, SECTIONS, RunConfig, run_workdir
from rollstream.v1 import rollout_pb2

StepM = TypeVar("StepM", rollout_pb2.StepMetrics, rollout_pb2.EvalMetrics)


@dataclass
class ByStep(Generic[StepM]):
    """A metrics stream read as it grows, its latest entry of each step. An entry that does not
    decode (or check) is skipped: anyone can write to the stream, and the display must not die of it."""

    message: type[StepM]
    check: Callable[[StepM], None] | None = None
    seen: dict[int, StepM] = field(default_factory=dict)
    last_id: bytes = b"0-0"

    def in_order(self) -> list[StepM]:
        return [self.seen[k] for k in sorted(self.seen)]

    def poll(self, client: redis_policy.Client, stream: str) -> list[StepM]:
        """The entries after the last one read; returns the messages of steps not seen before."""
        new = []
        for eid, fields in client.xrange(stream, min=b"(" + self.last_id, count=1000):
            self.last_id = eid
            try:
                m = validation.decode(fields, self.message)
                if self.check is not None:
                    self.check(m)
            except validation.EntryError:
                continue
            if m.step not in self.seen:
                new.append(m)
            self.seen[m.step] = m
        return new


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
            {
                "step": m.step,
                "accuracy": round(m.accuracy, 4),
                "pass_at_k": round(m.pass_at_k, 4),
                "reward_mean": round(m.reward_mean, 4),
                "prompts": m.prompts,
                "samples": m.samples,
                "version": m.version,
                "version_max": m.version_max,
            }
            for m in evals
        ],
    }


def cmd_up(cfg: RunConfig) -> int:
    # The run's data (the AOF's prompts and test answers, checkpoints, logs) is the owner's
    # alone: `up` and every service it starts create files 0600 and folders 0700.
    with procs.owner_only():
        return _up(cfg)


def child_env(tables: dict[str, dict[str, Any]]) -> dict[str, str]:
    """`up`'s environment for a child, less the ROLLSTREAM_* variables that would override its
    configuration file (the run configuration read them already). Credentials `up` does not
    set stay: with an external Redis they are the operator's (docs/security.md)."""
    fields = {
        ENV_PREFIX + name.upper()
        for service, values in tables.items()
        for name in SECTIONS[service].model_fields
        if name not in CREDENTIALS or name in values
    }
    env = {k: v for k, v in os.environ.items() if k not in fields | {ENV_PREFIX + "CONFIG"}}
    return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def delta_text(m: rollout_pb2.StepMetrics) -> str:
    """The step's delta for the console: an encoded one always has bytes (a header at least),
    so 0 is a step whose delta nobody would read (the step log's delta_skipped)."""
    return (
        f"delta {100 * m.delta_bytes / max(m.dense_bytes, 1):.2f}% of dense"
        if m.delta_bytes
        else "no delta (no reader)"
    )


def _up(cfg: RunConfig) -> int:
    """Prepare the run (its folders, model, credentials, Redis), plan it, and supervise the plan."""
    console = plain_console(stderr=True)
    if cfg.colocated and (missing := vllm_missing(cfg.generator)):  # said now, not once the trainer has loaded
        console.print(missing, style="red")
        return 2
    workdir = run_workdir(cfg.workdir, cfg.run)
    for folder in (workdir, workdir / "sockets"):  # also a workdir an older run left open to others
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
    if cfg.fresh:
        if Path(cfg.trainer.checkpoint_dir).exists():
            shutil.rmtree(cfg.trainer.checkpoint_dir)  # a fresh run must not resume the last one's checkpoints
        (workdir / steplog.FILE_NAME).unlink(missing_ok=True)  # nor append to the last one's curve
        (workdir / "restarts.json").unlink(missing_ok=True)
    # Resolve (and on first use convert) the model once, before any service races to do it;
    # the conversion in a child process, so that `up` stays small for the whole run.
    from rollstream.core.models import ModelNotFoundError, resolve_model_in_child

    console.print(
        Text("rollstream up", style="bold"),
        f"run={cfg.run} workdir={workdir}{'' if cfg.fresh else ' (continuing the run)'}",
    )
    try:
        model = str(resolve_model_in_child(cfg.model))
        if cfg.warm_start:  # SFT first, then GRPO from its model (warm_start.py)
            model = warm_start.warm_start(cfg.trainer, cfg.warm_start, model, workdir, cfg.run, cfg.generator.seed,
                                          cfg.threads, cfg.fresh, console)  # fmt: skip
        the_plan = plan(cfg, model, redis_url_of(cfg), os.cpu_count() or 2)
        for path in the_plan.sockets:
            check_socket_length(path)
    except (ModelNotFoundError, ValueError) as e:
        console.print(str(e), style="red")
        return 2
    except warm_start.WarmStartError as e:
        console.print(str(e), style="red")
        return 1
    console.print(f"model: {the_plan.children[0].tables()['trainer']['model']}")
    # Every service gets its own credentials (docs/security.md): a gRPC token per role, and
    # on the embedded server a Redis ACL user per role. Kept across runs in the workdir.
    creds = workdir / "credentials"
    admin = ClientCredentials(token=credentials.ensure_grpc_tokens(creds)["admin"])
    embedded = None
    admin_redis: tuple[str | None, str | None] = (None, None)  # an external URL brings its own
    if the_plan.embedded_redis:
        # With a reference stage, `ready` is the reference's alone: the reward user cannot write it.
        passwords = redis_acl.ensure_redis_credentials(creds, reference_stage=cfg.with_reference)
        admin_redis = (redis_acl.ADMIN, passwords[redis_acl.ADMIN])
        embedded = EmbeddedRedis(
            workdir / "redis",
            aclfile=redis_acl.acl_file(creds),
            admin_password=passwords[redis_acl.ADMIN],
            state_file=workdir / "state" / "redis.json",
            unix_socket=True,
        ).start()
        console.print(
            f"embedded redis-server: {embedded.url} (data in {workdir / 'redis'}, AOF on, ACL users per service in {creds})"
        )
    keys = run_keys.RunKeys(cfg.run)
    try:
        client = redis_policy.connect(the_plan.redis_url, *admin_redis)
        if cfg.fresh and (stale_keys := list(client.scan_iter(match=keys.prefix + "*"))):
            client.delete(*stale_keys)
    except redis_policy.ERRORS as e:
        console.print(
            f"Redis at {redis_policy.redact(the_plan.redis_url)} does not answer: {redis_policy.short(e)}", style="red"
        )
        if embedded is not None:
            embedded.stop()
        return 1
    return supervise(the_plan, cfg, Supervised(console, client, keys, embedded, admin))


@dataclass
class Supervised:
    """What `supervise` works with besides the plan, and what it learns as the run goes."""

    console: Console
    client: redis_policy.Client
    keys: run_keys.RunKeys
    embedded: EmbeddedRedis | None
    admin: ClientCredentials  # the admin role's gRPC credentials (settle_versions)
    children: list[Child] = field(default_factory=list)
    steps: ByStep[rollout_pb2.StepMetrics] = field(
        default_factory=lambda: ByStep(rollout_pb2.StepMetrics, validation.check_metrics)
    )
    evals: ByStep[rollout_pb2.EvalMetrics] = field(default_factory=lambda: ByStep(rollout_pb2.EvalMetrics))  # held-out
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False
    finished: bool = False


def supervise(the_plan: Plan, cfg: RunConfig, run: Supervised) -> int:
    """Run a plan: each child with its configuration file, restarted as the plan says, the
    progress shown, until the last step (or Ctrl-C); then stop it all and write the summary."""
    workdir = the_plan.workdir
    for spec in the_plan.children:
        path = spec.path(workdir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tomli_w.dumps(spec.config))
        run.children.append(Child(spec.name, spec.args(workdir), child_env(spec.tables()), workdir))

    def on_sigint(signum: int, _frame: object) -> None:
        run.stopping = True

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    versions: dict[str, int] = {}
    try:
        _start(the_plan, cfg, run)
        code = _watch(the_plan, cfg, run)
        if code is not None:
            return code
        if run.finished:
            versions = settle_versions(
                run.children[0], [c for c in run.children if c.name.startswith("generator-")], run.admin
            )
    except ChildFailed as e:  # at start: a bad setting (2) or a broken install; nothing to restart
        run.console.print(str(e), style="red")
        return 2 if e.returncode == 2 else 1
    finally:
        _stop_and_report(the_plan, cfg, run, versions)
    return 0


def _start(the_plan: Plan, cfg: RunConfig, run: Supervised) -> None:
    """The trainer first (the others need its socket and its checkpoint), then the rest."""
    trainer, *others = run.children
    trainer.start()
    run.console.print("starting trainer (loading the model)...")
    trainer.grpc_address()
    for child in others:
        child.start()
    for child in others:
        child.grpc_address()
    names = [c.name for c in run.children]  # the trainer first
    if cfg.colocated:
        engine = ", vLLM" if cfg.generator.backend == "vllm" else ""
        names[0] += f" (with generator-0 in its process{engine}{', asynchronous' if cfg.colocate == 'async' else ''})"
    run.console.print(f"services up: {', '.join(names)}; logs in {the_plan.workdir / 'logs'}")
    run.console.print(
        f"dashboard: http://127.0.0.1:{trainer.http_port()}/dashboard (metrics: /metrics on each service's HTTP port)"
    )
    if (external := the_plan.external_reward) is not None:
        run.console.print(external.instructions())
        external.write(the_plan.workdir / EXTERNAL_REWARD_FILE)
        run.console.print(external.waiting_line())  # a line in the log too: the spinner is not kept


def _restart_the_dead(the_plan: Plan, cfg: RunConfig, run: Supervised) -> int | None:
    """Restart each child that exited (the plan's restart policy); the run's exit status when
    one that must not be restarted did."""
    if run.embedded is not None and run.embedded.proc is not None and run.embedded.proc.poll() is not None:
        run.console.print(
            f"redis-server exited with {run.embedded.proc.returncode}; restarting it on its AOF", style="yellow"
        )
        run.embedded.stop()
        _restart_redis(run.embedded, run.console)
    for child in run.children:
        if not child.exited():
            continue
        code = child.proc.returncode if child.proc is not None else None
        if child is run.children[0] and code == 0:
            # steps 0 runs until stopped: an exit of 0 then came from outside (SIGTERM).
            steps = cfg.trainer.steps
            run.console.print(
                f"the trainer exited before step {steps}" if steps else "the trainer was stopped from outside",
                style="red",
            )
            return 1
        if code == 2:  # a bad setting: restarting would fail the same way
            run.console.print(
                Text(f"{child.name} refused its configuration:", style="red"), tail(child.log_path, 10), sep="\n"
            )
            return 2
        delay = child.restart_delay_s()
        child.restarts += 1
        _write_restarts(the_plan.workdir, run.children)  # `rollstream status --workdir` shows a crash loop
        run.console.print(
            Text(f"{child.name} exited with {code}; restarting ({child.restarts}) in {delay:.0f}s", style="yellow"),
            tail(child.log_path, 10),
            sep="\n",
        )
        time.sleep(delay)
        child.start()
    return None


def _watch(the_plan: Plan, cfg: RunConfig, run: Supervised) -> int | None:
    """Supervise until the last step (run.finished), Ctrl-C (None), or a child that ends the run (its status)."""
    steps = cfg.trainer.steps  # 0: until stopped
    external = the_plan.external_reward
    redis_down = False
    # Text: a spinner's str is read as markup whatever the console says.
    with run.console.status(
        Text(external.waiting_line() if external is not None else "waiting for the first step...")
    ) as status:
        while not run.stopping:
            if (code := _restart_the_dead(the_plan, cfg, run)) is not None:
                return code
            try:
                reward_line = external.poll(run.client, run.console) if external is not None else ""
                for m in run.steps.poll(run.client, run.keys.metrics):
                    # GRPO's loss is ~1e-8 when the mean advantage is 0 (+0.0000 at 4
                    # decimals): 3 significant digits, and the gradient norm, which moves.
                    run.console.print(
                        f"step {m.step:>3}/{steps or '-'}  reward {m.reward_mean:.3f} ±{m.reward_std:.3f}  "
                        f"loss {m.loss:+.3g}  grad norm {m.grad_norm:.3g}  length {m.tokens / max(m.completions, 1):.1f} tokens  "
                        f"staleness {m.mean_staleness:.2f}  {delta_text(m)}  {m.step_seconds:.1f}s  {m.train_tokens_per_s:.0f} tok/s"
                    )
                for held_out in run.evals.poll(run.client, run.keys.evals):
                    run.console.print(pipeline_status.eval_line(held_out))
                stats = run_keys.read_counters(run.client, run.keys)[0]
                if redis_down:
                    run.console.print("Redis answers again", style="green")
                    redis_down = False
            except redis_policy.ERRORS as e:
                if not redis_down:
                    run.console.print(
                        f"Redis unavailable ({redis_policy.short(e)}); the services wait and retry", style="yellow"
                    )
                    redis_down = True
                time.sleep(1.0)
                continue
            by_step, evals = run.steps.seen, run.evals.seen
            # The trainer reports the round after the last step before it stops training.
            trained = cfg.trainer.eval_only or (steps and by_step and max(by_step) >= steps)
            if trained and (not cfg.trainer.eval_prompts or (evals if cfg.trainer.eval_only else steps in evals)):
                run.finished = True
                return None
            status.update(
                Text(
                    reward_line
                    or f"steps {len(by_step)}/{steps or '-'}  elapsed {time.monotonic() - run.started:.0f}s  generated {stats.get('generated', 0)}  "
                    f"trained {stats.get('trained', 0)}  stale {stats.get('stale', 0)}  evaluated {stats.get('evaluated', 0)}"
                )
            )
            time.sleep(0.5)
    return None


def _stop_and_report(the_plan: Plan, cfg: RunConfig, run: Supervised, versions: dict[str, int]) -> None:
    """Stop every child (the trainer last), write WORKDIR/summary.json and say where the results are."""
    console, workdir, evals = run.console, the_plan.workdir, run.evals.seen
    trainer = run.children[0]
    if trainer.proc is not None and trainer.proc.poll() is None and not run.finished:
        console.print("stopping: the trainer finishes its current step first (Ctrl-C again does not hurry it)")
    for child in reversed(run.children):
        # A step on CPU can take a minute; killed mid-step it would lose nothing (its groups
        # are not acknowledged), but a clean exit flushes its logs and metrics.
        child.stop(timeout_s=120.0 if child is trainer else 30.0)
    result = summary(run.steps.in_order(), time.monotonic() - run.started, run.evals.in_order())
    result["versions"] = versions
    result["restarts"] = {c.name: c.restarts for c in run.children if c.restarts}
    try:
        result["stats"] = run_keys.read_counters(run.client, run.keys)[0]
    except redis_policy.ERRORS as e:
        console.print(f"could not read the run's counters: {redis_policy.short(e)}", style="yellow")
    run.client.close()
    if run.embedded is not None:
        run.embedded.stop()
    (workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    if run.steps.seen:
        console.print(
            Text.assemble(
                ("done", "bold"),
                f": {result['steps']} steps in {result['wall_seconds']}s; mean reward first 5 steps "
                f"{result['first5_reward_mean']}, last 5 steps {result['last5_reward_mean']} (summary: {workdir / 'summary.json'})",
            )
        )
    if len(evals) >= 2:
        first, last = evals[min(evals)], evals[max(evals)]
        console.print(
            f"held-out accuracy: {100 * first.accuracy:.0f}% at step {first.step} -> {100 * last.accuracy:.0f}% at step {last.step}"
        )
    elif run.stopping:
        console.print("stopped before the first step")
    if (checkpoints := Path(cfg.trainer.checkpoint_dir)).is_dir():
        # What resume needs (docs/reliability.md, "Checkpoints"): the trainer prunes the rest.
        held = sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file())
        console.print(
            f"checkpoints: {held / 1e9:.2f} GB in {checkpoints} ({', '.join(sorted(p.name for p in checkpoints.iterdir())) or 'none'})"
        )
    if (exported := Path(cfg.trainer.export_dir)).is_dir():  # the trained model (trainer/export.py)
        console.print(f"model: {exported}", soft_wrap=True)
    if (step_log := workdir / steplog.FILE_NAME).exists() and not cfg.trainer.eval_only:
        from rollstream.launcher import plot

        plot.render_at_end(step_log, workdir / "curves.png", console)


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
            console.print(
                f"redis-server did not start again ({str(e).splitlines()[0]}); retrying in {delay:.0f}s", style="yellow"
            )
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def settle_versions(
    trainer: Child, generators: list[Child], creds: ClientCredentials, timeout_s: float = 60.0
) -> dict[str, int]:
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
            return int(
                generator_pb2_grpc.GeneratorStub(ch)
                .GetState(generator_pb2.GetStateRequest(), timeout=10)
                .policy_version
            )

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
