#!/usr/bin/env python3
"""Print the Kubernetes Secrets for k8s/ from a credentials folder made by `rollstream secrets`.

    rollstream secrets ./secrets --tls --dns trainer.rollstream.svc \\
        --dns generator-headless.rollstream.svc --dns localhost
    python scripts/k8s_secrets.py ./secrets | kubectl apply -f -

One Secret per workload, holding only that workload's own files (docs/deploy.md, "Credentials"):

    <service>-credentials   (trainer, generator, reward, reference)
        grpc-token          DIR/grpc/<service>.token      the token it sends on the calls it makes
        grpc-roles.json     DIR/grpc/roles.json           {role: sha256(token)}: the callers it accepts
        redis-password      DIR/redis/<service>.password  its Redis ACL user's password (user = <service>)
        redis-observer-password  DIR/redis/observer.password  generator and trainer: the read-only Redis
                            user `observer`, which counts the generator's back-pressure over scored and ready
                            and feeds the trainer's dashboard
        tls-cert.pem        DIR/tls/<service>.pem         its certificate (server, and client for mTLS)
        tls-key.pem         DIR/tls/<service>.key
        tls-ca.pem          DIR/tls/ca.pem                the CA that verifies peers
    redis-credentials
        users.acl           DIR/redis/users.acl           the ACL file (--aclfile)
        admin.password      DIR/redis/admin.password      for redis-cli in the probes (user admin)

Nothing else of the folder goes into the cluster: not the admin token, not the other roles'
files, not a CA key. The k8s/ manifests turn TLS on, so DIR/tls/ must exist (`--tls`).

The output is JSON documents separated by `---` (a YAML stream kubectl reads), values base64
in `data`; only the standard library is needed. With the `cryptography` package installed,
the trainer's and generators' certificates are checked for a name their peers verify (the role,
or the Service name dialled); a missing one is reported on stderr (a warning: the output is
printed anyway).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

SERVICES = ("trainer", "generator", "reward", "reference")
ROLES = (*SERVICES, "admin")
# The gRPC servers other pods call, and the names a client may check their certificate
# against: the role (rollstream's clients verify the role they meant to call, whatever address
# discovery gave them) or the Service name it dialled (k8s/20-config.yaml: trainer_address,
# generators_dns), for clients that check the dialled host.
DIALLED_AS = {"trainer": ("trainer", "trainer.{ns}.svc"), "generator": ("generator", "generator-headless.{ns}.svc")}
LABELS = {"app.kubernetes.io/part-of": "rollstream"}


class CredentialsError(Exception):
    pass


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CredentialsError(f"missing {path}") from None
    except OSError as e:
        raise CredentialsError(f"cannot read {path}: {e.strerror or e}") from None
    if not data.strip():
        raise CredentialsError(f"{path} is empty")
    return data


def _check_roles(path: Path, data: bytes) -> None:
    try:
        roles = json.loads(data)
    except ValueError as e:
        raise CredentialsError(f"{path} is not JSON: {e}") from None
    if not isinstance(roles, dict):
        raise CredentialsError(f"{path}: expected an object {{role: sha256}}")
    missing = [r for r in SERVICES if r not in roles]
    if missing:
        raise CredentialsError(f"{path}: no entry for {', '.join(missing)}")


def secret(name: str, namespace: str, service: str, files: dict[str, bytes]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": service, **LABELS}},
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode() for key, value in files.items()},
    }


def build(folder: Path, namespace: str = "rollstream") -> list[dict]:
    """The Secrets for `folder` (CredentialsError naming the first missing or bad file)."""
    if not folder.is_dir():
        raise CredentialsError(
            f"{folder} is not a folder (create it with `rollstream secrets {folder} --tls --dns ...`)"
        )
    tls = folder / "tls"
    if not tls.is_dir():
        raise CredentialsError(
            f"{tls} is missing: the k8s/ manifests serve gRPC over TLS; create the folder with "
            f"`rollstream secrets {folder} --tls --dns trainer.{namespace}.svc --dns generator-headless.{namespace}.svc --dns localhost`"
        )
    roles_path = folder / "grpc/roles.json"
    roles = _read(roles_path)
    _check_roles(roles_path, roles)
    ca = _read(tls / "ca.pem")
    docs = []
    for service in SERVICES:
        files = {
            "grpc-token": _read(folder / f"grpc/{service}.token"),
            "grpc-roles.json": roles,
            "redis-password": _read(folder / f"redis/{service}.password"),
            "tls-cert.pem": _read(tls / f"{service}.pem"),
            "tls-key.pem": _read(tls / f"{service}.key"),
            "tls-ca.pem": ca,
        }
        if service in (
            "generator",
            "trainer",
        ):  # back-pressure over stages the generator's own user may not touch; the dashboard
            files["redis-observer-password"] = _read(folder / "redis/observer.password")
        docs.append(secret(f"{service}-credentials", namespace, service, files))
    redis_files = {
        "users.acl": _read(folder / "redis/users.acl"),
        "admin.password": _read(folder / "redis/admin.password"),
    }
    docs.append(secret("redis-credentials", namespace, "redis", redis_files))
    return docs


def san_warnings(folder: Path, namespace: str) -> list[str]:
    """Certificates that lack the DNS name their peers dial (empty without `cryptography`)."""
    try:
        from cryptography import x509
    except ImportError:
        return []
    out = []
    for service, patterns in DIALLED_AS.items():
        wanted = [p.format(ns=namespace) for p in patterns]
        path = folder / f"tls/{service}.pem"
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName
            )
        except Exception as e:  # noqa: BLE001 - not a parsable certificate, no SAN extension: say so, do not fail
            out.append(f"{path}: cannot read its DNS names ({e.__class__.__name__}: {e})")
            continue
        if not set(wanted) & set(names):
            out.append(
                f"{path}: none of the DNS names {', '.join(wanted)} (has {', '.join(names) or 'none'}); its peers will refuse it"
            )
    return out


def render(docs: list[dict]) -> str:
    return "".join("---\n" + json.dumps(d, indent=2, sort_keys=False) + "\n" for d in docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: python scripts/k8s_secrets.py ./secrets | kubectl apply -f -",
    )
    parser.add_argument("folder", type=Path, help="the folder `rollstream secrets FOLDER --tls ...` wrote")
    parser.add_argument(
        "--namespace", default="rollstream", help="namespace of the Secrets (default: rollstream, as k8s/)"
    )
    args = parser.parse_args(argv)
    try:
        docs = build(args.folder, args.namespace)
    except CredentialsError as e:
        print(f"k8s_secrets: {e}", file=sys.stderr)
        return 2
    for warning in san_warnings(args.folder, args.namespace):
        print(f"k8s_secrets: warning: {warning}", file=sys.stderr)
    sys.stdout.write(render(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
