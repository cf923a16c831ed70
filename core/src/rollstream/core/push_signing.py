"""Signed pushes: how a generator knows a PushWeights comes from the trainer, and the trainer
that an address is a generator's, without either sending a token the other could replay.

The registry is written by the `generator` Redis user, so an address in it proves nothing;
a bearer token sent there could be replayed by its receiver (docs/security.md, "Pushes are
signed"). Instead, with keys derived from each role's token (role_key; the public halves are
in roles.json):

1. The trainer asks for a one-time nonce (Generator.PushNonce, open) with a challenge of its
   own. The nonce is the generator's monotonic clock in ms (8 bytes) | 16 random bytes |
   HMAC-SHA256(process key, the first 24)[:16]: stateless to issue, valid NONCE_TTL_S on the
   generator's own clock. The generator answers with it its advertised address and a proof:
   its signature over `proof_text(challenge, nonce, address)`. The trainer pushes only to a
   generator whose proof verifies under `generator_proof_key`, and, for an address taken from
   the registry, whose proven address is the one it dialed (a fake registered address that
   relays a real generator's answer gets the real address back, and nothing is pushed).
2. The trainer signs `signed_text(nonce, header)` with an Ed25519 key derived from its token
   (HKDF-SHA256, so no new secret file; rotating the token rotates the key) and sends
   `rollstream-push-signature: <nonce b64>.<signature b64>`.
3. The generator checks the nonce is its own and fresh when the call starts, and on the first
   chunk the signature over that payload's header with the public key in roles.json
   (`trainer_push_key`), then spends the nonce (once). The payload's sha256 is checked against
   the header as it arrives (rollstream.core.weight_transfer), so the signature covers every
   byte.
4. A generator that applied the push answers with an acknowledgement: its own signature over
   `ack_text(nonce, header)` (the nonce the trainer signed for it). The trainer counts a
   generator as holding the version only with that ack for the nonce it issued to it, so a
   relay's report on its subtree (PushResult.relayed) is believed only where each generator
   below it signed for itself. Every generator holds the one generator token, so the ack
   proves that a generator signed for this nonce, not which one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rollstream.v1 import weights_pb2

METADATA_KEY = "rollstream-push-signature"
NONCE_TTL_S = 120.0
CHALLENGE_BYTES = 16  # what the trainer sends
MAX_CHALLENGE_BYTES = 64  # what a generator signs at most (PushNonce is open to anyone)
_STAMP = struct.Struct(">Q")
_RANDOM_BYTES = 16
_MAC_BYTES = 16
NONCE_BYTES = _STAMP.size + _RANDOM_BYTES + _MAC_BYTES


def role_key(token: str, role: str) -> Ed25519PrivateKey:
    """A role's signing key, derived from its token (HKDF-SHA256, no salt: the token is 32
    random bytes already; the role in `info`, so one token never makes two roles' keys)."""
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"rollstream {role} key v1".encode()).derive(
        token.encode()
    )
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_key_hex(token: str, role: str) -> str:
    """What roles.json holds for the role: its raw Ed25519 public key, hex."""
    return (
        role_key(token, role)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        .hex()
    )


