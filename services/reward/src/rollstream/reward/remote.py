"""A remote scorer: the reward stage calls someone else's `rollstream.v1.Reward/Score`.

`RemoteScorer.score(items)` sends the items in batches of `batch_size`, each call with a
deadline. gRPC itself retries an attempt that failed with UNAVAILABLE, RESOURCE_EXHAUSTED
or ABORTED, with exponential back-off: the channel's service config carries a retryPolicy
built from the scorer_retries/backoff settings (`service_config`). The deadline covers the
call with all its attempts. A circuit breaker stops calling a scorer that keeps failing:
after `failure_threshold` consecutive failed calls it opens, refuses calls for
`cooldown_s`, then lets one call through (half-open): success closes it, failure opens
it again. It and the `on_call` metric count calls (each up to 1 + retries attempts).

Two outcomes besides scores, and what the stage does with them:
- `ScorerUnavailable` (transient: retries used up, deadline passed, or the circuit is
  open): the stage keeps the groups pending, holds them and tries again later. They are
  neither acknowledged nor zero-scored: a zero reward would train the policy on a fault.
- `ScorerRejected` (the scorer answered, but with an error that retrying will not fix, or
  with scores that cannot be used): the stage retries group by group and dead-letters the
  groups that are still rejected, with the scorer's message.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import grpc

from rollstream.core import grpc_utils
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.v1 import reward_pb2, reward_pb2_grpc

if TYPE_CHECKING:
    from rollstream.reward.config import RewardSettings

# Failures that say nothing about the items: the scorer is down, overloaded, restarting or
# slow. A call that ends with one of these (after gRPC's retries) is ScorerUnavailable.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
# What gRPC retries within a call. Not DEADLINE_EXCEEDED (the deadline is the whole call's:
# no time is left to retry in) nor CANCELLED (we cancelled it: the channel is closing).
RETRYABLE_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED")
MAX_ATTEMPTS = 5  # gRPC treats a larger maxAttempts as 5
SCORE_METHOD = {"service": "rollstream.v1.Reward", "method": "Score"}


def service_config(retries: int, backoff_s: float, backoff_max_s: float) -> str:
    """The channel's service config (JSON): gRPC retries Score `retries` times, the n-th
    after a random delay of up to min(backoff_s * 2**(n-1), backoff_max_s) (gRFC A6)."""
    method: dict[str, object] = {"name": [SCORE_METHOD]}
    if retries > 0:  # maxAttempts must be at least 2: no policy at all means no retries
        method["retryPolicy"] = {
            "maxAttempts": min(retries + 1, MAX_ATTEMPTS),
            "initialBackoff": f"{backoff_s:.6f}s",
            "maxBackoff": f"{max(backoff_s, backoff_max_s):.6f}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": list(RETRYABLE_CODES),
        }
    return json.dumps({"methodConfig": [method]})


def scorer_channel(address: str, creds: ClientCredentials | None, config: str) -> grpc.Channel:
    """grpc_utils.channel with the retry service config among its options."""
    return grpc_utils.channel(
        address,
        creds,
        options=[
            ("grpc.enable_retries", 1),
            ("grpc.service_config", config),
            # Ours, not one a DNS TXT record could substitute.
            ("grpc.service_config_disable_resolution", 1),
        ],
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
    opened_at: float = 0.0

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
        on_call: Callable[[str], None] = lambda outcome: None,
        creds: ClientCredentials | None = None,
    ):
        """`retries`, `backoff_s`, `backoff_max_s`: gRPC's retry policy (service_config).
        `on_call(outcome)` is told of every call: "ok", "failed" (transient) or "rejected".
        `creds`: the reward stage's token and TLS material (a scorer with a role table
        wants them). A stop waits for a call in flight, at most `deadline_s` (its retries
        and their back-off included)."""
        self.batch_size = batch_size
        self.deadline_s = deadline_s
        self.retries = retries
        self.breaker = breaker
        self.channel = scorer_channel(address, creds, service_config(retries, backoff_s, backoff_max_s))
        self.stub = reward_pb2_grpc.RewardStub(self.channel)
        self.on_call = on_call

    @classmethod
    def from_settings(cls, settings: RewardSettings, on_call: Callable[[str], None]) -> "RemoteScorer":
        """The scorer at settings.scorer_address, with the settings' batching, retries and breaker."""
        return cls(
            settings.scorer_address,
            batch_size=settings.scorer_batch_size,
            deadline_s=settings.scorer_deadline_s,
            retries=settings.scorer_retries,
            backoff_s=settings.scorer_backoff_s,
            backoff_max_s=settings.scorer_backoff_max_s,
            breaker=CircuitBreaker(settings.scorer_breaker_failures, settings.scorer_breaker_cooldown_s),
            on_call=on_call,
            creds=ClientCredentials.from_settings(settings),
        )

    def close(self) -> None:
        self.channel.close()

    def score(self, items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]:
        """Scores for `items`, in order. Raises ScorerUnavailable or ScorerRejected."""
        out: list[reward_pb2.ItemScore] = []
        for start in range(0, len(items), self.batch_size):
            out.extend(self._score_batch(items[start : start + self.batch_size]))
        return out

    def _score_batch(self, batch: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ItemScore]:
        if not self.breaker.allow():
            raise ScorerUnavailable(
                f"circuit open after {self.breaker.failures} failed calls; next try in {self.breaker.retry_in_s():.1f}s"
            )
        try:
            # gRPC retries transient failures within this call (the channel's retryPolicy).
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
            raise ScorerUnavailable(
                f"call failed after up to {min(self.retries + 1, MAX_ATTEMPTS)} attempts, last: {code.name}: {details}"
            ) from None
        self.breaker.record_success()
        self.on_call("ok")
        problem = check_reply(reply, len(batch))
        if problem:
            self.on_call("rejected")
            raise ScorerRejected(problem)
        return list(reply.scores)


def check_reply(reply: reward_pb2.ScoreResponse, n_items: int) -> str:
    """Why a reply cannot be used ("" if it can): scores must match the items one to one,
    and be finite (a NaN reward would poison the whole training step)."""
    if len(reply.scores) != n_items:
        return f"the scorer returned {len(reply.scores)} scores for {n_items} items"
    for i, s in enumerate(reply.scores):
        if not math.isfinite(s.reward):
            return f"the scorer returned a non-finite reward ({s.reward}) for item {i}"
    return ""
