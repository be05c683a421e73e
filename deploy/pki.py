#!/usr/bin/env python3
"""Every certificate a Baton deployment needs, from one new CA, in one directory.

    python deploy/pki.py OUT --kubernetes baton     # names of deploy/kubernetes
    python deploy/pki.py OUT --compose              # names of deploy/compose
    python deploy/pki.py OUT --registry-name registry.example --etcd-name etcd-1.example ...

Writes into OUT (made if missing; what is there already is kept, so running it
again only adds what is missing):

| files | what |
|---|---|
| ``ca.crt``, ``ca.key`` | the CA (keep ``ca.key`` off the servers) |
| ``registry.crt/.key`` | the registry's server certificate, naming ``--registry-name`` |
| ``etcd.crt/.key`` | etcd's certificate for clients and peers, naming ``--etcd-name`` |
| ``etcd-client.crt/.key`` | the registry towards etcd (CN ``etcd-client``, the etcd user) |
| ``watcher.crt/.key`` | the watchers' identity (role ``watcher``) |
| ``operator.crt/.key`` | a first operator (roles ``operator``, ``agent``) |

More identities: ``baton cert issue --pki OUT --role agent --name ocr-1 --out DIR``.
Built on Baton's own ``kernel.pki`` (the ``baton-relay[pki]`` extra); any CA works as
well, Baton reads only the CN and OUs (docs/security.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from baton_relay.kernel import pki
from baton_relay.kernel.errors import BatonError

LOOPBACK = ["localhost", "127.0.0.1"]


def kubernetes_names(namespace: str) -> tuple[list[str], list[str]]:
    """The registry Service's names, and every etcd member's of the StatefulSet."""
    svc = "baton-registry"
    registry = [svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc",
                f"{svc}.{namespace}.svc.cluster.local", *LOOPBACK]
    etcd = [*LOOPBACK]
    for n in range(3):
        member = f"etcd-{n}.etcd"
        etcd += [member, f"{member}.{namespace}.svc", f"{member}.{namespace}.svc.cluster.local"]
    return registry, etcd


COMPOSE = (["registry-1", "registry-2", *LOOPBACK], ["etcd-0", "etcd-1", "etcd-2", *LOOPBACK])


def make(out: Path, registry_names: list[str], etcd_names: list[str]) -> list[Path]:
    """Issue what is missing in ``out``; the certificate files written."""
    pki.create_ca(out, name="Baton CA")
    wanted: list[tuple[str, list[str], list[str]]] = [  # name, roles, server names
        ("registry", [], registry_names),
        ("etcd", [], etcd_names),
        (pki.ETCD_CLIENT, [], []),
        ("watcher", ["watcher"], []),
        ("operator", ["operator", "agent"], []),
    ]
    written = []
    for name, roles, servers in wanted:
        if (out / f"{name}.crt").exists() and (out / f"{name}.key").exists():
            continue
        written.append(pki.issue(out, name, out, roles=roles, server_names=servers).cert)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="deploy/pki.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for the CA and certificates")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--kubernetes", metavar="NAMESPACE",
                        help="names of deploy/kubernetes in this namespace")
    preset.add_argument("--compose", action="store_true",
                        help="names of deploy/compose/compose.yaml")
    parser.add_argument("--registry-name", action="append", default=[],
                        help="a name or address the registry answers on (repeat)")
    parser.add_argument("--etcd-name", action="append", default=[],
                        help="a name or address an etcd member answers on (repeat)")
    args = parser.parse_args(argv)
    registry, etcd = list(args.registry_name), list(args.etcd_name)
    if args.kubernetes:
        more = kubernetes_names(args.kubernetes)
        registry, etcd = registry + more[0], etcd + more[1]
    elif args.compose:
        registry, etcd = registry + COMPOSE[0], etcd + COMPOSE[1]
    if not registry:
        parser.error("name the registry: --registry-name, --kubernetes or --compose")
    try:
        written = make(args.out, registry, etcd or LOOPBACK)
    except BatonError as e:
        print(f"deploy/pki.py: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"issued {path}")
    print(f"CA and certificates in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
