"""What holds a run up: rules over a snapshot of its pipeline, naming the bottleneck or the
stuck stage and why. Pure: no Redis, no clock. `rollstream status` (core/status.py) reads the
snapshots from Redis; the rules compare the current one with the previous one (rates, growth).

The pipeline, stage by stage: each stage consumes one stream through its consumer group and
counts what it did in its own hash `stats:<role>` (plus `dead_<stream>` for what it dead-lettered;
run_keys.read_counters sums the four into the snapshot's counters):

  generator  prompts  -> rollouts   generated
  reward     rollouts -> scored     scored, reward_passthrough
  reference  scored   -> ready      referenced              (only in runs with a reference stage)
  trainer    ready    -> a step     trained, stale, duplicates, evaluated (held-out groups: counted, never trained)

A stream's backlog is what its group has not acknowledged: unread (lag) + pending. `prompts`
always holds about `prompt_buffer` tasks (the trainer keeps it full): backlog there is normal.

The rules, most serious first (`diagnose` returns every finding, the first is the headline):
  crash loop        a service `up` restarted `crash_restarts` times, or once more since the last look
  no group          a stream with a backlog and no consumer group: its stage never started
  no consumer       a group with a backlog and no consumer in it
  deadlock          the trainer holds a partial batch and waits, while the generators are held back
                    by what waits downstream (that very batch): back-pressure below a step's groups
  not reading       a backlog, every consumer of the group idle for `idle_s` (dead or hung), and
                    nothing consumed since the last look (a slow batch idles its consumer too);
                    not for the generators while groups wait downstream (back-pressure holds them),
                    nor for the trainer during a step (it reads nothing until it commits)
  falling behind    a stage's backlog grew since the last look and it consumed nothing
  generator behind  a live generator more than `max_staleness` versions behind the trainer, or
                    with no weights; or no generator registered at all
  dead letters      the dead-letter stream grew since the last look (with the last reason)
  trainer waiting   nothing unread in `ready` and no step in progress (fewer than a step's groups,
                    the `groups_per_step` the trainer records in its counters, pending on it): the
                    bottleneck is the stage nearest the trainer with a backlog (or nothing is in
                    flight at all)
  bottleneck        otherwise the trainer is training or has groups waiting: it is the bottleneck
                    (the usual state of a healthy run: the step is the long pole)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

Level = Literal["stuck", "warn", "info", "ok"]
_ORDER = {"stuck": 0, "warn": 1, "info": 2, "ok": 3}


@dataclass(frozen=True)
class StageSpec:
    name: str
    stream: str  # the stage's input: rs:{<run>}:<stream>
    group: str  # its default consumer group
    counters: tuple[str, ...]  # stats fields that count what it consumed


PIPELINE = (
    StageSpec("generator", "prompts", "generator", ("generated",)),
    StageSpec("reward", "rollouts", "reward", ("scored", "reward_passthrough")),
    StageSpec("reference", "scored", "reference", ("referenced",)),
    StageSpec("trainer", "ready", "trainer", ("trained", "stale", "duplicates", "evaluated")),
)
_GEN, _TRAINER = PIPELINE[0], PIPELINE[-1]


@dataclass(frozen=True)
class Consumer:
    name: str
    pending: int
    idle_s: float  # since it last read or claimed (XINFO CONSUMERS idle)


@dataclass(frozen=True)
class Group:
    name: str
    pending: int  # delivered, not acknowledged
    lag: int  # not delivered yet
    consumers: tuple[Consumer, ...] = ()

    @property
    def backlog(self) -> int:
        return self.pending + self.lag


@dataclass(frozen=True)
class StreamState:
    length: int = 0
    exists: bool = False
    groups: tuple[Group, ...] = ()

    def group(self, preferred: str) -> Group | None:
        """The stage's group: the one of its default name, else the first (a custom reward
        service may name its own)."""
        first = self.groups[0] if self.groups else None
        return next((g for g in self.groups if g.name == preferred), first)


@dataclass(frozen=True)
class Snapshot:
    """The run at one moment. `at`: seconds on any clock the snapshots share (for rates)."""

    at: float
    streams: dict[str, StreamState]  # by stage stream name: prompts, rollouts, scored, ready
    counters: dict[str, int] = field(default_factory=dict)  # every role's counters, summed (run_keys.read_counters)
    trainer_version: int = 0
    trainer_step: int = 0
    generators: dict[str, int | None] = field(default_factory=dict)  # live generator -> version (None: no weights)
    dead: int = 0  # entries in the dead-letter stream
    last_dead: dict[str, str] = field(default_factory=dict)  # source stream -> its latest dead letter's reason
    restarts: dict[str, int] = field(default_factory=dict)  # service -> restarts by `up` (with --workdir)

    def stream(self, name: str) -> StreamState:
        return self.streams.get(name, StreamState())

    def backlog(self, stream: str, group: str) -> int:
        """What `group` has not acknowledged on `stream`; with no group, the stream's length."""
        s = self.stream(stream)
        g = s.group(group)
        return g.backlog if g is not None else s.length

    def consumed(self, spec: StageSpec) -> int:
        return sum(self.counters.get(c, 0) for c in spec.counters) + self.counters.get(f"dead_{spec.stream}", 0)

    def active(self, spec: StageSpec) -> bool:
        """Whether the run has this stage: the reference stage only when `scored` is used."""
        return spec.name != "reference" or self.stream("scored").exists

    def stages(self) -> list[StageSpec]:
        return [s for s in PIPELINE if self.active(s)]

    def ready(self) -> Group | None:
        return self.stream("ready").group(_TRAINER.group)

    def training(self) -> bool:
        """A step in progress: the trainer holds a step's groups (groups_per_step) pending."""
        ready, per_step = self.ready(), self.counters.get("groups_per_step", 0)
        return ready is not None and per_step > 0 and ready.pending >= per_step


