"""Typed settings shared by the services.

Each service defines one pydantic-settings class (subclassing `CommonSettings`) and loads
it with `load_settings(cls, argv)`. Precedence, lowest to highest: defaults, TOML file
(`--config PATH`, or `ROLLSTREAM_CONFIG`), `ROLLSTREAM_*` environment variables, flags
(`--field-name value`). A bad value fails at start with the field named (`ConfigError`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from rollstream.core.redis_policy import check_url

ENV_PREFIX = "ROLLSTREAM_"


class ConfigError(Exception):
    """A configuration value is missing or invalid; the message names the field."""


class CommonSettings(BaseSettings):
    """Fields every service has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    run: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="run name: isolates experiments sharing one Redis")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://, rediss:// or unix://)")
    host: str = Field("127.0.0.1", description="address the gRPC and HTTP servers bind to")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP /healthz /readyz /metrics port (0: pick a free one)")
    consumer: str = Field("", description="consumer name in the stream groups (default: hostname-pid)")
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")
    log_json: bool = Field(False, description="log JSON lines instead of key=value text")
    # Stream-stage behaviour (see rollstream.core.streams).
    claim_idle_ms: int = Field(30_000, ge=100, description="take over entries pending this long on a dead consumer")
    max_deliveries: int = Field(5, ge=1, description="dead-letter an entry delivered more often than this")
    read_count: int = Field(8, ge=1, description="entries read per XREADGROUP")
    block_ms: int = Field(500, ge=1, description="XREADGROUP block time")
    state_file: str = Field("", description="write {grpc_port, http_port, pid} here once serving (for supervisors)")
    # Credentials (docs/security.md). Secrets come from files (or ROLLSTREAM_REDIS_PASSWORD),
    # never from flags: a flag shows in every process listing.
    redis_username: str = Field("", description="Redis ACL user (empty: the URL's user, else 'default')")
    redis_password_file: str = Field("", description="file holding the Redis ACL user's password")
    redis_password: SecretStr = Field(SecretStr(""), description="Redis password (prefer redis_password_file)")
    grpc_token_file: str = Field("", description="file holding this service's gRPC token, sent on every call it makes")
    grpc_auth_file: str = Field("", description="JSON {role: sha256 of its token}: the callers this server accepts")
    grpc_tls_cert_file: str = Field("", description="PEM certificate this service presents (server, and client for mTLS)")
    grpc_tls_key_file: str = Field("", description="PEM private key for grpc_tls_cert_file")
    grpc_tls_ca_file: str = Field("", description="PEM CA bundle: verifies peers (servers; clients too when set on a server)")
    allow_unauthenticated: bool = Field(False, description="serve gRPC without grpc_auth_file on a non-loopback host")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        # A malformed URL is a configuration error, found now; an unreachable server is not
        # (it may be starting): the Redis policy waits for that.
        return check_url(url)

    @model_validator(mode="after")
    def _grpc_security(self) -> "CommonSettings":
        # Off loopback, a server without a role table lets anyone who reaches the port push
        # weights, read them, or write checkpoints: refuse, unless the operator says so.
        # Whether the files exist is checked when the server starts (rollstream.core.grpc_auth),
        # so settings can be validated where the secrets are not mounted (CI, a laptop).
        if not self.grpc_auth_file and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(f"grpc_auth_file: serving gRPC on {self.host} without authentication: set grpc_auth_file, or allow_unauthenticated=true")
        if self.grpc_tls_cert_file and not self.grpc_tls_key_file:
            raise ValueError("grpc_tls_key_file: required with grpc_tls_cert_file")
        if self.grpc_tls_key_file and not self.grpc_tls_cert_file:
            raise ValueError("grpc_tls_cert_file: required with grpc_tls_key_file")
        return self


S = TypeVar("S", bound=CommonSettings)


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _TomlDict(PydanticBaseSettingsSource):
    """Values read from a TOML file, below environment variables and flags."""

    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]):
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field, field_name):  # type: ignore[override]  # unused: __call__ returns all
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def _format_validation_error(cls: type[BaseSettings], err: ValidationError) -> str:
    lines = [f"invalid {cls.__name__} configuration:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(settings)"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  field '{field}': {e['msg']}{shown}")
    return "\n".join(lines)


def _add_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    for name, info in cls.model_fields.items():
        if info.annotation is SecretStr:
            continue  # secrets never as flags (visible in `ps`): a file, or the environment
        flag = "--" + name.replace("_", "-")
        help_text = info.description or ""
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def load_settings(cls: type[S], argv: list[str] | None = None, **overrides: Any) -> S:
    """Build `cls` from TOML file, environment, flags (`argv`) and `overrides` (highest)."""
    parser = argparse.ArgumentParser(prog=cls.__module__.rsplit(".", 1)[0], description=cls.__doc__)
    parser.add_argument("--config", default=os.environ.get(ENV_PREFIX + "CONFIG"), help="TOML settings file")
    _add_flags(parser, cls)
    args = parser.parse_args(argv if argv is not None else [])
    toml_values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        try:
            toml_values = tomllib.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"config file not found: {path}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    flags = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    flags.update(overrides)

    class _Loaded(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(cls_, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
            return (init_settings, env_settings, _TomlDict(settings_cls, toml_values))

    try:
        loaded = _Loaded(**flags)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(cls, e)) from None
    except SettingsError as e:  # e.g. an environment value that should be JSON and is not
        raise ConfigError(f"invalid {cls.__name__} configuration: {e}") from None
    return cls.model_validate(loaded.model_dump())


def consumer_name(settings: CommonSettings) -> str:
    """Stable consumer name: the configured one, else host-pid (a restart is a new consumer)."""
    if settings.consumer:
        return settings.consumer
    return f"{os.uname().nodename}-{os.getpid()}"


def load_or_exit(cls: type[S], argv: list[str]) -> S:
    """`load_settings` for a service's main(): a bad configuration prints the error (naming
    the field) and exits with status 2 before anything starts."""
    try:
        return load_settings(cls, argv)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