def load_public_key(text: str, what: str) -> Ed25519PublicKey:
    """A public key from roles.json (`what`: its entry) -> the key; ValueError if it is not 32
    bytes of hex."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{what} must be hex") from None
    if len(raw) != 32:
        raise ValueError(f"{what} must be 32 bytes (64 hex digits), got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def proof_text(challenge: bytes, nonce: bytes, address: str) -> bytes:
    """What a generator's PushNonce proof covers: the trainer's challenge, the nonce and the
    address the generator advertises (the registry's entry)."""
    return "\n".join(["rollstream.v1.Generator/PushNonce", challenge.hex(), nonce.hex(), address]).encode()


class GeneratorProver:
    """The generator's side of PushNonce: proves it holds the generator's token."""

    def __init__(self, generator_token: str):
        self._key = role_key(generator_token, "generator")

    def prove(self, challenge: bytes, nonce: bytes, address: str) -> bytes:
        return self._key.sign(proof_text(challenge, nonce, address))

    def ack(self, nonce: bytes, header: weights_pb2.WeightHeader) -> bytes:
        """The acknowledgement of an applied push (PushResult.ack)."""
        return self._key.sign(ack_text(nonce, header))


def verify_proof(key: Ed25519PublicKey, challenge: bytes, nonce: bytes, address: str, proof: bytes) -> bool:
    return _valid(key, proof, proof_text(challenge, nonce, address))


def signed_text(nonce: bytes, header: weights_pb2.WeightHeader) -> bytes:
    """What the signature covers: the method, the nonce and every field of the header, one
    per line (a canonical text, not a protobuf encoding, so both sides agree byte for byte)."""
    return "\n".join(["rollstream.v1.Generator/PushWeights", nonce.hex(), *_header_lines(header)]).encode()


def _header_lines(header: weights_pb2.WeightHeader) -> list[str]:
    """Every field of a weight header, in the order the signed texts give them."""
    return [
        header.kind,
        str(header.base_version),
        str(header.version),
        str(header.total_bytes),
        header.sha256,
        header.model_fingerprint,
    ]


def ack_text(nonce: bytes, header: weights_pb2.WeightHeader) -> bytes:
    """What a generator's acknowledgement covers: the push's nonce and header, under a method
    line of its own (an ack is never a push signature, nor a proof)."""
    return signed_text(nonce, header).replace(b"Generator/PushWeights", b"Generator/PushWeights/applied", 1)


def verify_ack(key: Ed25519PublicKey, nonce: bytes, header: weights_pb2.WeightHeader, ack: bytes) -> bool:
    return _valid(key, ack, ack_text(nonce, header))


class PushSigner:
    """The trainer's side: signs one push for one generator's nonce."""

    def __init__(self, trainer_token: str):
        self._key = role_key(trainer_token, "trainer")

    def metadata(self, nonce: bytes, header: weights_pb2.WeightHeader) -> tuple[tuple[str, str], ...]:
        signature = self._key.sign(signed_text(nonce, header))
        return ((METADATA_KEY, f"{_b64(nonce)}.{_b64(signature)}"),)


def parse_signature(metadata: Iterable[tuple[str, Any]] | None) -> tuple[bytes, bytes] | None:
    """(nonce, signature) from the one `rollstream-push-signature` entry; None if absent,
    repeated or malformed."""
    values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
    if len(values) != 1 or not isinstance(values[0], str) or values[0].count(".") != 1:
        return None
    nonce_text, signature_text = values[0].split(".")
    try:
        nonce, signature = base64.urlsafe_b64decode(nonce_text), base64.urlsafe_b64decode(signature_text)
    except (binascii.Error, ValueError):
        return None
    if len(nonce) != NONCE_BYTES or len(signature) != 64:
        return None
    return nonce, signature


def verify(key: Ed25519PublicKey, nonce: bytes, signature: bytes, header: weights_pb2.WeightHeader) -> bool:
    return _valid(key, signature, signed_text(nonce, header))


# -- catch-up: what a generator fetches or reads from the store ---------------------------
# No live call to bind a nonce to (the store has no caller at all), so a payload's signature
# covers its header alone, with the run: a replay can only offer the trainer's own payloads
# of this run, and the generator's version rule (catch_up.CatchUp.check_stream) keeps it from
# going back. GetState's answer is signed over the generator's fresh challenge, so the
# trainer's version a generator acts on is current, never replayed.


def payload_text(run: str, header: weights_pb2.WeightHeader) -> bytes:
    """What a catch-up payload's signature covers (FetchWeights' first chunk of each payload,
    the store's chain.json entry): the run and every field of its header."""
    return "\n".join(["rollstream.v1.Trainer/FetchWeights", run, *_header_lines(header)]).encode()


def state_text(run: str, challenge: bytes, version: int, fingerprint: str) -> bytes:
    """What GetState's signature covers: the caller's challenge and the version claimed."""
    return "\n".join(["rollstream.v1.Trainer/GetState", run, challenge.hex(), str(version), fingerprint]).encode()


class TrainerSigner:
    """The trainer's signatures on what generators catch up from (the same key as its pushes)."""

    def __init__(self, trainer_token: str, run: str):
        self._key = role_key(trainer_token, "trainer")
        self.run = run

    def payload(self, header: weights_pb2.WeightHeader) -> bytes:
        return self._key.sign(payload_text(self.run, header))

    def state(self, challenge: bytes, version: int, fingerprint: str) -> bytes:
        return self._key.sign(state_text(self.run, challenge, version, fingerprint))


def verify_payload(key: Ed25519PublicKey, run: str, header: weights_pb2.WeightHeader, signature: bytes) -> bool:
    return _valid(key, signature, payload_text(run, header))


def verify_state(
    key: Ed25519PublicKey, run: str, challenge: bytes, version: int, fingerprint: str, signature: bytes
) -> bool:
    return _valid(key, signature, state_text(run, challenge, version, fingerprint))


class PushNonces:
    """The generator's side: issues nonces and spends each at most once. The key lives only in
    this process: a restarted generator refuses its predecessor's nonces (the trainer asks
    for a new one at every push)."""

    def __init__(self, ttl_s: float = NONCE_TTL_S):
        self.ttl_s = ttl_s
        self._key = os.urandom(32)
        self._spent: dict[bytes, float] = {}  # nonce -> when it expires (monotonic)
        self._lock = threading.Lock()

    def issue(self) -> bytes:
        body = _STAMP.pack(int(time.monotonic() * 1000)) + os.urandom(_RANDOM_BYTES)
        return body + self._mac(body)

    def check(self, nonce: bytes) -> str | None:
        """Why `nonce` is not one of ours and fresh, or None. Stateless: a caller with no
        signature cannot fill any table by calling."""
        if len(nonce) != NONCE_BYTES:
            return "malformed nonce"
        body, mac = nonce[:-_MAC_BYTES], nonce[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            return "not a nonce of this generator (restarted since?)"
        age_s = time.monotonic() - _STAMP.unpack_from(body)[0] / 1000
        if not 0 <= age_s <= self.ttl_s:
            return f"nonce expired ({age_s:.0f} s old, valid {self.ttl_s:.0f} s)"
        return None

    def spend(self, nonce: bytes) -> str | None:
        """Check `nonce` and mark it used; why not, or None. Called only once a signature
        over it verified, so only the trainer's pushes take room here (one entry per push,
        kept until the nonce would have expired anyway)."""
        why = self.check(nonce)
        if why is not None:
            return why
        now = time.monotonic()
        with self._lock:
            for old in [n for n, expires in self._spent.items() if expires < now]:
                del self._spent[old]
            if nonce in self._spent:
                return "nonce already used"
            self._spent[nonce] = now + self.ttl_s
        return None

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_BYTES]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def _valid(key: Ed25519PublicKey, signature: bytes, text: bytes) -> bool:
    try:
        key.verify(signature, text)
    except InvalidSignature:
        return False
    return True
