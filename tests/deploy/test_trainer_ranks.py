"""docker/trainer_start.py as the launcher of a multi-rank trainer (issue 47): how many ranks it
starts and where (GPUs it can see, torchrun's PET_* variables, a StatefulSet pod's index), the
torchrun command it runs, every rank getting the one `--resume latest` decided before they
start, and the probes of a node other than 0 (which no rank serves).

Two tests run the real torchrun (torch.distributed.run of this environment's torch) on the
CPU, with the trainer's main() replaced in the ranks by a stub (a `sitecustomize` on
PYTHONPATH) that records what each rank was given: one node with two ranks, and two nodes
(two launchers, as two pods) meeting at node 0's rendezvous, rank 0 on node 0 whichever starts
first. The trainer itself under torchrun (FSDP2, its ranks) is not run here: it is another
change's (services/trainer), and a GPU's."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from deploy_files import DOCKER_DIR

LAUNCHER = DOCKER_DIR / "trainer_start.py"


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("trainer_start_ranks", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_dev(tmp_path: Path, gpus: int) -> Path:
    """A /dev as the NVIDIA container runtime fills it: one nvidiaN per GPU given, plus the
    control nodes every GPU container gets."""
    dev = tmp_path / f"dev{gpus}"
    dev.mkdir(exist_ok=True)
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]:
        (dev / name).touch()
    return dev


def test_visible_gpus_without_torch(launcher, tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, 4)
    assert launcher.visible_gpus({}, dev) == 4
    assert launcher.visible_gpus({}, fake_dev(tmp_path, 0)) == 0
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, dev) == 2  # CUDA's own list wins
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, dev) == 0
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, dev) == 1  # CUDA stops at a negative id
    # Loading the launcher (what every start does before it decides) loads neither the trainer's
    # service (transformers) nor torch.distributed: torchrun and the trainer do, in their processes.
    heavy = ("transformers", "rollstream.trainer.service", "torch.distributed.run")
    code = f"import runpy, sys; runpy.run_path(sys.argv[1]); print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code, str(LAUNCHER)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_one_gpu_the_cpu_or_one_named_device_is_the_single_process(launcher, tmp_path: Path) -> None:
    """k = 1 stays exactly today's path: no torchrun."""
    assert launcher.ranks("cuda", {}, fake_dev(tmp_path, 1)) is None
    assert launcher.ranks("cuda", {}, fake_dev(tmp_path, 0)) is None  # (the trainer then says there is no GPU)
    four = fake_dev(tmp_path, 4)
    assert launcher.ranks("cpu", {}, four) is None
    assert launcher.ranks("cuda:1", {}, four) is None  # one device named: one process
    # A rank that torchrun started runs the trainer, never torchrun again.
    assert launcher.ranks("cuda", {"LOCAL_RANK": "0", "PET_NNODES": "2"}, four) is None
    # compose.yaml / k8s/ with one machine set PET_NNODES=1 (and a node rank 0): still one process.
    assert launcher.ranks("cuda", {"PET_NNODES": "1", "PET_NODE_RANK": "0"}, fake_dev(tmp_path, 1)) is None


def test_one_rank_a_visible_gpu(launcher, tmp_path: Path) -> None:
    four = fake_dev(tmp_path, 4)
    r = launcher.ranks("cuda", {}, four)
    assert r == launcher.Ranks(nproc=4)
    cmd = launcher.torchrun_command(r, ["--checkpoint-dir", "/checkpoints", "--resume", "latest"])
    assert cmd == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--shutdown-timeout={launcher.SHUTDOWN_TIMEOUT_S}",
        "--standalone",
        str(LAUNCHER.resolve()),
        "--",  # torchrun's options end: the trainer's flags are its script's, whatever they abbreviate
        "--checkpoint-dir",
        "/checkpoints",
        "--resume",
        "latest",
    ]
    assert launcher.SHUTDOWN_TIMEOUT_S < 300, "torchrun must stop its ranks inside the containers' 300 s grace"
    # PET_NPROC_PER_NODE (torchrun's own variable) wins over the count, on the CPU too (gloo).
    assert launcher.ranks("cuda", {"PET_NPROC_PER_NODE": "2"}, four) == launcher.Ranks(nproc=2)
    assert launcher.ranks("cpu", {"PET_NPROC_PER_NODE": "2"}, four) == launcher.Ranks(nproc=2)


