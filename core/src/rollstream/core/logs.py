"""Structured log lines: `ts level service event key=value ...` or one JSON object a line.

Built on structlog's stdlib integration: one `structlog.stdlib.ProcessorFormatter` on the
root handler renders every record, ours (`event(log, "step", step=3)`, a plain `logging`
call carrying its fields in `record.fields`), third-party libraries' `logging` records and
structlog loggers' (`structlog.get_logger()`), so they all come out in the same format:

  text  2026-11-23T15:04:05.123 INFO    trainer step step=3 reward=0.5
        (fields in logfmt: `str(value)`, quoted and escaped when it holds a space, `=`, a
        quote or a newline; an exception's traceback on the lines after)
  JSON  {"ts": "2026-11-23T15:04:05.123", "level": "INFO", "service": "trainer",
         "event": "step", "step": 3, "reward": 0.5}   (one object a line; `exc`: the traceback)

A service started with its run's name (`setup(..., run="demo")`, as every ServiceHost does)
puts `run=demo` first among every line's fields. The events that move groups name them
(`groups=<id>,<id>,...` with the policy `version` they were sampled with: the generator's
`groups_written`, the reward's `groups_scored`, the reference's `groups_referenced`, the
trainer's `step`), so `grep <group id> WORKDIR/logs/*.log` follows one rollout through
every service.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

_NOISY = ("httpx", "urllib3", "filelock", "transformers", "datasets")
# Keys of the event dict that are not fields of the event.
_META = {"event", "_record", "_from_structlog", "exc_info", "stack_info", "exception", "level", "logger", "timestamp"}


def _structure(service: str, run: str = "") -> Processor:
    """The event dict -> {ts, level, service, event, run?, **fields, exc?}, from the record it came in."""
    first = {"run": run} if run else {}

    def structure(_: WrappedLogger, __: str, ed: EventDict) -> EventDict:
        record: logging.LogRecord = ed["_record"]
        fields = {k: v for k, v in ed.items() if k not in _META}
        if not ed.get("_from_structlog"):
            fields.update(getattr(record, "fields", None) or {})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        # A service host's own logger (rollstream.<name>) names its service: one process can
        # host two (the colocated trainer and generator).
        host = (
            record.name.removeprefix("rollstream.")
            if record.name.count(".") == 1 and record.name.startswith("rollstream.")
            else service
        )
        out: EventDict = {
            "ts": ts,
            "level": record.levelname,
            "service": host,
            "event": str(ed.get("event", "")),
            **first,
            **fields,
        }
        if "exception" in ed:  # set by format_exc_info
            out["exc"] = str(ed["exception"]).rstrip("\n")
        return out

    return structure


def _text(_: WrappedLogger, __: str, ed: EventDict) -> str:
    exc = ed.pop("exc", None)
    head = [ed.pop(k) for k in ("ts", "level", "service", "event")]
    # str() first, as the hand-written formatter printed them (True, None); logfmt quotes
    # and escapes what would otherwise run into the next field or line.
    kv = _logfmt(None, "", {k: str(v) for k, v in ed.items()})
    line = f"{head[0]} {head[1]:<7} {head[2]} {head[3]} {kv}".rstrip()
    return f"{line}\n{exc}" if exc else line


_logfmt = structlog.processors.LogfmtRenderer(bool_as_flag=False)


def formatter(service: str, as_json: bool, run: str = "") -> structlog.stdlib.ProcessorFormatter:
    """The `logging.Formatter` that renders every record in this service's format."""
    render: Processor = structlog.processors.JSONRenderer(json.dumps, default=str) if as_json else _text
    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.processors.format_exc_info,
            _structure(service, run),
            render,
        ],
    )


def setup(service: str, level: str = "INFO", as_json: bool = False, run: str = "") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(service, as_json, run))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # structlog loggers hand their event dicts to the same handler and formatter.
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    return logging.getLogger(f"rollstream.{service}")


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one structured event: `event(log, "step", step=3, reward=0.5)`. The fields ride on
    the record as `record.fields` (tests read them there through caplog)."""
    logger.log(level, name, extra={"fields": fields})


def group_ids(groups: object) -> str:
    """The `groups=` field of an event that moves groups: their ids, comma-separated (anything
    with a `group_id`)."""
    return ",".join(str(g.group_id) for g in groups)  # type: ignore[attr-defined]  # anything with a group_id
