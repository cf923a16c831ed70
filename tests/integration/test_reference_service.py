"""The reference service as a real process: real redis-server, real gRPC, real (tiny) model.

One `python -m rollstream.reference` process serves the whole module (loading torch and the
model is most of a test's cost); every test writes its own groups and finds them by id.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from helpers import MIN_WAIT_S, wait_for, wait_healthy, write
from procs import ServiceProc, start_service
from rollstream.core import redis_policy, run_keys, validation
from rollstream.core.grpc_utils import Service, channel
from rollstream.core.service import Every, ServiceHost
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.reference.config import ReferenceSettings
from rollstream.reference.scoring import ReferenceModel
from rollstream.reference.service import Metrics, ReferenceLoop, ReferenceServicer, Scorer, Totals
from rollstream.v1 import reference_pb2, reference_pb2_grpc, rollout_pb2
from synthetic import scored_group_in_vocab

# Small budgets so one group already spans several micro-batches and LM-head chunks.
TOKEN_BUDGET = 48
CHUNK_TOKENS = 5
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def keys() -> run_keys.RunKeys:
    return run_keys.RunKeys("ref" + uuid.uuid4().hex[:10])


@pytest.fixture(scope="module")
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis_policy.connect(redis_server.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(
    redis_server: EmbeddedRedis, keys: run_keys.RunKeys, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProc]:
    proc = start_service(
        "reference",
        tmp_path_factory.mktemp("reference"),
        "--model",
        str(tiny_model_dir),
        "--redis-url",
        redis_server.url,
        "--run",
        keys.run,
        "--token-budget",
        str(TOKEN_BUDGET),
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        "--temperature",
        str(TEMPERATURE),
        "--block-ms",
        "100",
        "--trim-every-s",
        "0.5",
    )
    try:
        proc.wait_ready(timeout_s=60)
        yield proc
    finally:
        # A clean SIGTERM stop exits 0 (checked here, once, for the whole module).
        rc = proc.stop()
    assert rc == 0, proc.log()[-4000:]


@pytest.fixture(scope="module")
def in_process(tiny_model_dir: Path) -> ReferenceModel:
    """The same model and settings in this process, to compare values against."""
    return ReferenceModel.load(
        tiny_model_dir, token_budget=TOKEN_BUDGET, chunk_tokens=CHUNK_TOKENS, temperature=TEMPERATURE
    )


def ready_groups(client: redis.Redis, keys: run_keys.RunKeys) -> dict[str, rollout_pb2.RolloutGroup]:
    out = {}
    for _id, fields in client.xrange(keys.stream("ready")):
        group = validation.decode(fields, rollout_pb2.RolloutGroup)
        out[group.group_id] = group
    return out


def wait_ready_group(client: redis.Redis, keys: run_keys.RunKeys, group_id: str) -> rollout_pb2.RolloutGroup:
    return wait_for(lambda: ready_groups(client, keys).get(group_id), 20, f"group {group_id} in ready")


def dead_reasons(client: redis.Redis, keys: run_keys.RunKeys) -> dict[str, str]:
    """source entry id -> reason, from the dead-letter stream."""
    out = {}
    for _id, fields in client.xrange(keys.dead):
        letter = validation.decode(fields, rollout_pb2.DeadLetter)
        assert fields[b"reason"].decode() == letter.reason
        out[letter.source_id] = letter.reason
    return out


def assert_close(got: list[float], want: list[float], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    assert max((abs(a - b) for a, b in zip(got, want)), default=0.0) <= atol, (got, want)


def test_scored_group_comes_out_ready_with_ref_logprobs(
    reference: ServiceProc, client: redis.Redis, keys: run_keys.RunKeys, in_process: ReferenceModel
) -> None:
    sent = scored_group_in_vocab(in_process.vocab_size, n=4, seed=1)
    entry_id = write(client, keys, "scored", sent)

    got = wait_ready_group(client, keys, sent.group_id)

    assert got.has_ref_logprobs
    want = in_process.logprobs([(list(sent.prompt_ids), list(c.token_ids)) for c in sent.completions])
    for c, w in zip(got.completions, want):
        assert len(c.ref_logprobs) == len(c.token_ids)
        assert_close(list(c.ref_logprobs), w)
    # Everything else is exactly what came in.
    stripped = rollout_pb2.RolloutGroup()
    stripped.CopyFrom(got)
    stripped.has_ref_logprobs = False
    for c in stripped.completions:
        del c.ref_logprobs[:]
    assert stripped == sent
    # The input was acknowledged in the same transaction, and counted.
    pending = client.xpending_range(keys.stream("scored"), "reference", min=entry_id, max=entry_id, count=1)
    assert pending == []
    assert int(client.hget(keys.counters("reference"), "referenced") or 0) >= 1


def test_malformed_entries_go_to_dead_and_the_stage_goes_on(
    reference: ServiceProc, client: redis.Redis, keys: run_keys.RunKeys, in_process: ReferenceModel
) -> None:
    garbage = client.xadd(
        keys.stream("scored"), {"type": "rollstream.v1.RolloutGroup", "schema": "1", "data": b"\xff\xff\xff"}
    )
    wrong_type = write(client, keys, "scored", rollout_pb2.PromptTask(task_id="not-a-group"))
    no_completions = write(client, keys, "scored", rollout_pb2.RolloutGroup(group_id="empty", prompt_ids=[1, 2]))
    out_of_vocab = scored_group_in_vocab(in_process.vocab_size, seed=2)
    out_of_vocab.completions[1].token_ids[2] = in_process.vocab_size + 7
    oov_id = write(client, keys, "scored", out_of_vocab)
    valid = scored_group_in_vocab(in_process.vocab_size, seed=3)
    write(client, keys, "scored", valid)

    got = wait_ready_group(client, keys, valid.group_id)
    assert got.has_ref_logprobs

    reasons = wait_for(lambda: (r := dead_reasons(client, keys)) and len(r) >= 4 and r, 20, "four dead letters")
    assert "does not parse as rollstream.v1.RolloutGroup" in reasons[garbage.decode()]
    assert "type is 'rollstream.v1.PromptTask'" in reasons[wrong_type.decode()]
    assert "has no completions" in reasons[no_completions.decode()]
    assert (
        f"= {in_process.vocab_size + 7} is not a token id (vocab size {in_process.vocab_size})"
        in reasons[oov_id.decode()]
    )
    assert out_of_vocab.group_id not in ready_groups(client, keys)
    # Dead letters are acknowledged too: nothing of this run is left pending.
    assert client.xpending(keys.stream("scored"), "reference")["pending"] == 0
    assert int(client.hget(keys.counters("reference"), "dead_scored") or 0) >= 4


def test_ref_logprobs_written_upstream_are_replaced_by_the_references_own(
    reference: ServiceProc, client: redis.Redis, keys: run_keys.RunKeys, in_process: ReferenceModel
) -> None:
    """The reward's Redis user can write `scored`: a group claiming ref log-probs there (a
    forged -9999 a token would make the KL term ~1e4 a token) gets this service's own."""
    sent = scored_group_in_vocab(in_process.vocab_size, n=2, seed=4)
    for c in sent.completions:
        c.ref_logprobs.extend([-9999.0] * len(c.token_ids))
    sent.has_ref_logprobs = True
    write(client, keys, "scored", sent)

    got = wait_ready_group(client, keys, sent.group_id)
    assert got.has_ref_logprobs
    want = in_process.logprobs([(list(sent.prompt_ids), list(c.token_ids)) for c in sent.completions])
    for c, w in zip(got.completions, want):
        assert_close(list(c.ref_logprobs), w)


