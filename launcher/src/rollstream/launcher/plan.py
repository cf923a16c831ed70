"""`rollstream up`'s plan: a pure function from the run configuration to what `up` starts
(each child's command, the TOML it reads, its socket and credentials' files, its restart
policy; the Redis; what an external reward service must use). up.py's `supervise` runs it,
`rollstream config` prints it, tests/unit/test_up_plan.py checks it without processes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from rollstream.core import credentials, redis_acl, redis_policy, run_keys, steplog
from rollstream.core.config import CommonSettings
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.launcher.run_config import RunConfig, child_toml, derived, run_workdir, trainer_folders


@dataclass(frozen=True)
class ChildPlan:
    """One process: `python -m rollstream.<module> --config WORKDIR/config/<name>.toml`."""

    name: str  # its config, log and state files' name
    module: str
    config: dict[
        str, Any
    ]  # the TOML it reads: its section's values, what `up` sets, its credentials' files (never a secret)
    sections: tuple[str, ...]  # the services whose settings it reads (two for the colocated process: a table each)

    def tables(self) -> dict[str, dict[str, Any]]:
        return {s: self.config[s] for s in self.sections} if len(self.sections) > 1 else {self.sections[0]: self.config}

    def path(self, workdir: Path) -> Path:
        return workdir / "config" / f"{self.name}.toml"

    def args(self, workdir: Path) -> list[str]:  # procs.Child's (it adds --state-file)
        return [self.module, "--config", str(self.path(workdir))]


@dataclass(frozen=True)
class Plan:
    """What `up` runs, in order: the trainer first (the others start once it serves)."""

    workdir: Path
    redis_url: str
    embedded_redis: bool  # a redis-server in WORKDIR/redis with an ACL user per role, else the operator's
    children: tuple[ChildPlan, ...]
    external_reward: ExternalReward | None
    # A child that fails restarts under its name, resuming its pending entries (the trainer its
    # latest checkpoint), ever more slowly while it keeps dying at once. The trainer's exit 0 ends
    # the run; exit 2, a refused configuration, stops it (a restart would fail the same way).
    restart: str = "on-failure (exit 2 stops the run)"

    @property
    def sockets(self) -> list[Path]:
        """Every unix socket of the run (each path must fit a sockaddr_un)."""
        found = [Path(t["grpc_socket"]) for c in self.children for t in c.tables().values()]
        return [*found, *([self.workdir / "redis" / "redis.sock"] if self.embedded_redis else [])]


def redis_url_of(cfg: RunConfig) -> str:
    """The run's Redis: the configured one, else the embedded server's socket in WORKDIR/redis."""
    return cfg.redis_url or EmbeddedRedis(run_workdir(cfg.workdir, cfg.run) / "redis", unix_socket=True).url


def plan(cfg: RunConfig, model: str, redis_url: str, cores: int) -> Plan:
    """The children of a run of `cfg`: `model` is the resolved model, `redis_url` the embedded
    server's (or cfg.redis_url), `cores` the machine's."""
    workdir = run_workdir(cfg.workdir, cfg.run)
    creds = workdir / "credentials"
    embedded = not cfg.redis_url
    common = {"run": cfg.run, "redis_url": redis_url, "log_json": cfg.log_json}
    shared = {**common, "model": model}  # the reward service alone has no model
    derive = derived(cfg.trainer)  # what the trainer's settings decide for the others
    # The trainer's step is the long pole: it gets every core. With max_staleness >= 1 the
    # next batch is sampled while the trainer trains, so the generators (and the reference)
    # get half; synchronous (0), sampling and training take turns and both get every core.
    max_staleness = cfg.trainer.max_staleness
    trainer_threads = cfg.threads or cores
    side_threads = cfg.threads or max(1, cores // 2)

    def values(section: str, name: str, **set_by_up: Any) -> dict[str, Any]:
        # Every gRPC server listens on a unix socket in the run's 0700 folder, never on a TCP
        # port: a port a restarting server gives up can be bound by any local user, who then
        # hears every password and token sent to it (issue 42). The same path across restarts.
        # Its role's credentials: paths of files, never the secrets (docs/security.md).
        flags = credentials.service_flags(creds, section, redis_acl=embedded)
        own = {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}
        return child_toml(
            getattr(cfg, section), section, **set_by_up, grpc_socket=str(workdir / "sockets" / f"{name}.sock"), **own
        )

    def generator(i: int, **more: Any) -> dict[str, Any]:
        return values(
            "generator",
            f"generator-{i}",
            **shared,
            **derive["generator"],
            consumer=f"generator-{i}",
            seed=cfg.generator.seed + i,
            **more,
        )

    trainer_values = values(
        "trainer",
        "trainer",
        **shared,
        threads=trainer_threads,
        consumer="trainer-0",
        **trainer_folders(workdir),
        metrics_file=str(workdir / steplog.FILE_NAME),
    )
    if cfg.colocated:  # named `trainer`: its gRPC and HTTP sides and its state file are the trainer's
        both = {"colocate": cfg.colocate, "trainer": trainer_values, "generator": generator(0, threads=trainer_threads)}
        children = [ChildPlan("trainer", "launcher.colocated", both, ("trainer", "generator"))]
    else:
        children = [ChildPlan("trainer", "trainer", trainer_values, ("trainer",))]
        for i in range(cfg.generators):
            more = {
                "threads": trainer_threads if max_staleness == 0 else side_threads,
                "weight_store": trainer_values["anchor_dir"],
                "trainer_address": f"unix:{trainer_values['grpc_socket']}",
            }
            children.append(ChildPlan(f"generator-{i}", "generator", generator(i, **more), ("generator",)))
    external = None
    if cfg.external_reward:
        external = ExternalReward(
            redis_url=redis_url,
            keys=run_keys.RunKeys(cfg.run),
            group=cfg.reward.group,
            output_stage=derive["reward"]["output_stage"],
            username=REWARD_ROLE if embedded else "",
            password_file=redis_acl.password_file(creds, REWARD_ROLE) if embedded else None,
        )
    else:
        reward = values("reward", "reward-0", **common, **derive["reward"], consumer="reward-0")
        children.append(ChildPlan("reward-0", "reward", reward, ("reward",)))
    if cfg.with_reference:
        reference = values(
            "reference", "reference-0", **shared, **derive["reference"], threads=side_threads, consumer="reference-0"
        )
        children.append(ChildPlan("reference-0", "reference", reference, ("reference",)))
    return Plan(workdir, redis_url, embedded, tuple(children), external)


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
