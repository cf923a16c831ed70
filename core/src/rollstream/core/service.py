"""The skeleton every service process runs on: logging, gRPC + HTTP servers, readiness,
the Redis policy, the stream stage's read-check-dead-letter step and its loop, a state file
for supervisors, and a stop event set by SIGTERM/SIGINT.

A service's own file then holds only what is its own: what it parses, what one turn of its
loop does, what it writes. The shape, in every service (main(argv) loads the settings, calls run):

    def run(settings) -> int:
        with ServiceHost("name", settings) as host:
            host.install_signal_handlers()
            host.start([grpc service...])               # /healthz answers; /readyz: "starting"
            ... load the model ...
            client = host.connect_redis()
            stage = host.open_stage(client, "source", settings.group)
            host.set_ready(True, "reading ...")
            host.run_loop(stage, NameLoop(host, stage, ...).turn, "name loop")   # until SIGTERM
        return 0

    @dataclass
    class NameLoop:                                     # what the loop holds between turns
        def turn(self) -> None:
            batch = self.host.read(self.stage, parse)   # bad entries: dead letters, counted, logged
            ... work ...
            self.stage.commit(inputs, outputs=..., extra=ledger)

Readiness (HTTP /readyz and gRPC health) is the service's own answer and Redis's: while
Redis is away (`self.redis`, rollstream.core.redis_policy) the service reports not ready,
waits and retries; it never exits for that."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram

from rollstream.core import grpc_auth, grpc_utils, logs, metrics, push_signing, redis_policy, streams
from rollstream.core.config import CommonSettings
from rollstream.core.credentials import read_secret
from rollstream.core.http_side import HttpSide, build_app
from rollstream.core.redis_policy import RedisHealth
from rollstream.core.streams import Entry, StreamStage

# Run data (the AOF's prompts, completions and test answers, checkpoints, logs) is its
# owner's alone: files 0600, folders 0700, whatever the umask of the shell that started us.
OWNER_ONLY_UMASK = 0o077

M = TypeVar("M")


@dataclass(frozen=True)
class StageMetrics:
    """What every stream stage counts, as rollstream_<service>_<name>. A service declares
    its own metrics the same way: a frozen dataclass with a `register(registry)`."""

    dead_lettered: Counter
    redelivered: Counter
    batch_seconds: Histogram

    @classmethod
    def register(cls, service: str, registry: CollectorRegistry) -> "StageMetrics":
        p = f"rollstream_{service}_"
        return cls(
            dead_lettered=Counter(p + "dead_lettered", "entries moved to the dead-letter stream", registry=registry),
            redelivered=Counter(
                p + "redelivered",
                "entries read again: claimed from a dead consumer, or our own after a restart",
                registry=registry,
            ),
            batch_seconds=Histogram(
                p + "batch_seconds", "time to process and commit one read's batch", registry=registry
            ),
        )


class Every:
    """Due once every `seconds` (monotonic clock): trims, progress lines."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._next = time.monotonic() + seconds

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True


