"""``baton up``: the embedded stack on one machine."""

from __future__ import annotations

from pathlib import Path

import click

from ..embedded import UpOptions, default_data_dir, default_staging, run_up
from ._root import cli


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="etcd data and logs  [default: $XDG_DATA_HOME/baton]")
@click.option("--staging", type=click.Path(file_okay=False, path_type=Path),
              help="staging root  [default: DATA_DIR/staging]")
@click.option("--etcd-port", type=click.IntRange(1, 65535), default=UpOptions.etcd_port,
              show_default=True, help="etcd client port on 127.0.0.1")
@click.option("--registry-port", type=click.IntRange(1, 65535),
              default=UpOptions.registry_port, show_default=True,
              help="registry gRPC port on 127.0.0.1")
@click.pass_context
def up(ctx: click.Context, data_dir: Path | None, staging: Path | None, etcd_port: int,
       registry_port: int) -> None:
    """Run a local Baton stack until Ctrl-C.

    A private single-member etcd in DATA_DIR, a registry serving the staging
    root and a watcher verifying the files put there; prints the address to
    export as BATON_REGISTRY.
    """
    data_dir = data_dir or default_data_dir()
    opts = UpOptions(data_dir=data_dir, staging=staging or default_staging(data_dir),
                     etcd_port=etcd_port, registry_port=registry_port)
    ctx.exit(run_up(opts, out=click.echo))


# --- tasks ----------------------------------------------------------------------


