"""One Redis policy for every service and the CLI.

- `connect(url, username, password)`: a client with explicit connect and socket timeouts
  and no hidden retries (a retried XREADGROUP or commit script whose first reply was lost
  would hide work from us; the stream stage re-reads and the commit script is idempotent
  instead). A server running in cluster mode gets a `RedisCluster` client: every key of a
  run carries the hash tag `{<run>}`, so one run lives in one slot.
- `RedisHealth`: what a loop does when Redis fails. A transient error (connection refused
  or reset, a timeout, a server still loading its AOF, a cluster failing over) makes the
  caller back off (0.2 s doubling to 5 s), reports the service not ready, and logs one
  line when the outage starts and one when it ends; nothing exits (a refusal does: below).
- `check_url(url)`: a malformed URL is a configuration error, found when settings load.

Credentials (Redis ACL users, rollstream.core.redis_acl). `credentials(...)` resolves them
from the settings (`redis_username`, `redis_password_file`, else `redis_password`) and the
URL (`redis://user:password@host`): each of the user and the password may come from one
place only, and a user needs a password; anything else, or a password file that cannot be
read or is empty, is a configuration error naming the field (ValueError). Redis refusing
them (WRONGPASS, NOAUTH), or refusing a command or key the user's ACL does not grant
(NOPERM), is not an outage to wait out: no retry changes it. `RedisHealth` then logs one
ERROR line naming the user, what was being done and what to check, and raises
`Misconfigured`, a SystemExit with status 2 (a configuration error's status, as
config.load_or_exit): no loop's `except Exception` or `except ERRORS` takes it for a Redis
outage, and the process ends through its usual cleanup. A supervisor restarting it sees
the same line again, instead of a service that says "not ready" forever.

A commit the stream stage's script refuses whole because of what a key holds (a key of
the wrong type, a counter field that is not an integer: `is_refused_write`, nothing
written) is neither: no retry soon changes it, but an operator can fix the key while the
service waits, and exiting would crash-loop on the same entries, each restart counting a
delivery until they are dead-lettered (a trainer would also lose the step it holds).
`RedisHealth.call(..., wait_out_refusals=True)` (the commit path) therefore reports the
service not ready with the refusal's text, logs an ERROR line naming the key (again every
REMIND_EVERY_S), and retries every REFUSED_RETRY_S, holding its work; docs/reliability.md.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeAlias, TypeVar
from urllib.parse import parse_qsl, urlencode, urlparse, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from rollstream.core import logs
from rollstream.core.credentials import read_secret

SCHEMES = ("redis", "rediss", "unix")
CONNECT_TIMEOUT_S = 5.0
# Above any XREADGROUP block time we use (block_ms is at most a few seconds) and above the
# stalls a loaded machine produces, so a slow answer is waited for rather than retried.
SOCKET_TIMEOUT_S = 15.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0
# While an outage lasts, repeat its log line this often (not on every retry).
REMIND_EVERY_S = 30.0
# A commit refused for what a key holds waits for an operator: retried this often.
REFUSED_RETRY_S = 10.0
# Replies a cluster or a replica gives while it settles; worth waiting out like a timeout.
_TRANSIENT_REPLIES = ("LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "BUSY ")
# A refusal inside a Lua script: Redis 7 keeps the NOPERM code; 6.2 reports a plain script
# error with this text.
_DENIED_IN_SCRIPT = ("NOPERM", "The user executing the script can't")

T = TypeVar("T")
Client: TypeAlias = redis.Redis | RedisCluster
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
    """The URL without its password (in the user part or a `?password=` query), for logs."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}{':***' if colon else ''}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if "pass" in k.lower() else v) for k, v in pairs], safe="*/")
    # Not urlunsplit: it writes unix:///path as unix:/path.
    return (
        f"{parts.scheme}://{netloc}{parts.path}"
        + (f"?{query}" if query else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )


def url_credentials(url: str) -> tuple[str | None, str | None]:
    """The (user, password) a Redis URL carries, if any."""
    options = redis.connection.parse_url(url)
    return options.get("username") or None, options.get("password") or None


def credentials(
    url: str, username: str = "", password_file: str = "", password: str = ""
) -> tuple[str | None, str | None]:
    """The (user, password) to pass to `connect` besides the URL, from the settings' fields
    `redis_username`, `redis_password_file` (read now) and `redis_password` (used when no
    file is given). ValueError naming the field when they cannot be used (module docstring)."""
    secret = read_secret(password_file, "redis_password_file") if password_file else (password or None)
    in_url_user, in_url_password = url_credentials(url)
    if username and in_url_user:
        raise ValueError(
            f"redis_username: {username!r} is set and redis_url names a user too ({in_url_user!r}): give it in one place"
        )
    if secret and in_url_password:
        field = "redis_password_file" if password_file else "redis_password"
        raise ValueError(f"{field}: a password is set and redis_url carries one too: give it in one place")
    user = username or in_url_user
    if user and not (secret or in_url_password):
        raise ValueError(
            f"redis_username: user {user!r} needs a password: set redis_password_file (or ROLLSTREAM_REDIS_PASSWORD)"
        )
    return username or None, secret


def _no_client_commands() -> dict[str, object]:
    """Options that keep redis-py from sending CLIENT commands on connect (CLIENT SETINFO,
    and on RESP3 the CLIENT MAINT_NOTIFICATIONS handshake of redis-py >= 7): the roles' ACLs
    grant no CLIENT command (its KILL, LIST and PAUSE reach other clients' connections), and
    each refusal would land in the server's ACL LOG at every connect. Each redis-py version
    says so in its own words: use those it has."""
    parameters = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    options: dict[str, object] = (
        {"driver_info": None} if "driver_info" in parameters else {"lib_name": None, "lib_version": None}
    )
    if "maint_notifications_config" in parameters:
        from redis.maint_notifications import MaintNotificationsConfig

        options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return options


def connect(
    url: str,
    username: str | None = None,
    password: str | None = None,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> Client:
    """A client that returns bytes (entries carry protobuf bytes), authenticating as
    `username` with `password` when given (else with what the URL carries; a part given
    both ways is a ValueError: redis-py would silently prefer the URL's). Talks to the
    server once, to learn whether it runs in cluster mode: call it under `RedisHealth.call`
    where the server may not be up yet."""
    in_url_user, in_url_password = url_credentials(url)
    if (username and in_url_user) or (password and in_url_password):
        raise ValueError(f"credentials given both in {redact(url)} and as arguments")
    options: dict = dict(
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=30,
        **_no_client_commands(),
    )
    if not url.startswith("unix"):  # TCP keepalive: a unix socket has none (redis-py refuses the option)
        options["socket_keepalive"] = True
    if username:
        options["username"] = username
    if password:
        options["password"] = password
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


def is_denied(error: BaseException) -> bool:
    """Redis refused who we are (WRONGPASS, NOAUTH: a wrong user or password, a user that is
    off) or what we asked (NOPERM: a command or key outside the user's ACL, also inside a
    script). A configuration error: no retry changes it."""
    if isinstance(
        error, (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)
    ):
        return True
    if not isinstance(error, redis.ResponseError):
        return False
    text = str(error)
    return text.upper().startswith(("NOPERM", "WRONGPASS", "NOAUTH")) or any(d in text for d in _DENIED_IN_SCRIPT)


def is_refused_write(error: BaseException) -> bool:
    """The commit script refused to write anything because of what a key holds (its own
    checks, streams._RUN_COMMANDS, end in "nothing written"), or Redis refused a write on
    a key of the wrong type or a field that is not an integer."""
    if not isinstance(error, redis.ResponseError) or is_denied(error):
        return False
    text = str(error)
    return "nothing written" in text or "WRONGTYPE" in text or "not an integer" in text


def is_transient(error: BaseException) -> bool:
    if is_denied(error):
        return False  # AuthenticationError is a ConnectionError, but waiting will not fix it
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return True  # includes BusyLoadingError (a restarted server replaying its AOF)
    if isinstance(error, (redis.exceptions.ClusterError, RedisClusterException)):
        return True  # a cluster failing over, or no node of it reachable right now
    return isinstance(error, redis.ResponseError) and str(error).upper().startswith(_TRANSIENT_REPLIES)


def short(error: BaseException) -> str:
    """One line: the error's class and first line, never a traceback."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class Stopped(Exception):
    """The service is stopping while waiting for Redis."""


class Misconfigured(SystemExit):
    """Redis cannot be used as configured and no retry will change that (see the module
    docstring): exits with status 2 unless caught. Its text says what to fix."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RedisHealth:
    """Back-off, readiness and logging for one process's Redis trouble. Thread-safe; the
    HTTP /readyz and gRPC health read `ok` and `detail` through the service host."""

    def __init__(
        self,
        log: logging.Logger,
        stop: threading.Event,
        on_change: Callable[[bool], None] | None = None,
        user: str = "",
    ):
        self.log = log
        self.stop = stop
        self.on_change = on_change
        self.user = user  # the Redis user we connect as, for the refusal line ("" : the default user)
        self.refused_retry_s = REFUSED_RETRY_S
        self.ok = True
        self.detail = ""
        self._delay = BACKOFF_FIRST_S
        self._since = 0.0
        self._reminded = 0.0
        self._lock = threading.Lock()

    def invalid(self, problem: str) -> Misconfigured:
        """Log the one line of a configuration error (`credentials`' ValueError, naming the
        field) and return the Misconfigured to raise."""
        logs.event(self.log, "invalid_configuration", logging.ERROR, error=problem)
        return Misconfigured(problem)

    def refused(self, error: BaseException, doing: str) -> Misconfigured:
        """Log the one line of a refusal (is_denied) and return the Misconfigured to raise."""
        user = self.user or "default"
        if isinstance(error, redis.ConnectionError):  # WRONGPASS, NOAUTH: who we are
            fix = "check redis_username and redis_password_file (or ROLLSTREAM_REDIS_PASSWORD) against the server's ACL users"
        else:  # NOPERM: what we asked
            fix = f"the server's ACL does not grant user {user!r} this command or key (rollstream.core.redis_acl lists what each role needs)"
        logs.event(self.log, "redis_refused_access", logging.ERROR, user=user, doing=doing, error=short(error), fix=fix)
        return Misconfigured(f"Redis refused user {user!r} ({doing}): {short(error)}; {fix}")

    def failed(self, error: BaseException, doing: str) -> None:
        """Record a failure and wait before the caller retries (returns early on stop). A
        refusal (is_denied) raises Misconfigured instead: retrying would never end. A key
        that holds what the call cannot use (is_refused_write: a loop's read of a key of
        another type, say) is said as such and retried slowly (refused_write), not taken
        for an outage."""
        if is_denied(error):
            raise self.refused(error, doing) from error
        if is_refused_write(error):
            self.refused_write(error, doing)
            return
        self._down(
            error, doing, "redis_unavailable", logging.WARNING, f"redis unavailable ({doing}): {short(error)}", None
        )

    def refused_write(self, error: BaseException, doing: str) -> None:
        """Record a call refused for what a key holds (is_refused_write; mostly a commit)
        and wait REFUSED_RETRY_S before the caller retries it: not ready, said as a refusal."""
        detail = f"redis refused ({doing}): {short(error)}; fix or delete that key as the admin user, retried every {self.refused_retry_s:g} s"
        self._down(error, doing, "redis_write_refused", logging.ERROR, detail, self.refused_retry_s)

    def _down(
        self, error: BaseException, doing: str, event: str, level: int, detail: str, wait_s: float | None
    ) -> None:
        """Not ready with `detail`; log `event` when this trouble starts and every
        REMIND_EVERY_S; wait `wait_s` (None: the backoff, doubling)."""
        now = time.monotonic()
        with self._lock:
            first = self.ok
            if first:
                self.ok, self._since, self._reminded = False, now, now
            changed = self.detail != detail
            self.detail = detail
            delay = wait_s if wait_s is not None else self._delay
            if wait_s is None:
                self._delay = min(self._delay * 2, BACKOFF_MAX_S)
            remind = not first and (changed and wait_s is not None or now - self._reminded >= REMIND_EVERY_S)
            if remind:
                self._reminded = now
        if first or remind:
            logs.event(
                self.log,
                event,
                level,
                doing=doing,
                error=short(error),
                retry_s=round(delay, 2),
                down_s=round(now - self._since, 1),
            )
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
            logs.event(self.log, "redis_recovered", down_s=round(down_s, 1))
            if self.on_change is not None:
                self.on_change(True)

    def call(self, fn: Callable[[], T], doing: str, wait_out_refusals: bool = False) -> T:
        """`fn()` until it succeeds without a transient error; raises Stopped on stop, and
        Misconfigured on a refusal (is_denied). Use for idempotent calls only (a read, a
        commit script, a SET). `wait_out_refusals`: a write refused for what a key holds
        (is_refused_write) is retried slowly too (refused_write), for a commit script
        that writes nothing when it refuses."""
        while True:
            if self.stop.is_set():
                raise Stopped(doing)
            try:
                result = fn()
            except ERRORS as e:
                if wait_out_refusals and is_refused_write(e):
                    self.refused_write(e, doing)
                    continue
                if not (is_transient(e) or is_denied(e)):
                    raise
                self.failed(e, doing)  # a refusal raises Misconfigured there
                continue
            self.recovered()
            return result