class ServiceHost:
    """Owns the servers of one service process. Use as a context manager."""

    def __init__(self, name: str, settings: CommonSettings):
        self.name = name
        self.settings = settings
        self.log = logs.setup(name, settings.log_level, settings.log_json, run=settings.run)
        self.registry = CollectorRegistry()
        self.stop = threading.Event()
        self.metrics = StageMetrics.register(name, self.registry)
        metrics.register_process(name, self.registry)
        self.grpc: grpc_utils.RunningServer | None = None
        self.http: HttpSide | None = None
        self._service_names: list[str] = []
        # Routes a service adds to its HTTP side before start() (the trainer's dashboard).
        self.http_extensions: list[Callable[[FastAPI], None]] = []
        # The service's own answer (model loaded, stage joined, a remote scorer reachable);
        # Redis's is self.redis. Both must be yes for /readyz and gRPC health to say SERVING.
        self._own_ready = False
        self._own_detail = "starting"
        self.redis = RedisHealth(self.log, self.stop, on_change=lambda _ok: self._publish_ready())
        # The one-time nonces this server hands out for signed pushes (a generator's PushNonce).
        self.push_nonces = push_signing.PushNonces()

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            logs.event(self.log, "stopping", signal=signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def start(self, services: Sequence[grpc_utils.Service]) -> None:
        """Serve gRPC and HTTP now (not ready until set_ready), so /healthz answers while
        the model loads and Redis is joined."""
        self._service_names = [s.name for s in services]
        # Every credential file is read now: a missing one fails the start, naming its field,
        # instead of the first call made or answered. The client side is built again where the
        # service makes its calls; this only checks it can be.
        try:
            security = grpc_auth.server_security(self.settings, self.log, self.push_nonces)
            grpc_auth.ClientCredentials.from_settings(self.settings)
        except ValueError as e:  # a file missing or unreadable: a configuration error (exit 2)
            raise self.redis.invalid(str(e)) from None
        self.grpc = grpc_utils.serve(
            services,
            self.settings.host,
            self.settings.grpc_port,
            interceptors=security.interceptors,
            credentials=security.credentials,
            unix_socket=self.settings.grpc_socket,
        )
        app = build_app(self.name, self.readiness, self.registry, self.settings.host)
        for extend in self.http_extensions:
            extend(app)
        self.http = HttpSide(app, self.settings.host, self.settings.http_port).start()
        if self.settings.state_file:
            path = Path(self.settings.state_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            state = {
                "pid": os.getpid(),
                "grpc_address": self.grpc.address,
                "grpc_port": self.grpc.port,
                "http_port": self.http.port,
            }
            tmp.write_text(json.dumps(state))
            tmp.replace(path)
        logs.event(
            self.log,
            "serving",
            grpc=self.grpc.address,
            http=f"{self.settings.host}:{self.http.port}",
            grpc_auth="on" if security.auth else "off",
            grpc_tls=security.tls,
        )

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers: not ready while Redis is away, else the service's own answer."""
        if not self.redis.ok:
            return False, self.redis.detail
        return self._own_ready, self._own_detail

    def set_ready(self, ready: bool, detail: str) -> None:
        """The service's own readiness, with what /readyz shows ("loading model", "reading
        rs:{demo}:rollouts", "remote scorer unavailable: ...")."""
        self._own_ready, self._own_detail = ready, detail
        self._publish_ready()

    def _publish_ready(self) -> None:
        if self.grpc is not None:
            self.grpc.set_serving(self._own_ready and self.redis.ok, ["", *self._service_names])

    def connect_redis(self, as_user: str = "", password_file: str = "", field: str = "") -> redis_policy.Client:
        """A client for settings.redis_url as settings.redis_username (password from
        redis_password_file, else redis_password), waiting (one log line, then backing off)
        until the server answers. Raises Stopped if the service is stopped meanwhile, and
        redis_policy.Misconfigured (exit status 2, after one log line naming the field or the
        user) for credentials that cannot be read or that Redis refuses.

        With `as_user`: a second connection as that user, its password in `password_file`
        (the setting `field`): the generator's read-only observer (rollstream.core.redis_acl).
        Its refusals name that user; the service's readiness follows its own user only."""
        s = self.settings
        url = s.redis_url
        username: str | None
        password: str | None
        try:
            if as_user:
                if any(redis_policy.url_credentials(url)):
                    raise ValueError(
                        f"{field}: redis_url carries credentials: give the service's own in redis_username and redis_password_file"
                    )
                username, password = as_user, read_secret(password_file, field)
            else:
                username, password = redis_policy.credentials(
                    url, s.redis_username, s.redis_password_file, s.redis_password.get_secret_value()
                )
        except ValueError as e:
            raise self.redis.invalid(str(e)) from None
        health = RedisHealth(self.log, self.stop, user=as_user) if as_user else self.redis
        if not as_user:
            health.user = username or redis_policy.url_credentials(url)[0] or ""
        doing = f"connecting to {redis_policy.redact(url)} as {health.user or 'default'}" + (
            f" ({field})" if field else ""
        )
        return health.call(lambda: redis_policy.connect(url, username, password), doing)

    def open_stage(self, client: redis_policy.Client, source: str, group: str) -> streams.StreamStage:
        """Join `group` on the run's `source` stream (waiting for Redis); commits retry through
        this host's Redis policy, and every entry the stage dead-letters is counted and logged
        here (`stage.dead_letter`, for one that parsed but cannot be used: a scorer's NaN, a
        failed sample, a refused step)."""
        return self.redis.call(
            lambda: streams.StreamStage.for_service(
                client, self.settings, source, group, health=self.redis, on_dead_letter=self._count_dead_letter
            ),
            f"joining {group} on {source}",
        )

    # -- the stream stage: read, dead-letter, loop --------------------------------------

    def read(
        self, stage: StreamStage, parse: Callable[[Entry], M], count: int = 0, wait: bool = True
    ) -> list[tuple[Entry, M]]:
        """One read's worth of parsed entries (`parse` decodes and validates, raising
        validation.EntryError with the reason), waiting up to block_ms for new ones unless `wait`
        is False. What does not parse goes to the dead letters alone, counted and logged;
        entries read again (a dead consumer's, or ours before a restart) are counted and
        logged too."""
        s = self.settings
        batch = stage.read_valid(count or s.read_count, s.block_ms if wait else None, parse)
        redelivered = [e.deliveries for e, _ in batch if e.deliveries > 1]
        if redelivered:
            self.metrics.redelivered.inc(len(redelivered))
            logs.event(self.log, "redelivered", entries=len(redelivered), max_deliveries_seen=max(redelivered))
        return batch

    def _count_dead_letter(self, entry: Entry, reason: str) -> None:
        self.metrics.dead_lettered.inc()
        logs.event(self.log, "dead_lettered", logging.WARNING, entry=entry.id.decode(), reason=reason)

    def run_loop(
        self,
        stage: StreamStage,
        turn: Callable[[], None],
        doing: str,
        on_redis_error: Callable[[], None] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Call `turn` until stopped (or `until()` says done). Redis trouble never ends the
        loop: what was read and not committed stays pending on us and is read again first
        (`on_redis_error` drops the service's own copy of it), and the Redis policy waits,
        backing off."""
        while not self.stop.is_set() and not (until is not None and until()):
            try:
                turn()
            except redis_policy.ERRORS as e:
                stage.reread_own_pending()
                if on_redis_error is not None:
                    on_redis_error()
                self.redis.failed(e, doing)
                continue
            self.redis.recovered()

    @property
    def grpc_address(self) -> str:
        assert self.grpc is not None
        return self.grpc.address

    def close(self) -> None:
        if self.grpc is not None:
            self.grpc.stop()
        if self.http is not None:
            self.http.stop()
        logs.event(self.log, "stopped")

    def __enter__(self) -> "ServiceHost":
        # What a running service writes (checkpoints, anchors, its step log, its state file)
        # is its owner's only: files 0600, folders 0700 (docs/security.md).
        self._previous_umask = os.umask(OWNER_ONLY_UMASK)
        return self

    def __exit__(self, *exc: object) -> bool:
        # Misconfigured has logged its one line already; it exits with status 2.
        if isinstance(exc[0], type) and not issubclass(
            exc[0], (KeyboardInterrupt, redis_policy.Stopped, redis_policy.Misconfigured)
        ):
            self.log.exception("service failed")
        self.close()
        os.umask(self._previous_umask)
        # Stopped while waiting for Redis is a clean stop, not a failure.
        return exc[0] is redis_policy.Stopped
