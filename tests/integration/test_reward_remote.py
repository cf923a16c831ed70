"""The reward stage calling a remote `Reward/Score` server: a real gRPC server started in the
test, a real reward process, a real redis-server. Covers batching, the scorer being down
(groups held pending, never zero-scored), recovery, the circuit breaker, and rejections;
and, against the server alone, gRPC's own retries (the channel's retryPolicy)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from helpers import REWARD_GROUP, groups_in, wait_for, write_many
from procs import free_port, start_reward
from rollstream.core import redis_policy
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.core.service import ServiceHost
from rollstream.reward.config import RewardSettings
from rollstream.reward.remote import CircuitBreaker, RemoteScorer, ScorerRejected, ScorerUnavailable
from rollstream.reward.scoring import Metrics, ScorePool, Scorer
from rollstream.reward.service import RewardLoop
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2
from synthetic import rollout_group

FAST_RETRIES = (
    "--scorer-retries", "1", "--scorer-backoff-s", "0.05", "--scorer-backoff-max-s", "0.1",
    "--scorer-breaker-failures", "2", "--scorer-breaker-cooldown-s", "0.3", "--scorer-deadline-s", "5",
)  # fmt: skip


class LengthScorer(reward_pb2_grpc.RewardServicer):
    """A team's grader: reward = len(completion) / 10, with a component saying so.

    `failing` makes every call answer UNAVAILABLE (a scorer that is down or restarting);
    a group id in `poison` makes the call answer INVALID_ARGUMENT; one in `huge` gets a
    reward of 1e30 (a broken grader)."""

    def __init__(self) -> None:
        self.failing = threading.Event()
        self.poison: set[str] = set()
        self.huge: set[str] = set()
        self.lock = threading.Lock()
        self.batches: list[int] = []
        self.items: list[reward_pb2.ScoreItem] = []
        self.failed_calls = 0

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        if self.failing.is_set():
            with self.lock:
                self.failed_calls += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "grader restarting")
        bad = [item.group_id for item in request.items if item.group_id in self.poison]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot grade {bad[0]}")
        with self.lock:
            self.batches.append(len(request.items))
            self.items.extend(request.items)
        return reward_pb2.ScoreResponse(
            scores=[
                reward_pb2.ItemScore(
                    reward=1e30 if item.group_id in self.huge else len(item.completion) / 10,
                    components=[
                        rollout_pb2.RewardComponent(
                            name="length", value=len(item.completion) / 10, weight=1.0, status="ok"
                        )
                    ],
                )
                for item in request.items
            ]
        )


class ScorerServer:
    """A real gRPC server on a fixed port that can be stopped and started again."""

    def __init__(self, servicer: LengthScorer, port: int):
        self.servicer = servicer
        self.port = port
        self.server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ScorerServer":
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        reward_pb2_grpc.add_RewardServicer_to_server(self.servicer, self.server)
        assert self.server.add_insecure_port(self.address) == self.port
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None


@pytest.fixture
def scorer() -> Iterator[ScorerServer]:
    server = ScorerServer(LengthScorer(), free_port())
    yield server
    server.stop()


def metric(port: int, line_prefix: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return 0.0


def readyz(port: int) -> tuple[int, str]:
    reply = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
    return reply.status_code, reply.json().get("detail", "")


def test_groups_are_scored_remotely_in_batches(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, scorer: ScorerServer
) -> None:
    scorer.start()
    svc = start_reward(
        tmp_path, redis_url, keys.run, "--scorer-address", scorer.address, "--scorer-batch-size", "3", *FAST_RETRIES
    )
    try:
        ids = [f"r{i}" for i in range(6)]
        write_many(rclient, keys, [rollout_group(i, ["8", "The answer is 8", "x" * 25, ""]) for i in ids])
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 6, 15, "6 groups scored", [svc])
        for g in groups_in(rclient, keys.stream("scored")):
            assert g.scored
            assert [c.reward for c in g.completions] == pytest.approx([0.1, 1.5, 2.5, 0.0])
            assert [[(rc.name, rc.status) for rc in c.reward_components] for c in g.completions] == [
                [("length", "ok")]
            ] * 4
        # 24 completions, never more than 3 per call.
        assert sum(scorer.servicer.batches) == 24 and max(scorer.servicer.batches) <= 3
        # What a grader gets besides the text: the token count and why sampling stopped.
        assert {(i.HasField("num_tokens"), i.num_tokens, i.finish_reason) for i in scorer.servicer.items} == {
            (True, 2, "stop")
        }
        assert rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 0
        assert metric(svc.http_port, 'rollstream_reward_scorer_calls_total{outcome="ok"}') == len(
            scorer.servicer.batches
        )
    finally:
        svc.kill()


def test_scorer_down_holds_groups_pending_then_recovers(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, scorer: ScorerServer
) -> None:
    # Written first, so that the stage's first read takes all five.
    ids = [f"d{i}" for i in range(5)]
    write_many(rclient, keys, [rollout_group(i, ["8", "abc"]) for i in ids])
    # Nothing listens at the scorer's address yet: every call fails with UNAVAILABLE.
    svc = start_reward(tmp_path, redis_url, keys.run, "--scorer-address", scorer.address, *FAST_RETRIES, ready=False)
    try:

        def holding() -> bool:
            code, detail = readyz(svc.http_port)
            return code == 503 and "remote scorer unavailable, holding 5 groups" in detail

        wait_for(svc.state_file.exists, 15, "state file", [svc])
        svc.http_port = json.loads(svc.state_file.read_text())["http_port"]
        wait_for(holding, 15, "the stage to report it holds the groups", [svc])
        wait_for(
            lambda: metric(svc.http_port, "rollstream_reward_scorer_circuit_open") == 1.0,
            15,
            "the circuit to open",
            [svc],
        )
        # Held: read but neither written downstream, nor acknowledged, nor dead-lettered.
        assert rclient.xlen(keys.stream("scored")) == 0
        assert rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 5
        assert rclient.xlen(keys.dead) == 0
        assert metric(svc.http_port, "rollstream_reward_held_groups") == 5.0
        assert metric(svc.http_port, 'rollstream_reward_scorer_calls_total{outcome="failed"}') >= 2

        # The grader comes up, but answers UNAVAILABLE for a while (a restart): still held.
        scorer.servicer.failing.set()
        scorer.start()
        wait_for(lambda: scorer.servicer.failed_calls >= 2, 15, "calls reaching the restarting grader", [svc])
        assert rclient.xlen(keys.stream("scored")) == 0

        scorer.servicer.failing.clear()  # recovered
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 5, 15, "all groups scored", [svc])
        out = groups_in(rclient, keys.stream("scored"))
        assert sorted(g.group_id for g in out) == sorted(ids)  # each exactly once
        assert all([c.reward for c in g.completions] == pytest.approx([0.1, 0.3]) for g in out)
        assert rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 0
        assert rclient.xlen(keys.dead) == 0
        wait_for(lambda: readyz(svc.http_port)[0] == 200, 15, "ready again", [svc])
        assert metric(svc.http_port, "rollstream_reward_scorer_circuit_open") == 0.0
        assert metric(svc.http_port, "rollstream_reward_held_groups") == 0.0
        assert "scorer_unavailable" in svc.log() and "scorer_recovered" in svc.log()
        assert rclient.hget(keys.counters("reward"), "scored") == b"5"
    finally:
        svc.kill()


def test_ready_again_only_once_the_circuit_gauge_says_closed(
    redis_url: str, rclient: redis.Redis, keys: RunKeys, scorer: ScorerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's turns in this process (real Redis, real scoring pool, real grader), so that
    the gauge can be read at the moment /readyz turns ready again: a dashboard or a test that
    sees ready must not see the circuit still open."""
    settings = RewardSettings(
        redis_url=redis_url,
        run=keys.run,
        scorer_address=scorer.address,
        block_ms=10,
        scorer_retries=1,
        scorer_backoff_s=0.05,
        scorer_backoff_max_s=0.1,
        scorer_breaker_failures=2,
        scorer_breaker_cooldown_s=0.3,
        scorer_deadline_s=5,
    )
    write_many(rclient, keys, [rollout_group("c0", ["8"])])
    client = redis_policy.connect(redis_url)
    with ServiceHost("reward", settings) as host:
        metrics = Metrics.register(host.registry)
        pool = ScorePool(settings.recipe_source(), settings.score_workers)
        remote = RemoteScorer.from_settings(settings, on_call=lambda outcome: None)
        try:
            stage = host.open_stage(client, "rollouts", settings.group)
            loop = RewardLoop(host, settings, stage, Scorer(local=pool, remote=remote), metrics)

            def circuit_open() -> float | None:
                return host.registry.get_sample_value("rollstream_reward_scorer_circuit_open")

            def turned(until: Callable[[], bool]) -> bool:
                loop.turn()
                return until()

            # Nothing listens at the grader's address: the batch is held and the circuit opens.
            wait_for(lambda: turned(lambda: circuit_open() == 1.0), 30, "the circuit to open")
            seen_at_ready: list[tuple[bool, float | None]] = []
            set_ready = host.set_ready

            def record(ready: bool, detail: str) -> None:
                seen_at_ready.append((ready, circuit_open()))
                set_ready(ready, detail)

            monkeypatch.setattr(host, "set_ready", record)
            scorer.start()
            wait_for(lambda: turned(lambda: loop.scorer_ok), 30, "the loop to recover")
            assert rclient.xlen(keys.stream("scored")) == 1
            assert [seen for seen in seen_at_ready if seen[0]] == [(True, 0.0)]
        finally:
            remote.close()
            pool.close()
    client.close()


