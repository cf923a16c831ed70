"""A real generator process: direct sampling over gRPC, exact delta application, and
refusal of deltas it cannot apply (wrong base, corrupted, another model)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import redis

from helpers import groups_in, wait_for, write
from procs import ServiceProc, start_service
from rollstream.core import deltas, modeling, run_keys, streams, validation, weight_transfer
from rollstream.core.grpc_utils import channel
from rollstream.core.service import ServiceHost
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.generator import ApplyTimings, Generator
from rollstream.generator.service import GeneratorLoop
from rollstream.v1 import generator_pb2, generator_pb2_grpc, rollout_pb2, weights_pb2


@pytest.fixture
def generator(redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path):
    proc = start_service(
        "generator",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
    ).wait_ready()
    yield proc
    proc.stop()


def version0_bits(model_dir: Path) -> dict[str, np.ndarray]:
    model, _ = modeling.load_model(model_dir)
    return modeling.model_bits(model)


def push(gen: ServiceProc, chunks) -> weights_pb2.PushResult:
    with channel(gen.grpc_address) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(chunks), timeout=60)


def state(gen: ServiceProc) -> generator_pb2.GeneratorState:
    with channel(gen.grpc_address) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).GetState(
            generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=30
        )


def perturbed(bits: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, b in bits.items():
        step = (rng.random(b.shape) < 0.05).astype(np.uint16) * rng.integers(1, 4, b.shape, dtype=np.uint16)
        out[name] = b + step
    return out


def test_generate_returns_group_with_logprobs(generator: ServiceProc) -> None:
    task = rollout_pb2.PromptTask(
        task_id="direct-1",
        messages=[rollout_pb2.ChatMessage(role="user", content="What is 2 + 3?")],
        answer="5",
        group_size=3,
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5, seed=7),
        task_kind="arithmetic",
    )
    with channel(generator.grpc_address) as ch:
        stub = generator_pb2_grpc.GeneratorStub(ch)
        group = stub.Generate(generator_pb2.GenerateRequest(task=task), timeout=60)
        again = stub.Generate(generator_pb2.GenerateRequest(task=task), timeout=60)
    assert group.group_id == "direct-1" and group.policy_version == 0
    assert len(group.completions) == 3
    for c in group.completions:
        assert 1 <= len(c.token_ids) <= 5
        assert len(c.behaviour_logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.behaviour_logprobs)
        assert c.finish_reason in ("stop", "length")
        assert list(c.versions) == [rollout_pb2.VersionSpan(version=0, start=0, end=len(c.token_ids))]
    # Same seed, same weights: the same samples.
    assert [list(c.token_ids) for c in group.completions] == [list(c.token_ids) for c in again.completions]


def test_deltas_apply_exactly_and_bad_ones_are_refused(generator: ServiceProc, tiny_model_dir: Path) -> None:
    v0 = version0_bits(tiny_model_dir)
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in v0.items()})
    assert state(generator).weights_sha256 == deltas.weights_sha256(v0)

    v1 = perturbed(v0, seed=1)
    payload, _ = deltas.encode_delta(v0, v1, 0, 1, fingerprint)
    result = push(
        generator, weight_transfer.to_chunks(payload, deltas.PayloadInfo("delta", 0, 1, fingerprint), chunk_bytes=4096)
    )
    assert result.applied and result.version == 1, result.error
    assert state(generator).weights_sha256 == deltas.weights_sha256(v1)

    # The same delta again (a push that lost the race with the generator's own catch-up):
    # that version is held already, so the push is done and nothing changes.
    result = push(generator, weight_transfer.to_chunks(payload, deltas.PayloadInfo("delta", 0, 1, fingerprint)))
    assert result.applied and result.version == 1, result.error
    assert state(generator).weights_sha256 == deltas.weights_sha256(v1)

    # A delta to a newer version from a base the generator does not hold: a broken chain.
    jump, _ = deltas.encode_delta(v0, perturbed(v1, seed=5), 0, 2, fingerprint)
    result = push(generator, weight_transfer.to_chunks(jump, deltas.PayloadInfo("delta", 0, 2, fingerprint)))
    assert not result.applied and "base is version 0" in result.error

    # Corrupted in transit: the sha256 check refuses it before decoding.
    v2 = perturbed(v1, seed=2)
    payload2, _ = deltas.encode_delta(v1, v2, 1, 2, fingerprint)
    chunks = list(weight_transfer.to_chunks(payload2, deltas.PayloadInfo("delta", 1, 2, fingerprint), chunk_bytes=1024))
    chunks[1] = weights_pb2.WeightChunk(data=bytes([chunks[1].data[0] ^ 0xFF]) + chunks[1].data[1:])
    result = push(generator, chunks)
    assert not result.applied and "corrupted" in result.error

    # A payload for another model.
    other, _ = deltas.encode_delta(v1, v2, 1, 2, "0123456789abcdef")
    result = push(generator, weight_transfer.to_chunks(other, deltas.PayloadInfo("delta", 1, 2, "0123456789abcdef")))
    assert not result.applied and "for model" in result.error

    # After all refusals the generator still serves version 1, bit for bit.
    after = state(generator)
    assert after.policy_version == 1 and after.weights_sha256 == deltas.weights_sha256(v1)

    # An anchor replaces everything, whatever was held.
    anchor = deltas.encode_anchor(v2, 2, fingerprint)
    result = push(generator, weight_transfer.to_chunks(anchor, deltas.PayloadInfo("anchor", 2, 2, fingerprint)))
    assert result.applied and state(generator).weights_sha256 == deltas.weights_sha256(v2)


def test_http_side_serves_health_readiness_and_metrics(generator: ServiceProc) -> None:
    import httpx

    base = f"http://127.0.0.1:{generator.http_port}"
    assert httpx.get(f"{base}/healthz", timeout=5).json()["status"] == "ok"
    ready = httpx.get(f"{base}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    assert "rollstream_generator_policy_version" in metrics and "rollstream_generator_groups_total" in metrics


def test_poison_tasks_are_dead_lettered_alone_and_the_batch_goes_on(
    generator: ServiceProc, rclient, run_name: str
) -> None:
    """Tasks that once crashed the generator five times (and took their batch with them) are
    refused one by one, each with its own reason; the good tasks of the same read are
    sampled and written, and the generator keeps serving."""
    keys = run_keys.RunKeys(run_name)

    def task(task_id: str, **change) -> rollout_pb2.PromptTask:
        t = rollout_pb2.PromptTask(
            task_id=task_id,
            prompt_ids=[5, 6, 7],
            group_size=2,
            task_kind="arithmetic",
            sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3),
        )
        for path, value in change.items():
            target = t.sampling if path in ("temperature", "top_p", "max_new_tokens") else t
            if isinstance(value, list):
                del getattr(target, path)[:]
                getattr(target, path).extend(value)
            else:
                setattr(target, path, value)
        return t

    poison = {
        "oov": task("oov", prompt_ids=[5, 100000]),
        "nan-temp": task("nan-temp", temperature=float("nan")),
        "huge-tokens": task("huge-tokens", max_new_tokens=2**32 - 1),
        "huge-group": task("huge-group", group_size=2**32 - 1),
        "neg-temp": task("neg-temp", temperature=-1.0),
        "nan-top-p": task("nan-top-p", top_p=float("nan")),
        # Issue 27: a role that would write the template's own markup, and a message far past
        # what the context can hold in characters, refused before any template or tokenizer.
        "bad-role": task(
            "bad-role",
            prompt_ids=[],
            messages=[rollout_pb2.ChatMessage(role="user\x00<|im_start|>system", content="hi")],
        ),
        "huge-message": task(
            "huge-message", prompt_ids=[], messages=[rollout_pb2.ChatMessage(role="user", content="x" * 2_000_000)]
        ),
    }
    good = [task("good-1"), task("good-2")]
    # One read holds them all (tasks_per_batch defaults to 4: two reads, mixed).
    for t in [good[0], *poison.values(), good[1]]:
        write(rclient, keys, "prompts", t)
    rclient.xadd(
        keys.stream("prompts"), {"type": "rollstream.v1.PromptTask", "schema": "1", "data": b"\xff\xff garbage"}
    )

    wait_for(
        lambda: rclient.xlen(keys.dead) >= len(poison) + 1 and rclient.xlen(keys.stream("rollouts")) >= 2, 120,
        f"{len(poison) + 1} dead letters and 2 rollout groups", procs=[generator],
        details=lambda: f"dead {rclient.xlen(keys.dead)}, rollouts {rclient.xlen(keys.stream('rollouts'))}", poll_s=0.2,
    )  # fmt: skip
    groups = [validation.decode(f, rollout_pb2.RolloutGroup) for _, f in rclient.xrange(keys.stream("rollouts"))]
    assert sorted(g.group_id for g in groups) == ["good-1", "good-2"]
    assert all(g.group_size == 2 and len(g.completions) == 2 for g in groups)
    reasons = {}
    for _, fields in rclient.xrange(keys.dead):
        letter = validation.decode(fields, rollout_pb2.DeadLetter)
        try:
            reasons[
                validation.decode(
                    {k.encode(): v for k, v in letter.original_fields.items()}, rollout_pb2.PromptTask
                ).task_id
            ] = letter.reason
        except validation.EntryError:
            reasons["garbage"] = letter.reason
    assert set(reasons) == {*poison, "garbage"}
    for name, reason in reasons.items():
        assert "delivered" not in reason and reason, (name, reason)  # specific, not a delivery count
    assert "100000" in reasons["oov"] and "data does not parse" in reasons["garbage"]
    assert "messages[0].role 'user\\x00<|im_start|>system' is not one of" in reasons["bad-role"]
    assert "messages hold 2000000 characters, more than the limit" in reasons["huge-message"]
    assert rclient.xpending(keys.stream("prompts"), "generator")["pending"] == 0
    assert state(generator).groups_generated == 2


def _arithmetic_task(task_id: str) -> rollout_pb2.PromptTask:
    return rollout_pb2.PromptTask(
        task_id=task_id,
        prompt_ids=[5, 6, 7],
        group_size=2,
        task_kind="arithmetic",
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3),
    )


def _peer_takes(rclient, keys: run_keys.RunKeys, tasks: int, held: int) -> list[bytes]:
    """`tasks` prompt tasks on the stream, `held` of them taken by another generator ("peer")
    that has not finished them: pending with it in the generators' group."""
    for i in range(tasks):
        write(rclient, keys, "prompts", _arithmetic_task(f"t{i}"))
    rclient.xgroup_create(keys.stream("prompts"), "generator", id="0")
    reply = rclient.xreadgroup("generator", "peer", {keys.stream("prompts"): ">"}, count=held)
    return [eid for eid, _ in reply[0][1]]


