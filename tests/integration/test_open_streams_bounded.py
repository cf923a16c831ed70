"""Health and reflection answer without a token; a process with no credentials holding many
reflection streams open (one request each, never half-closed) must not starve a service's
own methods (issue 27, S3: ten such streams held every worker of the generator, an admin
GetState timed out and training stopped). The reward service stands for every service:
they all build their server with rollstream.core.grpc_utils.serve."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from helpers import wait_for, wait_healthy
from procs import start_reward
from rollstream.core import credentials, grpc_utils
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import reward_pb2, reward_pb2_grpc

# More streams than the server has threads, own and open ones together.
STREAMS = 8 + grpc_utils.OPEN_STREAMS + 8


class HeldStream:
    """One reflection stream: one request sent, the request side never closed; `outcome`
    is "answered" once a response came, else the status code that ended it."""

    def __init__(self, stub: reflection_pb2_grpc.ServerReflectionStub):
        self.release = threading.Event()
        self.outcome: str = ""
        self.call = stub.ServerReflectionInfo(self._requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        self.release.wait()

    def _read(self) -> None:
        try:
            next(self.call)
            self.outcome = "answered"
            for _ in self.call:
                pass
        except grpc.RpcError as e:
            self.outcome = self.outcome or e.code().name

    def close(self) -> None:
        self.call.cancel()
        self.release.set()


def test_open_reflection_streams_do_not_starve_the_services_own_calls(
    tmp_path: Path, redis_url: str, keys: RunKeys
) -> None:
    creds = tmp_path / "credentials"
    tokens = credentials.ensure_grpc_tokens(creds)
    svc = start_reward(tmp_path, redis_url, keys.run, *credentials.service_flags(creds, "reward", redis_acl=False))
    admin = ClientCredentials(token=tokens["admin"])
    outsider = grpc_utils.channel(svc.grpc_address)  # no token at all
    streams: list[HeldStream] = []
    try:
        wait_healthy(svc.grpc_address, timeout_s=30)
        reflection = reflection_pb2_grpc.ServerReflectionStub(outsider)
        streams = [HeldStream(reflection) for _ in range(STREAMS)]
        # Each stream is answered or refused at once; none waits for a thread.
        wait_for(
            lambda: all(s.outcome for s in streams), timeout_s=60, what="every reflection stream answered or refused"
        )
        outcomes = [s.outcome for s in streams]
        assert outcomes.count("answered") == grpc_utils.OPEN_STREAMS, outcomes
        assert set(outcomes) == {"answered", "RESOURCE_EXHAUSTED"}, outcomes

        # While they stay open: the service's own work, as a caller with a token, and the probes.
        with grpc_utils.channel(svc.grpc_address, admin) as ch:
            item = reward_pb2.ScoreItem(group_id="a", task_kind="arithmetic", completion="8", answer="8")
            reply = reward_pb2_grpc.RewardStub(ch).Score(reward_pb2.ScoreRequest(items=[item]), timeout=60)
        assert len(reply.scores) == 1 and reply.scores[0].components[0].status == "ok", reply
        check = health_pb2_grpc.HealthStub(outsider).Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert check.status == health_pb2.HealthCheckResponse.SERVING

        # Closed streams give their slots back: reflection (grpcurl) works again.
        for s in streams:
            s.close()

        def served_again() -> bool:
            probe = HeldStream(reflection)
            streams.append(probe)
            wait_for(lambda: bool(probe.outcome), timeout_s=60, what="a new reflection stream answered or refused")
            return probe.outcome == "answered"

        wait_for(served_again, timeout_s=60, what="reflection served again once the streams closed")
    finally:
        for s in streams:
            s.close()
        outsider.close()
        svc.stop()
