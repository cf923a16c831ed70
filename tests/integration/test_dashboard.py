"""The dashboard and the pipeline gauges on the trainer's HTTP side (core/dashboard.py): a
real trainer process that trained a few steps, a real Redis holding a run's streams; and the
view itself against real Redis (scrubbing, Redis unreachable). No timing: the trainer is
waited for by its step log, the view's cache is driven by an injected clock."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from dashboard_run import EVAL_ROUNDS, STEPS, TrainedRun, start_trained_run
from metric_names import documented_trainer_names
from rollstream.core import dashboard, redis_policy, run_keys, streams
from rollstream.core.run_keys import RunKeys
from rollstream.launcher.redis_server import free_port


@pytest.fixture(scope="module")
def run(
    redis_server, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[TrainedRun, RunKeys]]:
    keys = RunKeys("dash-" + tmp_path_factory.mktemp("n").name[-6:].replace("_", ""))
    client = redis.Redis.from_url(redis_server.url)
    r = start_trained_run(tmp_path_factory.mktemp("dash"), redis_server.url, client, keys, tiny_model_dir)
    yield r, keys
    r.trainer.stop()
    client.close()


def test_pipeline_json_names_every_stage(run: tuple[TrainedRun, RunKeys]) -> None:
    r, keys = run
    p = httpx.get(r.base + "/api/pipeline", timeout=30).json()
    assert p["ok"] and p["run"] == keys.run
    assert [s["name"] for s in p["stages"]] == ["generator", "reward", "reference", "trainer"]
    by = {s["name"]: s for s in p["stages"]}
    assert all(s["active"] for s in p["stages"])
    assert (by["reward"]["lag"], by["reward"]["pending"], by["reward"]["backlog"]) == (2, 1, 3)
    assert (by["reference"]["lag"], by["reference"]["pending"]) == (1, 1)
    assert [c["name"] for c in by["reward"]["consumers"]] == ["reward-0"]
    assert p["trainer"]["step"] == STEPS and p["trainer"]["version"] == STEPS
    assert p["generators"] == [{"id": "gen-0", "version": STEPS}]
    assert p["headline"] and p["findings"][0]["line"] == p["headline"]
    assert p["last_step"]["step"] == STEPS
    assert (
        p["last_eval"]["kind"] == "eval" and p["last_eval"]["step"] == STEPS and p["last_eval"]["eval_accuracy"] == 0.75
    )
    assert "redis_url" not in str(p) and "password" not in str(p)


def test_steps_json_is_the_step_log(run: tuple[TrainedRun, RunKeys]) -> None:
    r, _ = run
    got = httpx.get(r.base + "/api/steps", timeout=30).json()
    assert [s["step"] for s in got["steps"]] == list(range(1, STEPS + 1))
    assert all("reward_mean" in s and "kl" in s and "delta_bytes" in s for s in got["steps"])
    # The held-out rounds apart, every one whatever `since` (a round is reported after later steps).
    assert [(e["step"], e["eval_accuracy"]) for e in got["evals"]] == list(EVAL_ROUNDS)
    later = httpx.get(r.base + "/api/steps?since=2", timeout=30).json()
    assert [s["step"] for s in later["steps"]] == [3] and len(later["evals"]) == len(EVAL_ROUNDS)


def test_page_and_script_are_served(run: tuple[TrainedRun, RunKeys]) -> None:
    r, _ = run
    page = httpx.get(r.base + "/dashboard", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "dashboard.js" in page.text
    script = httpx.get(r.base + "/dashboard.js", timeout=30)
    assert (
        script.status_code == 200 and "javascript" in script.headers["content-type"] and "api/pipeline" in script.text
    )


def test_api_answers_only_for_the_trainers_own_host(run: tuple[TrainedRun, RunKeys]) -> None:
    """DNS rebinding: a page from evil.example that points its name at 127.0.0.1 sends Host:
    evil.example; the trainer refuses it (421) before any route runs (issue 42)."""
    r, _ = run
    port = r.base.rsplit(":", 1)[1]
    for path in ("/api/pipeline", "/api/steps", "/dashboard", "/metrics"):
        assert httpx.get(r.base + path, headers={"Host": "evil.example"}, timeout=30).status_code == 421, path
        assert httpx.get(r.base + path, headers={"Host": f"evil.example:{port}"}, timeout=30).status_code == 421, path
    assert httpx.get(r.base + "/api/pipeline", headers={"Host": f"127.0.0.1:{port}"}, timeout=30).json()["run"]
    assert httpx.get(r.base + "/api/steps", headers={"Host": f"localhost:{port}"}, timeout=30).status_code == 200


def test_metrics_of_a_real_trainer(run: tuple[TrainedRun, RunKeys]) -> None:
    """Every documented trainer metric (but the CUDA-only ones) is on the live /metrics, with
    the pipeline gauges of this run and the step metrics of its steps."""
    r, _ = run
    text = httpx.get(r.base + "/metrics", timeout=30).text
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    missing = sorted(n for n in documented_trainer_names() if n not in types)
    assert not missing, missing
    assert re.search(r'^rollstream_trainer_stream_lag\{stage="reward",stream="rollouts"\} 2\.0$', text, re.M)
    assert re.search(r'^rollstream_trainer_stream_pending\{stage="reference",stream="scored"\} 1\.0$', text, re.M)
    assert re.search(r'^rollstream_trainer_generator_policy_version\{generator="gen-0"\} 3\.0$', text, re.M)
    assert re.search(r"^rollstream_trainer_pipeline_up 1\.0$", text, re.M)
    assert re.search(rf"^rollstream_trainer_steps_total {STEPS}\.0$", text, re.M)
    # the last held-out round, from the `evals` stream
    assert re.search(r"^rollstream_trainer_eval_accuracy 0\.75$", text, re.M)
    assert re.search(r"^rollstream_trainer_eval_pass_at_k 1\.0$", text, re.M)
    assert re.search(r"^rollstream_trainer_eval_reward_mean 0\.875$", text, re.M)
    assert re.search(rf"^rollstream_trainer_eval_step {STEPS}\.0$", text, re.M)
    assert re.search(rf"^rollstream_trainer_eval_policy_version {STEPS}\.0$", text, re.M)
    assert re.search(rf'^rollstream_trainer_groups_total\{{outcome="trained"\}} {2 * STEPS}\.0$', text, re.M)
    assert re.search(rf"^rollstream_trainer_group_staleness_versions_count {2 * STEPS}\.0$", text, re.M)
    for phase in ("forward", "backward", "optimizer", "delta_encode", "push_wait", "commit"):
        assert re.search(
            rf'^rollstream_trainer_step_phase_seconds_count\{{phase="{phase}"\}} {STEPS}\.0$', text, re.M
        ), phase
    # No generator read a delta while it trained (gen-0 registers afterwards): none was
    # encoded or pushed (publisher.Readers).
    assert re.search(rf"^rollstream_trainer_deltas_skipped_total {STEPS}\.0$", text, re.M)
    assert not re.search(r'^rollstream_trainer_step_phase_seconds_count\{phase="push"\}', text, re.M)
    assert re.search(r"^rollstream_trainer_process_resident_memory_bytes [0-9.e+]+$", text, re.M)


# -- the view alone, against real Redis ------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_view_scrubs_secrets_and_caches(rclient: redis.Redis, redis_url: str, keys: RunKeys) -> None:
    secret = "hunter2-secret"
    rclient.xadd(keys.stream("rollouts"), {"x": "1"})
    streams.StreamStage.ensure_group(rclient, keys.stream("rollouts"), "reward")
    rclient.xreadgroup("reward", f"reward-{secret}", {keys.stream("rollouts"): ">"}, count=1)
    run_keys.heartbeat(rclient, keys, f"gen-{secret}", "127.0.0.1:1", version=None)
    clock = Clock()
    looks = []

    def connect() -> redis_policy.Client:
        looks.append(1)
        return redis_policy.connect(redis_url, socket_timeout_s=1.0, connect_timeout_s=1.0)

    view = dashboard.PipelineView(connect, keys, secrets=(secret, ""), clock=clock)
    try:
        first = view.look()
        assert first["ok"] and secret not in str(first) and "reward-***" in str(first)
        assert first["generators"] == [{"id": "gen-***", "version": None}]
        rclient.xadd(keys.stream("rollouts"), {"x": "2"})
        assert view.look() is first  # within MIN_INTERVAL_S: the last look
        clock.t += dashboard.MIN_INTERVAL_S
        second = view.look()
        assert second is not first and {s["name"]: s["lag"] for s in second["stages"]}["reward"] == 1
        assert len(looks) == 1  # one connection, kept
    finally:
        view.close()


def test_view_without_redis_says_so() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    view = dashboard.PipelineView(
        lambda: redis_policy.connect(url, socket_timeout_s=0.5, connect_timeout_s=0.5), RunKeys("none")
    )
    got = view.look()
    assert not got["ok"] and got["stages"] == [] and "unreachable" in got["headline"]
    families = {f.name: f for f in view.collect()}
    assert [s.value for s in families["rollstream_trainer_pipeline_up"].samples] == [0.0]
    assert families["rollstream_trainer_stream_lag"].samples == []
    assert families["rollstream_trainer_eval_accuracy"].samples == []  # no round seen: no sample, not a 0
