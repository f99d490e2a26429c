"""Certificates for TLS and mutual TLS, made with the `cryptography` package.

`make_ca(dir)` writes a self-signed CA (`ca.pem`, `ca.key`); `issue(ca, dir, name, hosts=...)`
writes a certificate signed by it (`<name>.pem`, `<name>.key`): a server certificate names its
hosts (DNS names and IP addresses in the subjectAltName), a client certificate (`client=True`)
carries the client-auth usage and its name as CN (the role, for mutual TLS). Keys are EC P-256,
written 0600. Meant for loopback tests and small deployments; bring your own PKI otherwise.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _load(files: CertFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    return cert, key  # type: ignore[return-value]


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )


def make_ca(out: str | Path, name: str = "specbus CA", days: int = 365) -> CertFiles:
    """A self-signed CA in `out` (`ca.pem`, `ca.key`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    files = CertFiles(out / "ca.pem", out / "ca.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.key, key)
    return files


def issue(
    ca: CertFiles,
    out: str | Path,
    name: str,
    *,
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    client: bool = False,
    days: int = 365,
) -> CertFiles:
    """A certificate for `name` signed by `ca`: a server's for `hosts`, or a client's."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _load(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        _builder(subject, ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if not client:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    files = CertFiles(out / f"{name}.pem", out / f"{name}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.key, key)
    return files