def test_rejected_groups_are_dead_lettered_the_rest_scored(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, scorer: ScorerServer
) -> None:
    scorer.servicer.poison.add("bad")
    scorer.start()
    # Written before the stage starts, so they come in one read: the first call (all three)
    # is rejected, and the stage asks group by group to find the one the scorer refuses.
    write_many(rclient, keys, [rollout_group("ok1", ["8"]), rollout_group("bad", ["8"]), rollout_group("ok2", ["8"])])
    svc = start_reward(
        tmp_path, redis_url, keys.run, "--scorer-address", scorer.address, "--read-count", "8", *FAST_RETRIES
    )
    try:
        wait_for(lambda: rclient.xlen(keys.stream("scored")) == 2, 15, "two scored", [svc])
        wait_for(lambda: rclient.xlen(keys.dead) == 1, 15, "one dead letter", [svc])
        assert sorted(g.group_id for g in groups_in(rclient, keys.stream("scored"))) == ["ok1", "ok2"]
        ((_, fields),) = rclient.xrange(keys.dead)
        assert fields[b"reason"].decode() == "remote scorer rejected the group: INVALID_ARGUMENT: cannot grade bad"
        assert rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 0
        assert int(rclient.hget(keys.counters("reward"), "dead_rollouts") or 0) == 1
        # A rejection is the scorer answering: it does not open the circuit.
        assert metric(svc.http_port, "rollstream_reward_scorer_circuit_open") == 0.0
        assert metric(svc.http_port, 'rollstream_reward_scorer_calls_total{outcome="rejected"}') >= 1
    finally:
        svc.kill()


