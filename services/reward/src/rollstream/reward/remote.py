"""A remote scorer: the reward stage calls someone else's `rollstream.v1.Reward/Score`.

`RemoteScorer.score(items)` sends the items in batches of `batch_size`, each call with a
deadline, and retries what failed for a transient reason (UNAVAILABLE, DEADLINE_EXCEEDED,
...) with exponential back-off. A circuit breaker stops calling a scorer that keeps failing:
after `failure_threshold` consecutive failed calls it opens, refuses calls for
`cooldown_s`, then lets one call through (half-open): success closes it, failure opens
it again.

Two outcomes besides scores, and what the stage does with them:
- `ScorerUnavailable` (transient: retries used up, or the circuit is open): the stage
  keeps the groups pending, holds them and tries again later. They are neither
  acknowledged nor zero-scored: a zero reward would train the policy on a fault.
- `ScorerRejected` (the scorer answered, but with an error that retrying will not fix, or
  with scores that cannot be used): the stage retries group by group and dead-letters the
  groups that are still rejected, with the scorer's message.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc

from rollstream.core import grpc_utils
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.v1 import reward_pb2, reward_pb2_grpc

# Failures worth retrying: the scorer is down, overloaded, restarting or slow.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


class ScorerUnavailable(Exception):
    """No scores now, for a reason that may pass: keep the groups and try later."""


class ScorerRejected(Exception):
    """The scorer will not score these items as they are: retrying the same call won't help."""


BreakerState = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    """Consecutive-failure circuit breaker; `clock` is injectable so tests need no sleeping."""

    failure_threshold: int
    cooldown_s: float
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = "closed"
    failures: int = 0
    opened_at: float = field(default=0.0)

    def allow(self) -> bool:
        """May a call go out now? An open breaker turns half-open once the cool-down is over."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self.state = "half_open"
        return self.state != "open"

    def record_success(self) -> None:
        self.state, self.failures = "closed", 0

    def record_failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.failure_threshold:
            self.state, self.opened_at = "open", self.clock()

    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a call through (0 when it would now)."""
        if self.state != "open":
            return 0.0
        return max(0.0, self.opened_at + self.cooldown_s - self.clock())


class RemoteScorer:
    """Client of one `Reward/Score` server; used from one thread (the stream loop)."""

    def __init__(
        self,
        address: str,
        *,
        batch_size: int,
        deadline_s: float,
        retries: int,
        backoff_s: float,
        backoff_max_s: float,
        breaker: CircuitBreaker,
        wait: Callable[[float], bool],
        on_call: Callable[[str], None] = lambda outcome: None,
        creds: ClientCredentials | None = None,
    ):
        """`wait(seconds)` sleeps and returns True if the service is stopping meanwhile
        (threading.Event.wait), so a back-off never delays a shutdown. `on_call(outcome)`
        is told of every call: "ok", "failed" (transient) or "rejected". `creds`: the reward
        stage's token and TLS material (a scorer with a role table wants them)."""
        self.address = address
        self.batch_size = batch_size
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.breaker = breaker
        self.wait = wait
        self.channel = grpc_utils.channel(address, creds)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)
        self.on_call = on_call

    def close(self) -> None:
        self.channel.close()

    def score(self, items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]:
        """Scores for `items`, in order. Raises ScorerUnavailable or ScorerRejected."""
        out: list[reward_pb2.ItemScore] = []
        for start in range(0, len(items), self.batch_size):
            out.extend(self._score_batch(items[start : start + self.batch_size]))
        return out

    def _score_batch(self, batch: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]:
        last_error = ""
        for attempt in range(self.retries + 1):
            if not self.breaker.allow():
                raise ScorerUnavailable(f"circuit open after {self.breaker.failures} failed calls ({last_error or 'earlier failures'}); next try in {self.breaker.retry_in_s():.1f}s")
            try:
                reply = self.stub.Score(reward_pb2.ScoreRequest(items=batch), timeout=self.deadline_s)
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
                details = e.details() if isinstance(e, grpc.Call) else str(e)
                if code not in TRANSIENT_CODES:
                    # The scorer is up and said no: not its availability, so the breaker
                    # does not count it.
                    self.on_call("rejected")
                    raise ScorerRejected(f"{code.name}: {details}") from None
                self.on_call("failed")
                self.breaker.record_failure()
                last_error = f"{code.name}: {details}"
                if attempt < self.retries and self.wait(min(self.backoff_s * 2**attempt, self.backoff_max_s)):
                    raise ScorerUnavailable("stopping") from None
                continue
            self.breaker.record_success()
            self.on_call("ok")
            problem = check_reply(reply, len(batch))
            if problem:
                self.on_call("rejected")
                raise ScorerRejected(problem)
            return list(reply.scores)
        raise ScorerUnavailable(f"{self.retries + 1} attempts failed, last: {last_error}")


def check_reply(reply: reward_pb2.ScoreResponse, n_items: int) -> str:
    """Why a reply cannot be used ("" if it can): scores must match the items one to one,
    and be finite (a NaN reward would poison the whole training step)."""
    if len(reply.scores) != n_items:
        return f"the scorer returned {len(reply.scores)} scores for {n_items} items"
    for i, s in enumerate(reply.scores):
        if not math.isfinite(s.reward):
            return f"the scorer returned a non-finite reward ({s.reward}) for item {i}"
    return ""
