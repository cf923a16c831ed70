"""Scoring for the reward stage: the worker pool that runs every reward component under its
time limit, the `Reward/Score` RPC, how the stream loop scores a batch, and the metrics.

Local scoring goes through a `ScoresItems`: in the service the `ScorePool`, in tests a plain
`Recipes` (in this process, no limits). With a remote scorer configured the stream's groups
go to it instead (rollstream.reward.remote), while the `Reward/Score` RPC keeps serving this
service's own recipes to anyone else (evaluation scripts, another reward stage).

Why a process per check: a verifier can run for a very long time on a completion a model
wrote (math-verify asked to compare `\\boxed{9^{9^{9^{9}}}}` with 1 computes the power; a
regular expression can backtrack for ever inside one C call no signal interrupts), and
killing the process that runs it stops both. `ScorePool` is a `pebble.ProcessPool`: pebble
(LGPL, pure Python, no dependencies, maintained since 2013) gives each task its own timeout,
measured from when a worker starts it, kills the worker that overruns and starts a new one,
and reports a worker that died on its own (kill -9, the OOM killer) as ProcessExpired;
concurrent.futures' ProcessPoolExecutor has no per-task timeout, and a killed worker breaks
the whole executor. One task is one component on one completion, so a timeout costs that
component only ("timeout", value 0); a task whose worker died is tried once more on a fresh
worker (the kill may have been meant for someone else), then it is an "error" component.

Workers build the recipes themselves (rollstream.reward.recipes: `worker_init`, `worker_run`).
Pickle: tasks and results cross only the local pipes between this process and its own
workers (pebble's channel), never a network or a disk, and what crosses is plain data:
(task_kind, component index, the Sample's fields) out, (value, status) back (the sandbox
probe: the component specs as dicts out, a dict of problems back). Workers come
from a forkserver, not fork(): this process has gRPC and Redis threads by the time a worker
is replaced, and forking a threaded process can copy a lock held by another thread. The
forkserver preloads the recipes and math-verify, so a new worker is ready in well under a second.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import pebble
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.core import logs
from rollstream.reward import recipes
from rollstream.reward.recipes import OK, TIMEOUT, ComponentResult, ComponentSpec, RecipeComponent, Sample, Score
from rollstream.reward.remote import RemoteScorer, ScorerRejected
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

log = logging.getLogger("rollstream.reward.scoring")

# A Score RPC without a deadline still gets an answer or an error within this.
RPC_DEFAULT_TIMEOUT_S = 300.0
# A task whose worker died is run once more on a fresh worker; a second death is its fault.
CRASH_RETRIES = 1
# A pool can break as a whole (pebble gives up when a worker dies while no task runs);
# it is replaced, at most this many times in a row for one task before the caller is told.
POOL_REPLACEMENTS = 3
WAKE_S = 1.0
# The forkserver imports these once; every worker forked from it starts with them loaded.
PRELOAD = ["rollstream.reward.recipes", "math_verify"]


class ScoresItems(Protocol):
    """ScorePool, or recipes.Recipes: scores of (task_kind, sample) items, in order."""

    @property
    def kinds(self) -> tuple[str, ...]: ...

    def score_many(self, items: Sequence[tuple[str, Sample]], timeout_s: float | None = None) -> list[Score]: ...


# -- the worker pool ----------------------------------------------------------------------------


class PoolFailed(RuntimeError):
    """The pool could not run a task even after being replaced: nothing was scored."""


@dataclass
class _Task:
    task_kind: str
    index: int  # of `component` in the recipe: what the worker looks up
    component: RecipeComponent
    sample: tuple[str, str, str, int | None]
    future: concurrent.futures.Future[tuple[float, str]] = field(init=False)
    pool: pebble.ProcessPool | None = None  # the pool `future` came from
    crashes: int = 0
    replacements: int = 0


class ScorePool:
    """Scores (task_kind, Sample) items in worker processes, each component under its time
    limit. Thread-safe: the stream loop and the gRPC handlers share one."""

    def __init__(self, source: recipes.RecipeSource, workers: int):
        # This process's own copy: names, weights and time limits (the checks run in the workers).
        self.recipes = source()
        self.source = source
        self.workers = workers
        self._lock = threading.Lock()
        self._closed = False
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)  # no effect once the forkserver runs
        self._pool = self._new_pool()

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.recipes.kinds

    def _new_pool(self) -> pebble.ProcessPool:
        return pebble.ProcessPool(
            max_workers=self.workers, initializer=recipes.worker_init, initargs=(self.source,), context=self._context
        )

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Start the workers and wait until they take work (they build their recipes first)."""
        with self._lock:
            futures = [self._pool.schedule(os.getpid) for _ in range(self.workers)]
        concurrent.futures.wait(futures, timeout=timeout_s)

    def check_sandboxes(
        self, specs: Mapping[str, Sequence[ComponentSpec]], report: Callable[[dict[str, str]], None]
    ) -> None:
        """recipes.sandbox_problems of `specs`, run in a worker (where code runs) beside the
        start, as a sandbox's interpreter can take seconds to start: `report` gets its answer.
        Where the check itself fails (its worker killed, say), `report` gets every code kind
        with that reason: nothing says the sandbox works. Nothing when the pool closed first."""
        code_kinds = [kind for kind, components in specs.items() if any(c.component == "code" for c in components)]

        def reported(done: concurrent.futures.Future[dict[str, str]]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            report(
                {kind: f"the sandbox check did not finish: {error!r}" for kind in code_kinds}
                if error
                else done.result()
            )

        with self._lock:
            future = self._pool.schedule(recipes.sandbox_problems, args=(recipes.plain_specs(specs),))
        future.add_done_callback(reported)

    def close(self) -> None:
        """Stop the workers (a running check is killed)."""
        with self._lock:
            self._closed = True
            self._pool.stop()
        self._pool.join(timeout=10)

    def score_many(self, items: Sequence[tuple[str, Sample]], timeout_s: float | None = None) -> list[Score]:
        """Scores of every (task_kind, sample), in order. All components of all items are
        queued at once and run on the workers concurrently. With `timeout_s`, TimeoutError
        once that much time has passed (what is still queued or running is cancelled; a
        cancelled running task's worker is killed). PoolFailed if the pool keeps breaking."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        jobs: list[Score | list[_Task]] = []
        try:
            for kind, sample in items:
                recipe = self.recipes.table.get(kind)
                if recipe is None:
                    jobs.append(self.recipes.unknown(kind))
                    continue
                data = (sample.completion, sample.answer, sample.metadata_json, sample.num_tokens)
                tasks = [_Task(kind, i, c, data) for i, c in enumerate(recipe)]
                jobs.append(tasks)  # before submitting: a submit that fails must cancel the ones before it
                for task in tasks:
                    self._submit(task)
            out = []
            for job in jobs:
                if not isinstance(job, Score):
                    components = tuple(self._result(task, deadline) for task in job)
                    job = Score(reward=sum(c.weight * c.value for c in components), components=components)
                out.append(job)
            return out
        except BaseException:
            for job in jobs:
                if not isinstance(job, Score):
                    for task in job:
                        if hasattr(task, "future"):
                            task.future.cancel()
            raise

    def _submit(self, task: _Task) -> None:
        while True:
            with self._lock:
                if self._closed:
                    raise PoolFailed("the scoring pool is closed")
                pool = self._pool
                try:
                    task.future = pool.schedule(
                        recipes.worker_run,
                        args=(task.task_kind, task.index, task.sample),
                        timeout=task.component.timeout_s,
                    )
                    task.pool = pool
                    return
                except RuntimeError:  # broken (pebble: "Unexpected error within the Pool")
                    pass
            self._replace(pool, task, "the pool is not running")

    def _replace(self, broken: pebble.ProcessPool | None, task: _Task, why: str) -> None:
        """Replace `broken` by a new pool (unless another thread already has)."""
        task.replacements += 1
        if task.replacements > POOL_REPLACEMENTS:
            raise PoolFailed(f"the scoring pool broke {POOL_REPLACEMENTS} times in a row ({why})")
        with self._lock:
            if self._closed:
                raise PoolFailed("the scoring pool is closed")
            if self._pool is not broken:
                return
            logs.event(log, "score_pool_replaced", logging.WARNING, reason=why)
            broken.stop()
            self._pool = self._new_pool()
        broken.join(timeout=10)

    def _result(self, task: _Task, deadline: float) -> ComponentResult:
        while True:
            while not task.future.done():
                # Woken now and then to notice a pool closed meanwhile (its futures never finish).
                if self._closed:
                    raise PoolFailed("the scoring pool is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("scoring did not finish before the deadline")
                concurrent.futures.wait([task.future], timeout=min(WAKE_S, remaining))
            try:
                value, status = task.future.result()
            except TimeoutError:  # pebble: the task ran past its timeout_s; its worker is killed
                value, status = 0.0, TIMEOUT
            except pebble.ProcessExpired as e:
                task.crashes += 1
                logs.event(
                    log, "score_worker_lost", logging.WARNING, component=task.component.name, task_kind=task.task_kind,
                    pid=e.pid, exit_code=e.exitcode, retry=task.crashes <= CRASH_RETRIES,
                )  # fmt: skip
                if task.crashes > CRASH_RETRIES:
                    value, status = (
                        0.0,
                        f"error: ProcessExpired: the scoring worker died {task.crashes} times (exit code {e.exitcode})",
                    )
                else:
                    self._submit(task)
                    continue
            except BrokenProcessPool as e:
                self._replace(task.pool, task, f"{type(e).__name__}: {e}")
                self._submit(task)
                continue
            return ComponentResult(name=task.component.name, value=value, weight=task.component.weight, status=status)


@dataclass(frozen=True)
class Metrics:
    """The reward stage's own metrics (dead letters, redeliveries, batch time: ServiceHost.metrics)."""

    groups: Counter
    completions: Counter
    tokens: Counter
    reward: Histogram
    reward_mean: Gauge
    verifier_errors: Counter
    timeouts: Counter
    unknown_kind: Counter
    rpc_items: Counter
    scorer_calls: Counter
    scorer_circuit_open: Gauge
    held_groups: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_reward_"
        return cls(
            groups=Counter(p + "groups", "groups written downstream, by outcome", ["outcome"], registry=registry),
            completions=Counter(p + "completions", "completions scored from the stream", registry=registry),
            tokens=Counter(p + "tokens", "completion tokens of the groups scored from the stream", registry=registry),
            reward=Histogram(
                p + "completion_reward",
                "reward of each scored completion (stream and Score RPC)",
                buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.5, 2, 5),
                registry=registry,
            ),
            reward_mean=Gauge(
                p + "batch_reward_mean", "mean reward of the completions in the last scored batch", registry=registry
            ),
            verifier_errors=Counter(
                p + "verifier_errors", "components whose check failed, by component", ["component"], registry=registry
            ),
            timeouts=Counter(
                p + "timeouts", "components that ran out of time, by component", ["component"], registry=registry
            ),
            unknown_kind=Counter(
                p + "unknown_task_kind", "completions of a task kind no recipe knows", registry=registry
            ),
            rpc_items=Counter(p + "rpc_items", "items scored through the Score RPC", registry=registry),
            scorer_calls=Counter(
                p + "scorer_calls", "calls to the remote scorer, by outcome", ["outcome"], registry=registry
            ),
            scorer_circuit_open=Gauge(
                p + "scorer_circuit_open", "1 while the remote scorer's circuit breaker is open", registry=registry
            ),
            held_groups=Gauge(
                p + "held_groups", "groups held pending while the remote scorer is unavailable", registry=registry
            ),
        )

    def count_scores(self, scores: Sequence[Score]) -> None:
        for s in scores:
            if s.unknown_kind:
                self.unknown_kind.inc()
                continue
            self.reward.observe(s.reward)
            for c in s.components:
                if c.status == TIMEOUT:
                    self.timeouts.labels(component=c.name).inc()
                elif c.failed:
                    self.verifier_errors.labels(component=c.name).inc()


