"""The dashboard's JSON answers stay strict JSON whatever the numbers: a NaN or infinite value
(a diverged metric, a step log line written by hand) is served as null, not as a 500."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollstream.core import dashboard, redis_policy
from rollstream.core.run_keys import RunKeys


def test_json_safe_nulls_non_finite_floats_at_any_depth() -> None:
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (1, "x", None, True), 3: object}
    out = dashboard.json_safe(value)
    assert out == {"a": None, "b": [1.5, None, {"c": None}], "d": [1, "x", None, True], "3": str(object)}
    json.dumps(out, allow_nan=False)  # strict JSON


def test_steps_route_serves_a_log_with_nan_and_huge_values(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    # json.loads accepts the NaN / Infinity tokens some writers emit; the route must not pass them on.
    log.write_text(
        '{"step": 1, "loss": NaN, "reward_mean": 0.5}\n{"step": 2, "loss": Infinity, "reward_mean": 1e308}\n'
    )
    app = FastAPI()
    unreachable = dashboard.PipelineView(
        lambda: redis_policy.connect("redis://127.0.0.1:1/0", socket_timeout_s=0.2, connect_timeout_s=0.2),
        RunKeys("nan"),
    )
    dashboard.install(app, unreachable, str(log))
    client = TestClient(app)
    reply = client.get("/api/steps")
    assert reply.status_code == 200
    steps = reply.json()["steps"]
    assert [s["loss"] for s in steps] == [None, None] and steps[1]["reward_mean"] == 1e308
    assert client.get("/api/steps", params={"since": -1}).status_code == 422
    pipeline = client.get("/api/pipeline")
    assert pipeline.status_code == 200 and pipeline.json()["ok"] is False
