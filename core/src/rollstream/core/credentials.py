"""Secrets on disk: how rollstream writes and reads the files that hold credentials.

One layout, used by `rollstream up` (which generates everything under its state folder),
the compose file (Docker secrets) and the k8s Secret (docs/security.md):

    <dir>/grpc/<role>.token      a role's gRPC token (sent in metadata; 0600)
    <dir>/grpc/roles.json        {role: sha256(token)}, plus trainer_push_key and
                                 generator_proof_key (public keys derived from those roles'
                                 tokens): what a server checks calls against
    <dir>/redis/<role>.password  a role's Redis ACL password (0600); also observer.password,
                                 the read-only Redis user of the generator's back-pressure
    <dir>/redis/users.acl        the ACL file the Redis server loads

Roles are the four services and `admin` (the operator: the CLI, checkpoints on demand).
A server holds only hashes of other roles' tokens, so a leaked generator cannot act as
the trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

ROLES = ("trainer", "generator", "reward", "reference", "admin")


def new_secret() -> str:
    """32 random bytes, URL-safe text (fits a gRPC header and a Redis ACL password)."""
    return secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def write_secret(path: Path, value: str) -> None:
    """Write `value` to `path`, readable by the owner only, atomically (never a half-written
    secret next to a running service)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    tmp.replace(path)


def read_secret(path: str | Path, what: str) -> str:
    """The secret in `path`, stripped; ValueError (naming `what`) if missing or empty."""
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not value:
        raise ValueError(f"{what}: {path} is empty")
    return value


def ensure_secret(path: Path, what: str) -> str:
    """The secret in `path`, made (new_secret) if the file does not exist yet: kept across
    runs, so restarted services keep working; deleting the file rotates it."""
    if not path.exists():
        write_secret(path, new_secret())
    return read_secret(path, what)


def grpc_dir(root: Path) -> Path:
    return root / "grpc"


def redis_dir(root: Path) -> Path:
    return root / "redis"


def tls_dir(root: Path) -> Path:
    return root / "tls"


def ensure_grpc_tokens(root: Path) -> dict[str, str]:
    """A token per role (kept if its file exists, so a restarted `up` keeps its services'
    credentials), and roles.json with their hashes. Deleting a token file and running this
    again rotates that role's token."""
    tokens = {role: ensure_secret(grpc_dir(root) / f"{role}.token", f"{role} token") for role in ROLES}
    table = json.dumps(roles_table(tokens), indent=2, sort_keys=True)
    write_secret(grpc_dir(root) / "roles.json", table)  # hashes only, but no reason to share them
    return tokens


def roles_table(tokens: dict[str, str]) -> dict[str, str]:
    """roles.json's content: each role's token hash, and the public halves of the keys derived
    from the trainer's and the generators' tokens (rollstream.core.push_signing): generators
    check pushes against the first, the trainer a generator's PushNonce proof against the
    second."""
    from rollstream.core import push_signing

    return {
        **{role: digest(token) for role, token in tokens.items()},
        "trainer_push_key": push_signing.public_key_hex(tokens["trainer"], "trainer"),
        "generator_proof_key": push_signing.public_key_hex(tokens["generator"], "generator"),
    }


def ensure_tls(root: Path, namespace: str = "", extra_names: tuple[str, ...] = ()) -> None:
    """A CA and one certificate per role, each valid as server and as client (mTLS).

    A role's certificate names the role itself (DNS:trainer, ...): clients check a server
    against the role they meant to call (grpc.ssl_target_name_override), which holds
    whatever address discovery gave them (a pod IP, a loopback port). With `namespace`,
    the Kubernetes Service names are added (`trainer.<ns>.svc`, ...) for other clients
    (grpcurl, probes). Existing files are kept; delete tls/ to reissue everything."""
    from rollstream.core import tls_files

    folder = tls_dir(root)
    ca_key, ca_cert = tls_files.ensure_ca(folder / "ca.key", folder / "ca.pem")
    for role in ROLES:
        names = [role, "localhost", *extra_names]
        if namespace:
            names += [f"{role}.{namespace}.svc", f"{role}.{namespace}.svc.cluster.local"]
        tls_files.ensure_leaf(folder / f"{role}.key", folder / f"{role}.pem", ca_key, ca_cert, role, names)


def service_flags(root: Path, role: str, tls: bool = False, redis_acl: bool = True) -> list[str]:
    """The flags that give a service of `role` its own credentials from `root` (and only its
    own: its token, its Redis password, the role table every server checks against; a
    generator also gets the read-only `observer` user's password, for its back-pressure over
    stages it may not write, and the trainer for its dashboard: rollstream.core.redis_acl)."""
    flags = [
        "--grpc-token-file",
        str(grpc_dir(root) / f"{role}.token"),
        "--grpc-auth-file",
        str(grpc_dir(root) / "roles.json"),
    ]
    if redis_acl:
        flags += ["--redis-username", role, "--redis-password-file", str(redis_dir(root) / f"{role}.password")]
        if role in ("generator", "trainer"):  # back-pressure; the dashboard
            flags += ["--redis-observer-password-file", str(redis_dir(root) / "observer.password")]
    if tls:
        folder = tls_dir(root)
        flags += [
            "--grpc-tls-cert-file",
            str(folder / f"{role}.pem"),
            "--grpc-tls-key-file",
            str(folder / f"{role}.key"),
            "--grpc-tls-ca-file",
            str(folder / "ca.pem"),
        ]
    return flags
