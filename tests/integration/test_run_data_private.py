"""Run data is its owner's only (issue 27, S2: the AOF, which holds every prompt, completion
and test answer, and the checkpoints were 0644 in 0755 folders, and any local user read
both): the embedded redis-server's files, and what a service started on its own writes,
are 0600 in 0700 folders, whatever the umask of whoever started them. `up`'s workdir:
tests/e2e/test_up_plain_output.py."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from helpers import wait_for
from procs import start_service
from rollstream.core.grpc_utils import channel
from rollstream.core.run_keys import RunKeys
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import trainer_pb2, trainer_pb2_grpc


def open_to_others(root: Path) -> list[str]:
    """Every path under `root` (itself included) with a group or other permission bit."""
    paths = [root, *root.rglob("*")]
    return [
        f"{p} {stat.filemode(p.lstat().st_mode)}" for p in paths if p.lstat().st_mode & 0o077 and not p.is_symlink()
    ]


@contextlib.contextmanager
def usual_umask() -> Iterator[None]:
    """The umask of most shells (022: files 0644), for what this process starts meanwhile."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_the_embedded_redis_keeps_its_files_to_its_owner(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)  # left open by an older run
    data.chmod(0o755)
    with usual_umask(), EmbeddedRedis(data) as server:
        client = server.admin_client()
        client.xadd("rs:{demo}:prompts", {"data": b"a prompt and its test answer"})
        # An AOF rewrite writes the RDB base too (redis 7: appendonlydir/ with a manifest).
        client.bgrewriteaof()
        wait_for(
            lambda: int(client.info("persistence")["aof_rewrite_in_progress"]) == 0 and int(client.info("persistence")["aof_rewrite_scheduled"]) == 0,
            timeout_s=60, what="the AOF rewrite done",
        )  # fmt: skip
        client.close()
        written = [p for p in data.rglob("*") if p.is_file()]
        assert any("aof" in p.name for p in written), written
        assert open_to_others(data) == []


def test_a_trainer_started_alone_keeps_its_output_to_its_owner(
    tmp_path: Path, redis_url: str, keys: RunKeys, tiny_model_dir: Path
) -> None:
    out = tmp_path / "out"
    args = [
        "--redis-url", redis_url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1",
        "--checkpoint-dir", str(out / "checkpoints"), "--anchor-dir", str(out / "anchor"), "--metrics-file", str(out / "steps.jsonl"),
    ]  # fmt: skip
    with usual_umask():
        trainer = start_service("trainer", tmp_path / "logs", *args)
    try:
        trainer.wait_ready()
        with channel(trainer.grpc_address) as ch:
            saved = trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        assert Path(saved.path).is_relative_to(out / "checkpoints") and any(Path(saved.path).iterdir())
        assert open_to_others(out) == []
    finally:
        trainer.stop()
