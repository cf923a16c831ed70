"""rollstream.core.config.load_settings: defaults < TOML < ROLLSTREAM_* env < flags <
overrides (pydantic-settings' TOML, env and CLI sources), and errors that name the field;
plus the trainer's own settings and its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.core import cpu_runtime
from rollstream.core.config import CommonSettings, ConfigError, TorchSettings, load_or_exit, load_settings
from rollstream.generator.config import GeneratorSettings
from rollstream.reference.config import ReferenceSettings
from rollstream.reward.config import RewardSettings
from rollstream.trainer.config import TrainerSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ROLLSTREAM_* variable from the outer environment may leak into these tests."""
    for name in list(os.environ):
        if name.startswith("ROLLSTREAM_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings(CommonSettings, [])
    assert isinstance(s, CommonSettings)
    assert (s.run, s.max_deliveries, s.read_count, s.log_json, s.log_level) == ("demo", 5, 8, False, "INFO")


def test_precedence_defaults_toml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each field is set at a different number of layers, so each layer's win is visible.
    cfg = _toml(
        tmp_path,
        'run = "from-toml"\nread_count = 11\nmax_deliveries = 12\nblock_ms = 13\n',
    )
    monkeypatch.setenv("ROLLSTREAM_MAX_DELIVERIES", "22")
    monkeypatch.setenv("ROLLSTREAM_BLOCK_MS", "23")
    s = load_settings(CommonSettings, ["--config", str(cfg), "--block-ms", "33"])
    assert s.claim_idle_ms == 30_000  # default only
    assert s.run == "from-toml"  # TOML over default
    assert s.read_count == 11  # TOML over default
    assert s.max_deliveries == 22  # env over TOML
    assert s.block_ms == 33  # flag over env over TOML


def test_config_path_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _toml(tmp_path, "read_count = 3\n")
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(cfg))
    assert load_settings(CommonSettings, []).read_count == 3


def test_overrides_beat_flags() -> None:
    s = load_settings(CommonSettings, ["--read-count", "4"], read_count=5)
    assert s.read_count == 5


def test_bool_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(CommonSettings, ["--log-json"]).log_json is True
    assert load_settings(CommonSettings, ["--no-log-json"]).log_json is False
    # --no-log-json wins over TOML and env saying true.
    cfg = _toml(tmp_path, "log_json = true\n")
    assert load_settings(CommonSettings, ["--config", str(cfg)]).log_json is True
    monkeypatch.setenv("ROLLSTREAM_LOG_JSON", "true")
    assert load_settings(CommonSettings, []).log_json is True
    assert load_settings(CommonSettings, ["--config", str(cfg), "--no-log-json"]).log_json is False


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--max-deliveries", "0"], "max_deliveries"),
        (["--read-count", "many"], "read_count"),
        (["--grpc-port", "70000"], "grpc_port"),
        (["--run", "has space"], "run"),
        (["--log-level", "LOUD"], "log_level"),
        (["--claim-idle-ms", "10"], "claim_idle_ms"),
    ],
)
def test_bad_flag_names_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(CommonSettings, argv)
    assert f"field '{field}'" in str(err.value)
    assert "CommonSettings" in str(err.value)


def test_bad_env_names_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_BLOCK_MS", "-5")
    with pytest.raises(ConfigError, match="field 'block_ms'"):
        load_settings(CommonSettings, [])


def test_bad_toml_value_names_field(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, 'read_count = "lots"\n')
    with pytest.raises(ConfigError, match="field 'read_count'"):
        load_settings(CommonSettings, ["--config", str(cfg)])


def test_unknown_toml_key_fails_naming_it(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "read_cuont = 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(CommonSettings, ["--config", str(cfg)])
    assert "read_cuont" in str(err.value)
    assert "xtra" in str(err.value)  # pydantic: "Extra inputs are not permitted"


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="config file not found") as err:
        load_settings(CommonSettings, ["--config", str(missing)])
    assert str(missing) in str(err.value)


def test_invalid_toml(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "read_count = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(CommonSettings, ["--config", str(cfg)])


def test_one_field_through_every_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same field at each layer in turn, through the real sources: TOML < env < flag < override.
    cfg = _toml(tmp_path, "read_count = 2\n")
    assert load_settings(CommonSettings, ["--config", str(cfg)]).read_count == 2
    monkeypatch.setenv("ROLLSTREAM_READ_COUNT", "3")
    assert load_settings(CommonSettings, ["--config", str(cfg)]).read_count == 3
    assert load_settings(CommonSettings, ["--config", str(cfg), "--read-count", "4"]).read_count == 4
    assert load_settings(CommonSettings, ["--config", str(cfg), "--read-count", "4"], read_count=5).read_count == 5


def test_config_flag_beats_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_cfg = tmp_path / "env.toml"
    env_cfg.write_text("read_count = 3\n")
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(env_cfg))
    assert load_settings(CommonSettings, ["--config", str(_toml(tmp_path, "read_count = 4\n"))]).read_count == 4


