"""Folders written whole or not at all: what a checkpoint and an export are on disk."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_folder(path: Path, write: Callable[[Path], None], tmp: Path, old: Path) -> Path:
    """Call `write(tmp)` on a fresh folder `tmp` (a sibling of `path`), fsync what it wrote and
    rename it to `path`; a folder already there is first renamed to `old` (a folder cannot be
    renamed over a non-empty one) and removed after, so `path` never names a partial folder."""
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash of this very process id: never whole
    tmp.mkdir()
    try:
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync_path(file)
        fsync_path(tmp)
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: its entries' names)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
