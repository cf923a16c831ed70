"""Progress bars (rich.progress) for long work a person may sit in front of: converting the
demo model, saving and loading a checkpoint. Only when stderr is a terminal: a service's log
(a file, a container's stdout, `rollstream up`'s per-service logs) never gets a bar's
redraws, and the work's own log lines stay as they were."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")


def enabled() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _progress(*, as_bytes: bool) -> Progress:
    amount = DownloadColumn() if as_bytes else TaskProgressColumn()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        amount,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@contextlib.contextmanager
def task(description: str, total: float, as_bytes: bool = False) -> Iterator[Callable[[float], None]]:
    """`with task("saving", n) as advance: ... advance(k)`; advance does nothing off a TTY."""
    if not enabled():
        yield lambda _amount: None
        return
    with _progress(as_bytes=as_bytes) as progress:
        tid = progress.add_task(description, total=total)
        yield lambda amount: progress.advance(tid, amount)


def track(items: Iterable[T], description: str, total: float | None = None) -> Iterator[T]:
    """The items, with a bar on a TTY (by count)."""
    if not enabled():
        yield from items
        return
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]  # hasattr checked: a Sized Iterable
    with _progress(as_bytes=False) as progress:
        yield from progress.track(items, total=total, description=description)
