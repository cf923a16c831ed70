"""k8s/: the manifests are valid Kubernetes objects (kubernetes-validate --strict), and they
agree with the code: each container runs a real service module from the image that builds
it, every setting (ConfigMap TOML, ROLLSTREAM_* env) loads into the service's settings class,
probes and Services hit the ports those settings bind, and the addresses the services are
given (Redis, the generators' headless Service, the trainer) lead where they should."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from deploy_files import (
    K8S_DIR,
    NON_FIELD_ENV,
    SERVICES,
    TRAINER_LAUNCHER,
    K8s,
    check_env_names,
    dockerfile_entrypoint,
    dockerfile_user,
    image_name,
    k8s_container,
    k8s_settings,
    split_host_port,
    toml_keys,
)

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
    files = sorted(str(p) for p in K8S_DIR.glob("*.yaml"))
    done = subprocess.run([*kubernetes_validate_cmd(), "--strict", "--quiet", *files], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_folder_applies_as_it_is(k8s: K8s) -> None:
    """`kubectl apply -f k8s/`: no kustomization (kubectl would refuse the folder), only
    .yaml files, the namespace created first (files go in name order), everything in it."""
    names = {p.name.lower() for p in K8S_DIR.iterdir()}
    assert not names & {"kustomization.yaml", "kustomization.yml", "kustomization"}
    assert all(n.endswith(".yaml") for n in names), names
    assert k8s.docs[0][1]["kind"] == "Namespace" and k8s.docs[0][1]["metadata"]["name"] == NAMESPACE
    for path, doc in k8s.docs[1:]:
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{path.name}: {doc['kind']} {doc['metadata']['name']} is not in {NAMESPACE}"


def test_containers_run_the_service_their_image_builds(k8s: K8s) -> None:
    seen = set()
    for workload in k8s.workloads():
        c = k8s_container(k8s, workload)
        name = image_name(c.spec["image"])
        seen.add(name)
        if name == "redis":
            assert c.spec["command"] == ["redis-server"]
            continue
        if name == "trainer":
            assert c.spec["command"] == TRAINER_LAUNCHER
            assert "COPY docker/trainer_start.py /opt/rollstream/trainer_start.py" in (K8S_DIR.parent / "docker/trainer.Dockerfile").read_text()
        else:
            assert c.spec["command"] == ["python", "-m", f"rollstream.{name}"]
            assert importlib.util.find_spec(f"rollstream.{name}.__main__") is not None
        assert c.spec["command"] == dockerfile_entrypoint(name), f"{name}: command differs from the image's ENTRYPOINT"
    assert seen == {*SERVICES, "redis"}


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
            assert probe["httpGet"]["path"] == ("/readyz" if kind == "readinessProbe" else "/healthz"), f"{service} {kind}"
    for svc in k8s.all("Service"):
        workloads = k8s.pods_selected(svc)
        assert len(workloads) == 1, f"Service {svc['metadata']['name']} selects {len(workloads)} workloads"
        c = k8s_container(k8s, workloads[0])
        for port in svc["spec"]["ports"]:
            c.port(port["targetPort"])  # asserts the container declares it


def test_addresses_lead_to_the_right_services(k8s: K8s, settings: dict) -> None:
    redis = k8s_container(k8s, k8s.workload_of("redis"))
    redis_port = int(redis.args[redis.args.index("--port") + 1])
    password = redis.args[redis.args.index("--requirepass") + 1]
    assert password == k8s.secret_value("redis-auth", "password") and redis.port("redis") == redis_port
    for service, (c, s) in settings.items():
        url = urlsplit(s.redis_url)
        svc = k8s.service_for(url.hostname, NAMESPACE)
        assert [w["metadata"]["name"] for w in k8s.pods_selected(svc)] == ["redis"], service
        port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
        assert redis.port(port["targetPort"]) == redis_port, service
        assert url.password == password, f"{service}: the Redis URL does not carry the Secret's password"

    # The trainer pushes to every generator pod: a headless Service (one A record per pod).
    trainer = settings["trainer"][1]
    host, port = split_host_port(trainer.generators_dns)
    headless = k8s.service_for(host, NAMESPACE)
    assert headless["spec"].get("clusterIP") == "None", "generators_dns must name a headless Service"
    assert [image_name(w["spec"]["template"]["spec"]["containers"][0]["image"]) for w in k8s.pods_selected(headless)] == ["generator"]
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
    trainer, reward = settings["trainer"][1], settings["reward"][1]
    needs_reference = trainer.beta > 0 and trainer.kl_reference == "service"
    assert reference_on == needs_reference, "the reference stage runs exactly when the trainer's KL needs it"
    assert reward.output_stage == ("scored" if reference_on else "ready"), "reward must feed the reference stage exactly when it runs"


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
    c, trainer = settings["trainer"]
    assert k8s.workload_of("trainer")["kind"] == "StatefulSet" and k8s.workload_of("trainer")["spec"]["replicas"] == 1
    _, volume = c.mount_of(trainer.checkpoint_dir)
    assert "persistentVolumeClaimTemplate" in volume, "checkpoints must outlive the pod"
    assert trainer.checkpoint_every > 0 and not trainer.resume, "trainer_start.py adds --resume latest when there is a checkpoint"
    assert k8s.workload_of("trainer")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 120, "a step must be able to finish"


def test_pods_are_restricted_non_root(k8s: K8s) -> None:
    """What the namespace's `restricted` Pod Security level enforces, plus a read-only root
    with a writable /tmp, as the images' user."""
    assert k8s.get("Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in k8s.workloads():
        c = k8s_container(k8s, workload)
        pod_sc, sc = c.pod["securityContext"], c.spec["securityContext"]
        name = image_name(c.spec["image"])
        assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}" == dockerfile_user(name), f"{name}: not the image's user"
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
        assert sc["readOnlyRootFilesystem"] is True, name
        if name in SERVICES:
            _, tmp = c.mount_of("/tmp")
            assert "emptyDir" in tmp, f"{name}: /tmp must be writable"