# -- between protobuf and scores ----------------------------------------------------------------


def to_pb(component: ComponentResult) -> rollout_pb2.RewardComponent:
    return rollout_pb2.RewardComponent(
        name=component.name, value=component.value, weight=component.weight, status=component.status
    )


def from_pb(score: reward_pb2.ItemScore) -> Score:
    """A remote scorer's answer in our terms (its statuses are counted like ours)."""
    components = tuple(
        ComponentResult(name=c.name, value=c.value, weight=c.weight, status=c.status or OK) for c in score.components
    )
    return Score(reward=score.reward, components=components)


def apply_scores(groups: dict[int, rollout_pb2.RolloutGroup], scores: Iterable[Score]) -> dict[int, list[Score]]:
    """Fill every completion's reward and breakdown in place from `scores` (one per
    completion, group after group), replacing stale ones; mark the groups scored."""
    remaining = iter(scores)
    out = {}
    for i, group in groups.items():
        out[i] = [next(remaining) for _ in group.completions]
        for completion, s in zip(group.completions, out[i]):
            completion.reward = s.reward
            del completion.reward_components[:]
            completion.reward_components.extend(to_pb(c) for c in s.components)
        group.scored = True
    return out


def score_groups(groups: dict[int, rollout_pb2.RolloutGroup], scorer: ScoresItems) -> dict[int, list[Score]]:
    """Score every completion of every group with its task kind's recipe, in place; all of
    them in one go, so that the pool's workers share the whole batch."""
    items = [
        (
            g.task_kind,
            Sample(completion=c.text, answer=g.answer, metadata_json=g.metadata_json, num_tokens=len(c.token_ids)),
        )
        for g in groups.values()
        for c in g.completions
    ]
    return apply_scores(groups, scorer.score_many(items))


