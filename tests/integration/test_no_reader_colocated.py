"""Issue 44's bar: a colocated run that registers a remote generator mid-run serves it the exact
weights. A real colocated process (launcher/colocated.py: trainer and generator in one
process; its generator registers no address) trains on scored groups the test writes into
`ready` (playing the upstream stages, so the steps come at the test's pace). With nobody to
read them it encodes no delta and files no chain. A real generator process then joins
(registered with its address, reading the weight store and asking the trainer): the trainer
writes the anchor of its current version for it, encodes deltas from there and pushes them,
and the generator ends with the trainer's weights, sha256 for sha256 (both GetStates)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import redis
import tomli_w

from helpers import wait_for, write_ready
from procs import free_port, generator_state, start_service, trainer_state
from rollstream.core import run_keys, steplog, weight_transfer
from synthetic import Decode, scored_groups

GROUPS_PER_STEP = 2


def test_a_generator_joining_a_colocated_run_gets_the_exact_weights(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    anchor_dir, step_log = tmp_path / "anchor", tmp_path / "steps.jsonl"
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    common = {"redis_url": redis_url, "run": keys.run, "model": str(tiny_model_dir), "threads": 1, "block_ms": 100}
    colocated_toml = tmp_path / "colocated.toml"  # the generator half's table; the trainer's values are flags
    generator = {
        **common,
        "consumer": "generator-0",
        "max_inflight_groups": 1,
        "grpc_socket": str(sockets / "colo-gen.sock"),
    }
    colocated_toml.write_text(tomli_w.dumps({"colocate": "sync", "trainer": {}, "generator": generator}))
    port = free_port()
    address = f"127.0.0.1:{port}"
    colocated = start_service(
        "launcher.colocated",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--grpc-port",
        str(port),
        "--consumer",
        "trainer-0",
        "--groups-per-step",
        str(GROUPS_PER_STEP),
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--prompt-buffer",
        "2",
        "--lr",
        "1e-2",
        "--max-staleness",
        "100",
        "--block-ms",
        "100",
        "--steps",
        "6",
        "--linger",
        "--anchor-dir",
        str(anchor_dir),
        "--metrics-file",
        str(step_log),
        "--config",
        str(colocated_toml),
        tag="-colocated",
    ).wait_ready()
    procs = [colocated]
    gen = None
    try:
        for step in (1, 2, 3):
            write_ready(rclient, keys, scored_groups(step, GROUPS_PER_STEP, "mid", group_size=2), tiny_decode)
        wait_for(lambda: trainer_state(address).version == 3, 120, "the colocated trainer at version 3", procs)
        skipped = steplog.read(step_log).steps
        assert [(s["step"], s["delta_bytes"], s.get("delta_skipped")) for s in skipped] == [
            (k, 0, "no reader") for k in (1, 2, 3)
        ], skipped
        assert not (anchor_dir / weight_transfer.MANIFEST).exists() and not list(anchor_dir.glob("*.safetensors"))
        assert " deltas_skipped " in colocated.log() and "reanchored" not in colocated.log()

        # A remote generator joins mid-run: it reads the store (no chain yet) and asks the trainer.
        gen = start_service(
            "generator",
            tmp_path,
            "--redis-url",
            redis_url,
            "--run",
            keys.run,
            "--model",
            str(tiny_model_dir),
            "--threads",
            "1",
            "--trainer-address",
            address,
            "--weight-store",
            str(anchor_dir),
            "--consumer",
            "gen-remote",
            "--max-inflight-groups",
            "1",
            "--sync-interval-s",
            "0.5",
            "--block-ms",
            "100",
            tag="-remote",
        ).wait_ready()
        procs = [colocated, gen]
        wait_for(
            lambda: generator_state(gen.grpc_address).policy_version == 3,
            120,
            "the remote generator at version 3",
            procs,
        )
        assert (
            generator_state(gen.grpc_address, sha=True).weights_sha256
            == trainer_state(address, sha=True).weights_sha256
        )
        assert (
            "reanchored" in colocated.log() and "version=3" in colocated.log().split("reanchored", 1)[1].splitlines()[0]
        )
        wait_for(
            lambda: gen.grpc_address in run_keys.live_generators(rclient, keys, forget=False).values(),
            60,
            "the remote generator registered",
            procs,
        )

        for step in (4, 5, 6):
            write_ready(rclient, keys, scored_groups(step, GROUPS_PER_STEP, "mid", group_size=2), tiny_decode)
        wait_for(lambda: trainer_state(address).version == 6, 120, "the colocated trainer at version 6", procs)
        final = trainer_state(address, sha=True)
        wait_for(
            lambda: generator_state(gen.grpc_address).policy_version == 6,
            120,
            "the remote generator at version 6",
            procs,
        )
        assert generator_state(gen.grpc_address, sha=True).weights_sha256 == final.weights_sha256
        assert final.weights_sha256 != "" and final.version == 6

        # Deltas again from the anchor at 3, on disk as the store's chain, and in the step log.
        later = steplog.read(step_log).steps[3:]
        assert [s["step"] for s in later] == [4, 5, 6] and all(
            s["delta_bytes"] > 0 and "delta_skipped" not in s for s in later
        ), later
        chain = json.loads((anchor_dir / weight_transfer.MANIFEST).read_text())
        assert [(p["header"]["kind"], int(p["header"].get("version", 0))) for p in chain["payloads"]] == [
            ("anchor", 3),
            ("delta", 4),
            ("delta", 5),
            ("delta", 6),
        ]
        # Registered: pushed to as any generator.
        assert re.search(r" pushed run=\S+ version=6 applied=1 generators=1 ", colocated.log()), colocated.log()[-3000:]
    finally:
        for p in [colocated, *([gen] if gen is not None else [])]:
            p.stop()
