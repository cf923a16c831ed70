"""core/logs.py: the text and JSON line formats every service writes (structlog's
ProcessorFormatter on the root handler), for our events, third-party `logging` records and
structlog loggers alike; one line an event in JSON mode whatever the fields hold."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest
import structlog

from rollstream.core import logs

TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    noisy = {
        name: logging.getLogger(name).level for name in ("httpx", "urllib3", "filelock", "transformers", "datasets")
    }
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in noisy.items():
        logging.getLogger(name).setLevel(lvl)
    structlog.reset_defaults()


def lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_text_format(capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.setup("reward", "INFO", as_json=False)
    assert log.name == "rollstream.reward"
    logs.event(log, "step", step=3, reward=0.5, ok=True, nothing=None)
    logs.event(log, "started")
    logs.event(log, "redis unavailable", level=logging.WARNING, error="Connection refused", url="redis://h:1/0")
    logs.event(log, "hidden", level=logging.DEBUG, x=1)
    out = lines(capsys)
    assert len(out) == 3, out
    assert re.fullmatch(TS + r" INFO    reward step step=3 reward=0\.5 ok=True nothing=None", out[0]), out[0]
    assert re.fullmatch(TS + r" INFO    reward started", out[1]), out[1]  # no trailing space
    # A value with a space is quoted (logfmt), so it cannot run into the next field.
    assert re.fullmatch(
        TS + r' WARNING reward redis unavailable error="Connection refused" url=redis://h:1/0', out[2]
    ), out[2]
    assert " step " in out[0]


def test_json_format(capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.setup("trainer", "DEBUG", as_json=True)
    logs.event(log, "step", step=3, reward=0.5, ok=True, nothing=None, path=__import__("pathlib").Path("/x"))
    logs.event(log, "detail", level=logging.DEBUG)
    out = lines(capsys)
    assert len(out) == 2, out
    first = json.loads(out[0])
    assert list(first)[:4] == ["ts", "level", "service", "event"]
    assert re.fullmatch(TS, first.pop("ts"))
    assert first == {
        "level": "INFO",
        "service": "trainer",
        "event": "step",
        "step": 3,
        "reward": 0.5,
        "ok": True,
        "nothing": None,
        "path": "/x",
    }
    second = json.loads(out[1])
    assert (second["level"], second["event"]) == ("DEBUG", "detail") and "exc" not in second


@pytest.mark.parametrize("as_json", [False, True])
def test_third_party_logging_records_come_out_the_same(capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    logs.setup("generator", "INFO", as_json=as_json)
    logging.getLogger("grpc._server").warning("Exception %s in %s", "X", "handler")
    logging.getLogger("httpx").info("quiet: httpx is held at WARNING")
    structlog.get_logger("somelib").info("from structlog", n=2)
    out = lines(capsys)
    assert len(out) == 2, out
    if as_json:
        rows = [json.loads(line) for line in out]
        assert [(r["level"], r["service"], r["event"]) for r in rows] == [
            ("WARNING", "generator", "Exception X in handler"),
            ("INFO", "generator", "from structlog"),
        ]
        assert rows[1]["n"] == 2
    else:
        assert re.fullmatch(TS + r" WARNING generator Exception X in handler", out[0]), out[0]
        assert re.fullmatch(TS + r" INFO    generator from structlog n=2", out[1]), out[1]


@pytest.mark.parametrize("as_json", [False, True])
def test_an_exception_carries_its_traceback(capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    log = logs.setup("reference", "INFO", as_json=as_json)
    try:
        raise RuntimeError("the model went away")
    except RuntimeError:
        log.exception("scoring failed", extra={"fields": {"batch": 7}})
    out = capsys.readouterr().err
    if as_json:
        assert out.count("\n") == 1
        row = json.loads(out)
        assert (row["level"], row["event"], row["batch"]) == ("ERROR", "scoring failed", 7)
        assert row["exc"].startswith("Traceback (most recent call last):")
        assert row["exc"].endswith("RuntimeError: the model went away")
    else:
        first, *rest = out.splitlines()
        assert re.fullmatch(TS + r" ERROR   reference scoring failed batch=7", first), first
        assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "RuntimeError: the model went away"


def test_json_mode_is_one_line_an_event_whatever_the_fields_hold(capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.setup("reward", "INFO", as_json=True)
    nasty = {
        "spaces": "a b  c",
        "newlines": "one\ntwo\r\nthree",
        "unicode": "résumé – 数学 🙂",
        "quotes": 'say "hi" \\ bye',
        "tab": "x\ty",
    }
    logs.event(log, "scored\nevent with a newline", **nasty)
    logging.getLogger("lib").warning("multi\nline\nmessage")
    out = capsys.readouterr().err
    rows = out.splitlines()
    assert len(rows) == 2 and out.endswith("\n"), out
    first = json.loads(rows[0])
    assert first["event"] == "scored\nevent with a newline"
    assert {k: first[k] for k in nasty} == nasty
    assert json.loads(rows[1])["event"] == "multi\nline\nmessage"


def test_text_mode_keeps_a_field_on_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.setup("reward", "INFO", as_json=False)
    logs.event(log, "scored", answer="two\nlines", who="résumé")
    out = lines(capsys)
    assert len(out) == 1, out
    assert out[0].endswith(r"answer=two\nlines who=résumé"), out[0]


def test_fields_ride_on_the_record(caplog: pytest.LogCaptureFixture) -> None:
    """Tests read an event's fields from caplog's records (record.fields)."""
    log = logging.getLogger("rollstream.test-logs")
    with caplog.at_level(logging.INFO, logger=log.name):
        logs.event(log, "refused", level=logging.ERROR, user="reward")
    (record,) = [r for r in caplog.records if r.name == log.name]
    assert record.getMessage() == "refused" and record.levelno == logging.ERROR
    assert record.fields == {"user": "reward"}  # type: ignore[attr-defined]  # logs.event's attribute, not LogRecord's


@pytest.mark.parametrize("as_json", [False, True])
def test_a_service_names_its_run_on_every_line_and_events_name_their_groups(
    capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    """One grep of a group id follows it through the services: each event that moves groups
    carries their ids, and every line its run."""

    class G:
        def __init__(self, group_id: str):
            self.group_id = group_id

    log = logs.setup("generator", "INFO", as_json=as_json, run="demo")
    logs.event(log, "groups_written", n=2, version=4, groups=logs.group_ids([G("t-17"), G("t-18")]))
    structlog.get_logger().info("from structlog")
    out = lines(capsys)
    assert len(out) == 2, out
    if as_json:
        rows = [json.loads(line) for line in out]
        assert list(rows[0])[:5] == ["ts", "level", "service", "event", "run"]
        assert (rows[0]["run"], rows[0]["groups"], rows[0]["version"]) == ("demo", "t-17,t-18", 4)
        assert rows[1]["run"] == "demo"
    else:
        assert re.fullmatch(
            TS + r" INFO    generator groups_written run=demo n=2 version=4 groups=t-17,t-18", out[0]
        ), out[0]
        assert re.fullmatch(TS + r" INFO    generator from structlog run=demo", out[1]), out[1]
