"""Progress bars only on a terminal: saving a checkpoint's tensors and loading the optimizer
state draw a bar on stderr when it is a TTY (a pseudo-terminal here) and write nothing at all
to it otherwise (a service's log stays clean)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

from rollstream.core import progress

SCRIPT = """
import sys, torch
from pathlib import Path
from rollstream.trainer import checkpoint
from rollstream.core import progress
path = Path(sys.argv[1])
checkpoint.write_safetensors(path, {"a": torch.zeros(1 << 20), "b": torch.ones(1 << 18)})
got = checkpoint.SafetensorsReader(path)
assert float(got["b"].sum()) == 1 << 18
for _ in progress.track(range(3), "loading the optimizer state"):
    pass
print("done", progress.enabled(), flush=True)
"""


def run(tmp_path: Path, tty: bool) -> tuple[str, str]:
    target = tmp_path / ("tty" if tty else "plain") / "optimizer.safetensors"
    target.parent.mkdir()
    env = {**os.environ, "COLUMNS": "100", "TERM": "xterm"}
    if not tty:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(target)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=True,
        )
        return done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(target)], stdout=subprocess.PIPE, stderr=follower, env=env
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert proc.wait(timeout=120) == 0
        return out, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)


def test_no_bar_without_a_terminal(tmp_path: Path) -> None:
    out, err = run(tmp_path, tty=False)
    assert out.strip() == "done False" and err == ""


def test_bars_on_a_terminal(tmp_path: Path) -> None:
    out, err = run(tmp_path, tty=True)
    assert out.strip() == "done True"
    assert "saving optimizer.safetensors" in err and "loading the optimizer state" in err, err[-2000:]


def test_helpers_pass_items_through_off_a_terminal(monkeypatch) -> None:
    monkeypatch.setattr(progress, "enabled", lambda: False)
    assert list(progress.track(iter([1, 2, 3]), "x")) == [1, 2, 3]
    with progress.task("x", 10) as advance:
        advance(5)
