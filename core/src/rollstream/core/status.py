"""`rollstream status`: a run's pipeline read from Redis (`collect` -> diagnose.Snapshot), and
its rich view (`render`): per stage the rate between two looks, backlog, pending, consumers
with their idle times and the last dead-letter reason; the trainer's step and version, each
generator's version; the last step and the last held-out evaluation round (`evals`); the
groups' ledger (held-out groups are `evaluated`, never trained); and one line naming the
bottleneck or the stuck stage (core/diagnose.py).

Everything is read as the admin user (or any user allowed XINFO, XRANGE, HGETALL, GET, TIME
on the run's keys); nothing is written. A key that holds something else than rollstream
wrote there is reported as such, not a crash.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis
from rich.console import Group as RichGroup
from rich.table import Table
from rich.text import Text

from rollstream.core import diagnose, redis_policy, run_keys, validation
from rollstream.v1 import rollout_pb2

T = TypeVar("T")
_LAG_LIMIT = 10_000  # unread entries counted one by one (Redis 6.2 has no XINFO lag) up to this many


# Bidirectional overrides and isolates: they reorder what follows them on a terminal line.
_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A))


def printable(text: str) -> str:
    """`text` with every control character but newline and tab written as an escape (\\x1b,
    \\u202e): what Redis or a log holds (a group id, a consumer name, a dead-letter reason)
    must not drive the terminal it is printed on (ESC c resets it; rich passes ESC through)."""
    return "".join(
        c if c in "\n\t" or (unicodedata.category(c) != "Cc" and ord(c) not in _BIDI) else ascii(c)[1:-1] for c in text
    )


def _text(v: object) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class _Reader:
    """Reads that turn a foreign key's error (WRONGTYPE and the like) into a note."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def __call__(self, what: Callable[[], T], default: T, label: str) -> T:
        try:
            return what()
        except redis.ResponseError as e:
            self.errors.append(f"{label}: {redis_policy.short(e)}")
            return default


def _lag(client: redis_policy.Client, key: str, info: dict) -> int:
    lag = info.get("lag")
    if isinstance(lag, int):
        return lag
    last = _text(info.get("last-delivered-id", b"0-0"))
    return len(client.xrange(key, min="(" + last, max="+", count=_LAG_LIMIT))


def _stream(client: redis_policy.Client, key: str, read: _Reader) -> diagnose.StreamState:
    kind = _text(read(lambda: client.type(key), b"none", key))
    if kind == "none":
        return diagnose.StreamState()
    if kind != "stream":
        read.errors.append(f"{key}: holds a {kind}, not a stream")
        return diagnose.StreamState()
    groups = []
    infos: list[dict] = read(lambda: client.xinfo_groups(key), [], key)
    for info in infos:
        name = _text(info["name"])
        found: list[dict] = read(lambda: client.xinfo_consumers(key, name), [], key)  # noqa: B023 - read() calls it at once
        consumers = tuple(diagnose.Consumer(_text(c["name"]), int(c["pending"]), int(c["idle"]) / 1000) for c in found)
        groups.append(diagnose.Group(name, int(info["pending"]), _lag(client, key, info), consumers))
    return diagnose.StreamState(length=int(client.xlen(key)), exists=True, groups=tuple(groups))


def _last_dead(client: redis_policy.Client, keys: run_keys.RunKeys, read: _Reader) -> dict[str, str]:
    """Source stage -> the reason of its latest dead letter (among the last 200)."""
    out: dict[str, str] = {}
    letters: list[tuple[bytes, dict]] = read(lambda: client.xrevrange(keys.dead, count=200), [], keys.dead)
    for _eid, fields in letters:
        try:
            letter = validation.decode(fields, rollout_pb2.DeadLetter)
            source, reason = letter.source_stream.rsplit(":", 1)[-1], letter.reason
        except validation.EntryError:
            source, reason = "?", _text(fields.get(b"reason", b"(unreadable entry)"))
        out.setdefault(source, reason[:200])
    return out