def test_argv_none_or_empty_never_reads_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["rollstream.trainer", "--read-count", "7", "--bogus"])
    assert load_settings(CommonSettings).read_count == 8
    assert load_settings(CommonSettings, None).read_count == 8
    assert load_settings(CommonSettings, []).read_count == 8


def test_flag_sources_do_not_leak_into_direct_construction(tmp_path: Path) -> None:
    # Flags and TOML belong to one load_settings call; a class built directly afterwards reads
    # its keyword arguments and the environment only.
    load_settings(CommonSettings, ["--config", str(_toml(tmp_path, "read_count = 3\n")), "--block-ms", "9"])
    s = CommonSettings()
    assert (s.read_count, s.block_ms) == (8, 500)


def test_unknown_flag_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="--read-cuont"):
        load_settings(CommonSettings, ["--read-cuont", "3"])


def test_abbreviated_flag_is_refused() -> None:
    # argparse's prefix matching is off: `--read 3` must not quietly mean --read-count.
    with pytest.raises(ConfigError, match="--read"):
        load_settings(CommonSettings, ["--read", "3"])


def test_flag_missing_its_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--read-count"):
        load_settings(CommonSettings, ["--read-count"])


def test_load_or_exit_prints_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_or_exit(CommonSettings, ["--grpc-port", "notanumber"])
    assert e.value.code == 2
    assert "field 'grpc_port'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--redis-password", "hunter2"], ["--redis-password=hunter2"]])
