"""Time limits for reward components: every check runs in a worker process, and a worker
that runs past the component's `timeout_s` is killed.

A verifier can run for a very long time on a completion a model wrote: math-verify asked to
compare `\\boxed{9^{9^{9^{9}}}}` with 1 computes the power, and a regular expression can
backtrack for ever inside one C call that no signal handler interrupts. Killing the process
that runs it stops both. `ScorePool` is a `pebble.ProcessPool`: pebble (LGPL, pure Python,
no dependencies, maintained since 2013) schedules each task with its own timeout, measured
from when a worker starts it, kills the worker that overruns and starts a new one, and
reports a worker that died on its own (kill -9, the OOM killer) as ProcessExpired.
concurrent.futures' ProcessPoolExecutor can do neither: it has no per-task timeout, and a
killed worker breaks the whole executor.

One task is one component on one completion, so a timeout costs that component only
("timeout", value 0) and the other components and completions are scored as usual. A
worker that died mid-task has its task tried once more on a fresh worker (the kill may
have been meant for someone else), then it is an "error" component. The checks run
concurrently on `workers` processes; the stream loop and the Score RPC share the pool.

Workers build the recipes themselves, once, in the pool's initializer (the checks are
closures, not picklable) from a `RecipeSource`: a module-level function and plain data
(the component specs as dicts), which is how the workers are started again after a kill.

Pickle: tasks and results cross only the local pipes between this process and its own
worker processes (pebble's channel), never a network or a disk. What crosses is plain
data: (task_kind, component index, the Sample's fields) out, (value, status) back.

Workers come from a forkserver, not fork(): this process has gRPC and Redis threads by the
time a worker is replaced, and forking a threaded process can copy a lock held by another
thread. The forkserver preloads this module and math-verify, so a new worker is ready in
well under a second.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import pebble

from rollstream.core import logs
from rollstream.reward.recipes import (
    TIMEOUT,
    ComponentResult,
    ComponentSpec,
    RecipeComponent,
    Recipes,
    Sample,
    Score,
    build_recipes,
    run_component,
)

log = logging.getLogger("rollstream.reward.limits")

# A task whose worker died is run once more on a fresh worker; a second death is its fault.
CRASH_RETRIES = 1
# A pool can break as a whole (pebble gives up when a worker dies while no task runs);
# it is replaced, at most this many times in a row for one task before the caller is told.
POOL_REPLACEMENTS = 3
WAKE_S = 1.0
# The forkserver imports these once; every worker forked from it starts with them loaded.
PRELOAD = ["rollstream.reward.limits", "math_verify"]

RecipeSource = Callable[[], Recipes]
"""Builds the recipes; picklable (a module-level function, or a functools.partial of one
with plain arguments), as the pool hands it to every worker it starts."""


class PoolFailed(RuntimeError):
    """The pool could not run a task even after being replaced: nothing was scored."""


def recipes_from_data(specs: Mapping[str, Sequence[Mapping[str, Any]]], default_timeout_s: float | None) -> Recipes:
    return build_recipes(
        {kind: [ComponentSpec.model_validate(e) for e in entries] for kind, entries in specs.items()}, default_timeout_s
    )


def recipe_source(specs: Mapping[str, Sequence[ComponentSpec]], default_timeout_s: float | None) -> RecipeSource:
    """The RecipeSource of configured recipes: the specs as plain dicts, validated again in each worker."""
    data = {kind: [e.model_dump() for e in entries] for kind, entries in specs.items()}
    return functools.partial(recipes_from_data, data, default_timeout_s)


# -- in the worker processes -------------------------------------------------------------------

_recipes: Recipes | None = None
PR_SET_PDEATHSIG = 1


def _init_worker(source: RecipeSource) -> None:
    global _recipes
    # pebble makes SIGTERM run a Python handler, which waits for the interpreter: a worker
    # stuck in one long C call would then hold on for pebble's 3 s before its SIGKILL. The
    # default action ends it at once, wherever it is.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    try:
        # Die with the forkserver (which exits when the service does, kill -9 included).
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)  # orphaned before the line above took effect
    _recipes = source()


def _run(task_kind: str, index: int, sample: tuple[str, str, str, int | None]) -> tuple[float, str]:
    assert _recipes is not None, "worker not initialised"
    result = run_component(_recipes.table[task_kind][index], Sample(*sample))
    return result.value, result.status


# -- in the service ----------------------------------------------------------------------------


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

    def __init__(self, source: RecipeSource, workers: int):
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
            max_workers=self.workers, initializer=_init_worker, initargs=(self.source,), context=self._context
        )

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Start the workers and wait until they take work (they build their recipes first)."""
        with self._lock:
            futures = [self._pool.schedule(os.getpid) for _ in range(self.workers)]
        concurrent.futures.wait(futures, timeout=timeout_s)

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
                        _run, args=(task.task_kind, task.index, task.sample), timeout=task.component.timeout_s
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
