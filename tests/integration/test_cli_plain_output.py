"""What `rollstream` prints of what others wrote (consumer group and consumer names, dead
letter reasons, services' log lines) comes out as written, never read as rich markup
(issue 27, S4: a rollout's group_id "evil[/]" in the reward's dead-letter reason made `up`
raise MarkupError when it printed the dead reward's last log lines, and stop the run).
Against a real redis-server; `up` itself: tests/e2e/test_up_plain_output.py."""

from __future__ import annotations

import io

import pytest
import redis

from helpers import write
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import StreamStage
from rollstream.launcher import cli, plan
from rollstream.v1 import rollout_pb2

# An unmatched closing tag (MarkupError), an unclosed one, and tags rich would swallow.
MARKUP = ["evil[/]", "[bold", "[/]", "[link=https://example.com]x[/link]", "[red]r[/red]", "a[/bold]b"]


@pytest.mark.parametrize("text", MARKUP)
def test_status_prints_names_and_reasons_as_written(
    text: str,
    redis_url: str,
    rclient: redis.Redis,
    keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no cell wraps
    source = keys.stream("rollouts")
    write(rclient, keys, "rollouts", rollout_pb2.RolloutGroup(group_id=text, task_id="t"))
    StreamStage.ensure_group(rclient, source, text)
    rclient.xreadgroup(text, f"c{text}", {source: ">"}, count=1)  # a consumer named with it too
    write(rclient, keys, "dead", rollout_pb2.DeadLetter(source_stream=source, reason=f"group_id {text!r} refused"))
    assert cli.main_code(["status", "--redis-url", redis_url, "--run", keys.run]) == 0
    out = capsys.readouterr().out
    assert f"{text}: c{text}" in out
    assert f"group_id {text!r} refused" in out


@pytest.mark.parametrize("text", MARKUP)
def test_up_prints_other_consumer_groups_as_written(text: str, rclient: redis.Redis, keys: RunKeys) -> None:
    # `up --reward external` warns about any other consumer group on the rollouts stream.
    out = io.StringIO()
    console = cli.plain_console(file=out, width=400)
    watch = plan.ExternalReward(
        redis_url="redis://127.0.0.1:6379/0",
        keys=keys,
        group="reward",
        output_stage="ready",
        username="",
        password_file=None,
    )
    StreamStage.ensure_group(rclient, keys.stream("rollouts"), text)
    watch.poll(rclient, console)
    assert f"consumer group {text!r} on" in out.getvalue()
