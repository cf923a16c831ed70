"""Who may call what over gRPC: a token per role, checked on every call; optional TLS/mTLS.

A caller sends its role's token in metadata (`authorization: Bearer <token>`). A server holds
only the sha256 of each role's token (roles.json, see rollstream.core.credentials), finds the
caller's role by comparing hashes in constant time, and checks it against PERMISSIONS, the
one table of who may call which method. A method missing from the table is refused to
everyone (default deny); only health checking and reflection stay open, because probes and
tooling call them without a token and they reveal nothing but service names, and a
generator's PushNonce. PushWeights takes no token at all: the trainer signs each push for one
generator's nonce (rollstream.core.push_signing), because the addresses it pushes to come
from a registry a lesser role writes, and a token sent there could be replayed.

The check runs in a server interceptor, before the servicer: a refused call runs none of our
code, and a refused streaming call (PushWeights) has none of its request stream read.

Without grpc_auth_file a server checks nothing; the settings allow that only on a loopback
address or with allow_unauthenticated (rollstream.core.config). TLS is optional and
independent: grpc_tls_cert_file + grpc_tls_key_file make the server speak TLS, and a
grpc_tls_ca_file on top makes it require client certificates signed by that CA (mTLS).
Services call each other by role, whatever address discovery gave them (a pod IP, a port on
loopback), so with TLS a service's certificate must name its role (DNS:trainer,
DNS:generator): the trainer and generators check each other against that name
(grpc_utils.channel's server_name). Tokens ride in plain metadata, so a client sends one
only to a server it has authenticated: over a unix socket (in a folder only its owner can
enter) or over TLS; over plain TCP only with grpc_plaintext_token (token_refusal).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from rollstream.core import logs, push_signing
from rollstream.core.credentials import ROLES, read_secret

GENERATOR = "rollstream.v1.Generator"
TRAINER = "rollstream.v1.Trainer"
REWARD = "rollstream.v1.Reward"
REFERENCE = "rollstream.v1.Reference"

ANY_ROLE = frozenset(ROLES)
PUSH_WEIGHTS = f"/{GENERATOR}/PushWeights"

# Method full name -> the roles whose bearer token may call it. Nothing else is allowed.
PERMISSIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        # Weights a generator samples from, and so the trainer trains on: the trainer's only,
        # and by signature (SIGNED_METHODS), never by a token its receiver could replay.
        PUSH_WEIGHTS: frozenset(),
        f"/{GENERATOR}/Generate": frozenset({"admin", "trainer"}),
        f"/{GENERATOR}/GetState": ANY_ROLE,
        # Every weight of the policy: the generators (catch-up) and the operator.
        f"/{TRAINER}/FetchWeights": frozenset({"generator", "admin"}),
        # Writes files on the trainer's disk: the operator only.
        f"/{TRAINER}/SaveCheckpoint": frozenset({"admin"}),
        f"/{TRAINER}/GetState": ANY_ROLE,
        f"/{REWARD}/Score": ANY_ROLE,
        f"/{REFERENCE}/ComputeLogprobs": ANY_ROLE,
        f"/{REFERENCE}/GetState": ANY_ROLE,
    }
)

# Services any caller reaches without a token (health probes, grpcurl's reflection).
OPEN_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)
# Methods any caller reaches without a token: a generator's one-time nonces reveal nothing.
OPEN_METHODS = frozenset({f"/{GENERATOR}/PushNonce"})
# Method -> the role that signs it (rollstream.core.push_signing) instead of sending a token.
SIGNED_METHODS: Mapping[str, str] = MappingProxyType({PUSH_WEIGHTS: "trainer"})
# roles.json's entries for public keys (rollstream.core.push_signing) -> whose key it is: the
# trainer signs pushes, a generator proves it is one before the trainer pushes to it.
PUBLIC_KEYS: Mapping[str, str] = MappingProxyType({"trainer_push_key": "trainer", "generator_proof_key": "generator"})

METADATA_KEY = "authorization"
_SCHEME = "Bearer "
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def is_open(method: str) -> bool:
    """Whether `method` ("/package.Service/Method") is callable without a token."""
    return method in OPEN_METHODS or method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES


def allowed_roles(method: str) -> frozenset[str]:
    """The roles that may call `method`; empty for a method not in the table (denied)."""
    return PERMISSIONS.get(method, frozenset())


# -- the server's role table -------------------------------------------------------------


@dataclass(frozen=True)
class RoleTable:
    """role -> sha256 (hex) of its token: the callers a server accepts; and role -> its public
    key (PUBLIC_KEYS; absent in a roles.json from before signed pushes: every push refused)."""

    digests: Mapping[str, str]
    public_keys: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)

    @property
    def push_key(self) -> Ed25519PublicKey | None:
        return self.public_keys.get("trainer")

    @property
    def generator_key(self) -> Ed25519PublicKey | None:
        return self.public_keys.get("generator")

    def role_of(self, token: str) -> str | None:
        """The role whose token this is, or None. Every entry is compared, with
        hmac.compare_digest, so the time taken says nothing about how close a guess was."""
        presented = hashlib.sha256(token.encode()).hexdigest()
        found = None
        for role, expected in self.digests.items():
            if hmac.compare_digest(presented, expected):
                found = role
        return found


def parse_roles(text: str, source: str) -> RoleTable:
    """roles.json's content -> RoleTable; ValueError naming `source` if it is malformed."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object {{role: sha256 of its token}}, got {type(raw).__name__}")
    public_keys = {}
    for entry, role in PUBLIC_KEYS.items():
        if entry in raw:
            value = raw.pop(entry)
            try:
                public_keys[role] = push_signing.load_public_key(value if isinstance(value, str) else "", entry)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
    if not raw:
        raise ValueError(f"{source}: no roles: every call would be refused")
    for role, value in raw.items():
        if role not in ROLES:
            raise ValueError(f"{source}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(value, str) or not _HEX64.match(value):
            raise ValueError(f"{source}: role {role!r} must map to the sha256 of its token (64 lowercase hex digits)")
    # One token, one role: two roles with the same hash would make the caller's role a guess.
    by_digest: dict[str, str] = {}
    for role, value in raw.items():
        if value in by_digest:
            raise ValueError(f"{source}: roles {by_digest[value]!r} and {role!r} have the same token")
        by_digest[value] = role
    return RoleTable(digests=MappingProxyType(dict(raw)), public_keys=MappingProxyType(public_keys))


def load_roles(path: str | Path) -> RoleTable:
    return parse_roles(read_secret(path, "grpc_auth_file"), f"grpc_auth_file {path}")


# -- the server's check ------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of the one `authorization: Bearer ...` entry; None if absent, repeated or
    of another scheme."""
    values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
    if len(values) != 1 or not isinstance(values[0], str) or not values[0].startswith(_SCHEME):
        return None
    return values[0][len(_SCHEME) :].strip() or None


def check_call(
    table: RoleTable,
    method: str,
    metadata: Iterable[tuple[str, Any]] | None,
    nonces: push_signing.PushNonces | None = None,
) -> tuple[str | None, Refusal | None]:
    """(caller's role, why the call is refused or None). Open methods pass without a token;
    the caller is authenticated before the method is looked at, so an outsider learns
    nothing about the table. A signed method passes here with a fresh nonce of this server's
    (`nonces`); its signature is checked on the request's first message (AuthInterceptor)."""
    if is_open(method):
        return None, None
    if method in SIGNED_METHODS:
        return _check_signed(table, method, metadata, nonces)
    token = bearer_token(metadata)
    role = table.role_of(token) if token is not None else None
    if role is None:
        why = "no bearer token" if token is None else "unknown token"
        return None, Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{why}: send 'authorization: Bearer <token>' with a token from grpc_token_file",
        )
    if role not in allowed_roles(method):
        return role, Refusal(grpc.StatusCode.PERMISSION_DENIED, f"role {role!r} may not call {method}")
    return role, None


def _check_signed(
    table: RoleTable, method: str, metadata: Iterable[tuple[str, Any]] | None, nonces: push_signing.PushNonces | None
) -> tuple[str | None, Refusal | None]:
    signer = SIGNED_METHODS[method]
    signed = push_signing.parse_signature(metadata)
    if signed is None:
        how = f"{method} takes the {signer}'s signature ({push_signing.METADATA_KEY}), not a bearer token"
        return None, Refusal(grpc.StatusCode.UNAUTHENTICATED, how)
    if table.push_key is None:
        return None, Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            "this server's roles.json has no trainer_push_key: run `rollstream secrets` again",
        )
    why = nonces.check(signed[0]) if nonces is not None else "this server issues no nonces"
    if why is not None:
        return None, Refusal(grpc.StatusCode.UNAUTHENTICATED, f"push signature refused: {why}")
    return signer, None