def test_several_nodes_c10d_rendezvous_hosted_by_node_0(launcher, tmp_path: Path) -> None:
    eight = fake_dev(tmp_path, 8)
    env = {
        "PET_NNODES": "3",
        "PET_NODE_RANK": "2",
        "PET_RDZV_ENDPOINT": "trainer-0.trainer-ranks.rollstream.svc:29400",
        "PET_LOCAL_ADDR": "trainer-2.trainer-ranks.rollstream.svc",
    }
    r = launcher.ranks("cuda", env, eight, run_id="demo")
    assert r == launcher.Ranks(
        8, 3, 2, "trainer-0.trainer-ranks.rollstream.svc:29400", "demo", "trainer-2.trainer-ranks.rollstream.svc"
    )
    cmd = launcher.torchrun_command(r, ["--config", "/etc/rollstream/trainer.toml"])
    assert cmd[3:-4] == [
        "--nproc-per-node=8",
        f"--shutdown-timeout={launcher.SHUTDOWN_TIMEOUT_S}",
        "--nnodes=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=trainer-0.trainer-ranks.rollstream.svc:29400",
        "--rdzv-id=demo",
        f"--rdzv-conf=is_host=0,join_timeout={launcher.JOIN_TIMEOUT_S}",  # node 0 hosts the store
        "--local-addr=trainer-2.trainer-ranks.rollstream.svc",  # the order of the nodes' ranks
    ]
    # Node rank from the host name when the downward API gave none (a cluster without the
    # pod-index label); the default port; PET_RDZV_ID over the run name.
    env0 = {"PET_NNODES": "3", "PET_NODE_RANK": "", "PET_RDZV_ENDPOINT": "trainer-0.x", "PET_RDZV_ID": "job7"}
    r0 = launcher.ranks("cuda", env0, eight, hostname="trainer-0", run_id="demo")
    assert r0 == launcher.Ranks(8, 3, 0, "trainer-0.x:29400", "job7", "")
    assert f"--rdzv-conf=is_host=1,join_timeout={launcher.JOIN_TIMEOUT_S}" in launcher.torchrun_command(r0, [])
    assert not any(a.startswith("--local-addr") for a in launcher.torchrun_command(r0, []))


def test_a_rank_says_when_rank_0_is_not_on_node_0(launcher) -> None:
    assert launcher.placement_warning({}) is None
    assert launcher.placement_warning({"GROUP_RANK": "1", "PET_NODE_RANK": "1"}) is None
    assert launcher.placement_warning({"GROUP_RANK": "0", "PET_NODE_RANK": ""}) is None
    assert "PET_NODE_RANK" in launcher.placement_warning({"GROUP_RANK": "0", "PET_NODE_RANK": "1"})


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PET_NNODES": "two"}, "PET_NNODES"),
        ({"PET_NNODES": "0"}, "PET_NNODES"),
        ({"PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "1"}, "PET_RDZV_ENDPOINT"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_RDZV_ENDPOINT": "h"}, "node rank 2 of 2"),
        ({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "h"}, "PET_NODE_RANK"),
    ],
)
def test_bad_rank_settings_exit_2_naming_them(
    launcher, tmp_path: Path, env: dict, says: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_:
        launcher.ranks("cuda", env, fake_dev(tmp_path, 2), hostname="box")
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def _write_checkpoint(ckpt: Path) -> None:
    import torch

    from rollstream.trainer import checkpoint

    state = checkpoint.CheckpointState(version=3, step=3, optimizer_steps=3)
    tensors = {f"{kind}/w": torch.zeros(4) for kind in ("master", "exp_avg", "exp_avg_sq")}
    checkpoint.save(ckpt / "step-00000003", state, tensors, checkpoint.rng_state(), replace=True)


def test_main_decides_resume_once_then_every_rank_runs_the_trainer(
    launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith(("ROLLSTREAM_", "PET_"))] + ["LOCAL_RANK", "RANK"]:
        monkeypatch.delenv(name, raising=False)
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(ckpt)
    argv = ["--device", "cuda", "--checkpoint-dir", str(ckpt)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(sys, "argv", ["trainer_start.py", *argv])
    execs = []

    def execv(path: str, cmd: list[str]) -> None:
        execs.append(cmd)
        raise SystemExit(0)

    monkeypatch.setattr(launcher.os, "execv", execv)
    with pytest.raises(SystemExit):
        launcher.main()
    (cmd,) = execs
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert cmd[-len(argv) - 4 :] == [str(LAUNCHER.resolve()), "--", *argv, "--resume", "latest"]
    # A rank: torchrun's variables set, the same arguments: the trainer's main, resume not added twice.
    import rollstream.trainer.service as service

    called = []
    monkeypatch.setattr(service, "main", lambda args: called.append(args) or 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(sys, "argv", ["trainer_start.py", *cmd[-len(argv) - 2 :]])
    launcher.main()
    assert called == [[*argv, "--resume", "latest"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_health_of_a_node_without_rank_0(launcher) -> None:
    alive = [True]
    server = launcher.serve_health("127.0.0.1", 0, lambda: alive[0])
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert _get(base + "/healthz") == (200, "ok\n") and _get(base + "/readyz")[0] == 200
        assert _get(base + "/metrics")[0] == 404
        alive[0] = False
        assert _get(base + "/healthz")[0] == 503 and _get(base + "/readyz")[0] == 503
    finally:
        server.shutdown()


def test_a_node_other_than_0_answers_probes_and_forwards_sigterm(launcher) -> None:
    """run_ranks on node 1: torchrun (here a stand-in) is its child, the probes pass while it
    runs, SIGTERM reaches it, and the launcher exits with its status (128 + 15)."""
    port = _free_port()
    child = [sys.executable, "-c", "import time; time.sleep(120)"]
    settings = SimpleNamespace(host="127.0.0.1", http_port=port)
    seen = []

    def probe_then_stop() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                seen.append(_get(f"http://127.0.0.1:{port}/healthz"))
                break
            except OSError:
                time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=probe_then_stop, daemon=True).start()
    try:
        code = launcher.run_ranks(child, launcher.Ranks(1, 2, 1, "127.0.0.1:1", "demo"), settings)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert seen == [(200, "ok\n")]
    assert code == 128 + signal.SIGTERM


STUB = """
import json, os, sys, types
# The trainer's main() in each rank: record what the rank was given (no model, no Redis).
def main(args):
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    record = {"args": args, **{k: os.environ.get(k) for k in keys}}
    out = os.path.join(os.environ["STUB_OUT"], "rank-%s.json" % os.environ["RANK"])
    with open(out, "w") as f:
        json.dump(record, f)
    return 0
stub = types.ModuleType("rollstream.trainer.service")
stub.main = main
sys.modules["rollstream.trainer.service"] = stub
"""


def _rank_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir(exist_ok=True)
    (stub_dir / "sitecustomize.py").write_text(STUB)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "PET_", "TORCHELASTIC"))}
    env.pop("LOCAL_RANK", None)
    env.pop("RANK", None)
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(stub_dir), env.get("PYTHONPATH", "")]),
        "STUB_OUT": str(out),
        "ROLLSTREAM_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _records(tmp_path: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (tmp_path / "out").glob("rank-*.json")}


