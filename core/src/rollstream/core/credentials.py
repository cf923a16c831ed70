"""Secrets on disk: how rollstream writes and reads the files that hold credentials.

One layout, used by `rollstream up` (which generates everything under its state folder),
the compose file (Docker secrets) and the k8s Secret (docs/security.md):

    <dir>/grpc/<role>.token      a role's gRPC token (sent in metadata; 0600)
    <dir>/grpc/roles.json        {role: sha256(token)}: what a server checks calls against
    <dir>/redis/<role>.password  a role's Redis ACL password (0600)
    <dir>/redis/users.acl        the ACL file the Redis server loads

Roles are the four services and `admin` (the operator: the CLI, checkpoints on demand).
A server holds only hashes of other roles' tokens, so a leaked generator cannot act as
the trainer.
"""

from __future__ import annotations

import hashlib
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
