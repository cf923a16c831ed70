"""Issue 42's transport: on one machine no TCP port to squat, tokens only to servers the
client authenticated, the HTTP side answering only for its own Host, and nothing from Redis
driving the terminal. Real parts: a real gRPC server on a unix socket, a real TCP listener
standing in for a squatter, the real HTTP side, real Redis for `status`."""

from __future__ import annotations

import hashlib
import io
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from rich.console import Console

from rollstream.core import grpc_utils, status, validation
from rollstream.core.config import ConfigError, load_settings
from rollstream.core.grpc_auth import AuthInterceptor, ClientCredentials, RoleTable
from rollstream.core.http_side import HttpSide, build_app
from rollstream.core.run_keys import RunKeys
from rollstream.generator.config import GeneratorSettings
from rollstream.launcher.procs import tail
from rollstream.reward.config import RewardSettings
from rollstream.reward.remote import scorer_channel, service_config
from rollstream.v1 import rollout_pb2

TOKEN = "t" * 43


@pytest.fixture
def private(tmp_path: Path) -> Path:
    """A folder only this user can enter, short enough for a socket path."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def squatter() -> Iterator[socket.socket]:
    """A TCP listener on loopback, as a local user who took a restarting server's port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s


def accepted_nothing(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def test_no_token_goes_to_a_plain_tcp_server(squatter: socket.socket) -> None:
    address = "127.0.0.1:%d" % squatter.getsockname()[1]
    with pytest.raises(ValueError, match="refusing to send a gRPC token to 127.0.0.1"):
        grpc_utils.channel(address, ClientCredentials(token=TOKEN))
    # The reward's channel to a remote scorer (its own retry options) too.
    with pytest.raises(ValueError, match="refusing to send a gRPC token to 127.0.0.1"):
        scorer_channel(address, ClientCredentials(token=TOKEN), service_config(1, 0.1, 1.0))
    assert accepted_nothing(squatter)
    # Without a token, over TLS, or where the operator said the network cannot be squatted: a channel.
    for creds in (
        None,
        ClientCredentials(),
        ClientCredentials(token=TOKEN, tls=True),
        ClientCredentials(token=TOKEN, plaintext_token=True),
    ):
        grpc_utils.channel(address, creds).close()
    # An abstract unix socket has no folder to keep others out: not a unix path.
    with pytest.raises(ValueError, match="refusing"):
        grpc_utils.channel("unix-abstract:rollstream", ClientCredentials(token=TOKEN))


def test_a_server_on_a_unix_socket_gets_the_token(private: Path) -> None:
    path = private / "trainer.sock"
    table = RoleTable(digests={"admin": hashlib.sha256(TOKEN.encode()).hexdigest()})
    server = grpc_utils.serve([], "127.0.0.1", 0, interceptors=[AuthInterceptor(table)], unix_socket=str(path))
    try:
        assert server.address == f"unix:{path}" and server.port == 0
        server.set_serving(True)
        for address in (f"unix:{path}", f"unix://{path}"):
            with grpc_utils.channel(address, ClientCredentials(token=TOKEN)) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
    # A socket file left behind by a kill -9: the next server of the same name binds it again.
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(path))
    assert path.exists()
    grpc_utils.serve([], "127.0.0.1", 0, unix_socket=str(path)).stop()


