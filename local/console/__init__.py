"""``baton console``: the operator's web console, run next to the CLI.

It listens on loopback, talks to the registry with the identity the CLI resolves
(BATON_CA/CERT/KEY), keeps nothing of its own, and can do only what that identity
may do: the registry decides every read and every action. It joins ``baton`` as a
plugin (the entry-point group ``baton_relay.cli``) and needs ``baton-relay[console]``.
"""

from __future__ import annotations

from typing import Any

import click

from ...client.cli._common import Settings, pass_settings
from ...kernel import errors

#: where the console listens unless told
DEFAULT_LISTEN = "127.0.0.1:8470"


class ConsoleMissing(errors.BatonError):
    """The console's web stack is not installed here."""


def _server() -> Any:
    try:
        from . import server
    except ImportError as e:
        raise ConsoleMissing(
            f"`baton console` needs its web stack, not installed here ({e.name or e}): "
            f"pip install 'baton-relay[console]'", extra="console") from e
    return server


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (a bare ``:PORT`` is loopback) as (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT", param_hint="--listen")
    return host.strip("[]") or "127.0.0.1", int(port)


@click.command()
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
              help="where the console serves; keep it on loopback (it acts as you)")
@click.option("--registry", default=None, metavar="HOST:PORT",
              help="the registry to talk to  [default: baton's --registry, BATON_REGISTRY]")
@pass_settings
def console(settings: Settings, listen: str, registry: str | None) -> None:
    """Serve the web console: tasks, entries, sessions, watchers, and actions.

    It talks to --registry as the identity of BATON_CA, BATON_CERT and BATON_KEY
    (like every other command), holds no state of its own, and offers actions
    only to an operator identity; each asks for a reason and evidence, which the
    registry keeps in the journal.
    """
    host, port = parse_listen(listen)
    if registry:
        settings.registry = registry
    _server().serve(settings, host, port, out=click.echo)