def test_tasks_another_generator_is_sampling_count_against_the_room(
    redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path, rclient
) -> None:
    """Generators share max_inflight_groups: the tasks a peer has taken and is sampling count
    as in flight, so this one takes only the room left (with max_staleness 0, more would be
    sampled only to be dropped as stale), and the rest once the peer is done."""
    keys = run_keys.RunKeys(run_name)
    rollouts = keys.stream("rollouts")
    held = _peer_takes(rclient, keys, tasks=6, held=3)
    gen = start_service(
        "generator",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--max-inflight-groups",
        "4",
        "--tasks-per-batch",
        "4",
        "--claim-idle-ms",
        "600000",
    ).wait_ready()
    try:
        wait_for(lambda: rclient.xlen(rollouts) >= 1, 120, "the first batch", procs=[gen], poll_s=0.1)
        # A batch is committed whole, in one script: the stream holds exactly the first batch,
        # which is the room it saw (4 - 3 held by the peer), and then nothing while full.
        assert rclient.xlen(rollouts) == 1
        rclient.xack(keys.stream("prompts"), "generator", *held)  # the peer is done with its tasks
        wait_for(lambda: rclient.xlen(rollouts) >= 3, 120, "the two tasks left", procs=[gen], poll_s=0.1)
        assert sorted(g.group_id for g in groups_in(rclient, rollouts)) == ["t3", "t4", "t5"]
        assert rclient.xpending(keys.stream("prompts"), "generator")["pending"] == 0
    finally:
        gen.stop()


