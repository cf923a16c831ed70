"""`up`'s plan (launcher/plan.py) without processes: from the run configuration to each child's
command and configuration file; the colocated process's one file (launcher/colocation.py)
loads as its two halves; `rollstream config` prints the plan and never imports torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from rollstream.core.config import ConfigError
from rollstream.launcher import colocation, run_config
from rollstream.launcher.plan import Plan, plan

CORES = 8


def planned(tmp_path: Path, *argv: str, redis_url: str = "unix:///r.sock") -> Plan:
    return plan(run_config.load(["--workdir", str(tmp_path), *argv]), "/models/m", redis_url, CORES)


def test_separate_services_each_get_their_section_sockets_and_own_credentials(tmp_path: Path) -> None:
    p = planned(
        tmp_path, "--colocate", "off", "--generators", "2", "--trainer.beta", "0.05", "--trainer.max-staleness", "1"
    )
    assert [(c.name, c.module) for c in p.children] == [
        ("trainer", "trainer"), ("generator-0", "generator"), ("generator-1", "generator"), ("reward-0", "reward"), ("reference-0", "reference"),
    ]  # fmt: skip
    trainer, gen0, gen1, reward, reference = (c.config for c in p.children)
    assert p.embedded_redis and p.external_reward is None
    assert p.children[1].args(tmp_path) == ["generator", "--config", str(tmp_path / "config" / "generator-0.toml")]
    # The generators find the trainer at its socket, read its weight store, sample ahead by its staleness.
    for i, gen in enumerate((gen0, gen1)):
        assert (
            gen["trainer_address"] == f"unix:{trainer['grpc_socket']}" and gen["weight_store"] == trainer["anchor_dir"]
        )
        assert (gen["consumer"], gen["seed"], gen["max_staleness"], gen["max_inflight_groups"]) == (
            f"generator-{i}",
            i,
            1,
            2 * 8,
        )
        assert gen["threads"] == CORES // 2
    assert trainer["threads"] == CORES and trainer["model"] == gen0["model"] == reference["model"] == "/models/m"
    assert reference["temperature"] == run_config.load(["--workdir", str(tmp_path)]).trainer.temperature
    assert reward["output_stage"] == "scored" and "model" not in reward
    credentials = tmp_path / "credentials"
    for child, role in zip(p.children, ("trainer", "generator", "generator", "reward", "reference")):
        values = child.config
        assert values["redis_username"] == role and values["grpc_token_file"] == str(
            credentials / "grpc" / f"{role}.token"
        ), child.name
        assert "redis_password" not in values, "files only, never a secret"
        assert values["redis_url"] == "unix:///r.sock" and values["run"] == "demo"
    assert sorted(p.sockets) == sorted(
        {Path(c.config["grpc_socket"]) for c in p.children} | {tmp_path / "redis" / "redis.sock"}
    )
    assert len(set(p.sockets)) == 6 and all(s.parent in (tmp_path / "sockets", tmp_path / "redis") for s in p.sockets)


def test_synchronous_sampling_takes_every_core(tmp_path: Path) -> None:
    p = planned(tmp_path, "--colocate", "off", "--trainer.max-staleness", "0")
    assert p.children[1].config["threads"] == CORES and p.children[1].config["max_inflight_groups"] == 8


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_colocated_is_one_child_whose_one_file_loads_as_both_halves(mode: str, tmp_path: Path) -> None:
    p = planned(tmp_path, "--colocate", mode, "--trainer.max-staleness", "1" if mode == "async" else "0")
    assert [(c.name, c.module, c.sections) for c in p.children] == [
        ("trainer", "launcher.colocated", ("trainer", "generator")),
        ("reward-0", "reward", ("reward",)),
    ]
    child = p.children[0]
    assert child.config["colocate"] == mode and "trainer_address" not in child.config["generator"]
    assert (
        child.tables()["generator"]["redis_username"] == "generator"
        and child.tables()["trainer"]["redis_username"] == "trainer"
    )
    path = tmp_path / "colocated.toml"
    path.write_text(tomli_w.dumps(child.config))
    (tmp_path / "sockets").mkdir(mode=0o700)  # as `up` makes it: the sockets' folder is checked
    both = colocation.load(["--config", str(path), "--state-file", str(tmp_path / "s.json")])
    assert both.colocate == mode and both.trainer.state_file == str(
        tmp_path / "s.json"
    )  # the process's flags are the trainer's
    assert both.trainer.consumer == "trainer-0" and both.generator.consumer == "generator-0"
    assert both.generator.grpc_token_file.endswith("grpc/generator.token") and both.trainer.grpc_token_file.endswith(
        "grpc/trainer.token"
    )


def test_the_generators_table_wins_over_the_process_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a container both halves read the trainer's ROLLSTREAM_* variables; the generator's
    own values (its Redis user, its ports) are its table's."""
    path = tmp_path / "c.toml"
    path.write_text('colocate = "sync"\n[trainer]\n[generator]\nredis_username = "generator"\nhttp_port = 8081\n')
    env = {"ROLLSTREAM_REDIS_USERNAME": "trainer", "ROLLSTREAM_HTTP_PORT": "8080", "ROLLSTREAM_LR": "3e-5"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    both = colocation.load(["--config", str(path)])
    assert (both.trainer.redis_username, both.trainer.http_port, both.trainer.lr) == ("trainer", 8080, 3e-5)
    assert (both.generator.redis_username, both.generator.http_port) == ("generator", 8081)


@pytest.mark.parametrize(
    ("text", "argv", "cause"),
    [
        ('colocate = "both"\n[trainer]\n[generator]\n', [], "colocate"),
        ('colocate = "sync"\n[generator]\n', [], "no [trainer] table"),
        ('colocate = "sync"\nlr = 1e-5\n[trainer]\n[generator]\n', [], "lr"),
        ('colocate = "sync"\n[trainer]\nlora_rank = 8\n[generator]\n', [], "trainer.lora_rank"),
        ('colocate = "async"\n[trainer]\nmax_staleness = 0\n[generator]\n', [], "trainer.max_staleness"),
        ('colocate = "sync"\n[trainer]\n[generator]\nmodel = "other"\n', [], "generator.model"),
    ],
)
def test_a_colocated_file_that_cannot_run_is_refused_naming_the_cause(
    text: str, argv: list[str], cause: str, tmp_path: Path
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=cause.replace("[", r"\[")):
        colocation.load(["--config", str(path), *argv])


def test_an_external_reward_and_redis_are_in_the_plan_as_what_they_receive(tmp_path: Path) -> None:
    p = planned(
        tmp_path,
        "--colocate",
        "off",
        "--external-reward",
        "--redis-url",
        "redis://127.0.0.1:6390/0",
        redis_url="redis://127.0.0.1:6390/0",
    )
    assert [c.name for c in p.children] == ["trainer", "generator-0"] and not p.embedded_redis
    assert (
        p.external_reward is not None and p.external_reward.username == "" and p.external_reward.password_file is None
    )
    assert all("redis_username" not in c.config and c.config["grpc_token_file"] for c in p.children), (
        "an external Redis's users are the operator's"
    )
    assert tmp_path / "redis" / "redis.sock" not in p.sockets


def test_config_prints_the_plan_and_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom rollstream.launcher import cli\n"
        f"code = cli.main_code(['config', '--workdir', {str(tmp_path)!r}])\n"
        "assert code == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    values = tomllib.loads(shown.stdout)
    assert values["colocate"] == "sync"  # the demo profile's
    child = values["plan"]["trainer"]
    assert (
        child["colocate"] == "sync"
        and child["generator"]["consumer"] == "generator-0"
        and child["trainer"]["consumer"] == "trainer-0"
    )
    assert (
        f"# trainer: python -m rollstream.launcher.colocated --config {tmp_path / 'config' / 'trainer.toml'}"
        in shown.stdout
    )
    assert set(values["plan"]) == {"trainer", "reward-0"}