def test_a_token_over_tcp_is_refused_at_start_naming_the_field(tmp_path: Path, private: Path) -> None:
    token_file = tmp_path / "generator.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    with pytest.raises(ConfigError, match="trainer_address: 127.0.0.1:50051 is plain TCP"):
        load_settings(GeneratorSettings, ["--grpc-token-file", str(token_file), "--trainer-address", "127.0.0.1:50051"])
    with pytest.raises(ConfigError, match="scorer_address: scorer:50061 is plain TCP"):
        load_settings(RewardSettings, ["--grpc-token-file", str(token_file), "--scorer-address", "scorer:50061"])
    ok = [
        ["--trainer-address", f"unix:{private / 'trainer.sock'}"],
        ["--trainer-address", "trainer:50051", "--grpc-tls-ca-file", str(tmp_path / "ca.pem")],
        [
            "--trainer-address",
            "trainer:50051",
            "--grpc-plaintext-token",
        ],  # compose: each service its own network namespace
    ]
    for flags in ok:
        assert load_settings(GeneratorSettings, ["--grpc-token-file", str(token_file), *flags]).trainer_address
    # No token: nothing to hear.
    assert load_settings(GeneratorSettings, ["--trainer-address", "127.0.0.1:50051"]).trainer_address


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("relative.sock", "not an absolute path"),
        ("/nonexistent-rollstream/x.sock", "cannot be used"),
        ("OPEN/x.sock", "must be this user's only"),
        ("LONG", "longer than a unix socket path"),
    ],
)
def test_grpc_socket_is_checked(tmp_path: Path, where: str, why: str) -> None:
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    path = where.replace("OPEN", str(open_folder)).replace("LONG", str(tmp_path / ("x" * 120) / "g.sock"))
    with pytest.raises(ConfigError, match=f"grpc_socket: .*{why}"):
        load_settings(GeneratorSettings, ["--grpc-socket", path])


def test_http_side_answers_only_for_its_own_host() -> None:
    side = HttpSide(build_app("t", lambda: (True, "ok"), CollectorRegistry()), "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{side.port}"
    try:
        for host in (f"127.0.0.1:{side.port}", "127.0.0.1", f"localhost:{side.port}", "[::1]:8080", "10.1.2.3:8080"):
            assert httpx.get(base + "/healthz", headers={"Host": host}, timeout=60).status_code == 200, host
        for host in ("evil.example", f"evil.example:{side.port}", "localhost.evil.example", "127.0.0.1.nip.io:80"):
            assert httpx.get(base + "/metrics", headers={"Host": host}, timeout=60).status_code == 421, host
    finally:
        side.stop()


def test_control_characters_from_redis_are_escaped(rclient: redis.Redis, keys: RunKeys, tmp_path: Path) -> None:
    evil = "g\x1bc\x1b]0;owned\x07\u202e"
    rclient.xgroup_create(keys.stream("rollouts"), "reward", id="0", mkstream=True)
    rclient.xadd(keys.stream("rollouts"), {"x": "y"})
    rclient.xreadgroup("reward", evil, {keys.stream("rollouts"): ">"})
    letter = rollout_pb2.DeadLetter(
        source_stream=keys.stream("rollouts"), source_id="1-0", consumer=evil, reason=f"group {evil}: bad answer"
    )
    rclient.xadd(keys.dead, validation.encode(letter))
    snap, extra = status.collect(rclient, keys)
    out = io.StringIO()
    Console(file=out, markup=False, width=400, force_terminal=False).print(status.render(keys, snap, extra))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    assert "g\\x1bc" in text  # the name is still shown, escaped
    log = tmp_path / "reward-0.log"
    log.write_text(f"dead_lettered reason=group {evil}\n")
    assert tail(log) == "dead_lettered reason=group g\\x1bc\\x1b]0;owned\\x07\\u202e"
    assert status.printable("a\tb\nc") == "a\tb\nc"


def test_up_refuses_a_tcp_scorer_naming_the_field() -> None:
    """Under `up` the reward stage holds a token: its remote scorer only on a unix socket."""
    from rollstream.launcher import run_config

    with pytest.raises(ConfigError, match="reward.scorer_address: 127.0.0.1:50061 is TCP"):
        run_config.load(["--reward.scorer-address", "127.0.0.1:50061"])
    assert (
        run_config.load(["--reward.scorer-address", "unix:/run/scorer.sock"]).reward.scorer_address
        == "unix:/run/scorer.sock"
    )