def test_secret_is_never_a_flag(argv: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(CommonSettings, argv)
    assert "field 'redis_password'" in str(err.value)
    assert "hunter2" not in str(err.value)  # the error goes to logs: no echo of the secret


def test_secret_from_env_and_file_flag_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD", "hunter2")
    s = load_settings(CommonSettings, ["--redis-password-file", "/run/secrets/pw"])
    assert s.redis_password.get_secret_value() == "hunter2"
    assert s.redis_password_file == "/run/secrets/pw"


@pytest.mark.parametrize("cls", [CommonSettings, GeneratorSettings, ReferenceSettings, RewardSettings, TrainerSettings])
def test_help_lists_fields_with_descriptions(cls: type[CommonSettings], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_settings(cls, ["--help"])
    assert e.value.code == 0
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # argparse wraps lines,
    squeezed = "".join(raw.split())  # also after a hyphen ("hostname-\npid")
    assert "--read-count" in out and "entries read per XREADGROUP" in out
    assert "--log-json, --no-log-json" in out
    assert "--config PATH" in out and "ROLLSTREAM_CONFIG" in out
    assert "--redis-password-file" in out
    assert "--redis-password " not in out and "--redis-password," not in out and "ROLLSTREAM_REDIS_PASSWORD " not in out
    for name, info in cls.model_fields.items():
        if name != "redis_password":
            assert "--" + name.replace("_", "-") in out
            if info.description:
                assert "".join(info.description.split()) in squeezed, name


def test_torch_settings_are_shared_with_service_descriptions_kept() -> None:
    for cls in (GeneratorSettings, ReferenceSettings, TrainerSettings):
        assert issubclass(cls, TorchSettings)
        s = load_settings(cls, ["--model", "m", "--dtype", "bfloat16", "--device", "cuda:0", "--threads", "3"])
        assert (s.model, s.dtype, s.device, s.threads) == ("m", "bfloat16", "cuda:0", 3)
        with pytest.raises(ConfigError, match="field 'dtype'"):
            load_settings(cls, ["--dtype", "float16"])
    assert not issubclass(RewardSettings, TorchSettings)
    # Redeclared where the service says more, with the same default.
    assert "optimizer" in (TrainerSettings.model_fields["device"].description or "")
    assert "vllm" in (GeneratorSettings.model_fields["device"].description or "")
    assert TrainerSettings.model_fields["device"].default == TorchSettings.model_fields["device"].default == "cpu"


# --- trainer settings -------------------------------------------------------------------------


def test_trainer_generators_split_from_flag() -> None:
    s = load_settings(TrainerSettings, ["--generators", "a:1,b:2"])
    assert s.generators == ["a:1", "b:2"]
    assert load_settings(TrainerSettings, ["--generators", " a:1 , ,b:2 "]).generators == ["a:1", "b:2"]
    assert load_settings(TrainerSettings, []).generators == []


def test_trainer_generators_split_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # TrainerSettings._split says "Flags and env give 'a:1,b:2'". pydantic-settings JSON-decodes
    # list fields from the environment before any validator runs, so this needs NoDecode.
    monkeypatch.setenv("ROLLSTREAM_GENERATORS", "x:9,y:8")
    assert load_settings(TrainerSettings, []).generators == ["x:9", "y:8"]


def test_trainer_generators_json_list_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_GENERATORS", '["x:9", "y:8"]')
    assert load_settings(TrainerSettings, []).generators == ["x:9", "y:8"]


def test_delta_encode_threads_auto_is_half_the_cores_and_a_number_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollstream.trainer.config import auto_encode_threads

    assert [auto_encode_threads(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    s = load_settings(TrainerSettings, [])
    assert s.delta_encode_threads == "auto"
    assert s.encode_threads() == auto_encode_threads() == max(1, cpu_runtime.usable_cores() // 2)
    assert load_settings(TrainerSettings, ["--threads", "6"]).encode_threads() == 3  # torch's threads when set
    assert (
        load_settings(TrainerSettings, ["--delta-encode-threads", "0"]).encode_threads() == 0
    )  # after the step, on the trainer's thread
    monkeypatch.setenv("ROLLSTREAM_DELTA_ENCODE_THREADS", "5")
    assert load_settings(TrainerSettings, []).encode_threads() == 5
    monkeypatch.delenv("ROLLSTREAM_DELTA_ENCODE_THREADS")
    (tmp_path / "t.toml").write_text('delta_encode_threads = "auto"\n')
    assert load_settings(TrainerSettings, ["--config", str(tmp_path / "t.toml")]).delta_encode_threads == "auto"
    for bad in ("-1", "65", "many"):
        with pytest.raises(ConfigError, match="delta_encode_threads"):
            load_settings(TrainerSettings, ["--delta-encode-threads", bad])


def test_undecodable_env_value_is_a_config_error_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    # A complex field (tuple) whose env value is not JSON: pydantic-settings raises its own
    # SettingsError, which load_settings must turn into a ConfigError like any other bad value.
    monkeypatch.setenv("ROLLSTREAM_BETAS", "0.9,0.99")
    with pytest.raises(ConfigError, match="betas"):
        load_settings(TrainerSettings, [])


def test_trainer_betas_from_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _toml(tmp_path, "betas = [0.8, 0.95]\n")
    assert load_settings(TrainerSettings, ["--config", str(cfg)]).betas == (0.8, 0.95)
    monkeypatch.setenv("ROLLSTREAM_BETAS", "[0.9, 0.99]")
    assert load_settings(TrainerSettings, ["--config", str(cfg)]).betas == (0.9, 0.99)


def test_trainer_betas_from_flag() -> None:
    # Every field is meant to be settable by a flag; --betas gets the raw string.
    assert load_settings(TrainerSettings, ["--betas", "0.9,0.99"]).betas == (0.9, 0.99)


def test_trainer_generators_json_list_from_flag_and_repeated_flags() -> None:
    assert load_settings(TrainerSettings, ["--generators", '["a:1", "b:2"]']).generators == ["a:1", "b:2"]
    assert load_settings(TrainerSettings, ["--generators", "a:1", "--generators", "b:2"]).generators == ["a:1", "b:2"]
    assert load_settings(TrainerSettings, ["--lora-target-modules", "q_proj,v_proj"]).lora_target_modules == [
        "q_proj",
        "v_proj",
    ]
    assert load_settings(TrainerSettings, []).lora_target_modules == ["all-linear"]


def test_trainer_bad_betas_flag_names_field() -> None:
    with pytest.raises(ConfigError, match="betas"):
        load_settings(TrainerSettings, ["--betas", "0.9,x"])


def test_trainer_linger_flag_pair(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "linger = true\n")
    assert load_settings(TrainerSettings, ["--config", str(cfg)]).linger is True
    assert load_settings(TrainerSettings, ["--config", str(cfg), "--no-linger"]).linger is False


def test_trainer_generators_list_from_toml(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, 'generators = ["h1:50051", "h2:50051"]\nlr = 3e-6\n')
    s = load_settings(TrainerSettings, ["--config", str(cfg)])
    assert s.generators == ["h1:50051", "h2:50051"]
    assert s.lr == 3e-6


def test_trainer_jsonl_needs_dataset_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset_path"):
        load_settings(TrainerSettings, ["--task", "jsonl"])
    ok = load_settings(TrainerSettings, ["--task", "jsonl", "--dataset-path", str(tmp_path / "p.jsonl")])
    assert ok.task == "jsonl" and ok.dataset_path.endswith("p.jsonl")


def test_trainer_bad_literal_names_field() -> None:
    with pytest.raises(ConfigError, match="field 'task'"):
        load_settings(TrainerSettings, ["--task", "poetry"])


def test_trainer_cli_bad_lr_exits_2_naming_field(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream.trainer", "--lr", "-1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "field 'lr'" in proc.stderr
    assert "Traceback" not in proc.stderr
