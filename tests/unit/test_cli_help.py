"""`rollstream <command> --help`: every option has a help line, and every default shows.
`up`, `config` and `status`, whose flags are generated from settings classes: test_run_config.py
and below (`sft`'s: tests/integration/test_sft_command.py)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.launcher.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for name, p in sub.choices.items() if name not in ("up", "eval", "sft", "config", "status")}


def entries(help_text: str) -> dict[str, str]:
    """Each option's entry in the help, by its long flag: its line and the indented lines after."""
    out: dict[str, str] = {}
    current = ""
    for line in help_text.split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            current = re.findall(r"--[\w-]+", line)[0] if "--" in line else line.split()[0]
            out[current] = line
        elif current:
            out[current] += " " + line.strip()
    return {flag: " ".join(text.split()) for flag, text in out.items()}


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = subcommands()[command]
    rollstream = Path(sys.executable).parent / "rollstream"
    shown = subprocess.run(
        [str(rollstream), command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert shown.returncode == 0, shown.stderr
    by_flag = entries(shown.stdout)
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        assert (action.help or "").strip(), f"{command} {flag} has no help"
        entry = by_flag[flag]
        empty = action.default is None or action.default is False or action.default in ("", [])
        if not empty:
            assert f"(default: {action.default})" in entry, f"{command} {flag}: no default shown in {entry!r}"


def test_status_flags_and_variables_come_from_its_settings_class() -> None:
    """Every StatusSettings field but the password is a flag with its description and default,
    and names its ROLLSTREAM_* variable; the password is never a flag."""
    from rollstream.launcher.cli import StatusSettings

    rollstream = Path(sys.executable).parent / "rollstream"
    shown = subprocess.run(
        [str(rollstream), "status", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert shown.returncode == 0, shown.stderr
    by_flag = entries(shown.stdout)
    assert "--redis-password" not in by_flag
    for name, info in StatusSettings.model_fields.items():
        if name == "redis_password":
            continue
        entry = by_flag["--" + name.replace("_", "-")]
        assert str(info.description) in entry and f"(default: {info.default})" in entry, entry
        assert f"ROLLSTREAM_{name.upper()}" in entry, entry