def score_items(
    items: Sequence[reward_pb2.ScoreItem], scorer: ScoresItems, timeout_s: float | None = None
) -> list[Score]:
    return scorer.score_many(
        [
            (
                item.task_kind,
                Sample(
                    completion=item.completion,
                    answer=item.answer,
                    metadata_json=item.metadata_json,
                    num_tokens=item.num_tokens if item.HasField("num_tokens") else None,
                ),
            )  # fmt: skip
            for item in items
        ],
        timeout_s=timeout_s,
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """`Score`: the recipes over gRPC, item by item, in request order. Runs on the gRPC
    server's threads; the checks run in the scoring pool, like the stream loop's."""

    def __init__(self, scorer: ScoresItems, metrics: Metrics):
        self.scorer = scorer
        self.metrics = metrics

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        remaining = context.time_remaining()
        timeout = RPC_DEFAULT_TIMEOUT_S if remaining is None else max(0.0, remaining)
        try:
            scores = score_items(request.items, self.scorer, timeout)
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "scoring did not finish before the deadline")
        except PoolFailed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.rpc_items.inc(len(scores))
        self.metrics.count_scores(scores)
        return reward_pb2.ScoreResponse(scores=[item_score(s) for s in scores])


def item_score(score: Score) -> reward_pb2.ItemScore:
    return reward_pb2.ItemScore(reward=score.reward, components=[to_pb(c) for c in score.components])


