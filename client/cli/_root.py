"""The ``baton`` command group and the console-script entry point.

Each command lives in a module of this package (agents, leases, ops, tasks,
watchers, ...); a command's module is imported when the command is looked up, so
``baton claim`` never loads what ``baton up`` or ``baton status`` need.
:data:`COMMANDS` says where each one is.

Commands of other parts of Baton join the group as plugins: a distribution declares them
in the entry-point group :data:`PLUGIN_GROUP` (``baton up`` and ``baton demo`` come so
from :mod:`baton_relay.local`), and the client never imports those parts by name.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from importlib.metadata import EntryPoint, entry_points

import click

from ...kernel.contract import DEFAULT_REGISTRY, DISTRIBUTION
from ._common import (
    EXIT_STATUS,
    BatonGroup,
    Settings,
)

#: each command of ``baton`` and the module of ``client.cli`` that defines it
COMMANDS = {
    "ack": "agents",
    "ack-batch": "agents",
    "checkpoint": "agents",
    "claim": "agents",
    "commit": "agents",
    "commit-batch": "agents",
    "consume": "agents",
    "fail": "agents",
    "keepalive": "agents",
    "nack": "agents",
    "put": "agents",
    "release": "agents",
    "watch": "agents",
    "agents": "leases",
    "lease": "leases",
    "cert": "pkicmd",
    "explain": "ops",
    "log": "ops",
    "pool": "pools",
    "requeue": "ops",
    "status": "tasks",
    "task": "tasks",
    "top": "top",
    "shard": "watchers",
    "watcher": "watchers",
}


#: the entry-point group where other distributions' ``baton`` commands are declared
PLUGIN_GROUP = "baton_relay.cli"


def _plugins() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


class LazyGroup(BatonGroup):
    """The root group: a command's module is imported when the command is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *_plugins(), *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            if cmd_name in COMMANDS:
                importlib.import_module(f"{__package__}.{COMMANDS[cmd_name]}")
            elif (plugin := _plugins().get(cmd_name)) is not None:
                command = plugin.load()
                if isinstance(command, click.Command):
                    self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_STATUS)
@click.option("--registry", envvar="BATON_REGISTRY", show_envvar=True, default=DEFAULT_REGISTRY,
              show_default=True, metavar="HOST:PORT", help="registry address")
@click.option("--timeout", envvar="BATON_TIMEOUT", show_envvar=True,
              type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              metavar="SECONDS", help="per call, including retries while unreachable")
@click.option("--ca", envvar="BATON_CA", show_envvar=True, default="", metavar="FILE",
              help="CA of the registry's certificate (turns on mutual TLS)")
@click.option("--cert", envvar="BATON_CERT", show_envvar=True, default="", metavar="FILE",
              help="this identity's certificate (its CN and roles)")
@click.option("--key", envvar="BATON_KEY", show_envvar=True, default="", metavar="FILE",
              help="the certificate's private key")
@click.version_option(package_name=DISTRIBUTION, prog_name="baton")
@click.pass_context
def cli(ctx: click.Context, registry: str, timeout: float, ca: str, cert: str,
        key: str) -> None:
    """Baton: hand files between agents through a registry of manifest entries.

    Against a registry serving mutual TLS (as `baton up` does), give the identity
    with --ca/--cert/--key or BATON_CA, BATON_CERT and BATON_KEY.
    """
    settings = Settings(registry, timeout, ca, cert, key)
    ctx.obj = settings
    ctx.call_on_close(settings.close)


def main() -> None:
    """The ``baton`` console script.

    The process ends with ``os._exit`` once the command is over and its output
    flushed: with gRPC loaded, finalising the interpreter takes about 30 ms, a
    quarter of a short command, and there is nothing left for it to do (the
    client is closed, files are closed, sessions are either revoked or meant to
    outlive the process). An unexpected exception still ends it the usual way.
    """
    try:
        cli.main(prog_name="baton")
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(status)


def exit_status(code: object) -> int:
    """The status ``SystemExit(code)`` would end the process with (a message: 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(OSError, ValueError):
        print(code, file=sys.stderr)
    return 1
