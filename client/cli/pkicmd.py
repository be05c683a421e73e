"""``baton cert``: certificates for the identities of a deployment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ...kernel import errors
from ._root import cli


@cli.group()
def cert() -> None:
    """Certificates: each carries an identity (its CN) and its roles (its OUs)."""


@cert.command("issue")
@click.option("--role", "roles", multiple=True, required=True,
              type=click.Choice(["operator", "agent", "watcher"]),
              help="a role the identity holds (repeat for several)")
@click.option("--name", required=True, help="the identity's name (the certificate's CN)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="directory to write NAME.crt and NAME.key into")
@click.option("--pki", type=click.Path(file_okay=False, path_type=Path),
              help="directory holding ca.crt and ca.key  [default: the directory of "
                   "$BATON_CA, where `baton up` keeps its CA]")
@click.option("--days", type=click.IntRange(1, 3650), default=825, show_default=True,
              help="validity")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
def issue(roles: tuple[str, ...], name: str, out: Path, pki: Path | None, days: int,
          output: str) -> None:
    """Mint a certificate for NAME with ROLEs from the CA in --pki."""
    from ...kernel import pki as certificates

    if pki is None:
        ca = os.environ.get("BATON_CA", "")
        if not ca:
            raise errors.InvalidArgument(
                "no CA given: pass --pki DIR (holding ca.crt and ca.key) or set BATON_CA")
        pki = Path(ca).parent
    issued = certificates.issue(pki, name, out, roles=roles, days=days)
    if output == "json":
        click.echo(json.dumps({"name": name, "roles": list(roles), "cert": str(issued.cert),
                               "key": str(issued.key), "ca": str(pki / "ca.crt")}))
        return
    click.echo(f"issued {name} ({', '.join(roles)}): {issued.cert}, {issued.key}")
    click.echo(f"export BATON_CA={pki / 'ca.crt'} BATON_CERT={issued.cert} "
               f"BATON_KEY={issued.key}")
