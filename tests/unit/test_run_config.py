"""The run configuration `rollstream up` composes from the services' own settings classes
(launcher/run_config.py): one default per setting, whichever way it is read."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

from rollstream.core.config import ConfigError, load_settings
from rollstream.launcher import run_config
from rollstream.launcher.run_config import SECTIONS, SET_BY_UP
from rollstream.reference.config import ReferenceSettings
from rollstream.trainer.config import TrainerSettings

ROLLSTREAM = Path(sys.executable).parent / "rollstream"


@pytest.fixture(autouse=True)
def no_rollstream_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ROLLSTREAM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def weight_decay_default() -> Iterator[float]:
    """TrainerSettings' weight_decay default changed in its one place (the field), for one test."""
    field = TrainerSettings.model_fields["weight_decay"]
    before = field.default
    field.default = 0.0625
    TrainerSettings.model_rebuild(force=True)
    importlib.reload(run_config)  # as a new process would import it
    try:
        yield field.default
    finally:
        field.default = before
        TrainerSettings.model_rebuild(force=True)
        importlib.reload(run_config)


def test_a_default_changed_in_its_class_reaches_help_config_and_the_child(
    weight_decay_default: float, tmp_path: Path
) -> None:
    help_text = run_config.cli_source().root_parser.format_help()
    entry = " ".join(help_text.rsplit("--trainer.weight-decay float", 1)[1].split("--trainer.", 1)[0].split())
    assert f"(default: {weight_decay_default})" in entry
    cfg = run_config.load(["--workdir", str(tmp_path)])
    assert cfg.trainer.weight_decay == weight_decay_default
    shown = {
        key: (value, came) for key, value, came in run_config.sources(run_config.layers(["--workdir", str(tmp_path)]))
    }
    assert shown["trainer.weight_decay"] == (weight_decay_default, "default")
    path = tmp_path / "trainer.toml"
    path.write_text(tomli_w.dumps(run_config.child_toml(cfg.trainer, "trainer", checkpoint_dir=str(tmp_path / "c"))))
    assert load_settings(TrainerSettings, ["--config", str(path)]).weight_decay == weight_decay_default


def test_the_child_reads_what_the_run_configuration_says(tmp_path: Path) -> None:
    cfg = run_config.load(["--workdir", str(tmp_path), "--trainer.loss", "dapo", "--trainer.betas", "[0.8, 0.9]"])
    path = tmp_path / "trainer.toml"
    path.write_text(
        tomli_w.dumps(run_config.child_toml(cfg.trainer, "trainer", checkpoint_dir=cfg.trainer.checkpoint_dir))
    )
    child = load_settings(TrainerSettings, ["--config", str(path)])
    differ = {f for f in TrainerSettings.model_fields if getattr(child, f) != getattr(cfg.trainer, f)}
    assert differ <= SET_BY_UP["trainer"], differ
    assert (child.loss, child.betas, child.lr, child.steps) == (
        "dapo",
        (0.8, 0.9),
        2e-5,
        15,
    )  # flags, the default, the demo profile