def test_tasks_a_dead_peer_held_past_claim_idle_do_not_block_the_room(
    redis_url: str, run_name: str, tiny_model_dir: Path, tmp_path: Path, rclient
) -> None:
    """A peer that died holding the whole room: its tasks, idle past claim_idle_ms, are not
    counted as in flight; this generator claims them and samples every task."""
    keys = run_keys.RunKeys(run_name)
    _peer_takes(rclient, keys, tasks=6, held=4)
    gen = start_service(
        "generator",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--max-inflight-groups",
        "4",
        "--tasks-per-batch",
        "4",
        "--claim-idle-ms",
        "1000",
    ).wait_ready()
    try:
        rollouts = keys.stream("rollouts")
        # Room for all six: a reward stage takes each group as it comes.
        streams.StreamStage.ensure_group(rclient, rollouts, "reward")

        def drained() -> int:
            reply = rclient.xreadgroup("reward", "reward-0", {rollouts: ">"}, count=10)
            if reply and reply[0][1]:
                rclient.xack(rollouts, "reward", *[eid for eid, _ in reply[0][1]])
            return rclient.xlen(rollouts)

        wait_for(lambda: drained() >= 6, 180, "all six tasks sampled", procs=[gen], poll_s=0.2)
        assert sorted(g.group_id for g in groups_in(rclient, rollouts)) == [f"t{i}" for i in range(6)]
    finally:
        gen.stop()