@dataclass(frozen=True)
class Thresholds:
    idle_s: float = 300.0  # consumers idle this long with a backlog, and no progress, are not reading
    max_staleness: int = 1  # generators further behind produce groups the trainer drops
    crash_restarts: int = 3  # restarts that make a crash loop


@dataclass(frozen=True)
class Finding:
    level: Level
    stage: str
    reason: str

    def line(self) -> str:
        what = {"stuck": "STUCK", "warn": "warning", "info": "bottleneck", "ok": "ok"}[self.level]
        return f"{what}: {self.stage}: {self.reason}" if self.stage else f"{what}: {self.reason}"


def rate(prev: Snapshot | None, cur: Snapshot, spec: StageSpec) -> float | None:
    """Entries the stage consumed per second between the two snapshots (None without both)."""
    if prev is None or cur.at <= prev.at:
        return None
    return max(cur.consumed(spec) - prev.consumed(spec), 0) / (cur.at - prev.at)


def _rate_text(r: float | None) -> str:
    return "" if r is None else f" ({r:.2f}/s)"


def _crash_loops(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    for name, n in sorted(cur.restarts.items()):
        more = n - (prev.restarts.get(name, 0) if prev is not None else 0)
        if n >= t.crash_restarts or (prev is not None and more > 0):
            yield Finding(
                "stuck",
                name,
                f"restarted {n} times by `up`{f' ({more} since the last look)' if prev is not None and more else ''}: a crash loop? see its log (WORKDIR/logs/{name}.log)",
            )


def _deadlock(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    ready, per_step = cur.ready(), cur.counters.get("groups_per_step", 0)
    gen_group = cur.stream("prompts").group(_GEN.group)
    upstream_of_ready = sum(cur.backlog(s.stream, s.group) for s in cur.stages() if s not in (_GEN, _TRAINER))
    # A step in progress holds groups_per_step groups pending; fewer is a partial batch. Not
    # knowing groups_per_step, only a trainer that made no progress since the last look counts.
    partial = per_step > 0 or prev is not None
    if (
        ready is not None and ready.lag == 0 and 0 < ready.pending and (per_step == 0 or ready.pending < per_step) and partial
        and upstream_of_ready == 0
        and gen_group is not None and gen_group.lag > 0 and gen_group.consumers
        and all(c.idle_s >= t.idle_s for c in gen_group.consumers)
        and (prev is None or cur.consumed(_TRAINER) == prev.consumed(_TRAINER))
    ):  # fmt: skip
        yield Finding(
            "stuck", "generator",
            f"deadlock: the trainer holds {ready.pending} groups and waits for a full step, while the generators (idle "
            f"{min(c.idle_s for c in gen_group.consumers):.0f}s) are held back by those very groups: max_inflight_groups below groups_per_step?",
        )  # fmt: skip


def _stages(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    downstream = sum(cur.backlog(s.stream, s.group) for s in cur.stages() if s is not _GEN)
    for spec in cur.stages():
        g = cur.stream(spec.stream).group(spec.group)
        backlog = cur.backlog(spec.stream, spec.group)
        if backlog == 0:
            continue
        if g is None:
            yield Finding(
                "stuck",
                spec.name,
                f"{backlog} entries wait in {spec.stream} and no consumer group reads it: is the {spec.name} running?",
            )
            continue
        if not g.consumers:
            yield Finding(
                "stuck",
                spec.name,
                f"{backlog} entries wait in {spec.stream} and group '{g.name}' has no consumer: is the {spec.name} running?",
            )
            continue
        idle = min(c.idle_s for c in g.consumers)
        # A batch slower than idle_s (CPU sampling) leaves its consumer idle too: with an
        # earlier look, only a stage that consumed nothing since counts.
        progressed = prev is not None and cur.consumed(spec) > prev.consumed(spec)
        if idle >= t.idle_s and not progressed:
            if spec is _GEN and downstream > 0:
                continue  # held back by back-pressure: the groups downstream are the story
            if spec is _TRAINER and cur.training():
                continue  # a step in progress reads nothing until it commits
            yield Finding(
                "stuck",
                spec.name,
                f"not reading {spec.stream}: {backlog} waiting ({g.pending} pending), every consumer idle for {idle:.0f}s or more (dead or hung?)",
            )
            continue
        if prev is not None and cur.at > prev.at:
            before = prev.backlog(spec.stream, spec.group)
            if backlog > before and cur.consumed(spec) == prev.consumed(spec) and not (spec is _GEN and downstream > 0):
                yield Finding(
                    "warn",
                    spec.name,
                    f"falling behind: backlog in {spec.stream} grew {before} -> {backlog} in {cur.at - prev.at:.0f}s and it consumed nothing",
                )


def _generators_behind(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    if (
        cur.stream("prompts").exists
        and not cur.generators
        and (cur.trainer_step > 0 or cur.stream("prompts").length > 0)
    ):
        yield Finding(
            "warn",
            "generator",
            "no generator registered (no heartbeat in the registry): nothing samples, and the trainer pushes weights nowhere",
        )
    for name, v in sorted(cur.generators.items()):
        if v is None:
            yield Finding("warn", name, f"holds no weights yet; the trainer is at v{cur.trainer_version}")
        elif cur.trainer_version - v > t.max_staleness:
            pushes = cur.counters.get("pushes_not_applied", 0)
            yield Finding(
                "warn",
                name,
                f"at policy v{v}, the trainer at v{cur.trainer_version}: {cur.trainer_version - v} versions behind (max_staleness {t.max_staleness}), "
                f"its groups come out stale (pushes not applied so far: {pushes})",
            )


def _dead_letters(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    if prev is not None and cur.dead > prev.dead:
        last = "; ".join(f"{k}: {v}" for k, v in sorted(cur.last_dead.items()))
        yield Finding(
            "warn",
            "dead letters",
            f"+{cur.dead - prev.dead} since the last look ({cur.dead} in all){f'; last: {last}' if last else ''}",
        )


def _flow(cur: Snapshot, prev: Snapshot | None, t: Thresholds) -> Iterator[Finding]:
    stages, ready, training = cur.stages(), cur.ready(), cur.training()
    r = {spec.name: rate(prev, cur, spec) for spec in stages}
    if ready is None or (ready.lag == 0 and not training):
        waiting = [(spec, cur.backlog(spec.stream, spec.group)) for spec in stages if spec is not _TRAINER]
        holding = [(spec, n) for spec, n in waiting if n > 0]
        held = f" (it holds {ready.pending} pending)" if ready is not None and ready.pending else ""
        if holding:
            spec, n = holding[-1]
            yield Finding(
                "info",
                spec.name,
                f"the trainer waits for groups{held}; nearest backlog: {n} in {spec.stream}{_rate_text(r[spec.name])}",
            )
        else:
            yield Finding(
                "ok", "", f"nothing waiting anywhere (trainer step {cur.trainer_step}, v{cur.trainer_version})"
            )
        return
    since = f" for {min(c.idle_s for c in ready.consumers):.0f}s" if training and ready.consumers else ""
    doing = f"training a step on {ready.pending} groups{since}" if training else f"{ready.pending} groups pending on it"
    queued = f", {ready.lag} more wait in ready" if ready.lag else ""
    yield Finding("info", "trainer", f"{doing}{queued}{_rate_text(r['trainer'])}: the step is the long pole")


# The rules of the module docstring; `diagnose` keeps this order among findings of one level.
RULES = (_crash_loops, _deadlock, _stages, _generators_behind, _dead_letters, _flow)


def diagnose(cur: Snapshot, prev: Snapshot | None = None, t: Thresholds = Thresholds()) -> list[Finding]:
    """Every finding, most serious first; never empty (an idle run is `ok`)."""
    return sorted((f for rule in RULES for f in rule(cur, prev, t)), key=lambda f: _ORDER[f.level])
