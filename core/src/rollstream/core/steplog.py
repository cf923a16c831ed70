"""The run's step log: one JSON object per line per trainer step (`steps.jsonl` in an `up` run
folder), the source of `rollstream plot`.

Writing (`append`): each record is one `write()` of a whole line on a file opened for
appending, flushed and fsynced. A crash can still cut the last line short; the next append
then starts a new line first (it looks at the file's last byte), so a torn line never glues
itself to a good one. Reading (`read`): a line that is not a JSON object (torn, or garbage
someone wrote) is skipped and counted, never fatal; when a step appears twice (a trainer that
resumed from an older checkpoint trains those step numbers again) the last line wins.

A step record holds every StepMetrics field (proto/rollstream/v1/rollout.proto), the step's
phase times in seconds where known (`forward_s`, `backward_s`, `optimizer_s`, `delta_encode_s`,
`push_s`, `commit_s`), `schema`, `run` and `utc` (the wall time, ISO 8601). A held-out
evaluation round is a line of its own (`eval_record`): `"kind": "eval"`, its `step`, and every
other EvalMetrics field prefixed `eval_`; `read` keeps those apart (`StepLog.evals`), so an
eval line never stands for the step line of the same number. Lines without `kind` are steps.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rollstream.v1 import rollout_pb2

SCHEMA = 1
FILE_NAME = "steps.jsonl"  # in an `up` run folder


EVAL_KIND = "eval"  # the `kind` of a held-out evaluation line


def _fields(metrics: Message, prefix: str = "", skip: tuple[str, ...] = ()) -> dict:
    """The message's fields by name (with `prefix`), float32 ones rounded to the 7 significant
    digits they hold."""
    out: dict = {}
    for f in metrics.DESCRIPTOR.fields:
        if f.name in skip:
            continue
        value = getattr(metrics, f.name)
        if f.type == FieldDescriptor.TYPE_FLOAT:
            value = float(f"{value:.7g}")
        out[prefix + f.name] = value
    return out


def _utc(when: float) -> str | None:
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds") if when else None


def record(metrics: Message, run: str = "", phases: Mapping[str, float] | None = None) -> dict:
    """A step's JSON-able record: the StepMetrics fields, the phase times and the wall time."""
    out: dict = {"schema": SCHEMA, "run": run, **_fields(metrics)}
    for name, seconds in (phases or {}).items():
        out[name] = round(float(seconds), 6)
    out["utc"] = _utc(out.get("time") or 0.0)
    return out


def eval_record(metrics: rollout_pb2.EvalMetrics, run: str) -> dict:
    """A held-out evaluation round's JSON-able record: `kind` "eval", its `step`, and every
    other EvalMetrics field as `eval_<field>` (eval_accuracy, eval_reward_mean, ...), so its
    names never collide with a step's (reward_mean is the training reward)."""
    return {"schema": SCHEMA, "run": run, "kind": EVAL_KIND, "step": metrics.step, **_fields(metrics, "eval_", skip=("step",)),
            "utc": _utc(metrics.time)}  # fmt: skip


def _finite(value: object) -> object:
    """JSON has no NaN or infinity: such a value is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append(path: Path | str, rec: Mapping) -> None:
    """Append `rec` as one line (one write, flushed and fsynced), starting a new line first
    when the file's last line was cut short by a crash."""
    line = json.dumps({k: _finite(v) for k, v in rec.items()}, separators=(",", ":"), allow_nan=False) + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line
        data = line.encode()
        while data:
            written = os.write(fd, data)
            data = data[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class StepLog:
    """What `read` found: the steps (ascending, the last line of each step number), the
    held-out evaluation rounds (the same), and the lines skipped (line number and why)."""

    steps: list[dict] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


def read(path: Path | str) -> StepLog:
    """Every readable record of the file at `path` (which must exist). Lines that are not JSON
    objects with an integer `step`, or of a `kind` this version does not know, are skipped and
    listed in `skipped`."""
    by_step: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    skipped: list[tuple[int, str]] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                rec = json.loads(text)
            except (ValueError, UnicodeDecodeError) as e:
                torn = "" if raw.endswith(b"\n") else " (a torn last line?)"
                skipped.append((number, f"not JSON ({e.__class__.__name__}){torn}"))
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
                skipped.append((number, "not a step record (no integer 'step')"))
                continue
            kind = rec.get("kind")
            if kind is None:
                by_step[rec["step"]] = rec
            elif kind == EVAL_KIND:
                evals[rec["step"]] = rec
            else:
                skipped.append((number, f"unknown kind {str(kind)[:40]!r}"))
    return StepLog([by_step[k] for k in sorted(by_step)], skipped, [evals[k] for k in sorted(evals)])
