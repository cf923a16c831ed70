"""Weight fan-out: trainer step end -> 1, 2, 4, 8 generators serving the new version.

    .venv/bin/python benchmarks/weight_fanout.py --backend transformers --counts 1,2,4,8
    .venv-vllm/bin/python benchmarks/weight_fanout.py --backend vllm --counts 1,2 --enforce-eager
    .venv/bin/python benchmarks/weight_fanout.py --backend sink --counts 1,2,4,8 --payload first

Real processes on loopback: an embedded redis-server, N generator processes (python -m
rollstream.generator, real gRPC), and this process as the trainer: HostAdamW with fp32
masters steps on the demo model (synthetic gradient: a fixed random direction plus noise,
as benchmarks/weight_sync_latency.py does, so deltas are 0.6-0.9% of dense like the real
ones of benchmarks/delta_size.py), then the trainer's own WeightPublisher encodes the delta
once (publish) and pushes it to every generator concurrently (push). PushWeights answers
once a generator serves the new version, so push's end is "every generator serves it".

Per round, seconds:
  encode_s      WeightPublisher.publish: the delta, encoded once for all generators
  push_s        WeightPublisher.push: until the last generator answered
  total_s       encode_s + push_s: trainer step end -> every generator serving
the CPU seconds the trainer process spent encoding and pushing and the receivers spent in
all (from /proc), and per generator (medians and maxima over the N): its round trip, and from its PushResult
receive (reassembly + sha256, from the call's start on the generator), lock wait, decode
(core/deltas.decode against its host copy) and load (the backend's engine load); transfer =
round trip - (lock wait + decode + load).

`--backend sink` starts receivers that run only the generator's receive path
(weight_transfer.from_chunks: reassembly, size and sha256 checks) and answer; no model. It
separates the trainer side of the fan-out (one encode, N concurrent streams) from what N
receivers decoding and loading at once cost on a machine with fewer cores than receivers.
With sinks, `--payload first` pushes Adam's first step instead (2.7% of dense), `--payload
anchor` the full bf16 weights (269 MB per receiver); sinks get the same payload, encoded
once, every round.

Rounds: every count gets a fresh version in each of `--rounds` rounds, counts interleaved
so that load changes on a shared machine hit every count alike; generators not in a count
get the same version right after, untimed, so all stay on one chain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path


def serve_sink(state_file: str) -> None:
    """A receiver with the generator's receive path only (for --backend sink)."""
    import grpc

    from rollstream.core import weight_transfer
    from rollstream.v1 import generator_pb2_grpc, weights_pb2

    class Sink(generator_pb2_grpc.GeneratorServicer):
        def PushWeights(self, request_iterator, context):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            version = 0
            for header, _payload in weight_transfer.from_chunks(request_iterator):
                version = header.version
            received = time.perf_counter() - start
            return weights_pb2.PushResult(applied=True, version=version, apply_seconds=received, receive_seconds=received)

    from rollstream.core.grpc_utils import CHANNEL_OPTIONS

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    generator_pb2_grpc.add_GeneratorServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = Path(state_file + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "grpc_port": port}))
    tmp.replace(state_file)
    server.wait_for_termination()


