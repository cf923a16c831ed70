"""The run's dashboard on the trainer's HTTP side: `GET /dashboard` (one HTML page with its
script, package data under rollstream/core/static, no build step), `GET /api/pipeline` (the
snapshot `rollstream status` shows, as JSON: stages, backlog, consumers, versions, the
last step and held-out round, the diagnosis) and `GET /api/steps` (the step log's records
and its held-out rounds, core/steplog.py).

The same snapshot feeds the pipeline metrics on the trainer's /metrics (`PipelineView` is
also a Prometheus collector): lag, pending, length and consumers per stage, dead letters,
each live generator's policy version, and the last held-out round (from the `evals` stream).

Guards:
- The trainer's loop is never held up: the view has its own Redis connection with short
  socket timeouts, looks at most once a second (answers in between come from the last look),
  and runs on the HTTP side's threads.
- No secret leaves: nothing of the settings is served but the run name; every text that
  comes from Redis or an error is scrubbed of the passwords the view knows.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from typing import cast

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rollstream.core import diagnose, redis_policy, run_keys, status, steplog

SOCKET_TIMEOUT_S = 1.0  # the view's own Redis calls: a stalled Redis costs a look, not a thread
MIN_INTERVAL_S = 1.0  # looks closer together than this answer from the last one
RATE_WINDOW_S = 30.0  # rates are taken against the oldest look within this window
MAX_STEPS = 5000  # /api/steps serves at most this many (the latest)


def static_text(name: str) -> str:
    return resources.files("rollstream.core").joinpath("static", name).read_text(encoding="utf-8")


class PipelineView(Collector):
    """Cached looks at the run's pipeline in Redis, as JSON and as Prometheus gauges."""

    def __init__(self, connect: Callable[[], redis_policy.Client], keys: run_keys.RunKeys, secrets: tuple[str, ...] = (),
                 service: str = "trainer", clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self._connect = connect
        self.keys = keys
        self._secrets = tuple(s for s in secrets if s)
        self.p = f"rollstream_{service}_"
        self._clock = clock
        self._lock = threading.Lock()
        self._client: redis_policy.Client | None = None
        self._last: dict | None = None
        self._last_at = -1e18
        self._history: collections.deque[diagnose.Snapshot] = collections.deque()

    # -- looking ----------------------------------------------------------------------------

    def scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def look(self) -> dict:
        """The latest snapshot as a JSON-able dict (at most one Redis look a MIN_INTERVAL_S)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last_at < MIN_INTERVAL_S:
                return self._last
            self._last = self._look()
            self._last_at = now
            return self._last

    def _look(self) -> dict:
        try:
            if self._client is None:
                self._client = self._connect()
            snap, extra = status.collect(self._client, self.keys)
        except redis_policy.ERRORS + (OSError, ValueError) as e:
            if self._client is not None:
                with contextlib.suppress(Exception):  # closing a broken client
                    self._client.close()
            self._client = None
            return {"ok": False, "run": self.keys.run, "error": self.scrub(redis_policy.short(e) if isinstance(e, redis_policy.ERRORS) else str(e)),
                    "stages": [], "findings": [], "headline": "Redis unreachable from the dashboard"}  # fmt: skip
        while self._history and snap.at - self._history[0].at > RATE_WINDOW_S:
            self._history.popleft()
        prev = self._history[0] if self._history else None
        self._history.append(snap)
        return cast(dict, self.scrubbed(self.to_json(snap, extra, prev)))  # a dict scrubbed is a dict

    def scrubbed(self, value: object) -> object:
        """Every string in `value` (keys too) scrubbed: whatever a field comes to hold."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(str(k)): self.scrubbed(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrubbed(v) for v in value]
        return value

    def to_json(self, cur: diagnose.Snapshot, extra: dict, prev: diagnose.Snapshot | None) -> dict:
        stages = []
        for spec in diagnose.PIPELINE:
            s = cur.stream(spec.stream)
            g = s.group(spec.group)
            stages.append({
                "name": spec.name, "stream": spec.stream, "key": self.keys.stream(spec.stream), "active": cur.active(spec),
                "rate": diagnose.rate(prev, cur, spec), "backlog": cur.backlog(spec.stream, spec.group),
                "lag": g.lag if g else None, "pending": g.pending if g else None, "length": s.length, "group": g.name if g else None,
                "consumers": [{"name": self.scrub(c.name), "pending": c.pending, "idle_s": c.idle_s} for c in (g.consumers if g else ())],
                "last_dead": self.scrub(cur.last_dead.get(spec.stream, "")),
            })  # fmt: skip
        findings = diagnose.diagnose(cur, prev)
        last, held_out = extra.get("last_step"), extra.get("last_eval")
        return {
            "ok": True,
            "run": self.keys.run,
            "at": cur.at,
            "trainer": {
                "step": cur.trainer_step,
                "version": cur.trainer_version,
                "groups_per_step": cur.counters.get("groups_per_step"),
            },
            "stages": stages,
            "generators": [{"id": self.scrub(k), "version": v} for k, v in sorted(cur.generators.items())],
            "dead": cur.dead,
            "counters": dict(sorted(cur.counters.items())),
            "last_step": steplog.record(last, run=self.keys.run)
            if last is not None
            else None,  # as steps.jsonl holds it
            "last_eval": steplog.eval_record(held_out, run=self.keys.run) if held_out is not None else None,
            "findings": [
                {"level": f.level, "stage": f.stage, "reason": self.scrub(f.reason), "line": self.scrub(f.line())}
                for f in findings
            ],
            "headline": self.scrub(findings[0].line()),
            "errors": [self.scrub(e) for e in extra.get("errors", [])],
        }

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- as Prometheus gauges -----------------------------------------------------------------

    def describe(self) -> list:
        return list(self._families({}))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(self.look())

    def _families(self, view: dict) -> Iterator[GaugeMetricFamily]:
        p = self.p
        up = GaugeMetricFamily(p + "pipeline_up", "1 when the trainer's last look at the pipeline in Redis succeeded")
        up.add_metric([], 1.0 if view.get("ok") else 0.0)
        yield up
        families = {
            "lag": GaugeMetricFamily(
                p + "stream_lag",
                "entries of a stage's input stream its consumer group has not read yet",
                labels=["stage", "stream"],
            ),
            "pending": GaugeMetricFamily(
                p + "stream_pending", "entries a stage has read and not acknowledged", labels=["stage", "stream"]
            ),
            "length": GaugeMetricFamily(
                p + "stream_length",
                "entries held in a stage's input stream (trimmed behind every group)",
                labels=["stage", "stream"],
            ),
            "consumers": GaugeMetricFamily(
                p + "stream_consumers", "consumers in a stage's consumer group", labels=["stage", "stream"]
            ),
        }
        for st in view.get("stages", []):
            if not st["active"]:
                continue
            labels = [st["name"], st["stream"]]
            for name in ("lag", "pending", "length"):  # lag and pending are None without a group
                families[name].add_metric(labels, float(st[name] or 0))
            families["consumers"].add_metric(labels, float(len(st["consumers"])))
        yield from families.values()
        dead = GaugeMetricFamily(p + "dead_letters", "entries in the run's dead-letter stream")
        if view.get("ok"):
            dead.add_metric([], float(view["dead"]))
        yield dead
        gens = GaugeMetricFamily(
            p + "generator_policy_version",
            "policy version each live generator reported in its heartbeat (-1: no weights)",
            labels=["generator"],
        )
        for g in view.get("generators", []):
            gens.add_metric([g["id"]], float(-1 if g["version"] is None else g["version"]))
        yield gens
        # The last held-out round (no sample before the first): its fields in the step log's names.
        held_out = view.get("last_eval") or {}
        for field, name, doc in (
            (
                "eval_accuracy",
                "eval_accuracy",
                "share of the last held-out round's completions with full marks (pass@1)",
            ),
            (
                "eval_pass_at_k",
                "eval_pass_at_k",
                "share of the last held-out round's prompts with a completion with full marks among its samples",
            ),
            ("eval_reward_mean", "eval_reward_mean", "mean reward of the last held-out round's completions"),
            ("step", "eval_step", "the step after which the last held-out round was fed (0: before the first)"),
            ("eval_version", "eval_policy_version", "the (oldest) policy version that sampled the last held-out round"),
        ):
            family = GaugeMetricFamily(p + name, doc)
            if held_out:
                family.add_metric([], float(held_out[field]))
            yield family


def read_steps(path: str, since: int = 0) -> dict:
    """The step log's records with step > since (at most MAX_STEPS, the latest), and every
    held-out round (`evals`: few, and a round is reported after later steps' lines, so
    `since` does not apply to them)."""
    if not path:
        return {"steps": [], "evals": [], "skipped": 0, "note": "no metrics_file configured"}
    try:
        log = steplog.read(path)
    except FileNotFoundError:
        return {"steps": [], "evals": [], "skipped": 0, "note": "no step written yet"}
    except OSError as e:
        return {"steps": [], "evals": [], "skipped": 0, "note": f"unreadable: {e.strerror}"}
    steps = [r for r in log.steps if r["step"] > since][-MAX_STEPS:]
    return {"steps": steps, "evals": log.evals[-MAX_STEPS:], "skipped": len(log.skipped)}


def install(app: FastAPI, view: PipelineView, steps_file: str) -> None:
    """The dashboard's routes on an HTTP side app (plain `def`s: FastAPI runs them on its
    thread pool, so a slow Redis holds one worker thread, never the event loop)."""

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(static_text("dashboard.html"), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard.js", include_in_schema=False)
    def dashboard_js() -> Response:
        return Response(
            static_text("dashboard.js"), media_type="text/javascript", headers={"Cache-Control": "no-store"}
        )

    @app.get("/api/pipeline")
    def pipeline() -> JSONResponse:
        return JSONResponse(json_safe(view.look()), headers={"Cache-Control": "no-store"})

    @app.get("/api/steps")
    def steps(since: int = Query(0, ge=0)) -> JSONResponse:
        return JSONResponse(json_safe(read_steps(steps_file, since)), headers={"Cache-Control": "no-store"})


def json_safe(value: object) -> object:
    """`value` as strict JSON can carry it: a NaN or infinite float (a diverged metric, a step
    log line written by hand) becomes null, anything else unknown its text. JSONResponse
    refuses non-finite floats, which would turn one bad number into a 500 for the whole view."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)