def test_a_group_scored_then_refused_for_its_scores_counts_as_neither_scored_nor_passed(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, scorer: ScorerServer
) -> None:
    """A reward of 1e30 from the grader dead-letters that group alone; the counters say what
    was committed: two scored, none passed through (the stage once counted it as passed)."""
    scorer.servicer.huge.add("huge")
    scorer.start()
    write_many(rclient, keys, [rollout_group("ok1", ["8"]), rollout_group("huge", ["8"]), rollout_group("ok2", ["8"])])
    svc = start_reward(
        tmp_path, redis_url, keys.run, "--scorer-address", scorer.address, "--read-count", "8", *FAST_RETRIES
    )
    try:
        wait_for(
            lambda: rclient.xlen(keys.stream("scored")) == 2 and rclient.xlen(keys.dead) == 1,
            60,
            "two scored, one dead letter",
            [svc],
        )
        ((_, fields),) = rclient.xrange(keys.dead)
        assert fields[b"reason"].decode().startswith("scoring gave an unusable group")
        wait_for(
            lambda: rclient.xpending(keys.stream("rollouts"), REWARD_GROUP)["pending"] == 0,
            60,
            "every entry acknowledged",
            [svc],
        )
        stats = read_counters(rclient, keys)[0]
        assert stats == {"scored": 2, "dead_rollouts": 1}, stats
        assert metric(svc.http_port, 'rollstream_reward_groups_total{outcome="scored"}') == 2.0
        assert metric(svc.http_port, 'rollstream_reward_groups_total{outcome="passed_through"}') == 0.0
    finally:
        svc.kill()


