"""Exact weight sync: rollstream.core.deltas, safetensors_io, weight_transfer, and the
trainer's WeightPublisher (its encode/catch-up half; pushes need a network and live elsewhere).

Weights are uint16 bf16 bit patterns; "exact" means bit for bit, checked with array_equal
on the bits, never with a float tolerance.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import load as load_safetensors  # safetensors, not pickle

from rollstream.core import deltas, safetensors_io, weight_transfer
from rollstream.core.deltas import DeltaError
from rollstream.trainer.publisher import PayloadFile, WeightPublisher
from rollstream.v1 import weights_pb2

SHAPES = {
    "model.embed_tokens.weight": (384, 64),
    "model.layers.0.input_layernorm.weight": (64,),  # 1-D
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.norm.weight": (64,),
    "lm_head.weight": (1024, 512),  # large 2-D (512k values)
    "scalar_like": (1,),
    "wrap.weight": (4096,),  # 1-D, changes that wrap around uint16
}


def _finite(bits: np.ndarray) -> np.ndarray:
    """bits with every NaN/inf pattern (exponent all ones) made finite, in place: decode
    refuses non-finite weights, so the codec is tested on what a sane trainer sends."""
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF
    return bits


def _random_bits(rng: np.random.Generator, shapes=SHAPES) -> dict[str, np.ndarray]:
    return {name: _finite(rng.integers(0, 2**16, size=shape, dtype=np.uint16)) for name, shape in shapes.items()}


def _copy(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in w.items()}


def _snapshot(w: dict[str, np.ndarray]) -> str:
    return deltas.weights_sha256(w)


def _apply(held: dict[str, np.ndarray], replaced: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(held)
    out.update(replaced)
    return out


def _assert_bits_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == np.uint16 and b[name].dtype == np.uint16, name
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), f"{name}: {int((a[name] != b[name]).sum())} values differ"


def _bump(flat: np.ndarray, positions: np.ndarray, steps: np.ndarray) -> None:
    """flat[positions] += steps, as uint16 arithmetic (wraps), kept finite."""
    flat[positions] = _finite((flat[positions].astype(np.int64) + steps).astype(np.uint16))


@pytest.fixture
def scenario() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]:
    return make_scenario()


def make_scenario() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]:
    """base, new and fingerprint, with sparse few-ULP, dense random, unchanged and wrapping changes."""
    rng = np.random.default_rng(1234)
    base = _random_bits(rng)
    new = _copy(base)
    # (a) a few ULPs at sparse positions: should pick idx positions + ulp values.
    flat = new["lm_head.weight"].reshape(-1)
    pos = rng.choice(flat.size, size=200, replace=False)
    _bump(flat, pos, rng.choice([-2, -1, 1, 2], size=pos.size))
    # Small-ULP changes at ~40% of positions: mask positions beat gaps; steps beat values.
    flat = new["model.layers.0.mlp.down_proj.weight"].reshape(-1)
    pos = np.flatnonzero(rng.random(flat.size) < 0.4)
    _bump(flat, pos, rng.choice([-1, 1], size=pos.size))
    # (b) dense random changes: every value replaced by random bits.
    new["model.layers.0.self_attn.q_proj.weight"] = _finite(
        rng.integers(0, 2**16, size=SHAPES["model.layers.0.self_attn.q_proj.weight"], dtype=np.uint16)
    )
    # (c) "model.norm.weight" and "scalar_like" stay unchanged.
    # (d) uint16 wrap-around of the steps with finite values (the 0xFFFF/0x0000 edge is NaN
    # in bf16): sign flips at -max, +0, +max, -tiny, steps of 0x8000, two of them wrapping.
    ln = new["model.layers.0.input_layernorm.weight"]
    base["model.layers.0.input_layernorm.weight"][:4] = [0xFF7F, 0x0000, 0x7F7F, 0x8001]
    ln[:4] = [0x7F7F, 0x8000, 0xFF7F, 0x0001]
    ln[10] = base["model.layers.0.input_layernorm.weight"][10] ^ 0x8000  # sign flip
    emb_base = base["model.embed_tokens.weight"].reshape(-1)
    emb_new = new["model.embed_tokens.weight"].reshape(-1)
    emb_base[[0, 5, 999]] = [0xFF7F, 0x0000, 0x7F7F]
    emb_new[:] = emb_base
    emb_new[[0, 5, 999]] = [0x0000, 0xFF7F, 0x8000]
    # Wrapping ULP steps among many +-1 steps at random values: steps ({1, 0xFFFF}) compress,
    # values do not, so this tensor goes through the ULP encoding and its wrap-around.
    wb = base["wrap.weight"]
    wb[:8] = [0x0001, 0x8001, 0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
    wn = new["wrap.weight"]
    wn[:] = wb
    wn[:8] = [0x0000, 0x8000, 0x0001, 0x8001, 0x7F7E, 0xFF7E, 0x3F81, 0xBF7F]  # -1 steps wrap in uint16
    rest = 8 + rng.choice(wb.size - 8, size=1500, replace=False)
    _bump(wn, rest, rng.choice([-1, 1], size=rest.size))
    fp = deltas.model_fingerprint({k: v.shape for k, v in base.items()})
    return base, new, fp


# --- encode / decode ------------------------------------------------------------------------


def test_delta_round_trip_is_bit_exact(scenario) -> None:
    base, new, fp = scenario
    base_before = _snapshot(base)
    payload, stats = deltas.encode_delta(base, new, base_version=4, version=5, fingerprint=fp)
    info, replaced = deltas.decode(payload, base, held_version=4, fingerprint=fp)
    assert (info.kind, info.base_version, info.version, info.fingerprint) == ("delta", 4, 5, fp)
    assert _snapshot(base) == base_before  # decode never modifies what is held
    _assert_bits_equal(_apply(base, replaced), new)

    changed = {n for n in base if not np.array_equal(base[n], new[n])}
    assert set(replaced) == changed
    assert {"model.norm.weight", "scalar_like"}.isdisjoint(replaced)
    # Unchanged tensors are not in the payload at all.
    meta, arrays = safetensors_io.loads(payload)
    table = json.loads(meta["tensors"])
    assert set(table) == changed
    assert {k.split("::")[0] for k in arrays} == changed

    assert stats.changed_tensors == len(changed)
    assert stats.changed_values == sum(int((base[n] != new[n]).sum()) for n in base)
    assert stats.total_values == sum(v.size for v in base.values())
    assert stats.dense_bytes == 2 * stats.total_values
    assert stats.nbytes == len(payload)
    assert 0 < stats.fraction_of_dense < 1
    assert sum(stats.encodings.values()) == len(changed)


def test_every_position_and_value_encoding_is_exercised_and_exact(scenario) -> None:
    base, new, fp = scenario
    payload, stats = deltas.encode_delta(base, new, 0, 1, fp)
    used_pos = {k.split("+")[0] for k in stats.encodings}
    used_val = {k.split("+")[1] for k in stats.encodings}
    assert used_pos == {"mask", "idx"}, stats.encodings
    assert used_val == {"bf16", "ulp"}, stats.encodings
    # Per tensor, the choices are the ones the data calls for.
    table = json.loads(safetensors_io.loads(payload)[0]["tensors"])
    assert (table["lm_head.weight"]["pos"], table["lm_head.weight"]["val"]) == ("idx", "ulp")
    assert table["model.layers.0.mlp.down_proj.weight"]["pos"] == "mask"
    assert table["model.layers.0.mlp.down_proj.weight"]["val"] == "ulp"
    assert table["model.layers.0.self_attn.q_proj.weight"]["val"] == "bf16"
    assert table["wrap.weight"]["val"] == "ulp"  # the wrap-around goes through ULP steps
    _, replaced = deltas.decode(payload, base, 0, fp)
    _assert_bits_equal(_apply(base, replaced), new)


@pytest.mark.parametrize("density", [1e-5, 1e-3, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("max_ulp", [1, 3, 40_000])
def test_round_trip_across_densities(density: float, max_ulp: int) -> None:
    rng = np.random.default_rng(int(density * 1e6) + max_ulp)
    shapes = {"a": (257, 129), "b": (1000,), "c": (3, 5, 7)}
    base = _random_bits(rng, shapes)
    new = _copy(base)
    for name in ("a", "b"):
        flat = new[name].reshape(-1)
        pos = np.flatnonzero(rng.random(flat.size) < density)
        if pos.size == 0:
            pos = np.array([flat.size - 1])  # the last position: edge of the mask/idx range
        steps = rng.integers(1, max_ulp + 1, size=pos.size) * rng.choice([-1, 1], size=pos.size)
        _bump(flat, pos, steps)
    fp = deltas.model_fingerprint({k: v.shape for k, v in base.items()})
    payload, stats = deltas.encode_delta(base, new, 7, 8, fp)
    _, replaced = deltas.decode(payload, base, 7, fp)
    assert set(replaced) == {"a", "b"}
    _assert_bits_equal(_apply(base, replaced), new)


def test_identical_weights_give_an_empty_delta(scenario) -> None:
    base, _, fp = scenario
    payload, stats = deltas.encode_delta(base, _copy(base), 2, 3, fp)
    assert stats.changed_tensors == 0 and stats.encodings == {}
    info, replaced = deltas.decode(payload, base, 2, fp)
    assert info.version == 3 and replaced == {}


def test_encode_refuses_mismatched_names_and_shapes(scenario) -> None:
    base, new, fp = scenario
    extra = dict(new, extra=np.zeros(3, np.uint16))
    with pytest.raises(DeltaError, match="names differ"):
        deltas.encode_delta(base, extra, 0, 1, fp)
    reshaped = dict(new, **{"model.norm.weight": np.zeros((8, 8), np.uint16)})
    with pytest.raises(DeltaError, match="model.norm.weight: shape"):
        deltas.encode_delta(base, reshaped, 0, 1, fp)


# --- anchors --------------------------------------------------------------------------------


def test_anchor_loads_as_bf16_with_safetensors_torch(scenario) -> None:
    base, _, fp = scenario
    payload = deltas.encode_anchor(base, version=9, fingerprint=fp)
    loaded = load_safetensors(payload)
    assert loaded.keys() == base.keys()
    for name, bits in base.items():
        t = loaded[name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == bits.shape
        expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        # Compare bits, not values: NaN payloads and -0.0 must survive as well.
        assert torch.equal(t.view(torch.int16), expected.view(torch.int16)), name
    # And the metadata any safetensors reader sees.
    meta, _ = safetensors_io.loads(payload)
    assert meta["format"] == deltas.FORMAT and meta["kind"] == "anchor" and meta["version"] == "9"


def test_anchor_decodes_for_a_receiver_holding_nothing(scenario) -> None:
    base, new, fp = scenario
    payload = deltas.encode_anchor(new, version=9, fingerprint=fp)
    held = _copy(base)
    info, replaced = deltas.decode(payload, held, held_version=None, fingerprint=fp)
    assert (info.kind, info.version) == ("anchor", 9)
    _assert_bits_equal(replaced, new)
    # The returned arrays are writable copies, not views into the payload.
    assert all(a.flags.writeable for a in replaced.values())


def test_safetensors_io_round_trips_other_dtypes() -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "i64": np.arange(5, dtype=np.int64),
        "u8": np.frombuffer(b"hello", np.uint8),
        "bf": np.array([0x3F80, 0xBF80], np.uint16),
    }
    buf = safetensors_io.dumps(tensors, {"k": "v"}, bf16={"bf"})
    meta, back = safetensors_io.loads(buf)
    assert meta == {"k": "v"}
    for name, array in tensors.items():
        assert back[name].shape == array.shape and np.array_equal(back[name], array)
    # Same file read by the reference implementation.
    ref = load_safetensors(buf)
    assert ref["bf"].dtype == torch.bfloat16 and ref["bf"].tolist() == [1.0, -1.0]
    assert torch.equal(ref["f32"], torch.from_numpy(tensors["f32"]))


def test_empty_tensor_round_trips() -> None:
    """Zero-size tensors are valid safetensors; dumps must write them, not crash."""
    buf = safetensors_io.dumps({"empty": np.zeros((0, 4), np.float32), "x": np.ones(2, np.float32)})
    _, back = safetensors_io.loads(buf)
    assert back["empty"].shape == (0, 4) and back["x"].tolist() == [1.0, 1.0]
    assert load_safetensors(buf)["empty"].shape == torch.Size([0, 4])


def test_zero_dim_tensor_keeps_its_shape() -> None:
    """A 0-d tensor (a scalar parameter) must come back 0-d, from our reader and from
    safetensors.torch. np.ascontiguousarray in safetensors_io.dumps promotes it to 1-d."""
    buf = safetensors_io.dumps({"s": np.array(2.5, np.float64), "b": np.array(0x3F80, np.uint16)}, bf16={"b"})
    _, back = safetensors_io.loads(buf)
    assert back["s"].shape == () and float(back["s"]) == 2.5
    assert load_safetensors(buf)["b"].shape == torch.Size([])
    # And so an anchor of a model with a scalar parameter is accepted by the same model.
    held = {"s": np.array(0x3F80, np.uint16), "w": np.arange(6, dtype=np.uint16).reshape(2, 3)}
    fp = deltas.model_fingerprint({k: v.shape for k, v in held.items()})
    _, got = deltas.decode(deltas.encode_anchor(held, 1, fp), held, None, fp)
    _assert_bits_equal(got, held)


# --- refusals -------------------------------------------------------------------------------


def _refused(payload: bytes, held: dict[str, np.ndarray], held_version, fp: str, match: str) -> None:
    before = _snapshot(held)
    with pytest.raises(DeltaError, match=match):
        deltas.decode(payload, held, held_version, fp)
    assert _snapshot(held) == before


def test_refuses_base_version_mismatch(scenario) -> None:
    base, new, fp = scenario
    payload, _ = deltas.encode_delta(base, new, 4, 5, fp)
    _refused(payload, base, 3, fp, "delta base is version 4, this holds version 3")
    _refused(payload, base, 5, fp, "delta base is version 4")
    _refused(payload, base, None, fp, "delta base is version 4, this holds version None")


def test_refuses_wrong_fingerprint(scenario) -> None:
    base, new, fp = scenario
    payload, _ = deltas.encode_delta(base, new, 4, 5, fp)
    other = deltas.model_fingerprint({"x": (1,)})
    assert other != fp
    _refused(payload, base, 4, other, "payload is for model")
    anchor = deltas.encode_anchor(new, 5, fp)
    _refused(anchor, base, None, other, "payload is for model")


def test_fingerprint_depends_on_names_and_shapes_not_order() -> None:
    a = deltas.model_fingerprint({"x": (2, 3), "y": (4,)})
    assert a == deltas.model_fingerprint({"y": (4,), "x": (2, 3)})
    assert a != deltas.model_fingerprint({"x": (3, 2), "y": (4,)})
    assert a != deltas.model_fingerprint({"x": (2, 3), "z": (4,)})


@pytest.mark.parametrize("keep", [0, 5, 8, 100, -1])
def test_refuses_truncated_payload(scenario, keep: int) -> None:
    base, new, fp = scenario
    payload, _ = deltas.encode_delta(base, new, 4, 5, fp)
    truncated = payload[:keep] if keep >= 0 else payload[:-1]
    _refused(truncated, base, 4, fp, "not a valid safetensors payload")


def _part_span(payload: bytes, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor `name` inside a safetensors payload."""
    (head_len,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + head_len])
    start, end = header[name]["data_offsets"]
    return 8 + head_len + start, 8 + head_len + end


