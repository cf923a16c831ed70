"""Container entrypoint of the trainer: `python -m rollstream.trainer`, resuming from the
newest complete checkpoint in `checkpoint_dir` when there is one.

The trainer's own `resume = "latest"` refuses to start when checkpoint_dir holds no
checkpoint, which is exactly the state of a fresh volume on the first start; a container
that restarts (crash, eviction, node drain, `docker compose restart`) must pick up where
it left off. So: settings are read the trainer's way (TOML, ROLLSTREAM_* environment,
flags), and `--resume latest` is added only when a checkpoint exists and no `resume` was
configured. Everything else is the trainer's own main().

    trainer_start.py [trainer flags]

A configuration file (`--config`) that says `colocate = "sync"` or `"async"` runs the colocated
process instead (the trainer and a generator in one process: rollstream.launcher.colocated,
its file's shape in launcher/colocation.py; compose.one-gpu.yaml, k8s-one-gpu/), with the same
resume rule for its trainer. `backend = "vllm"` in its [generator] table makes the generator
half a vLLM engine in this process (docs/design.md, "One device"); this image has no vLLM, so
that exits at start saying so (docs/deploy.md, "One GPU": what an image for it needs).

Several GPUs, several machines (issue 47; docs/deploy.md, "The trainer on several GPUs and
machines"): with `device = "cuda"` and more than one GPU visible (CUDA_VISIBLE_DEVICES, else
the /dev/nvidiaN nodes the container runtime gave this container: compose.yaml's
ROLLSTREAM_TRAINER_GPU=0,1,2,3, a pod's `nvidia.com/gpu: 4`), or when torchrun's own variables
say so (PET_NPROC_PER_NODE, PET_NNODES > 1), this process becomes torchrun, one rank a GPU:

    python -m torch.distributed.run --standalone --nproc-per-node=K trainer_start.py ARGS
    python -m torch.distributed.run --nproc-per-node=K --nnodes=M --rdzv-backend=c10d
        --rdzv-endpoint=HOST:PORT --rdzv-id=RUN --rdzv-conf=is_host=0|1,join_timeout=S
        --local-addr=NAME trainer_start.py ARGS

and torchrun runs this file again in every rank (LOCAL_RANK set), which then runs the trainer's
main() as above. ARGS carry the `--resume latest` decided here; a rank decides it again when
torchrun restarts it, from the same checkpoints. Several machines (k8s-multi-node/): PET_NNODES,
PET_RDZV_ENDPOINT (node 0's name and port, default 29400), PET_NODE_RANK (else the number at the
end of the host name: a StatefulSet's pod index), PET_LOCAL_ADDR (this node's stable name).
Node 0 hosts the rendezvous (is_host, not guessed from DNS, which may lag the pod's start). The
c10d rendezvous numbers the nodes by their addresses in sorted order (it ignores --node-rank),
so rank 0 (the one that serves gRPC and HTTP, talks to Redis and writes the weight store) is on
node 0, the pod the trainer Service selects, when the names sort as the indexes do:
trainer-0.<service> comes first among trainer-N.<service>. A rank checks it at start
(GROUP_RANK against PET_NODE_RANK) and says so on stderr when not. c10d rather than the static
rendezvous: when a pod restarts and joins again, torchrun on the others restarts their ranks,
so the job resumes without waiting for a collective to fail. On a node other than 0, where no
rank serves HTTP, this process stays torchrun's parent and answers /healthz and /readyz on the
trainer's http_port while torchrun runs (the probes of the pod); on node 0 it replaces itself
with torchrun. One GPU, device cpu, a `cuda:N` device, a colocated file: the single process,
exactly as before.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

from rollstream.core.config import load_or_exit
from rollstream.launcher import colocation  # torch-free: the image's launcher and generator packages
from rollstream.trainer import checkpoint
from rollstream.trainer.config import TrainerSettings


def start_args(argv: list[str], table: str = "") -> list[str]:
    """The trainer's arguments: `argv`, plus `--resume latest` when a checkpoint is there
    (`table`: the trainer's table of a colocated file)."""
    settings = load_or_exit(TrainerSettings, argv, table)  # a bad setting exits 2 here, named, as the trainer would
    if settings.resume or not settings.checkpoint_dir:
        return argv
    if checkpoint.latest(Path(settings.checkpoint_dir)) is None:
        return argv  # first start: nothing to resume
    return [*argv, "--resume", "latest"]


# torchrun sets it in every rank it starts: this process is then a rank, not the launcher.
RANK_ENV = "LOCAL_RANK"
# torchrun's wait between the SIGTERM it forwards to its ranks and SIGKILL (its default is 30 s):
# the step in progress finishes, inside the 300 s grace of compose.yaml and k8s/30-trainer.yaml.
SHUTDOWN_TIMEOUT_S = 270
RDZV_PORT = 29400  # node 0's rendezvous port (k8s/30-trainer.yaml's `rendezvous`)
JOIN_TIMEOUT_S = 1800  # how long the nodes wait for each other (pods pulling a large image on new machines)


def visible_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> int:
    """GPUs this process can use, without importing torch: CUDA_VISIBLE_DEVICES when set (up to
    its first negative id, as CUDA reads it), else the /dev/nvidiaN device nodes (a container
    gets exactly the GPUs it was given: Docker's device_ids, the device plugin's allocation)."""
    ids = environ.get("CUDA_VISIBLE_DEVICES")
    if ids is not None:
        count = 0
        for i in ids.split(","):
            if not i.strip() or i.strip().startswith("-"):
                break
            count += 1
        return count
    return sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


class Ranks(NamedTuple):  # not a dataclass: the tests load this file by path, outside sys.modules
    """How torchrun runs the trainer here: `nproc` ranks on this node, node `node_rank` of
    `nnodes`; when nnodes > 1, the rendezvous at `endpoint` (host:port of node 0) named
    `run_id`, this node known to the others as `local_addr` (torchrun's guess when empty)."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str = ""
    run_id: str = ""
    local_addr: str = ""


def _whole(environ: Mapping[str, str], name: str, default: int, least: int) -> int:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < least:
        print(f"trainer_start: {name}={value!r}: expected a whole number >= {least}", file=sys.stderr)
        sys.exit(2)
    return int(value)


def ranks(
    device: str,
    environ: Mapping[str, str],
    dev: Path = Path("/dev"),
    hostname: str | None = None,
    run_id: str = "rollstream",
) -> Ranks | None:
    """The ranks to start, or None for the single process (one GPU, the CPU, `cuda:N`, or
    this process already a rank). Read from torchrun's own variables (PET_*, which torchrun
    would read too) and the GPUs visible."""
    if RANK_ENV in environ:
        return None
    nnodes = _whole(environ, "PET_NNODES", 1, 1)
    gpus = visible_gpus(environ, dev) if device == "cuda" else 1
    nproc = _whole(environ, "PET_NPROC_PER_NODE", max(gpus, 1), 1)
    if nproc == 1 and nnodes == 1:
        return None
    if nnodes == 1:
        return Ranks(nproc)
    endpoint = environ.get("PET_RDZV_ENDPOINT", "").strip()
    if not endpoint:
        print("trainer_start: PET_NNODES > 1 needs PET_RDZV_ENDPOINT, node 0's host[:port]", file=sys.stderr)
        sys.exit(2)
    if not re.search(r":\d+$", endpoint):
        endpoint = f"{endpoint}:{RDZV_PORT}"
    node_rank = _whole(environ, "PET_NODE_RANK", -1, 0)
    if node_rank < 0:  # a StatefulSet pod's name ends with its index: trainer-3
        m = re.search(r"-(\d+)$", (hostname or socket.gethostname()).split(".")[0])
        if m is None:
            print("trainer_start: PET_NNODES > 1 needs PET_NODE_RANK (or a host name ending -N)", file=sys.stderr)
            sys.exit(2)
        node_rank = int(m.group(1))
    if node_rank >= nnodes:
        print(f"trainer_start: node rank {node_rank} of {nnodes} nodes (PET_NNODES too small?)", file=sys.stderr)
        sys.exit(2)
    run = environ.get("PET_RDZV_ID", "").strip() or run_id
    return Ranks(nproc, nnodes, node_rank, endpoint, run, environ.get("PET_LOCAL_ADDR", "").strip())


def placement_warning(environ: Mapping[str, str]) -> str | None:
    """In a rank: a warning when torchrun's node number (GROUP_RANK) is not this pod's index
    (PET_NODE_RANK), i.e. rank 0 may be on a pod the trainer Service does not select."""
    group, node = environ.get("GROUP_RANK", ""), environ.get("PET_NODE_RANK", "").strip()
    if not group or not node or group == node:
        return None
    return (
        f"trainer_start: WARNING torchrun made node {node} (PET_NODE_RANK) its node {group}: rank 0 is "
        "on the node whose address sorts first (PET_LOCAL_ADDR), which the trainer Service may not select"
    )


def torchrun_command(r: Ranks, args: list[str], script: str = __file__) -> list[str]:
    """`python -m torch.distributed.run ... <this file> args`: torchrun runs this file again in
    every rank."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={r.nproc}",
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
    ]
    if r.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={r.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={r.endpoint}",
            f"--rdzv-id={r.run_id}",
            # Node 0 hosts the rendezvous store (said, not guessed from a DNS name that may lag).
            f"--rdzv-conf=is_host={int(r.node_rank == 0)},join_timeout={JOIN_TIMEOUT_S}",
            *([f"--local-addr={r.local_addr}"] if r.local_addr else []),
        ]
    # `--` ends torchrun's options: its parser takes any later flag that abbreviates one of its
    # own (the trainer's --run would be its --run-path).
    return [*cmd, str(Path(script).resolve()), "--", *args]


