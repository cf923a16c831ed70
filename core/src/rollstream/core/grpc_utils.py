"""gRPC plumbing: servers with health checking and reflection, channels sized for weights.

Who may call what, and TLS, are rollstream.core.grpc_auth's: `serve` mounts its interceptor
and server credentials, `channel` sends a client's token (and speaks TLS) when given
ClientCredentials.

Health and reflection answer without a token (grpc_auth.OPEN_SERVICES). A reflection stream
holds a worker thread for as long as its client keeps it open, so streams of open services
get their own few threads (OPEN_STREAMS): past that many they are refused with
RESOURCE_EXHAUSTED, and the service's own methods keep all of `max_workers`. (Ten idle
reflection streams from a process with no credentials held every thread of the generator
and stopped training.)"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollstream.core.grpc_auth import ClientCredentials, TokenInterceptor, is_open, token_refusal

# Chunks are a few MiB; leave headroom for Generate responses with many completions.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]
# Threads (beyond max_workers) for request streams of open services (reflection): a few
# grpcurl sessions at once.
OPEN_STREAMS = 4


@dataclass
class Service:
    """One servicer to mount: `add` is the generated add_XServicer_to_server."""

    name: str  # full service name, e.g. "rollstream.v1.Generator"
    servicer: Any
    add: Callable[[Any, grpc.Server], None]


@dataclass
class RunningServer:
    server: grpc.Server
    port: int  # 0 on a unix socket
    health: health.HealthServicer
    address: str  # what a client dials: host:port, or unix:/path

    def set_serving(self, serving: bool, names: Sequence[str] = ("",)) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            self.health.set(name, status)

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


class OpenStreamLimit(grpc.ServerInterceptor):
    """At most `limit` request streams of open services at a time; one more is refused
    (RESOURCE_EXHAUSTED) at once instead of waiting for, or holding, a worker thread.
    Unary open calls (health Check, the probes') are not counted: they hold a thread only
    while they run. Health Watch is not a request stream and holds no thread while it waits
    (grpcio-health-checking answers it through a callback)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or not handler.request_streaming or not is_open(handler_call_details.method):
            return handler
        stream_stream, stream_unary = handler.stream_stream, handler.stream_unary

        def bounded_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with self._slot(context):
                yield from stream_stream(requests, context)

        def bounded_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self._slot(context):
                return stream_unary(requests, context)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                bounded_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            bounded_unary, handler.request_deserializer, handler.response_serializer
        )

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """One of the `limit` slots for the call's whole run; none free: the call is refused."""
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limit} streams of open services (reflection) are already open here; try again later",
            )
        try:
            yield
        finally:
            self._slots.release()


def serve(
    services: Sequence[Service],
    host: str,
    port: int,
    max_workers: int = 8,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    unix_socket: str = "",
) -> RunningServer:
    """Start a server for `services` plus health and reflection. `interceptors` see every
    call first (grpc_auth.AuthInterceptor); with `credentials` the port speaks TLS only.
    `max_workers` threads are the services' own: open request streams get OPEN_STREAMS more.
    With `unix_socket` (a path) it listens there instead of on host:port: no TCP port at all."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers + OPEN_STREAMS, thread_name_prefix="grpc")
    server = grpc.server(pool, options=CHANNEL_OPTIONS, interceptors=[*interceptors, OpenStreamLimit(OPEN_STREAMS)])
    for s in services:
        s.add(s.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"unix:{unix_socket}" if unix_socket else f"{host}:{port}"
    bound = (
        server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    )
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC to {address}")
    server.start()
    port = 0 if unix_socket else bound
    running = RunningServer(
        server=server, port=port, health=health_servicer, address=address if unix_socket else f"{host}:{port}"
    )
    running.set_serving(False, ["", *[s.name for s in services]])
    return running


def channel(
    address: str, creds: ClientCredentials | None = None, server_name: str = "", options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to `address` (host:port, or unix:/path). With `creds`: TLS when creds.tls,
    and creds.token on every call. `server_name` is the name the server's certificate must
    carry when it is not the address's host (certificates name roles, addresses come from
    discovery: pod IPs, ports on loopback); ignored without TLS. `options`: channel options
    beyond CHANNEL_OPTIONS (a service config, say).

    A token goes only to a server the client has authenticated (grpc_auth.token_refusal):
    anything else is a ValueError before any connection is made."""
    why = token_refusal(address, creds)
    if why:
        raise ValueError(why)
    all_options = CHANNEL_OPTIONS + list(options)
    if creds is not None and creds.tls:
        ch = grpc.secure_channel(
            address,
            creds.channel_credentials(),
            options=all_options + ([("grpc.ssl_target_name_override", server_name)] if server_name else []),
        )
    else:
        ch = grpc.insecure_channel(address, options=all_options)
    if creds is not None and creds.token:
        ch = grpc.intercept_channel(ch, TokenInterceptor(creds.token))
    return ch


def rpc_error_text(error: grpc.RpcError) -> str:
    """An RPC error as one line: its status code and details."""
    return f"{error.code().name}: {error.details()}"
