"""Structured log lines: `ts level service event key=value ...` or one JSON object a line."""

from __future__ import annotations

import json
import logging
import sys
import time


class _Formatter(logging.Formatter):
    def __init__(self, service: str, as_json: bool):
        super().__init__()
        self.service = service
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        if self.as_json:
            data = {"ts": ts, "level": record.levelname, "service": self.service, "event": record.getMessage(), **fields}
            if record.exc_info:
                data["exc"] = self.formatException(record.exc_info)
            return json.dumps(data, default=str)
        kv = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{ts} {record.levelname:<7} {self.service} {record.getMessage()} {kv}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(service: str, level: str = "INFO", as_json: bool = False) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(service, as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock", "transformers", "datasets"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return logging.getLogger(f"rollstream.{service}")


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one structured event: `event(log, "step", step=3, reward=0.5)`."""
    logger.log(level, name, extra={"fields": fields})
