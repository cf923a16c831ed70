"""Fixtures of tests/ranks: the tiny model every rank program loads, built once a session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ranks") / "tiny", seed=0)
