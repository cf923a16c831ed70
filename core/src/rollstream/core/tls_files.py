"""A small private CA for rollstream's gRPC TLS: one CA, one certificate per role.

Keys are ECDSA P-256 (small, fast handshakes, supported by every gRPC stack). Leaf
certificates carry both serverAuth and clientAuth, so one file serves a service's server
and its outgoing calls under mTLS. Private keys are written 0600 (credentials.write_secret).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rollstream.core.credentials import write_secret

CA_DAYS = 3650
LEAF_DAYS = 825  # what public CAs allowed for a long time; rotate by deleting tls/ and re-running


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _load(key_path: Path, cert_path: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None:
    if not (key_path.exists() and cert_path.exists()):
        return None
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), f"{key_path} is not an EC key"
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())


def _write(key_path: Path, cert_path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    write_secret(key_path, _key_pem(key).strip())
    cert_path.parent.mkdir(parents=True, exist_ok=True)
    cert_path.write_text(cert.public_bytes(serialization.Encoding.PEM).decode())


def ensure_ca(key_path: Path, cert_path: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    existing = _load(key_path, cert_path)
    if existing is not None:
        return existing
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollstream CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, cert_path, key, cert)
    return key, cert


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for n in dict.fromkeys(names):  # keep order, drop repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def ensure_leaf(
    key_path: Path,
    cert_path: Path,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    names: list[str],
) -> None:
    if _load(key_path, cert_path) is not None:
        return
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(_san(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(key_path, cert_path, key, cert)