# -- what the stream loop scores with -------------------------------------------------------------


@dataclass
class Scored:
    """What scoring a batch gave: the scores of each group scored (by position in the
    batch), and the reason for each group a remote scorer rejected."""

    scores: dict[int, list[Score]]
    rejected: dict[int, str]


@dataclass
class Scorer:
    """How the stream loop scores: the local recipes (through the pool), or a remote scorer."""

    local: ScoresItems
    remote: RemoteScorer | None

    def score_groups(self, groups: dict[int, rollout_pb2.RolloutGroup]) -> Scored:
        """Score `groups` (position in the batch -> group) in place. Raises
        ScorerUnavailable when they must be held: nothing has been written then (a group
        already scored in place is simply scored again on the retry)."""
        if self.remote is None:
            # A kind no recipe knows has no verifier: its group is refused (dead letter), not
            # scored 0 and trained on as if every completion were wrong. A remote scorer
            # knows its own kinds and rejects what it cannot score.
            known = self.local.kinds
            rejected = {
                i: f"task_kind {g.task_kind!r} has no verifier in this reward service (known: {', '.join(known)})"
                for i, g in groups.items()
                if g.task_kind not in known
            }
            todo = {i: g for i, g in groups.items() if i not in rejected}
            return Scored(scores=score_groups(todo, self.local) if todo else {}, rejected=rejected)
        try:
            return Scored(scores=self._score_remotely(groups), rejected={})
        except ScorerRejected as e:
            if len(groups) == 1:
                return Scored(scores={}, rejected={i: f"remote scorer rejected the group: {e}" for i in groups})
        # Which group does the scorer object to? Ask group by group.
        result = Scored(scores={}, rejected={})
        for i, g in groups.items():
            try:
                result.scores.update(self._score_remotely({i: g}))
            except ScorerRejected as e:
                result.rejected[i] = f"remote scorer rejected the group: {e}"
        return result

    def _score_remotely(self, groups: dict[int, rollout_pb2.RolloutGroup]) -> dict[int, list[Score]]:
        assert self.remote is not None
        items = [
            reward_pb2.ScoreItem(
                group_id=g.group_id,
                completion_index=k,
                task_kind=g.task_kind,
                completion=c.text,
                answer=g.answer,
                metadata_json=g.metadata_json,
                num_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
            )
            for g in groups.values()
            for k, c in enumerate(g.completions)
        ]
        replies = self.remote.score(items)  # raises before any group is changed
        return apply_scores(groups, map(from_pb, replies))
