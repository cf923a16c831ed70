"""Typed settings shared by the services.

Each service defines one pydantic-settings class (subclassing `CommonSettings`, or
`TorchSettings` when it runs the model) and loads it with `load_settings(cls, argv)`.
Precedence, lowest to highest: field defaults, TOML file (`--config PATH`, or
`ROLLSTREAM_CONFIG`), `ROLLSTREAM_*` environment variables, flags (`--field-name value`;
`--field` / `--no-field` for booleans), then keyword overrides to `load_settings`. The three
outer layers are pydantic-settings' own sources (`TomlConfigSettingsSource`,
`EnvSettingsSource`, `CliSettingsSource`), ordered in `CommonSettings.settings_customise_sources`.
Secrets (`SecretStr` fields) are never flags. A bad value fails at start with the field named
(`ConfigError`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import AfterValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from rollstream.core.grpc_auth import is_unix_address
from rollstream.core.redis_policy import check_url

ENV_PREFIX = "ROLLSTREAM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
# Run and consumer-group names: they become parts of Redis keys and group names, so no
# spaces, braces or colons.
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
# A malformed Redis URL is a configuration error, found when settings load; an unreachable
# server is not (it may be starting): the Redis policy waits for that.
RedisUrl = Annotated[str, AfterValidator(check_url)]


class ConfigError(Exception):
    """A configuration value is missing or invalid; the message names the field."""


class _CallSources(NamedTuple):
    """The sources that belong to one `load_settings` call rather than to the class."""

    cli: CliSettingsSource[Any] | None
    toml: TomlConfigSettingsSource | None


# pydantic-settings asks the class for its sources (`settings_customise_sources`, a classmethod
# with no per-call arguments), but the parsed flags and the TOML file belong to one
# `load_settings` call. They reach it through this variable, set only while that call builds
# the instance: the result is a plain `cls`, built and validated once, and concurrent loads
# (threads, asyncio tasks) each see their own.
_call_sources: ContextVar[_CallSources | None] = ContextVar("rollstream_settings_sources", default=None)


class SettingsBase(BaseSettings):
    """How every settings class loads (the flags' spelling, the sources and their order), with
    no field: the services' classes add CommonSettings' fields, a command that is no service
    (`rollstream sft`: trainer/config.py SftSettings) its own."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
        # No setting means NaN or infinity: a learning rate of 1e400 parsed as inf and passed
        # `gt=0`, and would have trained on NaN from the first step.
        allow_inf_nan=False,
        # How CliSettingsSource (built in load_settings) spells the flags: --field-name, and a
        # --field / --no-field pair for booleans (so a flag can turn off what TOML or the
        # environment turned on). A parse error is raised (SettingsError -> ConfigError)
        # instead of exiting, so load_settings reports it like any other bad value.
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=False,
        # --help names the environment variable of each field next to its description.
        cli_show_env_vars=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest first (the module docstring's order). Flags and TOML exist only inside
        load_settings (`_call_sources`); a class built directly, `XSettings(field=...)`, reads
        its keyword arguments and the environment. No .env file, no secrets directory: the
        services never used them, and a file read from the working directory would be a
        surprise source."""
        cli, toml = _call_sources.get() or _CallSources(None, None)
        return tuple(s for s in (init_settings, cli, env_settings, toml) if s is not None)


class CommonSettings(SettingsBase):
    """Fields every service has."""

    run: str = Field("demo", pattern=NAME_PATTERN, description="run name: isolates experiments sharing one Redis")
    redis_url: RedisUrl = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://, rediss:// or unix://)")
    host: str = Field("127.0.0.1", description="address the gRPC and HTTP servers bind to")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    grpc_socket: str = Field(
        "",
        description="serve gRPC on this unix socket (an absolute path in a folder only its owner can enter) instead of host:grpc_port",
    )
    http_port: int = Field(0, ge=0, le=65535, description="HTTP /healthz /readyz /metrics port (0: pick a free one)")
    consumer: str = Field("", description="consumer name in the stream groups (default: hostname-pid)")
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="DEBUG, INFO, WARNING or ERROR")
    log_json: bool = Field(False, description="log JSON lines instead of key=value text")
    # Stream-stage behaviour (see rollstream.core.streams).
    claim_idle_ms: int = Field(30_000, ge=100, description="take over entries pending this long on a dead consumer")
    max_deliveries: int = Field(5, ge=1, description="dead-letter an entry delivered more often than this")
    read_count: int = Field(8, ge=1, description="entries read per XREADGROUP")
    block_ms: int = Field(500, ge=1, description="XREADGROUP block time")
    state_file: str = Field(
        "", description="write {grpc_address, grpc_port, http_port, pid} here once serving (for supervisors)"
    )
    # Credentials (docs/security.md). Secrets come from files (or ROLLSTREAM_REDIS_PASSWORD),
    # never from flags: a flag shows in every process listing. load_settings gives no
    # SecretStr field a flag, and refuses one given as a flag without echoing its value.
    redis_username: str = Field("", description="Redis ACL user (empty: the URL's user, else 'default')")
    redis_password_file: str = Field("", description="file holding the Redis ACL user's password")
    redis_password: SecretStr = Field(SecretStr(""), description="Redis password (prefer redis_password_file)")
    grpc_token_file: str = Field("", description="file holding this service's gRPC token, sent on every call it makes")
    grpc_auth_file: str = Field("", description="JSON {role: sha256 of its token}: the callers this server accepts")
    grpc_tls_cert_file: str = Field(
        "", description="PEM certificate this service presents (server, and client for mTLS)"
    )
    grpc_tls_key_file: str = Field("", description="PEM private key for grpc_tls_cert_file")
    grpc_tls_ca_file: str = Field(
        "", description="PEM CA bundle: verifies peers (servers; clients too when set on a server)"
    )
    allow_unauthenticated: bool = Field(False, description="serve gRPC without grpc_auth_file on a non-loopback host")
    grpc_plaintext_token: bool = Field(
        False,
        description="UNSAFE: send this service's gRPC token over plain TCP (no TLS), where whoever holds the address hears it; "
        "only where no one else can bind it (compose's per-container network namespaces)",
    )

    @model_validator(mode="after")
    def _grpc_security(self) -> "CommonSettings":
        # Off loopback, a server without a role table lets anyone who reaches the port push
        # weights, read them, or write checkpoints: refuse, unless the operator says so.
        # Whether the files exist is checked when the server starts (rollstream.core.grpc_auth),
        # so settings can be validated where the secrets are not mounted (CI, a laptop).
        if not self.grpc_auth_file and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"grpc_auth_file: serving gRPC on {self.host} without authentication: set grpc_auth_file, or allow_unauthenticated=true"
            )
        if self.grpc_tls_cert_file and not self.grpc_tls_key_file:
            raise ValueError("grpc_tls_key_file: required with grpc_tls_cert_file")
        if self.grpc_tls_key_file and not self.grpc_tls_cert_file:
            raise ValueError("grpc_tls_cert_file: required with grpc_tls_key_file")
        if self.grpc_socket:
            check_socket_path(self.grpc_socket, "grpc_socket")
        # A token goes only to a server this service has authenticated: one behind a unix
        # socket in a private folder, or one whose TLS certificate the client checks. A
        # TCP port can be taken by any local user while its server restarts (issue 42).
        if (
            self.grpc_token_file
            and not (self.grpc_tls_ca_file or self.grpc_tls_cert_file)
            and not self.grpc_plaintext_token
        ):
            for name in TOKEN_ADDRESS_FIELDS:
                address = getattr(self, name, "")
                if address and not is_unix_address(address):
                    raise ValueError(
                        f"{name}: {address} is plain TCP and this service sends its gRPC token there: use a unix:/path address, "
                        "TLS (grpc_tls_ca_file), or grpc_plaintext_token=true where no one else can bind that address"
                    )
        return self


class TorchSettings(CommonSettings):
    """Fields of the services that run the model with torch (generator, reference, trainer).

    Defaults and allowed values are the same in all three; a service that says more about a
    field (the generator's device under vllm, the trainer's dtype) redeclares it with its own
    description and the same default."""

    model: str = Field("smollm2-135m", description="local Hugging Face folder, or smollm2-135m (the demo model)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype (weights are always bf16 values)"
    )
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")


S = TypeVar("S", bound=SettingsBase)

# The settings fields (of the services' own classes) naming a server a service calls with
# its gRPC token: the generator's trainer, the reward stage's remote scorer.
TOKEN_ADDRESS_FIELDS = ("trainer_address", "scorer_address")
# sun_path is 108 bytes with its terminating NUL: a longer path cannot be bound.
MAX_SOCKET_PATH = 107


def check_socket_path(path: str, field: str) -> str:
    """ValueError naming `field` unless `path` is a socket path only its owner's processes can
    create: absolute, short enough to bind, in an existing folder that is its owner's alone
    (a unix socket in a folder others can enter could be taken while its server restarts)."""
    p = Path(path)
    if not p.is_absolute():
        raise ValueError(f"{field}: {path} is not an absolute path")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"{field}: {path} is longer than a unix socket path can be ({MAX_SOCKET_PATH} bytes): use a shorter folder"
        )
    try:
        folder = p.parent.stat()
    except OSError as e:
        raise ValueError(f"{field}: its folder {p.parent} cannot be used: {e.strerror or e}") from None
    if folder.st_mode & 0o077 or folder.st_uid != os.geteuid():
        raise ValueError(
            f"{field}: its folder {p.parent} must be this user's only (mode 0700): others could take the socket's name"
        )
    return path


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _format_validation_error(cls: type[BaseSettings], err: ValidationError) -> str:
    lines = [f"invalid {cls.__name__} configuration:"]
    secrets = _secret_fields(cls)
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(settings)"
        value = e.get("input")
        # A dict is the whole model (a model validator's error); a secret's value stays out of logs.
        shown = "" if isinstance(value, dict) or field in secrets else f" (got {value!r})"
        lines.append(f"  field '{field}': {e['msg']}{shown}")
    return "\n".join(lines)


def _secret_fields(cls: type[BaseSettings]) -> dict[str, str]:
    """{field name: its would-be flag} for the SecretStr fields of `cls`."""
    return {
        name: "--" + name.replace("_", "-") for name, info in cls.model_fields.items() if info.annotation is SecretStr
    }


def _refuse_secret_flags(cls: type[BaseSettings], argv: list[str]) -> None:
    # Checked before parsing: argparse would answer "unrecognized arguments: --redis-password
    # <the password>", printing the secret into logs on top of the process listing.
    for name, flag in _secret_fields(cls).items():
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            instead = (
                f"{name}_file or {ENV_PREFIX}{name.upper()}"
                if f"{name}_file" in cls.model_fields
                else f"{ENV_PREFIX}{name.upper()}"
            )
            raise ConfigError(
                f"invalid {cls.__name__} configuration:\n  field '{name}': a secret is never a flag (a flag shows in every "
                f"process listing): use {instead}"
            )


def _cli_source(cls: type[BaseSettings]) -> CliSettingsSource[Any]:
    """pydantic-settings' CLI source for `cls` (flag spelling: CommonSettings.model_config),
    with `--config` added and no flag for a SecretStr field."""
    secrets = set(_secret_fields(cls))

    def add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
        if kwargs.get("dest") in secrets:
            return None  # env (or a *_file field) only: see _refuse_secret_flags
        return parser.add_argument(*names, **kwargs)

    cli: CliSettingsSource[Any] = CliSettingsSource(
        cls,
        cli_prog_name=cls.model_config.get("cli_prog_name") or cls.__module__.rsplit(".", 1)[0],
        add_argument_method=add_argument,
    )
    _add_config_flag(cli.root_parser)
    return cli


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    # Not a field: it picks the TOML source, which must exist before the settings are built.
    parser.add_argument(
        "--config", default=os.environ.get(CONFIG_ENV), metavar="PATH", help=f"TOML settings file [env: {CONFIG_ENV}]"
    )


def config_path(argv: list[str]) -> str:
    """The TOML file `load_settings` reads for these flags: `--config PATH`, else the
    environment's ROLLSTREAM_CONFIG ('' if neither)."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_config_flag(parser)
    return parser.parse_known_args(argv)[0].config or ""


def _toml_source(cls: type[BaseSettings], config: str, table: str = "") -> TomlConfigSettingsSource:
    path = Path(config)
    # TomlConfigSettingsSource skips a file that is not there; a --config naming a missing
    # file is a mistake (a typo, an unmounted ConfigMap) and must stop the start.
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return TomlConfigSettingsSource(cls, toml_file=path, toml_table_header=(table,) if table else None)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except KeyError:  # pydantic-settings' word for a missing table
        raise ConfigError(f"config file {path} has no [{table}] table") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None


def load_settings(cls: type[S], argv: list[str] | None = None, table: str = "", **overrides: Any) -> S:
    """Build `cls` from field defaults < TOML file < environment < flags (`argv`) < `overrides`.

    `argv` is the flags alone (no program name); None or [] means no flags: sys.argv is never
    read here (services pass it; tests and tools pass their own lists). `--help` prints the
    fields with their descriptions and exits 0. `table`: the file's table of that name, not its
    top level (the colocated process's one file, launcher/colocation.py)."""
    args = list(argv or [])
    _refuse_secret_flags(cls, args)
    cli = _cli_source(cls)
    try:
        parsed = vars(cli.root_parser.parse_args(args))
        config = parsed.pop("config")
        toml = _toml_source(cls, config, table) if config else None
        token = _call_sources.set(_CallSources(cli(parsed_args=parsed), toml))
        try:
            return cls(**overrides)
        finally:
            _call_sources.reset(token)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(cls, e)) from None
    except SettingsError as e:  # a flag that does not parse, an unknown flag, an env value that should be JSON
        raise ConfigError(f"invalid {cls.__name__} configuration: {e}") from None


def consumer_name(settings: CommonSettings) -> str:
    """Stable consumer name: the configured one, else host-pid (a restart is a new consumer)."""
    return settings.consumer or f"{os.uname().nodename}-{os.getpid()}"


def load_or_exit(cls: type[S], argv: list[str], table: str = "") -> S:
    """`load_settings` for a service's main(): a bad configuration prints the error (naming
    the field) and exits with status 2 before anything starts."""
    try:
        return load_settings(cls, argv, table)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
