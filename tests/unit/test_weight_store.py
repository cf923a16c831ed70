"""The weight store (rollstream.core.weight_transfer): the trainer's anchor_dir as files and a
chain.json that a generator sharing the volume reads to catch up without the trainer. Read
back through the same checks as a transfer (size, sha256, base version), a reader reaches the
trainer's bits exactly from any version; a chain.json that is missing, garbage or points
outside its folder, and a file replaced or gone under it, are refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollstream.core import deltas, weight_transfer
from rollstream.trainer.publisher import WeightPublisher

SHAPES = {"emb": (120, 24), "ln": (24,), "head": (64, 24)}


def bf16_bits(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Finite bf16 bit patterns: the top halves of random float32s."""
    return {
        n: (rng.standard_normal(s).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for n, s in SHAPES.items()
    }


def evolved(rng: np.random.Generator, bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A few percent of each tensor moved by one bf16 step (still finite: no exponent change
    from +-1 on the mantissa's low bit of a normal number)."""
    out = {}
    for name, b in bits.items():
        flat = b.reshape(-1).copy()
        pos = np.flatnonzero(rng.random(flat.size) < 0.03)
        flat[pos] ^= np.uint16(1)
        out[name] = flat.reshape(b.shape)
    return out


def read_store(
    directory: Path, have: dict[str, np.ndarray] | None, have_version: int | None, fingerprint: str
) -> tuple[dict[str, np.ndarray], int]:
    """What a generator does with the store: the chain's payloads from its version on, each
    checked as a transfer (from_chunks) and decoded onto what it holds."""
    anchor, chain = weight_transfer.read_manifest(directory)
    needed = weight_transfer.catch_up_chain(
        -1 if have_version is None else have_version, anchor, chain, lambda p: p.info
    )
    held = dict(have) if have is not None else {n: np.zeros(s, np.uint16) for n, s in SHAPES.items()}
    version = have_version
    for _header, payload in weight_transfer.from_chunks(weight_transfer.store_chunks(directory, needed)):
        info, replaced = deltas.decode(payload, held, version, fingerprint)
        held.update(replaced)
        version = info.version
    assert version is not None
    return held, version


def test_a_reader_of_the_store_reaches_the_trainers_bits_from_any_version(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    history = [bf16_bits(rng)]
    pub = WeightPublisher(history[0], anchor_interval=4, anchor_dir=tmp_path)
    try:
        for _ in range(6):  # versions 1..6; 4 is an anchor
            history.append(evolved(rng, history[-1]))
            pub.publish(history[-1])
        anchor, chain = weight_transfer.read_manifest(tmp_path)
        assert [(p.info.kind, p.info.version) for p in (anchor, *chain)] == [("anchor", 4), ("delta", 5), ("delta", 6)]
        target = deltas.weights_sha256(history[6])
        for have in (None, 0, 2, 4, 5, 6):  # nothing, older than the anchor, the anchor, in the chain, current
            start = history[have] if have is not None else None
            held, version = read_store(tmp_path, start, have, pub.fingerprint)
            assert version == 6 and deltas.weights_sha256(held) == target, have
        # The files are exactly what FetchWeights would stream (same headers, same bytes).
        fetched = pub.catch_up_payloads(-1, pub.fingerprint)
        stored = list(weight_transfer.from_chunks(weight_transfer.store_chunks(tmp_path, [anchor, *chain])))
        assert [h for h, _ in stored] == [p.header() for p in fetched]
        assert [d for _, d in stored] == [p.data() for p in fetched]
    finally:
        pub.close()
    assert list(tmp_path.iterdir()) == []  # the chain and its files leave with the trainer


def test_a_file_replaced_truncated_or_gone_under_its_chain_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    bits = bf16_bits(rng)
    pub = WeightPublisher(bits, anchor_interval=10, anchor_dir=tmp_path)
    try:
        pub.publish(evolved(rng, bits))
        anchor, chain = weight_transfer.read_manifest(tmp_path)
        delta_file = tmp_path / chain[0].file
        good = delta_file.read_bytes()
        corrupted = bytearray(good)
        corrupted[len(good) // 2] ^= 0xFF
        delta_file.write_bytes(bytes(corrupted))
        with pytest.raises(deltas.DeltaError, match="corrupted"):
            list(weight_transfer.from_chunks(weight_transfer.store_chunks(tmp_path, chain)))
        delta_file.write_bytes(good[:-10])
        with pytest.raises(deltas.DeltaError, match="header says"):
            list(weight_transfer.from_chunks(weight_transfer.store_chunks(tmp_path, chain)))
        delta_file.unlink()
        with pytest.raises(weight_transfer.StoreUnreadable, match="a newer chain replaced it"):
            list(weight_transfer.from_chunks(weight_transfer.store_chunks(tmp_path, chain)))
        # A header declaring more than the reader accepts is refused before the file is read.
        with pytest.raises(weight_transfer.PayloadTooLarge):
            list(weight_transfer.from_chunks(weight_transfer.store_chunks(tmp_path, [anchor]), max_bytes=100))
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        (None, "no chain yet"),
        ("{not json", "not a weight chain"),
        ('{"format": "something-else/9", "payloads": []}', "format 'something-else/9'"),
        (json.dumps({"format": weight_transfer.STORE_FORMAT}), "not a weight chain"),
        (json.dumps({"format": weight_transfer.STORE_FORMAT, "payloads": []}), "an anchor, then deltas"),
        (
            json.dumps(
                {
                    "format": weight_transfer.STORE_FORMAT,
                    "payloads": [{"file": "../../etc/passwd", "header": {"kind": "anchor"}}],
                }
            ),
            "not a plain file name",
        ),
        (
            json.dumps(
                {"format": weight_transfer.STORE_FORMAT, "payloads": [{"file": 7, "header": {"kind": "anchor"}}]}
            ),
            "not a plain file name",
        ),
        (
            json.dumps(
                {
                    "format": weight_transfer.STORE_FORMAT,
                    "payloads": [{"file": "a", "header": {"kind": "anchor", "version": "x"}}],
                }
            ),
            "not a weight chain",
        ),
        (
            json.dumps(
                {"format": weight_transfer.STORE_FORMAT, "payloads": [{"file": "a", "header": {"kind": "delta"}}]}
            ),
            "an anchor, then deltas",
        ),
        (
            json.dumps(
                {
                    "format": weight_transfer.STORE_FORMAT,
                    "payloads": [{"file": "a", "header": {"kind": "anchor", "nope": 1}}],
                }
            ),
            "not a weight chain",
        ),
        ("[1, 2]", "not a weight chain"),
    ],
)
def test_a_missing_or_malformed_chain_is_refused_with_its_reason(
    tmp_path: Path, manifest: str | None, reason: str
) -> None:
    if manifest is not None:
        (tmp_path / weight_transfer.MANIFEST).write_text(manifest)
    with pytest.raises(weight_transfer.StoreUnreadable, match=reason):
        weight_transfer.read_manifest(tmp_path)


def test_a_restarted_trainer_replaces_the_chain_of_its_earlier_run(tmp_path: Path) -> None:
    """A trainer killed -9 leaves its chain; the next one on the folder removes it before
    writing its own, and a reader holding the earlier run's newer version is sent the anchor."""
    rng = np.random.default_rng(5)
    bits = bf16_bits(rng)
    first = WeightPublisher(bits, anchor_interval=10, anchor_dir=tmp_path)
    for _ in range(3):
        first.publish(evolved(rng, first.bits()))
    earlier_run_v3 = dict(first.bits())
    del first  # killed: no close(), the files stay
    assert (tmp_path / "delta-00000003.safetensors").exists()
    second = WeightPublisher(bits, anchor_interval=10, anchor_dir=tmp_path)
    try:
        assert sorted(f.name for f in tmp_path.iterdir()) == ["anchor.safetensors", "chain.json"]
        held, version = read_store(tmp_path, earlier_run_v3, 3, second.fingerprint)
        assert version == 0 and deltas.weights_sha256(held) == deltas.weights_sha256(bits)
    finally:
        second.close()