def start_receiver(args: argparse.Namespace, index: int, redis_url: str, model_dir: str, workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    state_file = workdir / f"receiver{index}.state.json"
    if args.backend == "sink":
        cmd = [sys.executable, __file__, "--serve-sink", str(state_file)]
    else:
        cmd = [
            sys.executable, "-m", "rollstream.generator", "--redis-url", redis_url, "--run", "fanout",
            "--model", model_dir, "--backend", args.backend, "--state-file", str(state_file), "--log-level", "WARNING",
            "--generator-id", f"g{index}", "--threads", str(args.generator_threads),
        ]
        if args.backend == "vllm":
            cmd += ["--cpu-kv-cache-gib", "1"] + (["--enforce-eager"] if args.enforce_eager else [])
    log = (workdir / f"receiver{index}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, state_file


def wait_ready(procs: list[tuple[subprocess.Popen[bytes], Path]], backend: str, workdir: Path) -> list[dict]:
    import httpx

    states: list[dict | None] = [None] * len(procs)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        for i, (proc, state_file) in enumerate(procs):
            if states[i] is not None:
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"receiver {i} exited with {proc.returncode}; see {workdir / f'receiver{i}.log'}")
            if not state_file.exists():
                continue
            state = json.loads(state_file.read_text())
            if backend == "sink":
                states[i] = state
                continue
            try:
                if httpx.get(f"http://127.0.0.1:{state['http_port']}/readyz", timeout=2).status_code == 200:
                    states[i] = state
            except httpx.HTTPError:
                pass
        if all(s is not None for s in states):
            return [s for s in states if s is not None]
        time.sleep(0.5)
    raise TimeoutError("receivers not ready")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-sink", metavar="STATE_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["transformers", "vllm", "sink"], default="transformers")
    parser.add_argument("--counts", default="1,2,4,8", help="generator counts to time, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--payload", choices=["delta", "first", "anchor"], default="delta",
                        help="delta: a steady-state step's delta (after Adam's first); first: Adam's first step; anchor: full weights (sink only)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--generator-threads", type=int, default=1, help="torch threads per generator process")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm: no torch.compile (starts in seconds; no effect on weight loads)")
    parser.add_argument("--push-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.serve_sink:
        serve_sink(args.serve_sink)
        return
    counts = [int(c) for c in args.counts.split(",")]
    if args.payload != "delta" and args.backend != "sink":
        parser.error("--payload first / anchor are for --backend sink (a generator takes Adam's first step once per start)")

    import torch

    from rollstream.core import deltas, modeling
    from rollstream.core.models import resolve_model
    from rollstream.launcher.redis_server import EmbeddedRedis
    from rollstream.trainer.optimizer import HostAdamW
    from rollstream.trainer.publisher import Published, WeightPublisher

    torch.set_num_threads(1)
    model_dir = str(resolve_model(args.model))
    n_max = max(counts)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rs-fanout-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis_server:
        workdir = Path(tmp)
        procs = [start_receiver(args, i, redis_server.url, model_dir, workdir) for i in range(n_max)]
        try:
            t = time.perf_counter()
            states = wait_ready(procs, args.backend, workdir)
            startup_s = time.perf_counter() - t
            addresses = [f"127.0.0.1:{s['grpc_port']}" for s in states]
            pids = [p.pid for p, _ in procs]

            model, _ = modeling.load_model(model_dir)
            params = modeling.named_weights(model)
            opt = HostAdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
            publisher = WeightPublisher(opt.sync_model(), anchor_interval=1_000_000)
            gen = torch.Generator().manual_seed(0)
            direction = {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}

            def step() -> dict:
                for name, p in params.items():
                    p.grad = direction[name] + 0.5 * torch.randn(p.shape, generator=gen)
                _norm, bits = opt.step(0.0)
                return bits

            def push(targets: list[str], published: Published) -> list:
                outcomes = publisher.push(targets, published, args.push_timeout)
                for o in outcomes:
                    if not o.applied:
                        raise RuntimeError(f"push of version {published.info.version} to {o.address} not applied: {o.error}")
                return outcomes

            sink = args.backend == "sink"
            fixed: tuple[Published, int, float, float] | None = None
            if not sink or args.payload != "first":
                # Adam's first step moves every weight; steady-state deltas come after it.
                published, _ = publisher.publish(step())
                if not sink:
                    push(addresses, published)
            if sink:
                # Sinks keep no chain: one payload, encoded once, pushed every round.
                bits = None if args.payload == "anchor" else step()
                t = time.perf_counter()
                if bits is None:
                    # The anchor was encoded when the publisher started; time a fresh encode of it.
                    published = publisher.catch_up_payloads(-1, "")[0]
                    deltas.encode_anchor(publisher.bits(), published.info.version, publisher.fingerprint)
                    nbytes, fraction = len(published.payload), 1.0
                else:
                    published, stats = publisher.publish(bits)
                    nbytes, fraction = stats.nbytes, stats.fraction_of_dense
                fixed = (published, nbytes, fraction, time.perf_counter() - t)
            rounds: dict[int, list[dict]] = {n: [] for n in counts}
            for _ in range(args.rounds):
                for n in counts:
                    bits = None if sink else step()
                    cpu_before = [cpu_seconds(pid) for pid in pids[:n]]
                    own_before = cpu_seconds(os.getpid())
                    step_end = time.perf_counter()  # the trainer's bf16 weights for the new version exist
                    if fixed is None:
                        published, stats = publisher.publish(bits)
                        nbytes, fraction = stats.nbytes, stats.fraction_of_dense
                        encode_s = time.perf_counter() - step_end
                    else:
                        published, nbytes, fraction, encode_s = fixed
                    encoded = time.perf_counter()
                    push_cpu_before = cpu_seconds(os.getpid())
                    outcomes = push(addresses[:n], published)
                    done = time.perf_counter()
                    push_cpu = cpu_seconds(os.getpid()) - push_cpu_before
                    encode_cpu = push_cpu_before - own_before
                    cpu = sum(cpu_seconds(pid) for pid in pids[:n]) - sum(cpu_before)
                    if n < n_max and not sink:
                        push(addresses[n:], published)  # untimed: keep every generator on the chain
                    rounds[n].append(summarize_round(n, nbytes, fraction, encode_s, done - encoded, outcomes, cpu, push_cpu, encode_cpu))
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    load_after = os.getloadavg()
    by_count = {n: medians(rs) for n, rs in rounds.items()}
    base = by_count[counts[0]]["total_s"]
    for n in counts:
        by_count[n]["total_vs_first_count"] = round(by_count[n]["total_s"] / base, 2) if base else None
    print(json.dumps({
        "benchmark": "weight_fanout",
        "backend": args.backend,
        "payload": args.payload,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average_before_after": [round(x, 2) for x in (*load_before, *load_after)],
        "model": model_dir,
        "generator_threads": args.generator_threads,
        "receivers_startup_s": round(startup_s, 1),
        "rounds": args.rounds,
        "medians_by_count": by_count,
        "all_rounds": rounds,
    }, indent=2))


def summarize_round(n: int, nbytes: int, fraction: float, encode_s: float, push_s: float, outcomes: list, cpu_s: float, push_cpu_s: float, encode_cpu_s: float) -> dict:
    rtt = [o.seconds for o in outcomes]
    applying = [o.lock_wait_s + o.decode_s + o.load_s for o in outcomes]
    transfer = [r - a for r, a in zip(rtt, applying)]

    def stat(values: list[float]) -> dict:
        return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}

    return {
        "generators": n,
        "payload_bytes": nbytes,
        "fraction_of_dense": round(fraction, 5),
        "encode_s": round(encode_s, 4),
        "push_s": round(push_s, 4),
        "total_s": round(encode_s + push_s, 4),
        "round_trip_s": stat(rtt),
        "transfer_s": stat(transfer),
        "receive_s": stat([o.receive_s for o in outcomes]),
        "lock_wait_s": stat([o.lock_wait_s for o in outcomes]),
        "decode_s": stat([o.decode_s for o in outcomes]),
        "load_s": stat([o.load_s for o in outcomes]),
        "receivers_cpu_s": round(cpu_s, 3),
        "trainer_push_cpu_s": round(push_cpu_s, 3),
        "trainer_encode_cpu_s": round(encode_cpu_s, 3),
    }


def medians(rounds: list[dict]) -> dict:
    """Median over rounds of each scalar, and of each per-generator median / max."""
    out: dict = {"generators": rounds[0]["generators"]}
    for key, value in rounds[0].items():
        if key == "generators":
            continue
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(r[key][k] for r in rounds), 4) for k in value}
        else:
            out[key] = round(statistics.median(r[key] for r in rounds), 4)
    return out


if __name__ == "__main__":
    main()