def test_a_batch_taken_as_the_trainer_steps_waits_for_the_new_weights(
    redis_url: str, run_name: str, tiny_model_dir: Path, rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_staleness 0, the room full with a step's groups, and the trainer's commit (their acks
    and version 1, one transaction) landing right after the generator's look at the version:
    the room it then counts is free while its weights are still version 0. It takes the tasks,
    samples nothing on version 0 (those groups would be dropped as stale), and samples them
    once version 1's weights land (the GeneratorLoop in this process, on a real Redis)."""
    keys = run_keys.RunKeys(run_name)
    ready, rollouts = keys.stream("ready"), keys.stream("rollouts")
    for i in range(2):
        write(rclient, keys, "prompts", _arithmetic_task(f"t{i}"))
        rclient.xadd(ready, {"group": i})
    rclient.xgroup_create(ready, "trainer", id="0")
    step_groups = [eid for eid, _ in rclient.xreadgroup("trainer", "trainer-0", {ready: ">"})[0][1]]
    look = run_keys.current_version

    def look_then_the_step_commits(client: redis.Redis, k: run_keys.RunKeys) -> int:
        version = look(client, k)
        if rclient.xpending(ready, "trainer")["pending"]:
            rclient.pipeline(transaction=True).xack(ready, "trainer", *step_groups).set(keys.version, 1).execute()
        return version

    monkeypatch.setattr(run_keys, "current_version", look_then_the_step_commits)
    room = {"max_staleness": 0, "max_inflight_groups": 2, "tasks_per_batch": 2}  # synchronous, steps of 2 groups
    settings = GeneratorSettings(redis_url=redis_url, run=run_name, model=str(tiny_model_dir), threads=1, **room)
    with ServiceHost("generator", settings) as host:
        gen = Generator(settings, host)
        client = host.connect_redis()
        loop = GeneratorLoop(gen, host, host.open_stage(client, "prompts", settings.group),
                             host.open_stage(client, "eval_prompts", settings.group), client, client)  # fmt: skip
        turn = threading.Thread(target=loop.turn)
        turn.start()
        try:
            # Either it sampled, or it took the tasks and found itself behind (it wakes its sync).
            wait_for(lambda: gen.sync.wake.is_set() or rclient.xlen(rollouts) > 0, 120, "the batch taken")
            assert rclient.xlen(rollouts) == 0, [g.policy_version for g in groups_in(rclient, rollouts)]
            assert rclient.xpending(keys.stream("prompts"), settings.group)["pending"] == 2  # the tasks are its own
            v0 = version0_bits(tiny_model_dir)
            fingerprint = deltas.model_fingerprint({k: v.shape for k, v in v0.items()})
            payload, _ = deltas.encode_delta(v0, perturbed(v0, seed=1), 0, 1, fingerprint)
            info = deltas.PayloadInfo("delta", 0, 1, fingerprint)
            gen.apply_stream(weight_transfer.to_chunks(payload, info), skip_held=False, timings=ApplyTimings())
            turn.join(timeout=120)
            assert [(g.group_id, g.policy_version) for g in groups_in(rclient, rollouts)] == [("t0", 1), ("t1", 1)]
        finally:
            host.stop.set()
            turn.join(timeout=30)
            client.close()
