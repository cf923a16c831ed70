"""gRPC plumbing: servers with health checking and reflection, channels sized for weights.

Who may call what, and TLS, are rollstream.core.grpc_auth's: `serve` mounts its interceptor
and server credentials, `channel` sends a client's token (and speaks TLS) when given
ClientCredentials."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollstream.core.grpc_auth import ClientCredentials, TokenInterceptor

# Chunks are a few MiB; leave headroom for Generate responses with many completions.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]


@dataclass
class Service:
    """One servicer to mount: `add` is the generated add_XServicer_to_server."""

    name: str  # full service name, e.g. "rollstream.v1.Generator"
    servicer: Any
    add: Callable[[Any, grpc.Server], None]


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, serving: bool, names: Sequence[str] = ("",)) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            self.health.set(name, status)

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def serve(
    services: Sequence[Service],
    host: str,
    port: int,
    max_workers: int = 8,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> RunningServer:
    """Start a server for `services` plus health and reflection. `interceptors` see every
    call first (grpc_auth.AuthInterceptor); with `credentials` the port speaks TLS only."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS, interceptors=list(interceptors))
    for s in services:
        s.add(s.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC to {address}")
    server.start()
    running = RunningServer(server=server, port=bound, health=health_servicer)
    running.set_serving(False, ["", *[s.name for s in services]])
    return running


def channel(address: str, creds: ClientCredentials | None = None, server_name: str = "") -> grpc.Channel:
    """A channel to `address`. With `creds`: TLS when creds.tls, and creds.token on every
    call. `server_name` is the name the server's certificate must carry when it is not the
    address's host (certificates name roles, addresses come from discovery: pod IPs, ports
    on loopback); ignored without TLS."""
    if creds is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if creds.tls:
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
        ch = grpc.secure_channel(address, creds.channel_credentials(), options=options)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if creds.token:
        ch = grpc.intercept_channel(ch, TokenInterceptor(creds.token))
    return ch