def test_real_torchrun_one_node_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.run")
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(ckpt)
    env = _rank_env(tmp_path, PET_NPROC_PER_NODE="2")
    args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    assert sorted(records) == [0, 1], done.stderr[-3000:]
    for rank, r in records.items():
        assert r["args"] == [*args, "--resume", "latest"], r
        assert (r["LOCAL_RANK"], r["WORLD_SIZE"]) == (str(rank), "2")
    assert "torch.distributed.run --nproc-per-node=2" in done.stderr and "--standalone" in done.stderr


def test_real_torchrun_two_nodes_rank_0_on_node_0(tmp_path: Path) -> None:
    """Two launchers as two pods of the StatefulSet (node ranks as their pod indexes, local
    addresses that sort as those), node 1 started first: the c10d rendezvous hosted by node 0
    puts global rank 0 on node 0, and node 1's launcher answers the probes on the http port
    meanwhile."""
    pytest.importorskip("torch.distributed.run")
    rdzv, http = _free_port(), _free_port()
    common = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{rdzv}",
        "ROLLSTREAM_HTTP_PORT": str(http),
        "ROLLSTREAM_RUN": "ranks-test",
    }
    procs = []
    try:
        for node in (1, 0):
            # 127.0.0.N: loopback addresses that sort as the node ranks, as trainer-N.<service> do.
            env = _rank_env(tmp_path, **common, PET_NODE_RANK=str(node), PET_LOCAL_ADDR=f"127.0.0.{node + 1}")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(LAUNCHER)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=tmp_path,
                )
            )
            if node == 1:  # its probes answer before any rank runs
                deadline = time.monotonic() + 120
                while True:
                    try:
                        assert _get(f"http://127.0.0.1:{http}/healthz") == (200, "ok\n")
                        break
                    except OSError:
                        assert time.monotonic() < deadline and procs[0].poll() is None
                        time.sleep(0.2)
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    records = _records(tmp_path)
    assert sorted(records) == [0, 1], outputs
    assert (records[0]["GROUP_RANK"], records[1]["GROUP_RANK"]) == ("0", "1")
    assert {r["WORLD_SIZE"] for r in records.values()} == {"2"}
    assert "--rdzv-backend=c10d" in outputs[0] and "--rdzv-id=ranks-test" in outputs[0]
    assert not any("WARNING" in o for o in outputs)