class FlakyScorer(LengthScorer):
    """Answers `code` to the first `fail_first` attempts, then scores (attempts counted)."""

    def __init__(self, fail_first: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__()
        self.fail_first = fail_first
        self.code = code
        self.attempts = 0

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        with self.lock:
            self.attempts += 1
            fail = self.attempts <= self.fail_first
        if fail:
            context.abort(self.code, "not yet")
        return super().Score(request, context)


def remote_scorer(address: str, retries: int, outcomes: list[str]) -> RemoteScorer:
    return RemoteScorer(
        address, batch_size=8, deadline_s=10.0, retries=retries, backoff_s=0.01, backoff_max_s=0.02,
        breaker=CircuitBreaker(failure_threshold=5, cooldown_s=10.0), on_call=outcomes.append,
    )  # fmt: skip


ITEMS = [reward_pb2.ScoreItem(group_id="g", task_kind="x", completion="abc")]


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED]
)
def test_grpc_retries_transient_failures_within_one_call(code: grpc.StatusCode) -> None:
    server = ScorerServer(FlakyScorer(fail_first=2, code=code), free_port()).start()
    outcomes: list[str] = []
    scorer = remote_scorer(server.address, retries=2, outcomes=outcomes)
    try:
        (score,) = scorer.score(ITEMS)
        assert score.reward == pytest.approx(0.3)
        assert server.servicer.attempts == 3  # two retries, by gRPC's retryPolicy
        assert outcomes == ["ok"] and scorer.breaker.failures == 0  # one call, as the metric and breaker see it
    finally:
        scorer.close()
        server.stop()


def test_retries_used_up_is_unavailable_and_counts_one_failed_call() -> None:
    server = ScorerServer(FlakyScorer(fail_first=10), free_port()).start()
    outcomes: list[str] = []
    scorer = remote_scorer(server.address, retries=1, outcomes=outcomes)
    try:
        with pytest.raises(ScorerUnavailable, match="UNAVAILABLE: not yet"):
            scorer.score(ITEMS)
        assert server.servicer.attempts == 2
        assert outcomes == ["failed"] and scorer.breaker.failures == 1
    finally:
        scorer.close()
        server.stop()


def test_a_refusal_is_not_retried() -> None:
    server = ScorerServer(FlakyScorer(fail_first=1, code=grpc.StatusCode.INVALID_ARGUMENT), free_port()).start()
    outcomes: list[str] = []
    scorer = remote_scorer(server.address, retries=3, outcomes=outcomes)
    try:
        with pytest.raises(ScorerRejected, match="INVALID_ARGUMENT: not yet"):
            scorer.score(ITEMS)
        assert server.servicer.attempts == 1 and outcomes == ["rejected"] and scorer.breaker.failures == 0
    finally:
        scorer.close()
        server.stop()


def test_nothing_listening_is_retried_then_unavailable() -> None:
    outcomes: list[str] = []
    scorer = remote_scorer(f"127.0.0.1:{free_port()}", retries=2, outcomes=outcomes)
    try:
        with pytest.raises(ScorerUnavailable, match="UNAVAILABLE"):
            scorer.score(ITEMS)
        assert outcomes == ["failed"]
    finally:
        scorer.close()
