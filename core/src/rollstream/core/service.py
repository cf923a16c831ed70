"""What every service process does around its loop: logging, gRPC + HTTP servers,
readiness, the Redis policy, a state file for supervisors, and a stop event set by
SIGTERM/SIGINT.

Readiness (HTTP /readyz and gRPC health) is the service's own answer and Redis's: while
Redis is away (`self.redis`, rollstream.core.redis_policy) the service reports not ready,
waits and retries; it never exits for that."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from rollstream.core import grpc_auth, grpc_utils, logs, redis_policy, streams
from rollstream.core.config import CommonSettings
from rollstream.core.http_side import HttpSide, build_app
from rollstream.core.redis_policy import RedisHealth


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
        self._own_ready = False
        self.redis = RedisHealth(self.log, self.stop, on_change=lambda _ok: self._publish_ready())

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            logs.event(self.log, "stopping", signal=signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def start(self, services: Sequence[grpc_utils.Service], ready: Callable[[], tuple[bool, str]]) -> None:
        self._ready = ready
        self._service_names = [s.name for s in services]
        # Every credential file is read now: a missing one fails the start, naming its field,
        # instead of the first call made or answered. The client side is built again where the
        # service makes its calls; this only checks it can be.
        try:
            security = grpc_auth.server_security(self.settings, self.log)
            grpc_auth.ClientCredentials.from_settings(self.settings)
        except ValueError as e:  # a file missing or unreadable: a configuration error (exit 2)
            raise self.redis.invalid(str(e)) from None
        self.grpc = grpc_utils.serve(
            services, self.settings.host, self.settings.grpc_port, interceptors=security.interceptors, credentials=security.credentials
        )
        self.http = HttpSide(build_app(self.name, self.readiness, self.registry), self.settings.host, self.settings.http_port).start()
        if self.settings.state_file:
            path = Path(self.settings.state_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "grpc_port": self.grpc.port, "http_port": self.http.port}))
            tmp.replace(path)
        logs.event(
            self.log, "serving", grpc=f"{self.settings.host}:{self.grpc.port}", http=f"{self.settings.host}:{self.http.port}",
            grpc_auth="on" if security.auth else "off", grpc_tls=security.tls,
        )

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers: not ready before the service says so (set_ready), nor while
        Redis is away; else the service's own answer."""
        if not self.redis.ok:
            return False, self.redis.detail
        if not self._own_ready:
            ok, detail = self._ready()
            return False, detail if not ok else "starting"
        return self._ready()

    def set_ready(self, ready: bool) -> None:
        self._own_ready = ready
        self._publish_ready()

    def _publish_ready(self) -> None:
        if self.grpc is not None:
            self.grpc.set_serving(self._own_ready and self.redis.ok, ["", *self._service_names])

    def connect_redis(self) -> redis_policy.Client:
        """A client for settings.redis_url as settings.redis_username (password from
        redis_password_file, else redis_password), waiting (one log line, then backing off)
        until the server answers. Raises Stopped if the service is stopped meanwhile, and
        redis_policy.Misconfigured (exit status 2, after one log line naming the field or the
        user) for credentials that cannot be read or that Redis refuses."""
        s = self.settings
        url = s.redis_url
        try:
            username, password = redis_policy.credentials(url, s.redis_username, s.redis_password_file, s.redis_password.get_secret_value())
        except ValueError as e:
            raise self.redis.invalid(str(e)) from None
        self.redis.user = username or redis_policy.url_credentials(url)[0] or ""
        doing = f"connecting to {redis_policy.redact(url)} as {self.redis.user or 'default'}"
        return self.redis.call(lambda: redis_policy.connect(url, username, password), doing)

    def open_stage(self, client: redis_policy.Client, source: str, group: str) -> streams.StreamStage:
        """Join `group` on the run's `source` stream (waiting for Redis); commits retry through
        this host's Redis policy."""
        return self.redis.call(
            lambda: streams.StreamStage.for_service(client, self.settings, source, group, health=self.redis), f"joining {group} on {source}"
        )

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

    def __exit__(self, *exc: object) -> bool:
        # Misconfigured has logged its one line already; it exits with status 2.
        if exc[0] is not None and not issubclass(exc[0], (KeyboardInterrupt, redis_policy.Stopped, redis_policy.Misconfigured)):  # type: ignore[arg-type]
            self.log.exception("service failed")
        self.close()
        # Stopped while waiting for Redis is a clean stop, not a failure.
        return exc[0] is redis_policy.Stopped

