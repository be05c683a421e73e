"""``python -m baton_relay.registry.edge.health``: ask the local registry replica whether it serves.

The probe of a registry container. It takes the registry's own settings (the same
flags, ``BATON_*`` variables and ``--config`` file), so it dials the port the
replica listens on and, under mutual TLS, presents the replica's own certificate
(every certificate Baton issues may act as a client) and checks the server's
against the replica's CA. The name it checks is the first DNS name of that same
certificate: the probe talks to the process whose certificate it holds, so it needs
no name of its own in the certificate. Kubernetes' built-in gRPC probe cannot
present a client certificate, which a registry serving mutual TLS requires of
every connection.

The line it prints names every etcd member and the release it runs (the replica
sends them in the reply's trailing metadata), and, when the replica is
``NOT_SERVING`` because an etcd member runs a release with a known bug, why.

Exit status: 0 when the service answers ``SERVING``, 1 when it answers anything
else or cannot be reached in ``--timeout`` seconds, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..store.etcd_members import MEMBERS_KEY, REASON_KEY
from .config import RegistryConfig, load_config

_ANY = {"", "0.0.0.0", "[::]", "::"}


def local_address(listen: str) -> str:
    """Where to dial a replica listening on ``listen`` from its own host."""
    host, _, port = listen.rpartition(":")
    if host in _ANY:
        host = "[::1]" if host in ("[::]", "::") else "127.0.0.1"
    return f"{host}:{port}"


def _own_name(cert_pem: bytes) -> str | None:
    """The first DNS name of a certificate, or None if it names no host."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return None
    names = alt.value.get_values_for_type(x509.DNSName)
    return names[0] if names else None


def channel(config: RegistryConfig, address: str) -> grpc.Channel:
    """A channel to ``address`` with the replica's own credentials."""
    if config.insecure:
        return grpc.insecure_channel(address)
    ca, cert, key = (Path(p).read_bytes() for p in (config.tls_ca, config.tls_cert,
                                                     config.tls_key))
    options = []
    name = _own_name(cert)
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    return grpc.secure_channel(address, credentials, options=options)


def check(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str]:
    """Run the check; (exit status, line to print)."""
    parser = argparse.ArgumentParser(
        prog="python -m baton_relay.registry.edge.health",
        description="Exit 0 if the local registry replica serves (a container probe). "
        "Every other option is the registry's own (see baton-registry --help).")
    parser.add_argument("--service", default="baton.v1.Registry",
                        help="health service name to ask about ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait")
    parser.add_argument("--address", default="",
                        help="host:port to dial (default: the --listen port on loopback)")
    ours, rest = parser.parse_known_args(list(argv))
    config = load_config(rest, environ)
    address = ours.address or local_address(config.listen)
    try:
        with channel(config, address) as ch:
            reply, call = health_pb2_grpc.HealthStub(ch).Check.with_call(
                health_pb2.HealthCheckRequest(service=ours.service), timeout=ours.timeout)
    except OSError as e:
        return 1, f"cannot read TLS file {e.filename}: {e.strerror}"
    except grpc.RpcError as e:
        return 1, f"{address}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    what = ours.service or "server"
    trailers = {key: str(value) for key, value in call.trailing_metadata() or ()}
    line = f"{address} {what}: {status}"
    if trailers.get(MEMBERS_KEY):
        line += f" (etcd members: {trailers[MEMBERS_KEY].replace(',', ', ')})"
    if trailers.get(REASON_KEY):
        line += f"\n{trailers[REASON_KEY]}"
    return (0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1, line)


def main(argv: Sequence[str] | None = None) -> int:
    code, line = check(sys.argv[1:] if argv is None else argv, os.environ)
    print(line, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
