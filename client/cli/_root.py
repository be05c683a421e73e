"""The ``baton`` command group and the console-script entry point."""

from __future__ import annotations

import click

from .._client import DEFAULT_REGISTRY
from ._common import (
    EXIT_STATUS,
    BatonGroup,
    Settings,
)


@click.group(cls=BatonGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_STATUS)
@click.option("--registry", envvar="BATON_REGISTRY", show_envvar=True, default=DEFAULT_REGISTRY,
              show_default=True, metavar="HOST:PORT", help="registry address")
@click.option("--timeout", envvar="BATON_TIMEOUT", show_envvar=True,
              type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              metavar="SECONDS", help="per call, including retries while unreachable")
@click.version_option(package_name="baton", prog_name="baton")
@click.pass_context
def cli(ctx: click.Context, registry: str, timeout: float) -> None:
    """Baton: hand files between agents through a registry of manifest entries."""
    settings = Settings(registry, timeout)
    ctx.obj = settings
    ctx.call_on_close(settings.close)



def main() -> None:
    """The ``baton`` console script."""
    cli.main(prog_name="baton")


