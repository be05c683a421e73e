"""Certificates for Baton's mutual TLS: a local CA and the identities it vouches for.

An identity is a certificate signed by the deployment's CA. Its subject's common
name (CN) is the identity's name; each organizational unit (OU) of the subject is
one role it holds: ``operator``, ``agent`` or ``watcher`` (see docs/security.md).
Servers (the registry, etcd) get the DNS names and addresses they answer on as
subject alternative names.

Built on ``cryptography`` (the ``baton-relay[pki]`` extra), imported here only, so the
agent's CLI never loads it unless a certificate is made.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidArgument

#: the roles a certificate may carry, one per OU of its subject
ROLES = ("operator", "agent", "watcher")

CA_NAME = "ca"
#: the names ``baton up`` gives the files of its local PKI (each NAME.crt, NAME.key)
LOCAL_IDENTITIES = {
    # the person at the terminal: operates, and runs agents from the same shell
    "operator": ("operator", "agent"),
    "agent": ("agent",),
    "watcher": ("watcher",),
}
#: servers of the local stack (no role: they are not clients of the registry)
LOCAL_SERVERS = ("registry", "etcd")
#: the registry's client certificate towards etcd (its CN is the etcd user)
ETCD_CLIENT = "etcd-client"

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _load() -> Any:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:  # pragma: no cover - depends on the install
        raise InvalidArgument(
            "making certificates needs the 'cryptography' package: "
            "pip install 'baton-relay[pki]'") from e
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """Where a certificate and its key were written."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode``, replacing it atomically (a reader
    that re-reads certificates on change never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_ca(pki: Path, *, name: str = "Baton local CA", days: int = 3650) -> Issued:
    """A new self-signed CA in ``pki`` (``ca.crt``, ``ca.key``); an existing one is kept."""
    x509, hashes, serialization, ec, _, NameOID = _load()
    pki.mkdir(parents=True, exist_ok=True)
    out = Issued(pki / f"{CA_NAME}.crt", pki / f"{CA_NAME}.key")
    if out.cert.exists() and out.key.exists():
        return out
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(out.key, key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()), 0o600)
    _write(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def _check_name(name: str) -> None:
    if not name or len(name) > 64 or not all(c.isalnum() or c in "._-" for c in name):
        raise InvalidArgument(
            f"certificate name {name!r}: use 1-64 letters, digits, '.', '_' or '-'",
            name=name)


def issue(
    pki: Path,
    name: str,
    out: Path,
    *,
    roles: Sequence[str] = (),
    server_names: Iterable[str] = (),
    days: int = 825,
) -> Issued:
    """Sign a certificate for ``name`` with the CA in ``pki`` into ``out/NAME.crt`` and
    ``out/NAME.key`` (mode 0600).

    ``roles`` become the subject's OUs (a client identity of the registry);
    ``server_names`` (DNS names or IP addresses) make it usable by a server as
    well. With neither, it is a plain client certificate (etcd's, whose user
    is the CN).
    """
    x509, hashes, serialization, ec, EKU, NameOID = _load()
    _check_name(name)
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise InvalidArgument(f"unknown role {bad[0]!r}: choose from {', '.join(ROLES)}",
                              role=bad[0])
    servers = list(server_names)
    ca_cert_path, ca_key_path = pki / f"{CA_NAME}.crt", pki / f"{CA_NAME}.key"
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    except FileNotFoundError as e:
        raise InvalidArgument(
            f"no CA in {pki}: expected {ca_cert_path.name} and {ca_key_path.name} "
            "(baton up makes one in its data directory)", pki=str(pki)) from e
    except ValueError as e:
        raise InvalidArgument(f"cannot read the CA in {pki}: {e}", pki=str(pki)) from e
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, r) for r in roles]
    now = datetime.datetime.now(datetime.UTC)
    usages = [EKU.CLIENT_AUTH] + ([EKU.SERVER_AUTH] if servers else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
    )
    if servers:
        alt: list[Any] = []
        for s in servers:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                alt.append(x509.DNSName(s))
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, exist_ok=True)
    issued = Issued(out / f"{name}.crt", out / f"{name}.key")
    _write(issued.key, key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()), 0o600)
    _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return issued


def local_pki(pki: Path, *, hosts: Iterable[str] = ()) -> dict[str, Issued]:
    """Everything a local stack needs in ``pki``, made once and kept: the CA, the
    local identities (:data:`LOCAL_IDENTITIES`), the registry's and etcd's server
    certificates (for loopback plus ``hosts``) and the registry's etcd client
    certificate. Returns each by name (``ca`` included)."""
    made = {CA_NAME: create_ca(pki)}
    servers = [*_LOOPBACK_NAMES, *hosts]
    wanted: list[tuple[str, dict[str, Any]]] = [
        *((n, {"roles": r}) for n, r in LOCAL_IDENTITIES.items()),
        *((n, {"server_names": servers}) for n in LOCAL_SERVERS),
        (ETCD_CLIENT, {"roles": ()}),
    ]
    for name, kwargs in wanted:
        existing = Issued(pki / f"{name}.crt", pki / f"{name}.key")
        if existing.cert.exists() and existing.key.exists():
            made[name] = existing
        else:
            made[name] = issue(pki, name, pki, **kwargs)
    return made


def identity(pem: bytes) -> tuple[str, tuple[str, ...]]:
    """The (name, roles) a PEM certificate carries: its CN and its OUs that are roles."""
    x509, _, _, _, _, NameOID = _load()
    cert = x509.load_pem_x509_certificate(pem)
    cn = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    ous = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    return (str(cn[0]) if cn else ""), tuple(str(r) for r in ous if r in ROLES)
