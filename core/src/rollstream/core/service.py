"""What every service process does around its loop: logging, gRPC + HTTP servers,
readiness, a state file for supervisors, and a stop event set by SIGTERM/SIGINT."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from rollstream.core import grpc_utils, logs
from rollstream.core.config import CommonSettings
from rollstream.core.http_side import HttpSide, build_app


class ServiceHost:
    """Owns the servers of one service process. Use as a context manager."""

    def __init__(self, name: str, settings: CommonSettings):
        self.name = name
        self.settings = settings
        self.log = logs.setup(name, settings.log_level, settings.log_json)
        self.registry = CollectorRegistry()
        self.stop = threading.Event()
        self._ready: Callable[[], tuple[bool, str]] = lambda: (False, "starting")
        self.grpc: grpc_utils.RunningServer | None = None
        self.http: HttpSide | None = None
        self._service_names: list[str] = []

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            logs.event(self.log, "stopping", signal=signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def start(self, services: Sequence[grpc_utils.Service], ready: Callable[[], tuple[bool, str]]) -> None:
        self._ready = ready
        self._service_names = [s.name for s in services]
        self.grpc = grpc_utils.serve(services, self.settings.host, self.settings.grpc_port)
        self.http = HttpSide(build_app(self.name, self._ready, self.registry), self.settings.host, self.settings.http_port).start()
        if self.settings.state_file:
            path = Path(self.settings.state_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "grpc_port": self.grpc.port, "http_port": self.http.port}))
            tmp.replace(path)
        logs.event(self.log, "serving", grpc=f"{self.settings.host}:{self.grpc.port}", http=f"{self.settings.host}:{self.http.port}")

    def set_ready(self, ready: bool) -> None:
        if self.grpc is not None:
            self.grpc.set_serving(ready, ["", *self._service_names])

    @property
    def grpc_address(self) -> str:
        assert self.grpc is not None
        return f"{self.settings.host}:{self.grpc.port}"

    def close(self) -> None:
        if self.grpc is not None:
            self.grpc.stop()
        if self.http is not None:
            self.http.stop()
        logs.event(self.log, "stopped")

    def __enter__(self) -> "ServiceHost":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and exc[0] is not KeyboardInterrupt:
            self.log.exception("service failed")
        self.close()

