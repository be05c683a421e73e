"""The registry's server credentials: mutual TLS, re-read when the files change.

gRPC asks :class:`ServerCertificates` for the configuration at every new
handshake; it answers with a new one only when the certificate, key or CA files
changed (their size and modification time), so a rotated certificate is served
from the next connection on, with no restart, while connections already open
(and their streams) carry on with the one they started with.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from pathlib import Path

import grpc

from ...kernel.errors import InvalidArgument

log = logging.getLogger("baton.registry")


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


def _check_pair(cert_pem: bytes, key_pem: bytes, where: str) -> None:
    """The key must be the certificate's (a rotation caught half-way is not)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as e:
        raise InvalidArgument(f"cannot load the TLS certificate or key ({where}): {e}") from e
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise InvalidArgument(f"the TLS key does not belong to the certificate {where}")


class ServerCertificates:
    """The registry's certificate, key and client CA, as files that may change."""

    def __init__(self, ca: str, cert: str, key: str) -> None:
        missing = [flag for flag, value in (("--tls-ca", ca), ("--tls-cert", cert),
                                            ("--tls-key", key)) if not value]
        if missing:
            raise InvalidArgument(
                f"mutual TLS needs {', '.join(missing)} as well (or --insecure to serve "
                "plaintext)")
        self.paths = (ca, cert, key)
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self.reloads = 0
        self.initial = self._read()

    def _read(self) -> grpc.ServerCertificateConfiguration:
        cert = self.paths[1]
        try:
            stamp = _stamp(self.paths)
            blobs = [Path(p).read_bytes() for p in self.paths]
        except OSError as e:
            raise InvalidArgument(f"cannot read TLS file {e.filename}: {e.strerror}") from e
        _check_pair(blobs[1], blobs[2], cert)
        self._stamp = stamp
        return grpc.ssl_server_certificate_configuration(
            [(blobs[2], blobs[1])], root_certificates=blobs[0])

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration if the files
        changed, else None (keep the current one). A half-rotated or unreadable set
        keeps the current one and says so."""
        with self._lock:
            try:
                if _stamp(self.paths) == self._stamp:
                    return None
                config = self._read()
            except (OSError, InvalidArgument) as e:
                log.warning("TLS files changed but cannot be read (%s); serving the "
                            "previous certificate", e)
                return None
            self.reloads += 1
            log.info("TLS certificate files changed: serving the new certificate to new "
                     "connections (reload %d)", self.reloads)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch,  # type: ignore[arg-type]  # None keeps the current one
            require_client_authentication=True)


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` only listens on a loopback address."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
