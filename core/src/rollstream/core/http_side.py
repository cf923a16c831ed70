"""The HTTP side server every service runs: /healthz, /readyz and Prometheus /metrics.

It answers only requests whose Host names it (HostCheck): a web page a browser loaded from
elsewhere can point its own DNS name at 127.0.0.1 (DNS rebinding) and would otherwise read
the trainer's /api/* as same-origin."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send


class _Asgi:
    """An ASGI app as a Starlette route's endpoint, served as it is. (Starlette wraps a plain
    function endpoint, as make_asgi_app's app is, as a request handler; and `app.mount`
    serves only /metrics/..., answering /metrics itself with a 307, which scrapers do not
    follow: prometheus/client_python#1016.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def host_allowed(host_header: str, bound: str) -> bool:
    """Whether a request's Host names this server: an IP address (no DNS name can be
    rebound there; probes and Prometheus in a cluster dial pod IPs), `localhost`, or the
    host it was configured to bind. Any port."""
    name = host_header.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in ("localhost", bound.lower())


class HostCheck:
    """ASGI middleware: 400 without one Host header, 421 (misdirected) for a Host that is
    not this server's (host_allowed); the app behind sees only requests that pass."""

    def __init__(self, app: ASGIApp, bound: str):
        self.app = app
        self.bound = bound

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            status = 400 if len(hosts) != 1 else 0 if host_allowed(hosts[0], self.bound) else 421
            if status:
                body = (
                    b"a request needs one Host header\n"
                    if status == 400
                    else b"this server does not answer for that Host\n"
                )
                headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(
    service: str, ready: Callable[[], tuple[bool, str]], registry: CollectorRegistry, bound_host: str = "127.0.0.1"
) -> FastAPI:
    """The HTTP side's app; `bound_host` (the host setting) is one more name its Host may carry."""
    app = FastAPI(title=f"rollstream-{service}", docs_url=None, redoc_url=None)
    app.add_middleware(HostCheck, bound=bound_host)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "service": service}

    @app.get("/readyz")
    def readyz(response: Response) -> dict[str, str]:
        ok, detail = ready()
        if not ok:
            response.status_code = 503
        return {"status": "ready" if ok else "not ready", "detail": detail}

    # prometheus_client's own exposition app: text format, or OpenMetrics when the scraper
    # asks for it, gzip when it accepts it, `name[]=` filters.
    app.router.routes.append(
        Route("/metrics", endpoint=_Asgi(make_asgi_app(registry)), methods=["GET", "HEAD"], include_in_schema=False)
    )

    return app


class HttpSide:
    """uvicorn in a daemon thread on a socket bound up front (so port 0 works)."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)  # listen now: the state file announcing this port is written before uvicorn starts
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="http-side", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> "HttpSide":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
