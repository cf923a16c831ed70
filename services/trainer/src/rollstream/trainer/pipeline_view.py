"""The trainer's dashboard (rollstream.core.dashboard) wired to its settings: set up once at
start, beside the loop in service.py, which it does not touch."""

from __future__ import annotations

from rollstream.core import dashboard, redis_acl, redis_policy, run_keys
from rollstream.core.credentials import read_secret
from rollstream.core.service import ServiceHost
from rollstream.trainer.config import TrainerSettings


def install(settings: TrainerSettings, host: ServiceHost) -> dashboard.PipelineView:
    """The dashboard's look at the pipeline (rollstream.core.dashboard): its own Redis
    connection with short timeouts, as the read-only observer where a password file for it is
    given; the pipeline gauges on /metrics and the dashboard's routes."""
    s = settings
    username: str | None
    password: str | None
    try:
        if s.redis_observer_password_file:
            username, password = (
                redis_acl.OBSERVER,
                read_secret(s.redis_observer_password_file, "redis_observer_password_file"),
            )
        else:
            username, password = redis_policy.credentials(
                s.redis_url, s.redis_username, s.redis_password_file, s.redis_password.get_secret_value()
            )
    except ValueError as e:
        raise host.redis.invalid(str(e)) from None
    secrets = (password or "", redis_policy.url_credentials(s.redis_url)[1] or "", s.redis_password.get_secret_value())
    timeout = dashboard.SOCKET_TIMEOUT_S
    view = dashboard.PipelineView(
        lambda: redis_policy.connect(
            s.redis_url, username, password, socket_timeout_s=timeout, connect_timeout_s=timeout
        ),
        run_keys.RunKeys(s.run),
        secrets=secrets,
    )
    host.registry.register(view)
    host.http_extensions.append(lambda app: dashboard.install(app, view, s.metrics_file))
    return view
