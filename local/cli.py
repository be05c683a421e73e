"""``baton up`` and ``baton demo``: the local stack on one machine.

They join the ``baton`` command as plugins (the entry-point group ``baton_relay.cli`` in
pyproject.toml): the client does not know this package, which sits above the client,
the registry and the watcher and needs ``baton-relay[local]``; an agent's install has only
the client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..client._client import Client, RetryPolicy
from ..client.cli._common import Settings, pass_settings
from ..kernel import errors
from ..kernel.contract import LOCAL_ETCD_PORT, REGISTRY_PORT

F = TypeVar("F", bound=Callable[..., Any])

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


#: the registry's archive settings (``registry/edge/config.py``) ``baton up`` passes through:
#: each is ``--archive-…`` / ``BATON_ARCHIVE_…`` as on ``baton-registry``
ARCHIVE_OPTIONS: dict[str, tuple[click.ParamType[Any], str, str]] = {
    "archive_dir": (
        click.Path(file_okay=False, path_type=Path), "DIR",
        "directory finished tasks are archived to, out of etcd  "
        "[default: DATA_DIR/archive, unless --archive-s3-bucket]"),
    "archive_s3_bucket": (
        click.STRING, "BUCKET",
        "S3 bucket finished tasks are archived to instead (credentials from boto3's "
        "chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, a role)"),
    "archive_s3_prefix": (click.STRING, "PREFIX", "key prefix of the archives in the bucket"),
    "archive_s3_endpoint": (
        click.STRING, "URL", "URL of an S3-compatible server (MinIO, ...)  [default: AWS S3]"),
    "archive_after": (
        click.FLOAT, "SECONDS",
        "seconds after a task finished that it is archived, unless its manifest says; "
        "negative = never  [default: 86400]"),
    "archive_retention": (
        click.FLOAT, "SECONDS", "seconds an archive is kept  [default: 90 days]"),
    "archive_interval": (
        click.FLOAT, "SECONDS",
        "seconds between looks for finished tasks due for the archive  [default: 30]"),
    "archive_lease_ttl": (
        click.IntRange(min=1), "SECONDS",
        "seconds of the archiver election's lease  [default: 10]"),
}


def archive_options(f: F) -> F:
    """``--archive-…`` options of ``baton up``, one per :data:`ARCHIVE_OPTIONS` entry."""
    for name, (kind, metavar, text) in reversed(ARCHIVE_OPTIONS.items()):
        f = click.option("--" + name.replace("_", "-"), name, type=kind, default=None,
                         metavar=metavar, envvar="BATON_" + name.upper(), show_envvar=True,
                         help=text)(f)
    return f


def archive_settings(ctx: click.Context, given: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The archive options given, as (name, value) for the registry; one store only."""
    chosen = {name: value for name, value in given.items() if value is not None}
    if chosen.get("archive_dir") and chosen.get("archive_s3_bucket"):
        raise click.UsageError("--archive-dir and --archive-s3-bucket both set: archive to "
                               "a directory or to S3, not both", ctx)
    if not chosen.get("archive_s3_bucket") and any(
            chosen.get(k) for k in ("archive_s3_prefix", "archive_s3_endpoint")):
        raise click.UsageError("--archive-s3-prefix/--archive-s3-endpoint need "
                               "--archive-s3-bucket", ctx)
    if isinstance(chosen.get("archive_dir"), Path):
        chosen["archive_dir"] = chosen["archive_dir"].expanduser().absolute()
    return tuple((name, str(value)) for name, value in chosen.items())


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
@archive_options
@click.pass_context
def up(ctx: click.Context, /, data_dir: Path | None, staging: Path | None, etcd_port: int,
       registry_port: int, watchers: int, demo: bool, insecure: bool,
       **archive: Any) -> None:
    """Run a local Baton stack until Ctrl-C.

    A private single-member etcd in DATA_DIR, a registry serving the staging
    root and a watcher verifying the files put there (--watchers N: N of them,
    each checking the tasks of the shards it owns). Everything speaks mutual
    TLS with certificates made in DATA_DIR/pki on first start; prints the
    `export` lines (BATON_REGISTRY, BATON_CA, BATON_CERT, BATON_KEY) for the
    operator identity, also kept in DATA_DIR/env.

    Finished tasks are archived out of etcd to DATA_DIR/archive, or as the
    --archive-* options say: they are the registry's (--archive-s3-bucket and
    --archive-s3-endpoint try the S3 store locally, against MinIO say).
    """
    settings = archive_settings(ctx, archive)
    local, _ = _local()
    data_dir = data_dir or local.default_data_dir()
    try:
        opts = local.UpOptions(data_dir=data_dir,
                               staging=staging or local.default_staging(data_dir),
                               etcd_port=etcd_port, registry_port=registry_port,
                               watchers=watchers, insecure=insecure, archive=settings)
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
            client.operator.list_tasks()
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
