"""One Redis policy for every service and the CLI.

- `connect(url)`: a client with explicit connect and socket timeouts and no hidden retries
  (a retried XREADGROUP or commit script whose first reply was lost would hide work from
  us; the stream stage re-reads and the commit script is idempotent instead). A server
  running in cluster mode gets a `RedisCluster` client: every key of a run carries the
  hash tag `{<run>}`, so one run lives in one slot.
- `RedisHealth`: what a loop does when Redis fails. A transient error (connection refused
  or reset, a timeout, a server still loading its AOF, a cluster failing over) makes the
  caller back off (0.2 s doubling to 5 s), reports the service not ready, and logs one
  line when the outage starts and one when it ends; nothing exits.
- `check_url(url)`: a malformed URL is a configuration error, found when settings load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from rollstream.core import logs

SCHEMES = ("redis", "rediss", "unix")
CONNECT_TIMEOUT_S = 5.0
# Above any XREADGROUP block time we use (block_ms is at most a few seconds) and above the
# stalls a loaded machine produces, so a slow answer is waited for rather than retried.
SOCKET_TIMEOUT_S = 15.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0
# While an outage lasts, repeat its log line this often (not on every retry).
REMIND_EVERY_S = 30.0
# Replies a cluster or a replica gives while it settles; worth waiting out like a timeout.
_TRANSIENT_REPLIES = ("LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "BUSY ")

T = TypeVar("T")
Client = redis.Redis | RedisCluster
# What a Redis call can raise: redis-py's errors, and the cluster client's "no node reachable",
# which is not a RedisError. Loops catch this tuple.
ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


def check_url(url: str) -> str:
    """Raise ValueError (for the settings validator) unless `url` is a usable Redis URL."""
    parsed = urlparse(url)
    if parsed.scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}, got {url!r}")
    if parsed.scheme != "unix" and not parsed.hostname:
        raise ValueError(f"no host in {url!r}")
    try:
        redis.connection.parse_url(url)
    except ValueError as e:
        raise ValueError(f"{url!r} is not a valid Redis URL: {e}") from None
    return url


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return url.replace(f":{parsed.password}@", ":***@", 1)


def connect(url: str, socket_timeout_s: float = SOCKET_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> Client:
    """A client that returns bytes (entries carry protobuf bytes). Talks to the server once,
    to learn whether it runs in cluster mode: call it under `RedisHealth.call` where the
    server may not be up yet."""
    options = dict(
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
    )
    client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
    try:
        if url.startswith("unix") or not int(client.info("cluster").get("cluster_enabled", 0)):
            return client
    except redis.ResponseError:
        return client  # a managed Redis that hides INFO: not a cluster we can drive
    except BaseException:
        client.close()
        raise
    client.close()
    # No hidden retries here either (it still follows MOVED and ASK redirections): a
    # retried XREADGROUP would leave what a lost reply delivered pending on us, unseen.
    return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0), **options)


def is_transient(error: BaseException) -> bool:
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return True  # includes BusyLoadingError (a restarted server replaying its AOF)
    if isinstance(error, (redis.exceptions.ClusterError, RedisClusterException)):
        return True  # a cluster failing over, or no node of it reachable right now
    return isinstance(error, redis.ResponseError) and str(error).upper().startswith(_TRANSIENT_REPLIES)


def short(error: BaseException) -> str:
    """One line: the error's class and first line, never a traceback."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Stopped(Exception):
    """The service is stopping while waiting for Redis."""


class RedisHealth:
    """Back-off, readiness and logging for one process's Redis trouble. Thread-safe; the
    HTTP /readyz and gRPC health read `ok` and `detail` through the service host."""

    def __init__(self, log: logging.Logger, stop: threading.Event, on_change: Callable[[bool], None] | None = None):
        self.log = log
        self.stop = stop
        self.on_change = on_change
        self.ok = True
        self.detail = ""
        self._delay = BACKOFF_FIRST_S
        self._since = 0.0
        self._reminded = 0.0
        self._lock = threading.Lock()

    def failed(self, error: BaseException, doing: str) -> None:
        """Record a failure and wait before the caller retries (returns early on stop)."""
        now = time.monotonic()
        with self._lock:
            first = self.ok
            if first:
                self.ok, self._since, self._reminded = False, now, now
            self.detail = f"redis unavailable ({doing}): {short(error)}"
            delay, self._delay = self._delay, min(self._delay * 2, BACKOFF_MAX_S)
            remind = not first and now - self._reminded >= REMIND_EVERY_S
            if remind:
                self._reminded = now
        if first or remind:
            logs.event(self.log, "redis unavailable", logging.WARNING, doing=doing, error=short(error), retry_s=round(delay, 2),
                       down_s=round(now - self._since, 1))
        if first and self.on_change is not None:
            self.on_change(False)
        self.stop.wait(delay)

    def recovered(self) -> None:
        if self.ok:
            return
        with self._lock:
            was_down, self.ok, self.detail, self._delay = not self.ok, True, "", BACKOFF_FIRST_S
            down_s = time.monotonic() - self._since
        if was_down:
            logs.event(self.log, "redis recovered", down_s=round(down_s, 1))
            if self.on_change is not None:
                self.on_change(True)

    def call(self, fn: Callable[[], T], doing: str) -> T:
        """`fn()` until it succeeds without a transient error; raises Stopped on stop. Use for
        idempotent calls only (a read, a commit script, a SET)."""
        while True:
            if self.stop.is_set():
                raise Stopped(doing)
            try:
                result = fn()
            except ERRORS as e:
                if not is_transient(e):
                    raise
                self.failed(e, doing)
                continue
            self.recovered()
            return result