def restarts(workdir: Path | None) -> dict[str, int]:
    """Restarts `up` recorded in WORKDIR/restarts.json ({} without a workdir or the file)."""
    if workdir is None:
        return {}
    try:
        data = json.loads((workdir / "restarts.json").read_text())
        return {str(k): int(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def collect(
    client: redis_policy.Client, keys: run_keys.RunKeys, workdir: Path | None = None
) -> tuple[diagnose.Snapshot, dict]:
    """A snapshot of the run (its `at` is the Redis server's clock, in seconds), and what the
    view shows besides: the last step's metrics, the live generators, errors met."""
    read = _Reader()
    seconds, micros = client.time()
    at = int(seconds) + int(micros) / 1e6
    states = {stage: _stream(client, keys.stream(stage), read) for stage in run_keys.STAGES}
    counters, unreadable = run_keys.read_counters(client, keys)
    read.errors.extend(unreadable)
    version = read(lambda: run_keys.current_version(client, keys), 0, keys.version)
    live: dict[str, str] = read(lambda: run_keys.live_generators(client, keys, forget=False), {}, keys.generators)
    versions: dict[str, int | None] = read(lambda: run_keys.held_versions(client, keys), {}, keys.generators_versions)
    dead_kind = _text(read(lambda: client.type(keys.dead), b"none", keys.dead))
    dead = int(client.xlen(keys.dead)) if dead_kind == "stream" else 0
    extra: dict = {"generators": live, "errors": read.errors, "last_step": None, "last_eval": None}
    last: list[tuple[bytes, dict]] = read(lambda: client.xrevrange(keys.metrics, count=1), [], keys.metrics)
    if last:
        try:
            m = validation.decode(last[0][1], rollout_pb2.StepMetrics)
            validation.check_metrics(m)
            extra["last_step"] = m
        except validation.EntryError as e:
            read.errors.append(f"last metrics entry unreadable: {e}")
    last_eval: list[tuple[bytes, dict]] = read(lambda: client.xrevrange(keys.evals, count=1), [], keys.evals)
    if last_eval:
        try:
            extra["last_eval"] = check_eval(validation.decode(last_eval[0][1], rollout_pb2.EvalMetrics))
        except validation.EntryError as e:
            read.errors.append(f"last eval entry unreadable: {e}")
    snap = diagnose.Snapshot(
        at=at,
        streams=states,
        counters=counters,
        trainer_version=version,
        trainer_step=counters.get("step", 0),
        generators={g: versions.get(g) for g in live},
        dead=dead,
        last_dead=_last_dead(client, keys, read) if dead else {},
        restarts=restarts(workdir),
    )
    return snap, extra


def check_eval(m: rollout_pb2.EvalMetrics) -> rollout_pb2.EvalMetrics:
    """`m` when it can be shown as a held-out round: finite, shares within [0, 1]."""
    for name in ("reward_mean", "accuracy", "pass_at_k", "completion_tokens"):
        value = getattr(m, name)
        if not math.isfinite(value):
            raise validation.EntryError(f"EvalMetrics step {m.step}: {name} is {value!r}")
    for name in ("accuracy", "pass_at_k"):
        if not 0.0 <= getattr(m, name) <= 1.0:
            raise validation.EntryError(
                f"EvalMetrics step {m.step}: {name} {getattr(m, name)!r} is not a share within [0, 1]"
            )
    return m


def eval_line(m: rollout_pb2.EvalMetrics) -> str:
    """A held-out round in one line: "held-out: accuracy 95% (pass@4 100%), reward 1.02 at
    step 15, version 15, 32 prompts"."""
    at_k = f" (pass@{m.samples} {100 * m.pass_at_k:.0f}%)" if m.samples > 1 else ""
    version = f"versions {m.version}-{m.version_max}" if m.version_max > m.version else f"version {m.version}"
    prompts = (
        f"{m.prompts} prompts" if m.prompts >= m.prompts_fed else f"{m.prompts} of {m.prompts_fed} prompts (incomplete)"
    )
    return f"held-out: accuracy {100 * m.accuracy:.0f}%{at_k}, reward {m.reward_mean:.2f} at step {m.step}, {version}, {prompts}"


def step_line(m: rollout_pb2.StepMetrics) -> str:
    """A step's numbers that move, in one line (GRPO's loss is ~1e-8 when the mean advantage
    is 0: three significant digits, and the gradient norm beside it)."""
    length = m.tokens / m.completions if m.completions else 0.0
    return (f"reward {m.reward_mean:.3f} ±{m.reward_std:.3f}, loss {m.loss:+.3g}, grad norm {m.grad_norm:.3g}, kl {m.kl:.4f}, "
            f"entropy {m.entropy:.3f}, {length:.1f} tokens/completion, {m.step_seconds:.1f}s, {m.train_tokens_per_s:.0f} tok/s, "
            f"staleness {m.mean_staleness:.2f}")  # fmt: skip


# The groups' ledger, as counted (run_keys.read_counters): every generated group ends trained,
# stale, evaluated (a held-out round's), dead, or still waits.
LEDGER = ("generated", "trained", "stale", "evaluated")


_STYLE = {"stuck": "bold red", "warn": "yellow", "info": "cyan", "ok": "green"}


def render(keys: run_keys.RunKeys, cur: diagnose.Snapshot, extra: dict, prev: diagnose.Snapshot | None = None,
           thresholds: diagnose.Thresholds = diagnose.Thresholds()) -> RichGroup:  # fmt: skip
    """The view: the stage table, the trainer and generators, counters, and the diagnosis."""
    table = Table(
        title=f"run {keys.run}: trainer step {cur.trainer_step}, policy version {cur.trainer_version}",
        title_justify="left",
    )
    for col, justify in (("stage", "left"), ("stream", "left"), ("rate/s", "right"), ("backlog", "right"), ("pending", "right"),
                         ("length", "right"), ("consumers (idle)", "left"), ("last dead letter", "left")):  # fmt: skip
        table.add_column(col, justify=justify)  # type: ignore[arg-type]  # each one of rich's JustifyMethod literals
    for spec in diagnose.PIPELINE:
        if not cur.active(spec):
            continue
        s = cur.stream(spec.stream)
        g = s.group(spec.group)
        r = diagnose.rate(prev, cur, spec)
        # Text, never markup, and printable: consumer names and dead-letter reasons are
        # whatever was written to Redis.
        if g is None:
            consumers = Text("no consumer group", style="red") if s.length else Text("-")
        elif not g.consumers:
            consumers = Text.assemble(f"{printable(g.name)}: ", ("no consumer", "red"))
        else:
            consumers = Text(printable(f"{g.name}: " + ", ".join(f"{c.name} ({c.idle_s:.0f}s)" for c in g.consumers)))
        table.add_row(
            spec.name,
            keys.stream(spec.stream),
            "…" if r is None else f"{r:.2f}",
            str(cur.backlog(spec.stream, spec.group)),
            str(g.pending) if g is not None else "-",
            str(s.length),
            consumers,
            Text(printable(cur.last_dead.get(spec.stream, ""))),
        )
    lines: list[Text | Table] = [table]
    gens = ", ".join(f"{g} v{'?' if v is None else v}" for g, v in sorted(cur.generators.items())) or "none registered"
    lines.append(Text(printable(f"generators (live): {gens}")))
    if not any(g.consumers for g in cur.stream("rollouts").groups):
        # No reward stage has taken an entry yet: the built-in one is starting, or an outside
        # one (`up --reward external`) has not joined (Redis 6.2 lists a consumer only once it
        # has been handed an entry).
        lines.append(Text(f"waiting for a reward consumer on {keys.stream('rollouts')}", style="yellow"))
    m = extra.get("last_step")
    if m is not None:
        lines.append(Text(f"last step {m.step}: {step_line(m)}"))
    if extra.get("last_eval") is not None:
        lines.append(Text(eval_line(extra["last_eval"])))
    lines.append(Text("groups: " + "  ".join(f"{k} {cur.counters.get(k, 0)}" for k in LEDGER)))
    lines.append(Text(f"dead letters: {cur.dead}" + (f"  restarts by up: {cur.restarts}" if cur.restarts else "")))
    counters = "  ".join(f"{k}={v}" for k, v in sorted(cur.counters.items())) or "no counters yet"
    lines.append(Text(f"counters: {counters}", style="dim"))
    for err in extra.get("errors", []):
        lines.append(Text(printable(f"unreadable: {err}"), style="yellow"))
    findings = diagnose.diagnose(cur, prev, thresholds)
    head = findings[0]
    lines.append(Text(printable(head.line()), style=_STYLE[head.level]))
    for f in findings[1:]:
        if f.level in ("stuck", "warn"):
            lines.append(Text(printable("  also " + f.line()), style=_STYLE[f.level]))
    return RichGroup(*lines)