def serve_health(host: str, port: int, alive: Callable[[], bool]) -> ThreadingHTTPServer:
    """/healthz and /readyz on host:port, 200 while `alive()` (else 503), in a daemon thread:
    a node other than 0 has no rank serving HTTP, and its pod's probes must still pass."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/healthz", "/readyz"):
                self.send_error(404)
                return
            ok = alive()
            body = b"ok\n" if ok else b"torchrun has exited\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # a probe every 10 s: nothing to log

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server


def run_ranks(cmd: list[str], r: Ranks, settings: TrainerSettings) -> int:
    """Node 0: become torchrun (exec; signals reach it directly). Another node: run it as a
    child, forward SIGTERM/SIGINT to it, answer the probes while it runs, exit with its status."""
    if r.node_rank == 0:
        os.execv(cmd[0], cmd)
    started: list[subprocess.Popen[bytes]] = []
    signalled: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        signalled.append(sig)
        if started:
            started[0].send_signal(sig)

    # The handlers first: a SIGTERM while torchrun starts is passed on once it has started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    # The port next: a port it cannot bind fails here, before torchrun would be left running.
    # Alive while torchrun starts and runs: 503 only once it has exited.
    server = serve_health(settings.host, settings.http_port, lambda: not started or started[0].poll() is None)
    try:
        child = subprocess.Popen(cmd)
        started.append(child)
        if signalled:
            child.send_signal(signalled[0])
        code = child.wait()
    finally:
        server.shutdown()
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's 128 + N


def main() -> None:
    argv = sys.argv[1:]
    if colocation.colocated_file(argv):
        from rollstream.launcher import colocated

        args = start_args(argv, table="trainer")
        print(f"trainer_start: python -m rollstream.launcher.colocated {' '.join(args)}", file=sys.stderr, flush=True)
        sys.exit(colocated.main(args))
    args = start_args(argv)  # every rank gets the same `--resume latest`, decided once here
    settings = load_or_exit(TrainerSettings, args)
    r = ranks(settings.device, os.environ, run_id=settings.run)
    if r is not None:
        cmd = torchrun_command(r, args)
        print(f"trainer_start: {' '.join(cmd)}", file=sys.stderr, flush=True)
        sys.exit(run_ranks(cmd, r, settings))
    from rollstream.trainer.service import main as trainer_main

    rank = f" (rank {os.environ['RANK']} of {os.environ.get('WORLD_SIZE', '?')})" if "RANK" in os.environ else ""
    warning = placement_warning(os.environ)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(f"trainer_start{rank}: python -m rollstream.trainer {' '.join(args)}", file=sys.stderr, flush=True)
    trainer_main(args)


if __name__ == "__main__":
    main()
