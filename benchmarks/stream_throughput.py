"""Rollout-buffer throughput: raw Redis stream ops against four chained StreamStages.

    .venv/bin/python benchmarks/stream_throughput.py [--entries 10000] [--groups 1000] [--read-count 8] [--repeats 3]
        [--payload-bytes 1024] [--payload-tokens 64] [--completions 8] [--processes]
        [--redis-url URL | --appendfsync always|everysec|no]

Both measurements run on the same redis-server, one after the other: an embedded one
configured as `rollstream up` runs it (AOF on; --appendfsync overrides its fsync policy),
or the one at --redis-url. The JSON says which AOF settings the server had.

(a) raw: one hop done by hand with redis-py the way a stage moves entries: XREADGROUP
    `--read-count` entries of `--payload-bytes` from a pre-filled stream, then one pipeline
    with an XADD per entry to the next stream and one XACK for the batch. entries/s.
(b) stages: rollstream.core.streams.StreamStage x 4 chained prompts -> rollouts -> scored
    -> ready -> sink, each in its own thread (--processes: its own process). Each stage
    decodes the RolloutGroup and commits it to the next stream (commit: the Lua script that
    writes, acknowledges and checks the inputs are still ours, atomically); the sink
    commits with no output. The payload is a realistic group: `--completions` completions
    of `--payload-tokens` tokens with behaviour and reference log-probs and version spans.
    The prompts stream is filled first; the clock runs from the stages' start until the
    sink has acknowledged every group. groups/s end to end.

`--repeats` rounds, each (a) then (b), so both see the same machine; each rate is reported
as its median and best round, and the ratio per round and of the medians. Prints one JSON
object with the rates, the ratios, the payload sizes and the load average before and after
(other work on the machine skews the figures, fsync-bound ones most: compare runs on the
same load only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import random
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from rollstream.core import validation
from rollstream.core.redis_policy import connect
from rollstream.core.run_keys import STAGES, RunKeys
from rollstream.core.streams import Ops, StreamStage
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import rollout_pb2

SINK = "sink"
# The consumer group reading each stream (the service that reads it in a real run).
READERS = {"prompts": "generator", "rollouts": "reward", "scored": "reference", "ready": "trainer"}
BLOCK_MS = 100


def realistic_group(i: int, completions: int, tokens: int, rng: random.Random) -> rollout_pb2.RolloutGroup:
    """What the trainer reads: scored, with reference log-probs, one version span each."""
    group = rollout_pb2.RolloutGroup(
        group_id=f"g{i:08d}",
        task_id=f"g{i:08d}",
        policy_version=3,
        prompt_ids=[rng.randrange(50_000) for _ in range(48)],
        answer="42",
        task_kind="arithmetic",
        scored=True,
        has_ref_logprobs=True,
        group_size=completions,
        created_at=time.time(),
    )
    for _ in range(completions):
        c = group.completions.add()
        c.token_ids.extend(rng.randrange(50_000) for _ in range(tokens))
        c.behaviour_logprobs.extend(-rng.random() * 5 for _ in range(tokens))
        c.ref_logprobs.extend(-rng.random() * 5 for _ in range(tokens))
        c.text = "x" * (tokens * 3)
        c.finish_reason = "length"
        c.versions.add(version=3, start=0, end=tokens)
        c.reward = rng.random()
        c.reward_components.add(name="answer", value=c.reward, weight=1.0, status="ok")
    return group


# -- (a) raw redis-py ---------------------------------------------------------------------


def raw_rate(url: str, entries: int, read_count: int, payload_bytes: int) -> dict:
    client = redis.Redis.from_url(url)
    run = RunKeys(f"bench-raw-{uuid.uuid4().hex[:8]}")
    source, target = run.stream("a"), run.stream("b")
    payload = {"type": b"bench", "schema": b"1", "data": os.urandom(payload_bytes)}
    try:
        client.xgroup_create(source, "g", id="0", mkstream=True)
        for start in range(0, entries, 1000):  # fill, pipelined (not timed)
            pipe = client.pipeline(transaction=False)
            for _ in range(min(1000, entries - start)):
                pipe.xadd(source, payload)
            pipe.execute()
        moved = 0
        t0 = time.perf_counter()
        while moved < entries:
            reply = client.xreadgroup("g", "c", {source: ">"}, count=read_count, block=BLOCK_MS)
            batch = reply[0][1] if reply else []
            pipe = client.pipeline(transaction=True)  # MULTI/EXEC: one atomic commit, as a stage's
            for _eid, fields in batch:
                pipe.xadd(target, fields)
            pipe.xack(source, "g", *[eid for eid, _f in batch])
            pipe.execute()
            moved += len(batch)
        seconds = time.perf_counter() - t0
    finally:
        client.delete(source, target)
        client.close()
    return {"entries": entries, "seconds": round(seconds, 3), "entries_per_s": round(entries / seconds, 1)}


# -- (b) four StreamStages ----------------------------------------------------------------


def run_stage(url: str, run: str, source: str, target: str, read_count: int, stop: threading.Event) -> None:
    """One no-op stage: decode each group and commit it to `target` (the sink: ack only)."""
    client = connect(url)
    keys = RunKeys(run)
    stage = StreamStage(client, keys, source, READERS[source], f"{source}-0")
    try:
        while not stop.is_set():
            entries = stage.read(read_count, BLOCK_MS)
            if not entries:
                continue
            groups = [validation.decode(e.fields, rollout_pb2.RolloutGroup) for e in entries]
            if target == SINK:
                count = len(entries)

                def sunk(ops: Ops, n: int = count) -> None:
                    ops.hincrby(keys.stats, "sunk", n)

                stage.commit(entries, extra=sunk)
            else:
                stage.commit(entries, outputs=[(target, g) for g in groups])
    finally:
        client.close()


def stage_rate(url: str, groups: list[rollout_pb2.RolloutGroup], read_count: int, processes: bool) -> dict:
    run = f"bench-stages-{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run)
    client = connect(url)
    chain = [*STAGES, SINK]
    for source in STAGES:  # groups exist before the fill, so nothing is read before the clock starts
        StreamStage.ensure_group(client, keys.stream(source), READERS[source])
    for start in range(0, len(groups), 500):
        pipe = client.pipeline(transaction=False)
        for g in groups[start : start + 500]:
            pipe.xadd(keys.stream("prompts"), validation.encode(g))
        pipe.execute()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event() if processes else threading.Event()
    make = ctx.Process if processes else threading.Thread
    workers = [
        make(target=run_stage, args=(url, run, src, dst, read_count, stop), daemon=True)
        for src, dst in itertools.pairwise(chain)
    ]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 600
        while int(client.hget(keys.stats, "sunk") or 0) < len(groups):
            if time.monotonic() > deadline or not all(w.is_alive() for w in workers):
                raise RuntimeError(
                    f"stages stalled at {int(client.hget(keys.stats, 'sunk') or 0)}/{len(groups)} groups"
                )
            time.sleep(0.005)
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
        client.delete(*client.scan_iter(match=keys.prefix + "*"))
        client.close()
    return {
        "groups": len(groups),
        "stages": len(STAGES),
        "seconds": round(seconds, 3),
        "groups_per_s": round(len(groups) / seconds, 1),
        "hops_per_s": round(len(STAGES) * len(groups) / seconds, 1),  # entries moved by some stage, per second
        "mode": "processes" if processes else "threads",
    }


def summarize(rates: list[float], unit: str) -> dict:
    return {f"median_{unit}": round(statistics.median(rates), 1), f"best_{unit}": round(max(rates), 1), "rounds": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000, help="raw: entries moved through one hop")
    parser.add_argument("--groups", type=int, default=1_000, help="stages: groups sent through all four stages")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of (a) then (b)")
    parser.add_argument(
        "--read-count", type=int, default=8, help="entries per XREADGROUP (the services' read_count default)"
    )
    parser.add_argument("--payload-bytes", type=int, default=1024, help="raw: bytes of each entry's data")
    parser.add_argument("--payload-tokens", type=int, default=64, help="stages: tokens per completion")
    parser.add_argument("--completions", type=int, default=8, help="stages: completions per group")
    parser.add_argument("--processes", action="store_true", help="each stage in its own process instead of a thread")
    parser.add_argument("--redis-url", default="", help="this Redis instead of an embedded redis-server")
    parser.add_argument(
        "--appendfsync",
        choices=["always", "everysec", "no"],
        default="",
        help="embedded: AOF fsync policy (default: rollstream up's)",
    )
    args = parser.parse_args()

    rng = random.Random(0)
    groups = [realistic_group(i, args.completions, args.payload_tokens, rng) for i in range(args.groups)]
    group_bytes = len(groups[0].SerializeToString())
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        fsync = {"appendfsync": args.appendfsync} if args.appendfsync else {}
        server = None if args.redis_url else EmbeddedRedis(Path(tmp) / "redis", **fsync).start()
        url = args.redis_url or server.url  # type: ignore[union-attr]  # server is None only where --redis-url is given
        try:
            raw_rate(url, min(2_000, args.entries), args.read_count, args.payload_bytes)  # warm-up
            raws, stagess = [], []
            for _ in range(args.repeats):
                raws.append(raw_rate(url, args.entries, args.read_count, args.payload_bytes))
                stagess.append(stage_rate(url, groups, args.read_count, args.processes))
            probe = redis.Redis.from_url(url, decode_responses=True)
            info = probe.info("server")
            try:
                aof = {**probe.config_get("appendonly"), **probe.config_get("appendfsync")}
            except redis.ResponseError:  # a managed Redis may refuse CONFIG
                aof = {}
            probe.close()
        finally:
            if server is not None:
                server.stop()
    out = {
        "benchmark": "stream_throughput",
        "redis": {"version": info["redis_version"], "embedded": not args.redis_url, **aof},
        "read_count": args.read_count,
        "repeats": args.repeats,
        "raw": {
            **summarize([r["entries_per_s"] for r in raws], "entries_per_s"),
            "entries": args.entries,
            "payload_bytes": args.payload_bytes,
        },
        "stages": {
            **summarize([r["groups_per_s"] for r in stagess], "groups_per_s"),
            "groups": args.groups,
            "stages": len(STAGES),
            "mode": "processes" if args.processes else "threads",
            "group_bytes": group_bytes,
            "completions": args.completions,
            "tokens": args.payload_tokens,
        },
        # The chained stages run concurrently, so end to end they move what their slowest hop
        # moves: groups/s end to end over the raw one-hop entries/s is what the stage machinery
        # (decode, commit script, bigger payload, GIL or processes) keeps of the raw rate.
        "ratio_stages_to_raw_median": round(
            statistics.median(r["groups_per_s"] for r in stagess) / statistics.median(r["entries_per_s"] for r in raws),
            3,
        ),
        "ratio_stages_to_raw_per_round": [
            round(b["groups_per_s"] / a["entries_per_s"], 3) for a, b in zip(raws, stagess, strict=True)
        ],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