def test_grpc_compute_logprobs_and_state(
    reference: ServiceProc,
    client: redis.Redis,
    keys: run_keys.RunKeys,
    in_process: ReferenceModel,
    tiny_model_dir: Path,
) -> None:
    wait_healthy(reference.grpc_address, timeout_s=10, service="rollstream.v1.Reference")
    sequences = [
        ([5, 9, 13], [2, 4, 6, 8, 10, 12, 14]),
        ([7] * 20, [1]),
        ([3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]),
    ]
    with channel(reference.grpc_address) as ch:
        stub = reference_pb2_grpc.ReferenceStub(ch)
        before = stub.GetState(reference_pb2.ReferenceStateRequest(), timeout=10)
        reply = stub.ComputeLogprobs(
            reference_pb2.LogprobsRequest(
                sequences=[reference_pb2.TokenSequence(prompt_ids=p, completion_ids=c) for p, c in sequences]
            ),
            timeout=30,
        )
        for got, want in zip(reply.sequences, in_process.logprobs(sequences), strict=True):
            assert_close(list(got.logprobs), want)

        with pytest.raises(grpc.RpcError) as err:
            stub.ComputeLogprobs(
                reference_pb2.LogprobsRequest(
                    sequences=[reference_pb2.TokenSequence(prompt_ids=[], completion_ids=[1])]
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequence 0: empty prompt" in err.value.details()

        # GetState counts what the stream loop referenced and every completion token scored.
        group = scored_group_in_vocab(in_process.vocab_size, n=2, seed=5)
        write(client, keys, "scored", group)
        wait_ready_group(client, keys, group.group_id)
        after = stub.GetState(reference_pb2.ReferenceStateRequest(), timeout=10)
    assert after.model == str(tiny_model_dir.resolve())
    assert after.groups_processed == before.groups_processed + 1
    group_tokens = sum(len(c.token_ids) for c in group.completions)
    assert after.tokens_processed == before.tokens_processed + sum(len(c) for _, c in sequences) + group_tokens


def test_getstate_counts_a_group_by_the_time_it_shows_in_ready(
    redis_server: EmbeddedRedis, in_process: ReferenceModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream loop's pieces in this process (real Redis, real gRPC server, the real
    commit), so that GetState can be asked at the moment the commit has made a group
    visible in ready: what a client polling ready, then GetState, would see. A commit that
    is refused waits, holding its entry, until the key is fixed."""
    keys = run_keys.RunKeys("refstate" + uuid.uuid4().hex[:8])
    settings = ReferenceSettings(redis_url=redis_server.url, run=keys.run, block_ms=10)
    client = redis_policy.connect(redis_server.url)
    with ServiceHost("reference", settings) as host:
        totals = Totals()
        servicer = ReferenceServicer("tiny", totals)
        host.start([Service("rollstream.v1.Reference", servicer, reference_pb2_grpc.add_ReferenceServicer_to_server)])
        assert host.grpc is not None
        scorer = Scorer(in_process, Metrics.register(host.registry), totals)
        servicer.scorer = scorer
        stage = host.open_stage(client, "scored", settings.group)
        loop = ReferenceLoop(host, stage, scorer, Every(settings.trim_every_s))
        with channel(f"127.0.0.1:{host.grpc.port}") as ch:
            stub = reference_pb2_grpc.ReferenceStub(ch)
            counted_at_commit: list[int] = []
            commit = stage.commit

            def commit_then_ask(*args: object, **kwargs: object) -> bool:
                done = commit(*args, **kwargs)  # type: ignore[arg-type]  # the commit's own arguments, passed through
                counted_at_commit.append(
                    stub.GetState(reference_pb2.ReferenceStateRequest(), timeout=30).groups_processed
                )
                return done

            monkeypatch.setattr(stage, "commit", commit_then_ask)

            # A commit refused by Redis (ready is not a stream): nothing written while it waits
            # (not ready, retrying) for the key to be fixed; the entry stays pending.
            host.redis.refused_retry_s = 0.05
            client.set(keys.stream("ready"), "not a stream")
            write(client, keys, "scored", scored_group_in_vocab(in_process.vocab_size, n=2, seed=7))
            batch = wait_for(lambda: host.read(stage, loop.parse), 30, "the group read")
            referencing = threading.Thread(target=loop.reference, args=(batch,), daemon=True)
            referencing.start()
            wait_for(lambda: not host.redis.ok, 30, "the commit refused")
            assert "WRONGTYPE" in host.redis.detail
            assert (
                client.type(keys.stream("ready")) == b"string"
                and client.xpending(stage.stream, stage.group)["pending"] == 1
            )

            # Once ready is a stream, the same commit lands: counted by the time it is there.
            client.delete(keys.stream("ready"))
            referencing.join(60)
            assert not referencing.is_alive()
            assert client.xlen(keys.stream("ready")) == 1
            assert counted_at_commit == [1]
    client.close()


def test_metrics_and_trim(
    reference: ServiceProc, client: redis.Redis, keys: run_keys.RunKeys, in_process: ReferenceModel
) -> None:
    def metrics() -> str:
        return httpx.get(f"http://127.0.0.1:{reference.http_port}/metrics", timeout=30).text

    def referenced() -> float:
        prefix = 'rollstream_reference_groups_total{outcome="referenced"} '
        return next((float(line[len(prefix) :]) for line in metrics().splitlines() if line.startswith(prefix)), 0.0)

    before = referenced()
    group = scored_group_in_vocab(in_process.vocab_size, seed=6)
    write(client, keys, "scored", group)
    wait_ready_group(client, keys, group.group_id)

    # The counter moves just after the commit (a counter cannot take back a failed one), so
    # a scrape right after the group shows in ready may not have it yet: waited for.
    wait_for(lambda: referenced() >= before + 1, 20, "the referenced-groups metric to count the group")
    text = metrics()
    assert 'rollstream_reference_tokens_total{kind="completion"}' in text
    assert "rollstream_reference_tokens_per_second" in text
    # Acknowledged entries are trimmed from the scored stream (every 0.5 s here).
    wait_for(lambda: client.xlen(keys.stream("scored")) == 0, 10, "scored stream trimmed")


def test_bad_settings_exit_2_naming_the_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.reference", "--dtype", "float16"],
        capture_output=True,
        text=True,
        timeout=MIN_WAIT_S,
    )
    assert result.returncode == 2
    assert "field 'dtype'" in result.stderr


def test_missing_model_folder_exits_2(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.reference", "--model", str(missing), "--redis-url", redis_server.url],
        capture_output=True,
        text=True,
        timeout=MIN_WAIT_S,
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr
