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


def serve_sink(state_file: str, die_in_push: int, secrets: str, nonce_delay_s: float, apply_s: float) -> None:
    """A receiver with the generator's receive path only (for --backend sink), forwarding as a
    generator does where the push names targets (rollstream.generator.relay). Each version it
    received whole (sha256 checked) is appended to STATE_FILE.served with the wall clock.
    `die_in_push` > 0: SIGKILL itself at the first chunk of its that-many-th push (a relay
    killed mid-push). `secrets` (a folder of `rollstream secrets`' grpc/ files, or ""): pushes
    are signed, as a generator with grpc_auth_file takes them (the same interceptor, nonces
    proven with the generator's key, applied pushes acknowledged). `nonce_delay_s`: PushNonce
    answers that late (a slow or stalled member). `apply_s`: once a payload is received whole
    it waits this long before answering, as a generator's apply would (lock wait, decode, load)."""
    import signal
    import threading

    import grpc

    from rollstream.core import credentials, grpc_auth, push_signing, weight_transfer
    from rollstream.core.grpc_auth import ClientCredentials
    from rollstream.generator.relay import PeerChannels, RelayedStream
    from rollstream.v1 import generator_pb2, generator_pb2_grpc, weights_pb2

    nonces = push_signing.PushNonces()
    table = prover = None
    if secrets:
        folder = credentials.grpc_dir(Path(secrets))
        table = grpc_auth.parse_roles((folder / "roles.json").read_text(), "roles.json")
        prover = push_signing.GeneratorProver(credentials.read_secret(folder / "generator.token", "generator token"))

    pushes = 0
    lock = threading.Lock()
    served = open(state_file + ".served", "a")
    peers = PeerChannels(ClientCredentials())
    address = ""

    def dying(chunks):
        for chunk in chunks:
            os.kill(os.getpid(), signal.SIGKILL)
            yield chunk

    class Sink(generator_pb2_grpc.GeneratorServicer):
        def PushWeights(self, request_iterator, context):
            nonlocal pushes
            start = time.perf_counter()
            with lock:
                pushes += 1
                die = pushes == die_in_push
            stream = RelayedStream(request_iterator, address, peers, context.time_remaining())
            version, signed_header = 0, None
            try:
                # Killed after its first chunk went on to its targets: their streams break off.
                for header, _payload in weight_transfer.from_chunks(dying(stream) if die else stream):
                    version, signed_header = header.version, header
                with lock:  # served: received whole and checked, before the targets answer
                    served.write(json.dumps({"version": version, "t": time.time()}) + "\n")
                    served.flush()
                received = time.perf_counter() - start
                time.sleep(apply_s)
            finally:
                relayed = stream.finish(read_rest=False)
            signed = push_signing.parse_signature(context.invocation_metadata())
            ack = (
                prover.ack(signed[0], signed_header)
                if prover is not None and signed is not None and signed_header is not None
                else b""
            )
            return weights_pb2.PushResult(
                applied=True,
                version=version,
                apply_seconds=time.perf_counter() - start,
                receive_seconds=received,
                relayed=relayed,
                ack=ack,
            )

        def PushNonce(self, request, context):
            time.sleep(nonce_delay_s)
            nonce = nonces.issue()
            proof = prover.prove(request.challenge, nonce, address) if prover is not None else b""
            return generator_pb2.PushNonceResponse(nonce=nonce, address=address, proof=proof)

    from rollstream.core.grpc_utils import CHANNEL_OPTIONS

    interceptors = [grpc_auth.AuthInterceptor(table, nonces=nonces)] if table is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS, interceptors=interceptors)
    generator_pb2_grpc.add_GeneratorServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    server.start()
    tmp = Path(state_file + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "grpc_port": port}))
    tmp.replace(state_file)
    server.wait_for_termination()


def start_receiver(
    args: argparse.Namespace, index: int, redis_url: str, model_dir: str, workdir: Path, secrets: str
) -> tuple[subprocess.Popen[bytes], Path]:
    from rollstream.core import credentials

    state_file = workdir / f"receiver{index}.state.json"
    if args.backend == "sink":
        die = args.kill_relay_round if index == 0 and args.fanout else 0
        delay = args.slow_nonce_s if index == args.slow_index else 0.0
        cmd = [
            sys.executable,
            __file__,
            "--serve-sink",
            str(state_file),
            "--die-in-push",
            str(die),
            "--sink-secrets",
            secrets,
            "--nonce-delay-s",
            str(delay),
            "--apply-s",
            str(args.apply_s),
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "rollstream.generator",
            "--redis-url",
            redis_url,
            "--run",
            "fanout",
            "--model",
            model_dir,
            "--backend",
            args.backend,
            "--state-file",
            str(state_file),
            "--log-level",
            "WARNING",
            "--generator-id",
            f"g{index}",
            "--threads",
            str(args.generator_threads),
        ]
        if args.poll_steps:  # syncing from the trainer too, with its weights_applied lines (hops)
            cmd += ["--trainer-address", (workdir / "trainer_address").read_text(), "--log-level", "INFO"]
        if secrets:
            cmd += credentials.service_flags(Path(secrets), "generator", redis_acl=False)
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


def sync_race(args: argparse.Namespace, model_dir: str, redis_url: str, n: int, workdir: Path, secrets: str) -> dict:
    """--poll-steps: the trainer as it runs (rollstream.trainer.trainer's Trainer: its publisher,
    BackgroundPush and TrainerServicer, served over gRPC) with n real generators that take its
    pushes (--fanout: the relay tree) and also sync from it every sync_interval_s (the k8s
    configuration: push_fanout = 2, generators with trainer_address). Steps back to back (the
    synthetic gradient), each published, then pushed in the background as the trainer's loop
    does (Trainer.train_and_push). Counts the FetchWeights calls that streamed a payload and
    their bytes (a generator fetching what is being pushed to it: trainer egress twice over),
    the payloads the trainer pushed itself, and each relay hop from the generators' own
    weights_applied lines."""
    import threading

    import torch

    from rollstream.core import credentials
    from rollstream.core.config import load_settings
    from rollstream.core.grpc_utils import Service
    from rollstream.core.service import ServiceHost
    from rollstream.trainer.config import TrainerSettings
    from rollstream.trainer.fleet import GeneratorDirectory
    from rollstream.trainer.servicer import CheckpointRequests, TrainerServicer
    from rollstream.trainer.trainer import Trainer
    from rollstream.v1 import trainer_pb2_grpc

    fetched = {"calls": 0, "payloads": 0, "bytes": 0}
    lock = threading.Lock()

    class Counting(TrainerServicer):
        """The trainer's servicer, the FetchWeights that stream something counted."""

        def FetchWeights(self, request, context):
            payloads = nbytes = 0
            for chunk in super().FetchWeights(request, context):
                payloads += chunk.HasField("header")
                nbytes += len(chunk.data)
                yield chunk
            with lock:
                fetched["calls"] += 1 if payloads else 0
                fetched["payloads"] += payloads
                fetched["bytes"] += nbytes

    flags = credentials.service_flags(Path(secrets), "trainer", redis_acl=False) if secrets else []
    settings = load_settings(
        # On a unix socket: generators send their token only to a server nothing else can bind.
        TrainerSettings,
        flags,
        run="fanout",
        model=model_dir,
        threads=1,
        grpc_socket=str(workdir / "trainer.sock"),
        push_fanout=args.fanout,
        push_nonce_timeout_s=args.nonce_timeout,
        push_timeout_s=args.push_timeout,
        anchor_interval=1_000_000,
    )
    with ServiceHost("trainer", settings) as host:
        trainer = Trainer(settings, host)
        host.start(
            [
                Service(
                    "rollstream.v1.Trainer",
                    Counting(trainer, GeneratorDirectory([]), CheckpointRequests()),
                    trainer_pb2_grpc.add_TrainerServicer_to_server,
                )
            ]
        )
        (workdir / "trainer_address").write_text(host.grpc_address)
        procs = [start_receiver(args, i, redis_url, model_dir, workdir, secrets) for i in range(n)]
        try:
            addresses = [f"127.0.0.1:{s['grpc_port']}" for s in wait_ready(procs, args.backend, workdir)]
            gen = torch.Generator().manual_seed(0)
            direction = {name: torch.randn(p.shape, generator=gen) for name, p in trainer.params.items()}
            pushed: list = []
            sizes: list[int] = []
            start = time.perf_counter()
            for _ in range(args.poll_steps):
                for name, p in trainer.params.items():
                    p.grad = direction[name] + 0.5 * torch.randn(p.shape, generator=gen)
                encoder = trainer.publisher.begin_delta()
                _norm, bits = trainer.optimizer.step(0.0, on_piece=encoder.add_piece)
                published, stats = trainer.publisher.publish(bits, encoder)
                sizes.append(stats.nbytes)
                pushed += trainer.publisher.pushes.wait()
                trainer.publisher.pushes.start(
                    published.info.version,
                    lambda p=published: trainer.publisher.fleet.push(
                        addresses, p, args.push_timeout, fanout=args.fanout
                    ),
                )
            pushed += trainer.publisher.pushes.wait()
            seconds = time.perf_counter() - start
            time.sleep(2 * 2.0)  # two sync intervals (the default 2 s): a generator a push missed has fetched by now
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                proc.wait(timeout=120)
            trainer.close()
    with lock:
        counts = dict(fetched)
    sent = sum(1 for o in pushed if not o.via and o.applied)
    return {
        "generators": n,
        "fanout": args.fanout,
        "steps": args.poll_steps,
        "seconds": round(seconds, 2),
        "payload_bytes_median": int(statistics.median(sizes)),
        "trainer_payloads_per_step": round(sent / args.poll_steps, 2),
        "trainer_push_bytes": round(sent * statistics.mean(sizes)),
        "applied_by_push": sum(1 for o in pushed if o.applied),
        "pushes": len(pushed),
        "not_applied": sorted({o.error.split(":")[0] for o in pushed if not o.applied}),
        "fetch_calls_with_payloads": counts["calls"],
        "fetched_payloads": counts["payloads"],
        "fetched_bytes": counts["bytes"],
        "hop_s": applied_hops(workdir, addresses, pushed),
    }


def applied_hops(workdir: Path, addresses: list[str], outcomes: list) -> dict | None:
    """Real generators: per version, each relayed generator's receive end less its relay's,
    from their weights_applied lines (receiver<i>.log: the line's time less its seconds)."""
    import datetime
    import re

    received: dict[tuple[str, int], float] = {}
    for i, address in enumerate(addresses):
        for line in (workdir / f"receiver{i}.log").read_text().splitlines():
            m = re.match(r"(\S+) .* weights_applied .*version=(\d+) .*seconds=([\d.]+)", line)
            if m:
                logged = datetime.datetime.fromisoformat(m.group(1)).timestamp()
                received[(address, int(m.group(2)))] = logged - float(m.group(3))
    hops = [
        received[(o.address, o.version)] - received[(o.via, o.version)]
        for o in outcomes
        if o.via and (o.address, o.version) in received and (o.via, o.version) in received
    ]
    return {"n": len(hops), "median": round(statistics.median(hops), 4), "max": round(max(hops), 4)} if hops else None


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
    parser.add_argument(
        "--payload",
        choices=["delta", "first", "anchor"],
        default="delta",
        help="delta: a steady-state step's delta (after Adam's first); first: Adam's first step; anchor: full weights (sink only)",
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--generator-threads", type=int, default=1, help="torch threads per generator process")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vllm: no torch.compile (starts in seconds; no effect on weight loads)",
    )
    parser.add_argument("--push-timeout", type=float, default=600.0)
    parser.add_argument(
        "--fanout",
        type=int,
        default=0,
        help="push down a relay tree of this fanout (0: the trainer pushes to every receiver)",
    )
    parser.add_argument(
        "--kill-relay-round",
        type=int,
        default=0,
        help="sink, with --fanout: receiver 0 (a root) kills itself at its Nth push's first chunk",
    )
    parser.add_argument("--die-in-push", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--signed", action="store_true", help="signed pushes, as with grpc_auth_file: nonces, proofs, acknowledgements"
    )
    parser.add_argument("--nonce-timeout", type=float, default=3.0, help="the trainer's push_nonce_timeout_s")
    parser.add_argument(
        "--slow-index", type=int, default=-1, help="sink, --signed: this receiver answers PushNonce --slow-nonce-s late"
    )
    parser.add_argument("--slow-nonce-s", type=float, default=10.0)
    parser.add_argument(
        "--apply-s",
        type=float,
        default=0.0,
        help="sink: seconds each receiver takes after receiving a payload, as an apply",
    )
    parser.add_argument("--sink-secrets", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--poll-steps",
        type=int,
        default=0,
        help="real generators: the sync race (sync_race), this many steps, with --counts N generators",
    )
    parser.add_argument("--nonce-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sink:
        serve_sink(args.serve_sink, args.die_in_push, args.sink_secrets, args.nonce_delay_s, args.apply_s)
        return
    counts = [int(c) for c in args.counts.split(",")]
    if args.payload != "delta" and args.backend != "sink":
        parser.error(
            "--payload first / anchor are for --backend sink (a generator takes Adam's first step once per start)"
        )

    import torch

    from rollstream.core import credentials, deltas, modeling
    from rollstream.core.grpc_auth import ClientCredentials, load_roles
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
        secrets = str(workdir / "secrets") if args.signed else ""
        tokens = credentials.ensure_grpc_tokens(Path(secrets)) if secrets else {}
        if args.poll_steps:
            race = sync_race(args, model_dir, redis_server.url, n_max, workdir, secrets)
            print(
                json.dumps(
                    {
                        "benchmark": "weight_fanout_sync_race",
                        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                        "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
                        "model": model_dir,
                        **race,
                    },
                    indent=2,
                )
            )
            return
        procs = [start_receiver(args, i, redis_server.url, model_dir, workdir, secrets) for i in range(n_max)]
        try:
            t = time.perf_counter()
            states = wait_ready(procs, args.backend, workdir)
            startup_s = time.perf_counter() - t
            addresses = [f"127.0.0.1:{s['grpc_port']}" for s in states]
            pids = [p.pid for p, _ in procs]

            model, _ = modeling.load_model(model_dir)
            params = modeling.named_weights(model)
            opt = HostAdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0, moments_dtype="float32")
            publisher = WeightPublisher(
                opt.sync_model(),
                anchor_interval=1_000_000,
                nonce_timeout_s=args.nonce_timeout,
                creds=ClientCredentials(token=tokens["trainer"]) if tokens else None,
                generator_key=load_roles(str(credentials.grpc_dir(Path(secrets)) / "roles.json")).generator_key
                if secrets
                else None,
            )
            gen = torch.Generator().manual_seed(0)
            direction = {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}

            def step() -> tuple[dict, deltas.DeltaEncoder]:
                """One AdamW step, its delta encoded on the way as the trainer does (the bits
                are views of the split layout's masters: the step changes the base in place)."""
                for name, p in params.items():
                    p.grad = direction[name] + 0.5 * torch.randn(p.shape, generator=gen)
                encoder = publisher.begin_delta()
                _norm, bits = opt.step(0.0, on_piece=encoder.add_piece)
                return bits, encoder

            dead: set[str] = set()

            def push(targets: list[str], published: Published) -> list:
                outcomes = publisher.fleet.push(targets, published, args.push_timeout, fanout=args.fanout)
                for o in outcomes:
                    if not o.applied and args.slow_index >= 0 and o.address == addresses[args.slow_index]:
                        continue  # the slow member: left out, then backed off (it would catch up)
                    if not o.applied and not (args.kill_relay_round and o.address == addresses[0]):
                        raise RuntimeError(
                            f"push of version {published.info.version} to {o.address} not applied: {o.error}"
                        )
                    if not o.applied:
                        dead.add(o.address)  # the relay that killed itself: out of the later rounds
                return outcomes

            sink = args.backend == "sink"
            fixed: tuple[Published, int, float, float] | None = None
            if not sink or args.payload != "first":
                # Adam's first step moves every weight; steady-state deltas come after it.
                published, _ = publisher.publish(*step())
                if not sink:
                    push(addresses, published)
            if sink:
                # Sinks keep no chain: one payload, encoded once, pushed every round.
                stepped = None if args.payload == "anchor" else step()
                t = time.perf_counter()
                if stepped is None:
                    # The anchor was encoded when the publisher started; time a fresh encode of it.
                    published = publisher.catch_up_payloads(-1, "")[0]
                    deltas.encode_anchor(publisher.bits(), published.info.version, publisher.fingerprint)
                    nbytes, fraction = len(published.payload), 1.0
                else:
                    published, stats = publisher.publish(*stepped)
                    nbytes, fraction = stats.nbytes, stats.fraction_of_dense
                fixed = (published, nbytes, fraction, time.perf_counter() - t)
            rounds: dict[int, list[dict]] = {n: [] for n in counts}
            for _ in range(args.rounds):
                for n in counts:
                    stepped = None if sink else step()
                    cpu_before = [cpu_seconds(pid) for pid in pids[:n]]
                    own_before = cpu_seconds(os.getpid())
                    step_end = time.perf_counter()  # the trainer's bf16 weights for the new version exist
                    if stepped is not None:
                        published, stats = publisher.publish(*stepped)
                        nbytes, fraction = stats.nbytes, stats.fraction_of_dense
                        encode_s = time.perf_counter() - step_end
                    else:
                        published, nbytes, fraction, encode_s = fixed
                    encoded = time.perf_counter()
                    push_cpu_before = cpu_seconds(os.getpid())
                    step_end_wall = time.time() - (encoded - step_end)
                    outcomes = push([a for a in addresses[:n] if a not in dead], published)
                    done = time.perf_counter()
                    push_cpu = cpu_seconds(os.getpid()) - push_cpu_before
                    encode_cpu = push_cpu_before - own_before
                    cpu = sum(cpu_seconds(pid) for pid in pids[:n] if Path(f"/proc/{pid}").exists()) - sum(cpu_before)
                    if n < n_max and not sink:
                        push(addresses[n:], published)  # untimed: keep every generator on the chain
                    row = summarize_round(
                        n, nbytes, fraction, encode_s, done - encoded, outcomes, cpu, push_cpu, encode_cpu
                    )
                    if sink:
                        slow = addresses[args.slow_index] if 0 <= args.slow_index < n else ""
                        row.update(
                            serving(
                                workdir, addresses[:n], published.info.version, step_end_wall, outcomes, nbytes, slow
                            )
                        )
                    rounds[n].append(row)
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
    print(
        json.dumps(
            {
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
            },
            indent=2,
        )
    )


def summarize_round(
    n: int,
    nbytes: int,
    fraction: float,
    encode_s: float,
    push_s: float,
    outcomes: list,
    cpu_s: float,
    push_cpu_s: float,
    encode_cpu_s: float,
) -> dict:
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


def serving(
    workdir: Path, addresses: list[str], version: int, step_end_wall: float, outcomes: list, nbytes: int, slow: str
) -> dict:
    """Sinks: each receiver's step end -> served (received whole; its own wall clock, same
    machine), whether every live one got the version whole, what left the trainer (a payload
    per push it made itself: outcomes without a relay, nonce calls aside), each relay hop's
    cost (a receiver's served time less its relay's: one chunk when the relay forwards on
    receipt, its whole apply when it forwards only after it), and the latest receiver other
    than `slow` (the slow member's address, or "")."""
    served: dict[str, float] = {}
    for i, address in enumerate(addresses):
        path = workdir / f"receiver{i}.state.json.served"
        lines = path.read_text().splitlines() if path.exists() else []
        times = [json.loads(line)["t"] for line in lines if json.loads(line)["version"] == version]
        if times and times[-1] >= step_end_wall:  # sinks get one version every round: this round's is the last
            served[address] = times[-1] - step_end_wall
    sent = sum(1 for o in outcomes if not o.via and o.applied)
    hops = [served[o.address] - served[o.via] for o in outcomes if o.via and o.address in served and o.via in served]
    others = [s for a, s in served.items() if a != slow]
    return {
        "served": len(served),
        "applied": sum(1 for o in outcomes if o.applied),
        "step_end_to_serving_s": {
            "median": round(statistics.median(served.values()), 4),
            "max": round(max(served.values()), 4),
        }
        if served
        else None,
        "others_than_slow_max_s": round(max(others), 4) if others else None,
        "hop_s": {"median": round(statistics.median(hops), 4), "max": round(max(hops), 4)} if hops else None,
        "trainer_payloads": sent,
        "trainer_bytes": sent * nbytes,
        "trainer_bytes_over_payload": sent,
        "left_out": sorted(o.error.split(":")[0] for o in outcomes if not o.applied),
    }


def medians(rounds: list[dict]) -> dict:
    """Median over rounds of each scalar, and of each per-generator median / max."""
    out: dict = {"generators": rounds[0]["generators"]}
    for key, value in rounds[0].items():
        if key == "generators" or isinstance(value, list) or any(r.get(key) is None for r in rounds):
            continue
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(r[key][k] for r in rounds), 4) for k in value}
        else:
            out[key] = round(statistics.median(r[key] for r in rounds), 4)
    return out


if __name__ == "__main__":
    main()
