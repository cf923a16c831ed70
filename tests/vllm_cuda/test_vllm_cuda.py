"""VllmBackend's CUDA weight path on a GPU: the engine's weights equal the trainer's bf16
bits, bit for bit, after every delta; greedy outputs equal transformers' on the same bits;
versions are what the engine (or, without per-token versions, the service) records; the
prefix cache does not serve KV of the old weights after an update.

On a GPU nothing is prepacked, so every parameter is read back from the engine
(VllmBackend.engine_bits) and compared with the bits the trainer published. Which engine
path runs depends on the installed vLLM: "patch" (sparse in-place patches, vLLM with
checkpoint weight patches) or "inplace" (rollstream's writer of the changed positions into
vLLM's fused parameters, vLLM 0.26); each test prints it. The in-place tests below run the
"inplace" mode on either vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tier_helpers import adamw_like_step, assert_engine_holds

from rollstream.core import deltas, modeling
from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.generator.generator import HostWeights

pytestmark = pytest.mark.vllm_cuda

# bf16 engines on both sides (vLLM's kernels vs transformers' SDPA): log-probs agree to
# bf16 rounding of the logits, not to fp32's.
ATOL = 0.05


@pytest.fixture(scope="module")
def engine(qwen_dir: Path) -> Iterator[object]:
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    b = VllmBackend(
        str(qwen_dir),
        GeneratorSettings(
            backend="vllm",
            device="cuda",
            dtype="bfloat16",
            enforce_eager=True,
            gpu_memory_utilization=0.25,
            max_model_len=1024,
        ),
    )
    b.load_weights(b.host_bits(), version=0)
    print(f"vLLM transfer mode: {b.transfer_mode}; engine weight versions: {b.engine_versions}")
    yield b


@pytest.fixture(scope="module")
def reference(qwen_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(qwen_dir), dtype="bfloat16", device="cuda")


def greedy(prompt: list[int], tokens: int = 16) -> list[SampleRequest]:
    return [SampleRequest(prompt_ids=prompt, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=tokens, seed=1)]


def apply_delta(backend, host: HostWeights, new: dict[str, np.ndarray]) -> None:
    """As the generator does: encode (trainer), decode against the host copy, load, commit."""
    version = (host.version or 0) + 1
    payload, _ = deltas.encode_delta(host.bits, new, host.version or 0, version, host.fingerprint)
    info, touched = host.decode(payload)
    backend.load_weights(touched, version=info.version)
    host.commit(info, touched)


def reference_logprobs(
    reference: TransformersBackend, bits: dict[str, np.ndarray], prompt: list[int], tokens: list[int]
) -> np.ndarray:
    reference.load_weights(bits)
    batch = modeling.make_batch([(prompt, tokens)], pad_id=reference.pad_id, device="cuda")
    with torch.no_grad():
        logps, _ = modeling.completion_logprobs(reference.model, batch, temperature=1.0)
    return logps.float().cpu().numpy()


def check_greedy(backend, reference: TransformersBackend, bits: dict[str, np.ndarray], prompt: list[int]):
    sample = backend.sample(greedy(prompt))[0][0]
    reference.load_weights(bits)
    expected = reference.sample(greedy(prompt, len(sample.token_ids)))[0][0]
    assert sample.token_ids == expected.token_ids
    # Greedy requests report log_softmax(logits) (T = 1) in vLLM.
    np.testing.assert_allclose(
        sample.logprobs, reference_logprobs(reference, bits, prompt, sample.token_ids), atol=ATOL, rtol=0
    )
    return sample


def test_version0_is_the_checkpoint_bit_for_bit(engine, qwen_dir: Path) -> None:
    model, _ = modeling.load_model(qwen_dir)
    v0 = modeling.model_bits(model)
    assert deltas.weights_sha256(engine.host_bits()) == deltas.weights_sha256(v0)
    assert_engine_holds(engine, v0)


def test_deltas_apply_bit_exact_over_several_steps(engine) -> None:
    host = HostWeights(engine.host_bits(), version=0)
    names = sorted(host.bits)
    steps = [
        adamw_like_step(host.bits, lr=1e-3, seed=1),  # Adam's first step: every tensor moves
        None,  # a later step at an RL learning rate: a few ULPs, a small share of the values
        None,  # one tensor only (a sparse delta)
    ]
    for i, new in enumerate(steps):
        if i == 1:
            new = adamw_like_step(host.bits, lr=2e-5, seed=2)
        elif i == 2:
            new = {**host.bits, **adamw_like_step({names[3]: host.bits[names[3]]}, lr=1e-3, seed=3)}
        apply_delta(engine, host, new)
        assert_engine_holds(engine, new)


def test_one_shard_of_a_fused_module_changes_alone(engine) -> None:
    """Only k_proj of one layer: q and v (same fused qkv_proj) must stay as they were."""
    base = engine.host_bits()
    name = "model.layers.1.self_attn.k_proj.weight"
    changed = adamw_like_step({name: base[name]}, lr=1e-3, seed=4)
    engine.load_weights(changed, version=100)
    assert_engine_holds(engine, {**base, **changed})


def test_greedy_outputs_match_transformers_on_the_same_bits(engine, reference: TransformersBackend) -> None:
    bits = engine.host_bits()
    for question in ("What is 4 + 5?", "Tell me a story about a lighthouse keeper and a storm."):
        check_greedy(engine, reference, bits, engine.encode_chat([("user", question)]))


def test_versions_are_recorded(engine) -> None:
    engine.load_weights(engine.host_bits(), version=7)
    sample = engine.sample(greedy(engine.encode_chat([("user", "What is 1 + 1?")])))[0][0]
    if engine.engine_versions:
        assert sample.versions == [(7, 0, len(sample.token_ids))]  # the engine's own spans
    else:
        assert sample.versions == []  # the service records the version it held (in_flight = finish)


def test_the_prefix_cache_serves_no_kv_of_the_old_weights(engine, reference: TransformersBackend) -> None:
    # A long shared prompt: several full KV blocks land in the prefix cache.
    prompt = engine.encode_chat([("user", "Tell me a story about a lighthouse keeper and a storm. " * 6)])
    old = check_greedy(engine, reference, engine.host_bits(), prompt)
    new_bits = adamw_like_step(engine.host_bits(), lr=3e-3, seed=5)
    engine.load_weights(new_bits, version=8)
    new = check_greedy(engine, reference, new_bits, prompt)  # computed with the new weights throughout
    assert new.logprobs != old.logprobs


def test_interleave_without_engine_versions_is_refused(engine, qwen_dir: Path) -> None:
    if engine.engine_versions:
        pytest.skip("this vLLM records per-token versions: interleave is supported")
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    with pytest.raises(RuntimeError, match="interleave"):
        VllmBackend(
            str(qwen_dir), GeneratorSettings(backend="vllm", device="cuda", dtype="bfloat16", in_flight="interleave")
        )


def test_the_mode_is_the_installed_vllms(engine) -> None:
    from rollstream.generator import vllm_transfer

    assert engine.transfer_mode == ("patch" if vllm_transfer.has_checkpoint_patches() else "inplace")


@pytest.fixture
def inplace(engine) -> Iterator[object]:
    """The engine in "inplace" mode (its own on 0.26), back in its own mode afterwards."""
    mode = engine.transfer_mode
    engine.use_transfer_mode("inplace")
    engine.load_weights(engine.host_bits(), version=200)  # the first update sends every value
    yield engine
    engine.use_transfer_mode(mode)
    engine.load_weights(engine.host_bits(), version=201)


def test_inplace_deltas_are_bit_exact_and_move_the_changes_only(inplace, reference: TransformersBackend) -> None:
    host = HostWeights(inplace.host_bits(), version=0)
    k_proj, q_bias, gate, head = (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "lm_head.weight",
    )
    steps = [
        lambda bits: adamw_like_step(bits, lr=1e-3, seed=11),  # every tensor moves
        lambda bits: adamw_like_step(bits, lr=2e-5, seed=12),  # a few ULPs, a share of the values
        lambda bits: {**bits, **adamw_like_step({k_proj: bits[k_proj]}, lr=1e-3, seed=13)},  # a lone fused shard
        lambda bits: {
            **bits,
            **adamw_like_step({q_bias: bits[q_bias], gate: bits[gate]}, lr=1e-3, seed=14),
        },  # a bias shard, gate of gate/up
        lambda bits: {
            **bits,
            **adamw_like_step({head: bits[head]}, lr=1e-3, seed=15),
        },  # the untied lm_head alone (a VocabParallelEmbedding)
    ]
    prompt = inplace.encode_chat([("user", "What is 4 + 5?")])
    for step in steps:
        new = step(host.bits)
        old = dict(host.bits)
        version = (host.version or 0) + 1
        payload, stats = deltas.encode_delta(host.bits, new, host.version or 0, version, host.fingerprint)
        info, touched = host.decode(payload)
        inplace.load_weights(touched, version=info.version)
        host.commit(info, touched)
        update = inplace.last_update
        changed = sum(int(np.count_nonzero(touched[n] != old[n])) for n in touched)
        print(
            f"inplace update {version}: {changed} values changed, delta {stats.nbytes} B, payload {update['payload_bytes']} B in {update['seconds']} s"
        )
        assert update["mode"] == "inplace" and 2 * changed <= update["payload_bytes"] <= 2 * sum(
            touched[n].size for n in touched
        )
        assert_engine_holds(inplace, new)
        check_greedy(inplace, reference, new, prompt)


def test_inplace_refuses_what_does_not_map_and_writes_nothing(inplace) -> None:
    from rollstream.generator import vllm_transfer

    before = inplace.host_bits()
    name = "model.layers.0.mlp.up_proj.weight"
    changed = adamw_like_step({name: before[name]}, lr=2e-5, seed=16)[name]
    good = vllm_transfer.inplace_patch(name, changed, before[name])
    assert good is not None and good["positions"] == "steps"
    bad = [
        ({**good, "name": "model.layers.0.mlp.up_projection.weight"}, "maps to no parameter"),
        (vllm_transfer.inplace_patch(name, changed.T.copy(), None), "rows"),
        ({**good, "steps": good["steps"][:-1]}, "steps for"),
    ]
    with inplace._engine_lock:
        for patch, message in bad:
            with pytest.raises(ValueError, match=message):
                inplace._update([[good], [patch]], dense=False)
    assert_engine_holds(inplace, before)
