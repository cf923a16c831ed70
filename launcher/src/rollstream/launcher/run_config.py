"""One run's configuration: the four services' own settings classes, composed.

`RunConfig` nests a section per service (`trainer`, `generator`, `reward`, `reference`: each
that service's settings class, so each field has one default, its class's) under the values
`up` itself needs (the run, the model, Redis, the workdir, how many generators). It is loaded
by pydantic-settings' own sources, lowest first: field defaults, a profile (a TOML file:
`--profile demo` is profiles/demo.toml here, or give a path), `ROLLSTREAM_*` environment
variables (`ROLLSTREAM_TRAINER__LR`: sections after a double underscore), flags generated from
the same fields (`--trainer.lr`). `up` hands each child its section as the TOML file the
service reads with `--config` (`child_toml`), plus what only `up` knows (ports, addresses,
credentials): `SET_BY_UP` lists those fields, and a profile, variable or flag that sets one is
refused with the field named.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from rollstream.core.config import ENV_PREFIX, NAME_PATTERN, CommonSettings, ConfigError, TorchSettings
from rollstream.core.grpc_auth import is_unix_address
from rollstream.core.redis_policy import check_url
from rollstream.generator.config import GeneratorSettings
from rollstream.launcher import warm_start
from rollstream.launcher.colocation import Colocate, refusal
from rollstream.reference.config import ReferenceSettings
from rollstream.reward.config import RewardSettings
from rollstream.trainer.config import TrainerSettings

PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "demo"
SECTIONS: dict[str, type[CommonSettings]] = {
    "trainer": TrainerSettings,
    "generator": GeneratorSettings,
    "reward": RewardSettings,
    "reference": ReferenceSettings,
}
# What `up` decides for every child: where it runs (the run's Redis, its ports, its consumer
# name, its credentials) and what the top level says once for all (the run, the model, the
# torch threads, log format). Everything else in a section is the user's.
CREDENTIALS = {
    "redis_username",
    "redis_password_file",
    "redis_password",
    "grpc_token_file",
    "grpc_auth_file",
    "grpc_tls_cert_file",
    "grpc_tls_key_file",
    "grpc_tls_ca_file",
    "redis_observer_password_file",
}
_EVERY_CHILD = {
    "run",
    "redis_url",
    "host",
    "grpc_port",
    "grpc_socket",
    "http_port",
    "consumer",
    "log_json",
    "state_file",
    "model",
    "threads",
    "allow_unauthenticated",
    "grpc_plaintext_token",
} | CREDENTIALS
SET_BY_UP: dict[str, set[str]] = {
    # The run's folders (trainer_folders) and where the trainer finds the generators.
    "trainer": _EVERY_CHILD
    | {
        "checkpoint_dir",
        "anchor_dir",
        "export_dir",
        "tracker_dir",
        "metrics_file",
        "resume",
        "linger",
        "generators",
        "generators_dns",
    },
    # The trainer's address and anchor_dir (the weight store); what the trainer's values decide (`derived`).
    "generator": _EVERY_CHILD
    | {"trainer_address", "weight_store", "max_staleness", "max_inflight_groups", "generator_id", "advertise_address"},
    "reward": _EVERY_CHILD | {"output_stage"},  # `scored` when a reference stage follows, else `ready`
    "reference": _EVERY_CHILD | {"temperature"},
}


def derived(trainer: TrainerSettings) -> dict[str, dict[str, Any]]:
    """Other services' fields that the trainer's settings decide: `up` passes them (SET_BY_UP); compose and k8s/ write the same."""
    return {
        # The trainer's staleness, and max_staleness + 1 steps of groups in flight: with 1 the
        # next batch is sampled while the trainer trains on this one, with 0 only once it is
        # trained (acknowledged with the new version). More would only be dropped as stale.
        "generator": {
            "max_staleness": trainer.max_staleness,
            "max_inflight_groups": (trainer.max_staleness + 1) * trainer.groups_per_step,
        },
        # The KL compares log pi_ref with the trainer's log pi, both of logits / temperature.
        "reference": {"temperature": trainer.temperature},
        # The reward stage feeds the reference stage exactly when the KL needs it.
        "reward": {"output_stage": "scored" if trainer.reference_service else "ready"},
    }


class RunConfig(BaseSettings):
    """rollstream up: the whole system as local processes, configured from one profile."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=False,
        cli_avoid_json=True,
        cli_prog_name="rollstream up",
    )

    run: str = Field(
        CommonSettings.model_fields["run"].default,
        pattern=NAME_PATTERN,
        description="the run's name: its Redis keys and the default workdir",
    )
    model: str = Field(
        TorchSettings.model_fields["model"].default, description=TorchSettings.model_fields["model"].description
    )
    redis_url: str = Field(
        "", description="use this Redis instead of an embedded redis-server (empty: embedded, in the workdir)"
    )
    workdir: str = Field(
        "", description="logs, redis data, checkpoints, steps.jsonl and summary.json (empty: runs/<run>)"
    )
    generators: int = Field(1, ge=1, description="generator processes (generator i samples with generator.seed + i)")
    colocate: Colocate = Field(
        "off",
        description="the trainer and the generator in one process (launcher/colocated.py): off (separate processes); sync "
        "(sampling from the trainer's own model, one copy of the weights, sampling and training take turns); async (the "
        "generator on its own copy, written in memory after each step, samples the next batch during the step: needs "
        "trainer.max_staleness >= 1). With --generator.backend vllm: a vLLM engine in the process, written from the trainer's "
        "weights after each step",
    )
    threads: int = Field(
        0, ge=0, description="torch threads per service; 0: all cores for the trainer, half for the others"
    )
    fresh: bool = Field(True, description="delete the run's keys and checkpoints first; --no-fresh continues the run")
    external_reward: bool = Field(
        False,
        description="start no reward service: print what an outside one must use and wait for it (docs/custom-reward.md)",
    )
    log_json: bool = Field(
        CommonSettings.model_fields["log_json"].default, description="the services log JSON lines (in WORKDIR/logs)"
    )
    warm_start: int = Field(
        0,
        ge=0,
        description="before GRPO, SFT on this many generated examples of the answer format (300: 19 SFT steps, about 200 s on "
        "2 quiet cores), then GRPO from that model (WORKDIR/warm-start/; launcher/warm_start.py); 0: GRPO from the model itself",
    )
    trainer: TrainerSettings = Field(
        TrainerSettings.model_validate({}),
        description="the trainer service's settings (its class's defaults; the profile's values: rollstream config)",
    )
    generator: GeneratorSettings = Field(
        GeneratorSettings.model_validate({}),
        description="the generator service's settings (its class's defaults; the profile's values: rollstream config)",
    )
    reward: RewardSettings = Field(
        RewardSettings.model_validate({}),
        description="the reward service's settings (its class's defaults; the profile's values: rollstream config)",
    )
    reference: ReferenceSettings = Field(
        ReferenceSettings.model_validate({}),
        description="the reference service's settings (its class's defaults; the profile's values: rollstream config)",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_sections(cls, data: Any) -> Any:
        """Refuse a section field that `up` sets; fill in the ones the sections' own checks
        need before the children exist (the trainer's checkpoint folder)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        # A profile's [sft] table is `rollstream sft`'s (trainer/sft.py), read by that command.
        data.pop("sft", None)
        for name in SECTIONS:
            section = dict(data.get(name) or {})
            given = sorted(set(section) & SET_BY_UP[name])
            if given:
                raise ValueError(
                    f"{name}.{given[0]}: `rollstream up` sets it for every run (set the top-level value or the trainer's, if there is one)"
                )
            data[name] = section
        workdir = run_workdir(str(data.get("workdir") or ""), str(data.get("run") or cls.model_fields["run"].default))
        data["trainer"].update(trainer_folders(workdir))
        return data

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        return check_url(url) if url else url

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.external_reward and self.reward.scorer_address:
            raise ValueError(
                "reward.scorer_address: only with the built-in reward service (an external one scores by itself)"
            )
        if self.reward.scorer_address and not is_unix_address(self.reward.scorer_address):
            # The reward stage sends its token to the scorer: under `up` only over a unix socket.
            raise ValueError(
                f"reward.scorer_address: {self.reward.scorer_address} is TCP; under `up` serve the scorer on a unix socket (unix:/path)"
            )
        # A generator dead-letters a task over its limits: here, every task of the run.
        for asks, limit in (("group_size", "max_group_size"), ("max_new_tokens", "max_task_new_tokens")):
            if getattr(self.trainer, asks) > getattr(self.generator, limit):
                raise ValueError(f"trainer.{asks} is over generator.{limit}: the generators would refuse every task")
        if self.warm_start and (why := warm_start.refusal(self.trainer, self.warm_start)):
            raise ValueError(why)
        if self.colocated:
            # The demo profile colocates: say how to leave it (not to one who asked for async).
            hint = "" if self.colocate == "async" else " (--colocate off: the generators in processes of their own)"
            if self.generators != 1:
                raise ValueError(
                    f"generators: colocated, the one generator is in the trainer's process, not {self.generators}{hint}"
                )
            why = refusal(self.trainer, self.generator.model_copy(update={"model": self.trainer.model}), self.colocate)
            if why:
                raise ValueError(why + hint)
        return self

    @property
    def colocated(self) -> bool:
        """The trainer and the generator in one process (either variant)."""
        return self.colocate != "off"

    @property
    def with_reference(self) -> bool:
        """The reference service runs where the KL needs it and the trainer is not its own
        reference (LoRA with kl_reference = lora_base: the base under the adapters)."""
        return self.trainer.reference_service


def run_workdir(workdir: str, run: str) -> Path:
    return Path(workdir or f"runs/{run}").resolve()


def trainer_folders(workdir: Path) -> dict[str, Any]:
    """The trainer's fields `up` derives from the workdir (set before validation: the trainer's
    own checks need checkpoint_dir). A restarted trainer resumes its newest checkpoint and
    lingers after its last step, so the generators can catch up; the anchor lives on disk."""
    return {
        "checkpoint_dir": str(workdir / "checkpoints"),
        "anchor_dir": str(workdir / "anchor"),
        "resume": "auto",
        "linger": True,
        "export_dir": str(workdir / "model"),
        "tracker_dir": str(workdir / "trackers"),
    }


def profile_path(profile: str) -> Path:
    """A profile's file: a name in this package's profiles/ folder, or a path."""
    named = PROFILES / f"{profile}.toml"
    path = named if "/" not in profile and not profile.endswith(".toml") else Path(profile)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
        raise ConfigError(f"profile {profile!r}: no such file ({path}); the named profiles: {known}")
    return path


def _hidden(dest: str) -> bool:
    """Whether a generated flag is left out: `up` sets the field, or it is a secret."""
    section, _, name = dest.partition(".")
    return section in SECTIONS and (not name or name in SET_BY_UP[section])


def cli_source() -> CliSettingsSource[Any]:
    """The flags of `up` and `config`, generated from RunConfig's fields (the sections' too)."""

    def add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
        return None if _hidden(str(kwargs.get("dest", ""))) else parser.add_argument(*names, **kwargs)

    cli: CliSettingsSource[Any] = CliSettingsSource(RunConfig, add_argument_method=add_argument)
    # The defaults above are the services' classes'; the profile sets some of them again.
    given = TomlConfigSettingsSource(RunConfig, toml_file=profile_path(DEFAULT_PROFILE))()
    shown = ", ".join(
        f"{k}.{f} = {v}" if isinstance(vs, dict) else f"{k} = {vs}"
        for k, vs in given.items()
        for f, v in (vs.items() if isinstance(vs, dict) else [(k, vs)])
    )
    cli.root_parser.epilog = f"The {DEFAULT_PROFILE} profile sets: {shown}. Every value and its source: rollstream config [--profile ...] [flags]."
    cli.root_parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="NAME|PATH",
        help=f"a profile in {PROFILES} by name, or a TOML file (default: {DEFAULT_PROFILE})",
    )
    return cli


class Layers(BaseModel):
    """The raw values of each source, lowest first, for `load` and for `rollstream config`."""

    profile: str
    by_source: dict[str, dict[str, Any]]


def layers(argv: list[str]) -> Layers:
    cli = cli_source()
    try:
        parsed = vars(cli.root_parser.parse_args(argv))
        profile = parsed.pop("profile")
        path = profile_path(profile)
        try:
            from_profile = TomlConfigSettingsSource(RunConfig, toml_file=path)()
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"profile {path} is not valid TOML: {e}") from None
        from_env = EnvSettingsSource(RunConfig)()
        from_flags = cli(parsed_args=parsed)()
    except SettingsError as e:
        raise ConfigError(f"invalid {RunConfig.__name__} configuration: {e}") from None
    return Layers(profile=str(path), by_source={"profile": from_profile, "environment": from_env, "flags": from_flags})


def merged(by_source: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for values in by_source.values():
        _merge(out, values)
    return out


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def load(argv: list[str]) -> RunConfig:
    """RunConfig from defaults < profile < ROLLSTREAM_* environment < flags; a bad value is a
    ConfigError naming the field."""
    return build(layers(argv))


def build(found: Layers) -> RunConfig:
    try:
        # model_validate, not RunConfig(...): the sources are merged already (no second read of the environment).
        return RunConfig.model_validate(merged(found.by_source))
    except ValidationError as e:
        lines = [f"invalid run configuration (profile {found.profile}):"]
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(run)"
            lines.append(f"  field '{where}': {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def sources(found: Layers) -> Iterator[tuple[str, Any, str]]:
    """(dotted field, resolved value, where it came from) for every field of the run, for
    `rollstream config`; a field no source gave is its class's default."""
    resolved = build(found).model_dump(mode="json")
    shown_folders = trainer_folders(Path())  # set by up, and known before the run starts
    for key in RunConfig.model_fields:
        if key in SECTIONS:
            for field in SECTIONS[key].model_fields:
                if field in SET_BY_UP[key] and (key != "trainer" or field not in shown_folders):
                    continue
                came = "set by up" if field in SET_BY_UP[key] else _origin(found.by_source, key, field)
                yield f"{key}.{field}", resolved[key][field], came
        else:
            yield key, resolved[key], _origin(found.by_source, key)


def _origin(by_source: dict[str, dict[str, Any]], key: str, field: str | None = None) -> str:
    came = "default"
    for name, values in by_source.items():
        value = values.get(key)
        if (value is not None and field is None) or (isinstance(value, dict) and field in value):
            came = name
    return came


def child_toml(section: CommonSettings, name: str, **set_by_up: Any) -> dict[str, Any]:
    """What a child reads with `--config`: its section's values that differ from its class's
    defaults, and what `up` sets (secrets never: they go by file)."""
    secret = {f for f, info in type(section).model_fields.items() if info.annotation is SecretStr}
    values = section.model_dump(mode="json", exclude_defaults=True, exclude=secret | SET_BY_UP[name])
    return {**values, **set_by_up}
