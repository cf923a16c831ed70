"""The HTTP side server every service runs: /healthz, /readyz and Prometheus /metrics."""

from __future__ import annotations

import asyncio
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


def build_app(service: str, ready: Callable[[], tuple[bool, str]], registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title=f"rollstream-{service}", docs_url=None, redoc_url=None)

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
    app.router.routes.append(Route("/metrics", endpoint=_Asgi(make_asgi_app(registry)), methods=["GET", "HEAD"], include_in_schema=False))

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