def test_sources_in_order_flags_over_environment_over_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    profile = tmp_path / "mine.toml"
    profile.write_text(
        'generators = 2\n[trainer]\nlr = 3e-5\nbeta = 0.01\ngroup_size = 4\n[reward]\ngroup = "scorers"\n'
    )
    monkeypatch.setenv("ROLLSTREAM_TRAINER__BETA", "0.02")
    monkeypatch.setenv("ROLLSTREAM_TRAINER__GROUP_SIZE", "6")
    found = run_config.layers(["--profile", str(profile), "--trainer.group-size", "5", "--workdir", str(tmp_path)])
    shown = {key: (value, came) for key, value, came in run_config.sources(found)}
    assert shown["trainer.lr"] == (3e-5, "profile")
    assert shown["trainer.beta"] == (0.02, "environment")
    assert shown["trainer.group_size"] == (5, "flags")
    assert shown["trainer.max_new_tokens"] == (TrainerSettings.model_fields["max_new_tokens"].default, "default")
    assert shown["generators"] == (2, "profile") and shown["reward.group"] == ("scorers", "profile")
    assert shown["trainer.checkpoint_dir"] == (str(tmp_path / "checkpoints"), "set by up")


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_a_field_up_sets_is_refused_from_every_source(
    section: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text(f'[{section}]\nconsumer = "mine"\n')
    with pytest.raises(ConfigError, match=rf"{section}\.consumer: `rollstream up` sets it"):
        run_config.load(["--profile", str(profile)])
    monkeypatch.setenv(f"ROLLSTREAM_{section.upper()}__CONSUMER", "mine")
    with pytest.raises(ConfigError, match=rf"{section}\.consumer"):
        run_config.load([])
    monkeypatch.delenv(f"ROLLSTREAM_{section.upper()}__CONSUMER")
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        run_config.load([f"--{section}.consumer", "mine"])


def test_what_the_trainer_decides_for_another_service_is_derived_never_given(tmp_path: Path) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text("[reference]\ntemperature = 0.7\n")
    with pytest.raises(
        ConfigError,
        match=r"reference\.temperature: `rollstream up` sets it for every run \(set the top-level value or the trainer's",
    ):
        run_config.load(["--profile", str(profile)])
    flags = [
        "--trainer.temperature",
        "0.7",
        "--trainer.max-staleness",
        "2",
        "--trainer.groups-per-step",
        "3",
        "--trainer.beta",
        "0.1",
    ]
    cfg = run_config.load(["--profile", "gpu", *flags])
    derived = run_config.derived(cfg.trainer)
    assert derived == {
        "generator": {"max_staleness": 2, "max_inflight_groups": 9},
        "reference": {"temperature": 0.7},
        "reward": {"output_stage": "scored"},
    }
    path = tmp_path / "reference.toml"
    path.write_text(tomli_w.dumps(run_config.child_toml(cfg.reference, "reference", **derived["reference"])))
    assert (
        load_settings(ReferenceSettings, ["--config", str(path)]).temperature == 0.7
    )  # the child's log-probs are of the trainer's logits / T


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--trainer.max-staleness", "-1"], "trainer.max_staleness"),
        (["--trainer.lr", "nan"], "trainer.lr"),
        (["--trainer.lr", "1e400"], "trainer.lr"),
        (["--generators", "0"], "generators"),
        (["--run", "a b"], "run"),
        (["--redis-url", "http://x"], "redis_url"),
        (["--trainer.task", "jsonl"], "dataset_path"),
        (["--external-reward", "--reward.scorer-address", "127.0.0.1:1"], "reward.scorer_address"),
        (["--trainer.group-size", "300"], "trainer.group_size is over generator.max_group_size"),
        (
            ["--trainer.max-new-tokens", "20", "--generator.max-task-new-tokens", "19"],
            "trainer.max_new_tokens is over generator.max_task_new_tokens",
        ),
        (["--profile", "no-such-profile"], "no-such-profile"),
    ],
)
def test_a_bad_value_names_its_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        run_config.load(argv)


def test_a_profile_that_is_not_toml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        run_config.load(["--profile", str(bad)])


def test_every_named_profile_loads_and_sets_only_real_fields() -> None:
    for path in sorted(run_config.PROFILES.glob("*.toml")):
        cfg = run_config.load(["--profile", path.stem])
        given = tomllib.loads(path.read_text())
        for section, values in given.items():
            if not isinstance(values, dict):  # a top-level field (the demo's `colocate`)
                assert getattr(cfg, section) == values, (path.name, section)
            for name, value in values.items() if isinstance(values, dict) else []:
                got = getattr(getattr(cfg, section), name)
                assert got == value or list(got) == value, (path.name, section, name)


def test_up_help_lists_each_section_field_once_with_its_default_and_the_profile() -> None:
    shown = subprocess.run(
        [str(ROLLSTREAM), "up", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert shown.returncode == 0, shown.stderr
    for section, cls in SECTIONS.items():
        for name in cls.model_fields:
            flag = f"--{section}.{name.replace('_', '-')} "
            assert (flag in shown.stdout) == (name not in SET_BY_UP[section]), flag
    assert "--trainer.lr float" in shown.stdout and "(default: 2e-05)" in shown.stdout
    assert "The demo profile sets: colocate = sync, trainer.steps = 15, trainer.token_budget = 512" in " ".join(
        shown.stdout.split()
    )


def test_config_command_prints_toml_with_sources(tmp_path: Path) -> None:
    shown = subprocess.run(
        [str(ROLLSTREAM), "config", "--trainer.lr", "4e-5", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "lr = 4e-05  # flags" in shown.stdout and "steps = 15  # profile" in shown.stdout
    values = tomllib.loads(shown.stdout)  # comments aside, it is the TOML of the run
    assert values["trainer"]["lr"] == 4e-5 and values["generators"] == 1
    bad = subprocess.run([str(ROLLSTREAM), "config", "--trainer.lr", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "trainer.lr" in bad.stderr