def _zstd_parts(payload: bytes) -> list[str]:
    table = json.loads(safetensors_io.loads(payload)[0]["tensors"])
    return [f"{n}::pos" for n, t in table.items() if t["pos_zstd"]] + [
        f"{n}::val" for n, t in table.items() if t["val_zstd"]
    ]


def test_refuses_flipped_bytes_in_a_zstd_frame_header(scenario) -> None:
    base, new, fp = scenario
    payload, _ = deltas.encode_delta(base, new, 4, 5, fp)
    parts = _zstd_parts(payload)
    assert len(parts) >= 2, "the scenario must produce zstd parts"
    for part in parts:
        start, _ = _part_span(payload, part)
        for offset in range(start, start + 4):  # the zstd magic number
            corrupt = bytearray(payload)
            corrupt[offset] ^= 0xFF
            _refused(bytes(corrupt), base, 4, fp, f"{part.split('::')[0]}: corrupt delta")


def test_refuses_flipped_bytes_anywhere_inside_a_zstd_part(scenario) -> None:
    """A byte flipped anywhere in a compressed part must be refused, not decoded into
    wrong weights. zstd frames only carry a content checksum when the compressor writes
    one (python-zstandard: write_checksum=False by default), so a flip inside a literals
    section decompresses "fine" to different bytes. Fails until deltas adds a checksum."""
    base, new, fp = scenario
    payload, _ = deltas.encode_delta(base, new, 4, 5, fp)
    accepted: list[str] = []
    for part in _zstd_parts(payload):
        start, end = _part_span(payload, part)
        for offset in range(start, end, max(1, (end - start) // 64)):
            corrupt = bytearray(payload)
            corrupt[offset] ^= 0xFF
            before = _snapshot(base)
            try:
                _, replaced = deltas.decode(bytes(corrupt), base, 4, fp)
            except DeltaError:
                continue
            finally:
                assert _snapshot(base) == before  # held weights untouched either way
            wrong = [n for n in new if not np.array_equal(_apply(base, replaced)[n], new[n])]
            accepted.append(f"{part}+{offset - start} (wrong tensors: {wrong})")
    assert accepted == [], f"{len(accepted)} corrupted payloads were accepted, e.g. {accepted[:3]}"


def test_refuses_delta_that_does_not_go_forward(scenario) -> None:
    base, new, fp = scenario
    same, _ = deltas.encode_delta(base, new, 4, 4, fp)
    _refused(same, base, 4, fp, "goes backwards: 4 -> 4")
    back, _ = deltas.encode_delta(base, new, 4, 2, fp)
    _refused(back, base, 4, fp, "goes backwards: 4 -> 2")


def test_refuses_anchor_for_a_different_tensor_set(scenario) -> None:
    base, _, fp = scenario
    smaller = {k: v for k, v in base.items() if k != "scalar_like"}
    anchor = deltas.encode_anchor(smaller, 3, fp)  # right fingerprint, wrong contents
    _refused(anchor, base, None, fp, "anchor tensors differ")


def test_refuses_foreign_safetensors(scenario) -> None:
    base, _, fp = scenario
    plain = safetensors_io.dumps({"x": np.zeros(3, np.float32)}, {"format": "pt"})
    _refused(plain, base, 0, fp, "not a rollstream.weights")
    _refused(b"\x00" * 64, base, 0, fp, "not a valid safetensors payload")


# --- chunked transfer -----------------------------------------------------------------------


def _payloads(scenario) -> list[tuple[bytes, deltas.PayloadInfo]]:
    base, new, fp = scenario
    anchor = deltas.encode_anchor(base, 4, fp)
    delta, _ = deltas.encode_delta(base, new, 4, 5, fp)
    empty, _ = deltas.encode_delta(new, new, 5, 6, fp)
    return [
        (anchor, deltas.PayloadInfo("anchor", 4, 4, fp)),
        (delta, deltas.PayloadInfo("delta", 4, 5, fp)),
        (empty, deltas.PayloadInfo("delta", 5, 6, fp)),
    ]


def test_chunks_round_trip_several_payloads_in_one_stream(scenario) -> None:
    items = _payloads(scenario)
    chunk_bytes = 4099  # odd size: chunk boundaries land anywhere
    chunks = [c for payload, info in items for c in weight_transfer.to_chunks(payload, info, chunk_bytes=chunk_bytes)]
    # Serialise each chunk as it would cross the wire.
    wire = [weights_pb2.WeightChunk.FromString(c.SerializeToString()) for c in chunks]
    assert len(wire) == sum(-(-len(p) // chunk_bytes) for p, _ in items)
    assert sum(c.HasField("header") for c in wire) == len(items)
    assert all(len(c.data) <= chunk_bytes for c in wire)
    out = list(weight_transfer.from_chunks(wire))
    assert len(out) == len(items)
    for (header, payload), (sent, info) in zip(out, items, strict=True):
        assert payload == sent
        assert (header.kind, header.base_version, header.version, header.model_fingerprint) == (
            info.kind,
            info.base_version,
            info.version,
            info.fingerprint,
        )
        assert header.total_bytes == len(sent) and header.sha256 == hashlib.sha256(sent).hexdigest()
    # And what came out decodes to the new weights.
    base, new, fp = scenario
    _, anchor_bits = deltas.decode(out[0][1], base, None, fp)
    _, replaced = deltas.decode(out[1][1], anchor_bits, 4, fp)
    _assert_bits_equal(_apply(anchor_bits, replaced), new)


def test_chunk_stream_refuses_corrupted_chunk(scenario) -> None:
    items = _payloads(scenario)
    chunks = [c for payload, info in items for c in weight_transfer.to_chunks(payload, info, chunk_bytes=4096)]
    victim = 3  # inside the anchor, not its header chunk
    assert not chunks[victim].HasField("header")
    data = bytearray(chunks[victim].data)
    data[17] ^= 0x01
    chunks[victim] = weights_pb2.WeightChunk(data=bytes(data))
    with pytest.raises(DeltaError, match="corrupted"):
        list(weight_transfer.from_chunks(chunks))


def test_chunk_stream_refuses_truncated_stream(scenario) -> None:
    items = _payloads(scenario)
    first = list(weight_transfer.to_chunks(items[0][0], items[0][1], chunk_bytes=4096))
    second = list(weight_transfer.to_chunks(items[1][0], items[1][1], chunk_bytes=4096))
    assert len(second) > 2
    stream = iter(first + second[:-1])  # the connection drops before the last chunk
    out = weight_transfer.from_chunks(stream)
    header, payload = next(out)  # the complete first payload is delivered
    assert payload == items[0][0]
    with pytest.raises(DeltaError, match="bytes, header says"):
        next(out)
    # A payload missing a middle chunk, followed by the next header, is refused too.
    holed = first[:2] + first[3:] + second
    with pytest.raises(DeltaError, match=f"version {items[0][1].version} has"):
        list(weight_transfer.from_chunks(holed))


def test_chunk_stream_must_start_with_a_header(scenario) -> None:
    payload, info = _payloads(scenario)[0]
    chunks = list(weight_transfer.to_chunks(payload, info, chunk_bytes=4096))
    with pytest.raises(DeltaError, match="does not start with a header"):
        list(weight_transfer.from_chunks(chunks[1:]))


# --- the trainer's publisher ----------------------------------------------------------------


def _evolve(rng: np.random.Generator, bits: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    new = _copy(bits)
    for i, name in enumerate(sorted(new)):
        if (i + step) % 3 == 0:
            continue  # some tensors unchanged at each version
        flat = new[name].reshape(-1)
        pos = np.flatnonzero(rng.random(flat.size) < 0.02)
        _bump(flat, pos, rng.choice([-3, -1, 1, 2], size=pos.size))
    return new


@pytest.mark.parametrize("anchor_in", ["memory", "file"])
def test_publisher_catch_up_reproduces_current_bits_from_any_version(anchor_in: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    shapes = {"emb": (97, 33), "ln": (33,), "head": (200, 33), "one": (1,)}
    history = [_random_bits(rng, shapes)]
    pub = WeightPublisher(
        history[0], anchor_interval=3, anchor_dir=tmp_path / "anchor" if anchor_in == "file" else None
    )
    assert pub.version == 0
    for step in range(8):
        history.append(_evolve(rng, history[-1], step))
        published, stats = pub.publish(history[-1])
        assert (published.info.kind, published.info.base_version, published.info.version) == ("delta", step, step + 1)
        assert stats.changed_tensors > 0
    current = pub.version
    assert current == 8
    _assert_bits_equal(pub.bits(), history[-1])

    for have in range(-1, current + 1):
        held = _copy(history[have]) if have >= 0 else {k: np.zeros(s, np.uint16) for k, s in shapes.items()}
        held_version: int | None = have if have >= 0 else None
        payloads = pub.catch_up_payloads(have, pub.fingerprint)
        if have == current:
            assert payloads == []
        for p in payloads:
            info, replaced = deltas.decode(p.data(), held, held_version, pub.fingerprint)
            assert info.version == p.info.version
            held = _apply(held, replaced)
            held_version = info.version
            # Every intermediate state is a published version, bit for bit.
            _assert_bits_equal(held, history[held_version])
        assert held_version == current
        _assert_bits_equal(held, history[-1])
    # The anchor is the newest multiple of anchor_interval (6); older deltas are dropped.
    from_nothing = pub.catch_up_payloads(-1, "")
    assert [p.info.kind for p in from_nothing] == ["anchor", "delta", "delta"]
    assert [p.info.version for p in from_nothing] == [6, 7, 8]
    if anchor_in == "file":
        # Every payload kept is a file, named by the store's chain (the one returned for the
        # push is in memory, and lives as long as the push); the chain before the anchor left
        # no file behind.
        assert [type(p.payload).__name__ for p in from_nothing] == ["PayloadFile"] * 3
        assert isinstance(published.payload, bytes) and published.payload == from_nothing[2].data()
        assert sorted(f.name for f in (tmp_path / "anchor").iterdir()) == [
            "anchor.safetensors",
            "chain.json",
            "delta-00000007.safetensors",
            "delta-00000008.safetensors",
        ]
        stored_anchor, stored_chain = weight_transfer.read_manifest(tmp_path / "anchor")
        assert [p.file for p in (stored_anchor, *stored_chain)] == [p.payload.path.name for p in from_nothing]
        assert [p.header for p in (stored_anchor, *stored_chain)] == [p.header() for p in from_nothing]
        pub.close()
        assert list((tmp_path / "anchor").iterdir()) == []
        # A trainer killed -9 leaves its chain; its restart removes it.
        (tmp_path / "anchor" / "delta-00000004.safetensors").write_bytes(b"stale")
        WeightPublisher(history[0], anchor_interval=3, anchor_dir=tmp_path / "anchor").close()
        assert list((tmp_path / "anchor").iterdir()) == []


def test_an_anchor_kept_in_a_file_is_the_same_payload_and_leaves_one_file(tmp_path: Path) -> None:
    """anchor_dir: the anchor's bytes, header and chunks are those of the in-memory anchor; a
    new anchor replaces the file (a reader already holding the old one reads on), and close()
    removes it."""
    rng = np.random.default_rng(11)
    shapes = {"emb": (300, 40), "ln": (40,)}
    bits = _random_bits(rng, shapes)
    in_memory = WeightPublisher(bits, anchor_interval=2)
    in_file = WeightPublisher(bits, anchor_interval=2, anchor_dir=tmp_path)
    a, b = in_memory.catch_up_payloads(-1, "")[0], in_file.catch_up_payloads(-1, "")[0]
    assert isinstance(b.payload, PayloadFile) and b.data() == a.payload
    assert b.header() == a.header()
    assert [c.data for c in b.chunks()] == [c.data for c in a.chunks()]
    chunks = list(
        weight_transfer.to_chunks(b.payload, b.info, chunk_bytes=4096, header=b.header())
    )  # several, the last one short
    assert len(chunks) > 2 and chunks[0].header == a.header() and b"".join(c.data for c in chunks) == a.payload
    assert weight_transfer.make_header(b.payload, b.info, chunk_bytes=4096) == a.header()  # hashed piece by piece
    assert sorted(f.name for f in tmp_path.iterdir()) == [b.payload.path.name, "chain.json"]
    for step in range(2):  # version 2 is the next anchor
        bits = _evolve(rng, bits, step)
        in_file.publish(bits)
    newer = in_file.catch_up_payloads(-1, "")[0]
    assert newer.info.version == 2 and sorted(f.name for f in tmp_path.iterdir()) == [
        newer.payload.path.name,
        "chain.json",
    ]
    assert b.data() == a.payload  # unlinked, still readable by whoever holds it
    in_file.close()
    assert list(tmp_path.iterdir()) == []
    # A write cut short (kill -9 mid-write) is cleared by the next publisher on the folder.
    (tmp_path / ".anchor.safetensors.12345.tmp").write_bytes(b"half")
    again = WeightPublisher(bits, anchor_interval=2, anchor_dir=tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["anchor.safetensors", "chain.json"]
    again.close()


def test_an_anchor_that_cannot_be_written_stays_in_memory(tmp_path: Path) -> None:
    """A full or read-only anchor_dir must not stop training: the anchor is kept in memory."""
    rng = np.random.default_rng(12)
    bits = _random_bits(rng, {"w": (64, 8)})
    with mock.patch("builtins.open", side_effect=OSError(28, "No space left on device")):
        pub = WeightPublisher(bits, anchor_interval=2, anchor_dir=tmp_path)
    anchor = pub.catch_up_payloads(-1, "")[0]
    assert (
        isinstance(anchor.payload, bytes)
        and anchor.data() == WeightPublisher(bits, anchor_interval=2).catch_up_payloads(-1, "")[0].payload
    )
    # A directory that cannot be made (a file in the way) is the same: memory, no exception.
    (tmp_path / "taken").write_bytes(b"")
    pub = WeightPublisher(bits, anchor_interval=2, anchor_dir=tmp_path / "taken" / "anchor")
    assert isinstance(pub.catch_up_payloads(-1, "")[0].payload, bytes)


def test_publisher_refuses_a_wrong_fingerprint() -> None:
    rng = np.random.default_rng(8)
    pub = WeightPublisher(_random_bits(rng, {"w": (16, 16)}), anchor_interval=3)
    other = deltas.model_fingerprint({"w": (16, 17)})
    with pytest.raises(DeltaError, match="is not the trainer's"):
        pub.catch_up_payloads(-1, other)
    assert pub.catch_up_payloads(-1, pub.fingerprint)[0].info.kind == "anchor"


def test_publisher_sends_an_anchor_to_a_generator_ahead_of_it() -> None:
    """A generator can hold a version the trainer does not have (the trainer restarted from
    an older checkpoint, or from scratch: checkpoints are not implemented yet). Its bits are
    from another lineage, so nothing but an anchor can bring it back. catch_up_payloads
    returns [] for have_version > current, so FetchWeights sends nothing and the generator
    keeps weights the trainer never had."""
    rng = np.random.default_rng(9)
    shapes = {"w": (32, 8)}
    pub = WeightPublisher(_random_bits(rng, shapes), anchor_interval=3)
    bits = pub.bits()
    for step in range(4):
        bits = _evolve(rng, bits, step)
        pub.publish(bits)
    assert pub.version == 4
    payloads = pub.catch_up_payloads(7, pub.fingerprint)  # the generator says it holds v7
    assert payloads and payloads[0].info.kind == "anchor"
    held = _random_bits(rng, shapes)  # whatever the other lineage left there
    held_version = 7
    for p in payloads:
        info, replaced = deltas.decode(p.payload, held, held_version, pub.fingerprint)
        held, held_version = _apply(held, replaced), info.version
    assert held_version == 4
    _assert_bits_equal(held, pub.bits())


# --- non-finite weights ---------------------------------------------------------------------


def _finite_bits(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """bf16 bits of small normal values (what a sane trainer holds), all finite."""
    out = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        out[name] = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncate fp32 to bf16
    return out


@pytest.mark.parametrize("bad", [0x7FC0, 0xFFC1, 0x7F80, 0xFF80], ids=["nan", "-nan", "inf", "-inf"])
def test_refuses_anchor_and_delta_carrying_a_non_finite_value(bad: int) -> None:
    """A diverged trainer publishes NaN/inf with a valid hash: decode must refuse the payload
    (naming the tensor), and the weights held stay as they were."""
    rng = np.random.default_rng(11)
    shapes = {"a.weight": (64, 32), "b.weight": (300,), "c.bias": (7,)}
    held = _finite_bits(rng, shapes)
    fp = deltas.model_fingerprint(shapes)
    new = _copy(held)
    new["b.weight"][123] = bad
    _refused(deltas.encode_anchor(new, 5, fp), held, None, fp, r"anchor b.weight: value 123 is not finite")
    _refused(deltas.encode_anchor(new, 5, fp), held, 4, fp, r"anchor b.weight: value 123 is not finite")
    # Both value encodings: a lone change goes as new bits; many +-1 ULP steps go as steps.
    payload, stats = deltas.encode_delta(held, new, 4, 5, fp)
    _refused(payload, held, 4, fp, r"^b.weight: value 123 is not finite")
    steps = _copy(new)
    flat = steps["a.weight"].reshape(-1)
    flat[::3] += np.uint16(1)
    flat[1000] = bad
    payload, stats = deltas.encode_delta(held, steps, 4, 5, fp)
    assert json.loads(safetensors_io.loads(payload)[0]["tensors"])["a.weight"]["val"] == "ulp"
    _refused(payload, held, 4, fp, r"a.weight: value 1000 is not finite \(bf16 bits 0x")
    # The same weights without the bad value are accepted, bit for bit.
    flat[1000] = held["a.weight"].reshape(-1)[1000]
    steps["b.weight"][123] = held["b.weight"][123]
    payload, _ = deltas.encode_delta(held, steps, 4, 5, fp)
    _, replaced = deltas.decode(payload, held, 4, fp)
    _assert_bits_equal(_apply(held, replaced), steps)
    _, anchor = deltas.decode(deltas.encode_anchor(steps, 5, fp), held, None, fp)
    _assert_bits_equal(anchor, steps)


def test_refuses_a_malformed_delta_table_without_crashing() -> None:
    """A tensor table that is JSON but not the expected shape is refused, not a TypeError."""
    rng = np.random.default_rng(12)
    shapes = {"w": (16,)}
    held = _finite_bits(rng, shapes)
    fp = deltas.model_fingerprint(shapes)
    meta = {
        "format": deltas.FORMAT,
        "format_version": deltas.FORMAT_VERSION,
        "kind": "delta",
        "base_version": "1",
        "version": "2",
        "fingerprint": fp,
    }
    for table, match in [
        ("[1, 2]", "tensor table is a JSON list"),
        ('{"w": 5}', "w: delta entry 5 is not an object"),
        ('{"w": {"count": 1}}', r"w: delta shape None != held \[16\]"),
        (
            '{"w": {"shape": [16], "count": null, "pos": "idx", "pos_zstd": false, "val": "bf16", "val_zstd": false, "xxh3": ""}}',
            "w: corrupt delta",
        ),
        ("[" * 100_000, "no valid tensor table"),
    ]:
        parts = {"w::pos": np.zeros(4, np.uint8), "w::val": np.zeros(2, np.uint8)}
        payload = safetensors_io.dumps(parts, dict(meta, tensors=table))
        _refused(payload, held, 1, fp, match)


def test_a_published_payload_is_hashed_once_whatever_the_number_of_pushes() -> None:
    """The publisher's fan-out: one header (sha256 of the payload) per payload, reused by
    every generator's stream, and streams that reassemble to the payload."""
    from rollstream.core import weight_transfer
    from rollstream.trainer.publisher import Published

    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, 3 * weight_transfer.CHUNK_BYTES + 123, dtype=np.uint8).tobytes()
    published = Published(deltas.PayloadInfo("delta", 4, 5, "fp"), payload)
    first = published.header()
    assert published.header() is first  # made once
    assert first.sha256 == hashlib.sha256(payload).hexdigest() and first.total_bytes == len(payload)
    for _ in range(3):  # three generators' streams
        [(header, data)] = list(weight_transfer.from_chunks(published.chunks()))
        assert header.version == 5 and data == payload


# --- a delta built piece by piece (the optimizer's on_piece) ---------------------------------


def _pieces(rng: np.random.Generator, size: int) -> list[tuple[int, int]]:
    """Random contiguous pieces covering [0, size), starts not aligned to anything."""
    cuts = sorted({0, size, *rng.integers(1, size, size=min(size - 1, 5)).tolist()}) if size > 1 else [0, size]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("threads", [0, 3])
def test_a_delta_added_piece_by_piece_in_any_order_is_the_same_bytes(scenario, threads: int) -> None:
    """Each piece brings its own old bits, as the split layout's optimizer hands them over
    (the base given to the encoder may already hold the new bits: it is not read for pieces)."""
    from concurrent.futures import ThreadPoolExecutor

    base, new, fp = scenario
    expected, _ = deltas.encode_delta(base, new, 3, 4, fp)
    rng = np.random.default_rng(7)
    work = [(name, lo, hi) for name in base for lo, hi in _pieces(rng, base[name].size)]
    rng.shuffle(work)
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        encoder = deltas.DeltaEncoder(
            new, 3, 4, fp, executor=pool, max_pending_bytes=4096
        )  # `new` as the base: in-place layout
        for name, lo, hi in work:
            old = base[name].reshape(-1)[lo:hi].copy()
            encoder.add_piece(name, lo, old, new[name].reshape(-1)[lo:hi])
        payload, stats = encoder.finish()
    finally:
        if pool is not None:
            pool.shutdown()
    assert payload == expected
    assert stats.changed_values > 0


def test_pieces_that_overlap_or_leave_a_gap_are_refused(scenario) -> None:
    base, new, fp = scenario
    name = "model.layers.0.mlp.down_proj.weight"
    old, now = base[name].reshape(-1), new[name].reshape(-1)
    encoder = deltas.DeltaEncoder(base, 0, 1, fp)
    encoder.add_piece(name, 0, old[:100], now[:100])
    with pytest.raises(DeltaError, match="piece"):
        encoder.add_piece(name, now.size - 10, old[:20], now[:20])  # past the end
    with pytest.raises(DeltaError, match="piece"):
        encoder.add_piece(name, 0, old[:10], now[:11])  # old and new differ in size
    for other in base:
        if other != name:
            encoder.add(other, new[other])
    with pytest.raises(DeltaError, match=f"{name}: pieces cover 100 of"):
        encoder.finish()
    with pytest.raises(DeltaError, match="added twice"):
        encoder.add_piece(name, 0, old, now)  # all of it: the first 100 values twice
    encoder.add_piece(name, 100, old[100:], now[100:])
    payload, _ = encoder.finish()
    assert payload == deltas.encode_delta(base, new, 0, 1, fp)[0]


def _reference_delta(
    base: dict[str, np.ndarray], new: dict[str, np.ndarray], base_version: int, version: int, fp: str
) -> bytes:
    """The delta format spelled out a whole tensor at a time (int64 positions, every candidate
    made at once, the smallest kept, the first of equals): the bytes the encoder's chunked,
    piece-by-piece path must reproduce exactly."""
    cctx = zstandard.ZstdCompressor(level=deltas.ZSTD_LEVEL, write_checksum=True)

    def smallest(options: list[tuple[str, bytes]]) -> tuple[str, bytes, bool]:
        candidates = []
        for kind, raw in options:
            packed = cctx.compress(raw)
            candidates.append((kind, packed, True) if len(packed) < len(raw) else (kind, raw, False))
        return min(candidates, key=lambda c: len(c[1]))

    arrays: dict[str, np.ndarray] = {}
    infos: dict[str, dict] = {}
    for name in sorted(base):
        b, n = base[name].reshape(-1), new[name].reshape(-1)
        idx = np.flatnonzero(b != n)
        if idx.size == 0:
            continue
        pos_kind, pos, pos_z = smallest(
            [("mask", np.packbits(b != n).tobytes()), ("idx", np.diff(idx, prepend=0).astype("<u4").tobytes())]
        )
        val_kind, val, val_z = smallest(
            [("bf16", n[idx].astype("<u2").tobytes()), ("ulp", (n[idx] - b[idx]).astype("<u2").tobytes())]
        )
        infos[name] = {
            "shape": list(base[name].shape),
            "count": int(idx.size),
            "pos": pos_kind,
            "pos_zstd": pos_z,
            "val": val_kind,
            "val_zstd": val_z,
            "xxh3": xxhash.xxh3_64_hexdigest(np.ascontiguousarray(new[name]).data),
        }
        arrays[f"{name}::pos"] = np.frombuffer(pos, np.uint8)
        arrays[f"{name}::val"] = np.frombuffer(val, np.uint8)
    meta = deltas._meta("delta", base_version, version, fp, tensors=json.dumps(infos, separators=(",", ":")))
    return safetensors_io.dumps(arrays, meta)


@pytest.mark.parametrize("chunk", [64, 1 << 23])
def test_the_encoder_makes_the_reference_bytes_whole_or_piece_by_piece(scenario, monkeypatch, chunk: int) -> None:
    """At every density, whole tensors and pieces (cut inside mask bytes) in any order; with
    chunks of 8 mask bytes too, so that tensors and pieces span many, some without a change."""
    monkeypatch.setattr(deltas, "_CHUNK", chunk)
    base, new, fp = scenario
    rng = np.random.default_rng(chunk)
    cases = [new]
    for density in (1e-4, 0.03, 0.3, 1.0):
        other = _copy(base)
        for flat in (a.reshape(-1) for a in other.values()):
            pos = np.flatnonzero(rng.random(flat.size) < density)
            _bump(flat, pos, rng.integers(1, 4, size=pos.size) * rng.choice([-1, 1], size=pos.size))
        cases.append(other)
    for case in cases:
        expected = _reference_delta(base, case, 3, 4, fp)
        assert deltas.encode_delta(base, case, 3, 4, fp)[0] == expected
        work = [(name, lo, hi) for name in base for lo, hi in _pieces(rng, base[name].size)]
        rng.shuffle(work)
        encoder = deltas.DeltaEncoder(case, 3, 4, fp)
        for name, lo, hi in work:
            encoder.add_piece(name, lo, base[name].reshape(-1)[lo:hi].copy(), case[name].reshape(-1)[lo:hi])
        assert encoder.finish()[0] == expected


def test_a_tensor_too_large_for_uint32_positions_is_refused() -> None:
    huge = np.broadcast_to(np.uint16(0), (deltas.MAX_TENSOR_VALUES + 1,))  # no memory behind it
    encoder = deltas.DeltaEncoder({"huge": huge}, 0, 1, "fp")
    with pytest.raises(DeltaError, match="uint32"):
        encoder.add("huge", huge)
    with pytest.raises(DeltaError, match="uint32"):
        encoder.add_piece("huge", 0, huge[:8], huge[:8])


def test_dumps_taking_is_dumps_and_lets_go_of_the_tensors() -> None:
    tensors = {
        "a::pos": np.arange(7, dtype=np.uint8),
        "b": np.array([0x3F80, 0xBF80], np.uint16),
        "c::val": np.zeros(0, np.uint8),
    }
    expected = safetensors_io.dumps(tensors, {"k": "v"}, bf16={"b"})
    taken = dict(tensors)
    assert safetensors_io.dumps_taking(taken, {"k": "v"}, bf16={"b"}) == expected
    assert taken == {}