def _signature_checked(
    handler: grpc.RpcMethodHandler, table: RoleTable, nonces: push_signing.PushNonces, metadata: Any
) -> grpc.RpcMethodHandler:
    """PushWeights' handler, behind a check of its first chunk: the header must carry a
    signature by the trainer's push key over this call's nonce, which is then spent; a second
    payload in the same stream is refused (the signature covers one). The chunks themselves
    are checked against the header's sha256 as they arrive (weight_transfer)."""
    nonce, signature = push_signing.parse_signature(metadata) or (b"", b"")
    assert table.push_key is not None  # _check_signed refused the call otherwise
    key = table.push_key

    def checked(chunks: Iterator[Any], context: grpc.ServicerContext) -> Any:
        first = next(chunks, None)
        if (
            first is None
            or not first.HasField("header")
            or not push_signing.verify(key, nonce, signature, first.header)
        ):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "push signature does not match this payload's header")
        why = nonces.spend(nonce)
        if why is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"push signature refused: {why}")

        def one_payload() -> Iterator[Any]:
            # Imported here: weight_transfer brings numpy (deltas), which servers that never
            # take weights (the reward service) must not load.
            from rollstream.core.weight_transfer import TransferRefused

            yield first
            for chunk in chunks:
                if chunk.HasField("header"):  # the servicer answers INVALID_ARGUMENT, reading no further
                    raise TransferRefused("a signed push carries one payload; this stream starts another")
                yield chunk

        return handler.stream_unary(one_payload(), context)

    return grpc.stream_unary_rpc_method_handler(
        checked, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _refusing(handler: grpc.RpcMethodHandler, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only aborts. No request deserializer:
    a unary request is not even parsed, and a request stream is never iterated."""

    def refuse(_request: object, context: grpc.ServicerContext) -> None:
        context.abort(refusal.code, refusal.message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose token or role does not match PERMISSIONS."""

    def __init__(
        self, table: RoleTable, log: logging.Logger | None = None, nonces: push_signing.PushNonces | None = None
    ):
        self.table = table
        self.log = log
        self.nonces = nonces

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        role, refusal = check_call(self.table, method, metadata, self.nonces)
        handler = continuation(handler_call_details)
        # No handler: not a method of this server; gRPC answers UNIMPLEMENTED, reading nothing.
        if handler is None:
            return handler
        if refusal is None:
            if method in SIGNED_METHODS and self.nonces is not None:
                return _signature_checked(handler, self.table, self.nonces, metadata)
            return handler
        if self.log is not None:
            logs.event(
                self.log, "grpc_call_refused", logging.WARNING, method=method, code=refusal.code.name, role=role or "-"
            )
        return _refusing(handler, refusal)


# -- TLS material --------------------------------------------------------------------------


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; ValueError naming `what` (the settings field) if unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


class _Security(Protocol):
    """The settings fields this module reads (CommonSettings has them all)."""

    grpc_token_file: str
    grpc_auth_file: str
    grpc_tls_cert_file: str
    grpc_tls_key_file: str
    grpc_tls_ca_file: str
    grpc_plaintext_token: bool


@dataclass(frozen=True)
class ServerSecurity:
    interceptors: tuple[grpc.ServerInterceptor, ...]
    credentials: grpc.ServerCredentials | None  # None: plaintext
    auth: bool
    tls: str  # "off", "tls" or "mtls"


def server_security(
    settings: _Security, log: logging.Logger | None = None, nonces: push_signing.PushNonces | None = None
) -> ServerSecurity:
    """The interceptor and TLS credentials a server is built with, from its settings. Reads
    every file now (ValueError naming the field): a typo fails the start, not a call.
    `nonces`: the ones this server hands out (a generator's), against which signed pushes
    are checked."""
    interceptors: tuple[grpc.ServerInterceptor, ...] = ()
    if settings.grpc_auth_file:
        interceptors = (AuthInterceptor(load_roles(settings.grpc_auth_file), log, nonces),)
    credentials = None
    tls = "off"
    if settings.grpc_tls_cert_file:
        cert = read_pem(settings.grpc_tls_cert_file, "grpc_tls_cert_file")
        key = read_pem(settings.grpc_tls_key_file, "grpc_tls_key_file")
        ca = read_pem(settings.grpc_tls_ca_file, "grpc_tls_ca_file") if settings.grpc_tls_ca_file else None
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )
        tls = "mtls" if ca is not None else "tls"
    return ServerSecurity(interceptors=interceptors, credentials=credentials, auth=bool(interceptors), tls=tls)


# -- the client side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientCredentials:
    """What a client sends: its role's token on every call, and TLS when `tls`."""

    token: str = field(default="", repr=False)
    tls: bool = False
    ca_pem: bytes | None = None  # verifies servers; None with tls: the system's roots
    cert_pem: bytes | None = None  # presented to servers that require client certificates
    key_pem: bytes | None = field(default=None, repr=False)
    # UNSAFE (settings' grpc_plaintext_token): the token also over plain TCP, to a server
    # nothing authenticates; for networks where no one else can bind the address.
    plaintext_token: bool = False

    @classmethod
    def from_settings(cls, settings: _Security) -> ClientCredentials:
        """A service's own credentials as a client: the same token, CA and certificate it uses
        as a server (one identity per service). TLS is on when a CA or a certificate is set:
        a CA alone verifies the servers called, a certificate alone (with its key) is
        presented to them and the servers are checked against the system's roots."""
        token = read_secret(settings.grpc_token_file, "grpc_token_file") if settings.grpc_token_file else ""
        ca = read_pem(settings.grpc_tls_ca_file, "grpc_tls_ca_file") if settings.grpc_tls_ca_file else None
        cert = key = None
        if settings.grpc_tls_cert_file:
            cert = read_pem(settings.grpc_tls_cert_file, "grpc_tls_cert_file")
            key = read_pem(settings.grpc_tls_key_file, "grpc_tls_key_file")
        return cls(
            token=token,
            tls=ca is not None or cert is not None,
            ca_pem=ca,
            cert_pem=cert,
            key_pem=key,
            plaintext_token=settings.grpc_plaintext_token,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )


def is_unix_address(address: str) -> bool:
    """Whether a gRPC target is a unix socket by path (`unix:/abs/path` or `unix:///abs/path`).
    `unix-abstract:` is not: an abstract socket has no folder to keep others out."""
    path = address.removeprefix("unix:")
    return address.startswith("unix:") and (path[2:] if path.startswith("//") else path).startswith("/")


def token_refusal(address: str, creds: ClientCredentials | None) -> str:
    """Why `creds` must not be used to call `address` ("" when they may). A token goes to a
    server behind a unix socket (its folder is the run owner's alone, so only the owner's
    processes can have bound it) or over TLS (the server's certificate checked); over plain
    TCP anyone who holds the port while the real server restarts receives it (issue 42),
    unless the credentials say plaintext_token."""
    if creds is None or not creds.token or creds.tls or creds.plaintext_token or is_unix_address(address):
        return ""
    return (
        f"refusing to send a gRPC token to {address}: plain TCP, the server unauthenticated "
        "(use a unix:/path address, TLS with grpc_tls_ca_file, or grpc_plaintext_token where no one else can bind it)"
    )


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call. An interceptor, not call
    credentials (grpc.metadata_call_credentials), because gRPC sends call credentials only
    over TLS: one code path for plaintext and TLS channels."""

    def __init__(self, token: str):
        self._metadata = ((METADATA_KEY, _SCHEME + token),)

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = tuple(m for m in (details.metadata or ()) if m[0] != METADATA_KEY) + self._metadata
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def _intercept(self, continuation, client_call_details, request_or_iterator):
        return continuation(self._with_token(client_call_details), request_or_iterator)

    # The four call shapes differ only in whether the request is one message or an iterator.
    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _intercept
