"""The registry's configuration: flags, ``BATON_*`` variables, an optional TOML file.

Precedence: flag > environment > TOML file > default. Every flag ``--some-name``
has the variable ``BATON_SOME_NAME`` and the TOML key ``some_name`` (the loader,
``kernel.settings``, is the watcher's too). This is the only place that reads the
environment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...kernel import settings
from ...kernel.collector import HELP as GC_YOUNG_HELP
from ...kernel.collector import YOUNG
from ...kernel.contract import DEFAULT_SHARDS
from ...kernel.errors import BatonError
from ...kernel.logs import FORMATS
from ..verbs.shards import MOVE_DEADLINE


@dataclass(frozen=True)
class RegistryConfig:
    etcd: str = "127.0.0.1:2379"
    listen: str = "127.0.0.1:7390"
    staging: str = "/var/lib/baton/staging"
    prefix: str = "/baton/v1/"
    reap_interval: float = 0.5
    grace: float = 10.0
    log_level: str = "INFO"
    log_format: str = "kv"
    # Python's cyclic garbage collector (kernel/collector.py)
    gc_young: int = YOUNG
    # mutual TLS towards clients
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    insecure_beyond_loopback: bool = False
    # etcd over TLS, with the registry's own credentials
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""
    # etcd releases with a known bug served anyway (comma-separated), and how often
    # every member's release is read again
    allow_etcd_version: str = ""
    etcd_check_interval: float = 10.0
    # Prometheus metrics over HTTP
    metrics: str = ""
    # finished tasks out of etcd
    archive_dir: str = ""
    archive_s3_bucket: str = ""
    archive_s3_prefix: str = ""
    archive_s3_endpoint: str = ""
    archive_after: float = 86400.0
    archive_retention: float = 90 * 86400.0
    archive_interval: float = 30.0
    archive_lease_ttl: int = 10
    # the election of the replica that runs the periodic sweeps, and how often it
    # looks at every index whole besides what its watch tells it
    sweep_lease_ttl: int = 10
    full_sweep_interval: float = 300.0
    # an entry written for longer is counted (status) and named (explain) as stuck
    stuck_written_after: float = 600.0
    # consumed entries' files out of staging (the watcher owning the shard removes them)
    staging_retention: float = 86400.0
    # watcher shards
    shards: int = DEFAULT_SHARDS
    shard_move_deadline: float = MOVE_DEADLINE


_HELP = {
    "etcd": "etcd endpoint host:port, or several (members of one cluster) joined by commas",
    "listen": "gRPC address to serve on (port 0 = pick one)",
    "staging": "staging root; a task's files live under STAGING/TASK/",
    "prefix": "etcd key prefix (start and end with '/')",
    "reap_interval": "seconds between two runs of one sweep at most (the reaper, "
    "backoffs, deadlines, stalls...): the sweeps run when what they read is written or "
    "falls due, and a burst of writes is swept together within this",
    "grace": "seconds in-flight calls get to finish on SIGTERM",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "kv (key=value lines) or json (one object per line)",
    "gc_young": GC_YOUNG_HELP,
    "tls_ca": "CA bundle client certificates must chain to (re-read when it changes)",
    "tls_cert": "the registry's server certificate, PEM (re-read when it changes)",
    "tls_key": "the server certificate's private key, PEM",
    "insecure": "serve plaintext with no client identities (on a loopback address only, "
    "unless --insecure-beyond-loopback)",
    "insecure_beyond_loopback": "with --insecure, serve plaintext on an address beyond "
    "loopback too: anyone who reaches it may do anything",
    "etcd_ca": "CA bundle etcd's server certificate must chain to (turns on TLS to etcd)",
    "etcd_cert": "client certificate the registry presents to etcd",
    "etcd_key": "private key of --etcd-cert",
    "etcd_user": "etcd user (etcd auth enabled); its password comes from --etcd-password-file",
    "etcd_password_file": "file holding the etcd user's password",
    "allow_etcd_version": "serve even though an etcd member runs this release with a known "
    "bug (exactly as the member reports it, e.g. 3.5.1; several: comma-separated); "
    "see docs/operations.md, etcd versions",
    "etcd_check_interval": "seconds between reads of every etcd member's release (a "
    "member added or upgraded is seen within this)",
    "archive_dir": "directory finished tasks are archived to, out of etcd; every replica "
    "must see the same one (empty = finished tasks stay in etcd)",
    "archive_s3_bucket": "S3 bucket finished tasks are archived to (instead of "
    "--archive-dir); credentials from boto3's chain (AWS_ACCESS_KEY_ID/"
    "AWS_SECRET_ACCESS_KEY, ~/.aws, a role)",
    "archive_s3_prefix": "key prefix of the archives in --archive-s3-bucket",
    "archive_s3_endpoint": "URL of an S3-compatible server (empty = AWS S3)",
    "archive_after": "seconds after a task finished that it is archived, unless its "
    "manifest says (archive_after_seconds); negative = never",
    "archive_retention": "seconds an archive is kept; then it and the task's header go",
    "archive_interval": "seconds between looks for finished tasks due for the archive",
    "archive_lease_ttl": "seconds of the lease behind the archiver election: one replica "
    "archives at a time, and a dead one is replaced within this",
    "sweep_lease_ttl": "seconds of the lease behind the sweeps' election: one replica "
    "runs the periodic sweeps (reaper, scheduler, deadlines, stalls) at a time, and a dead "
    "one is replaced within this",
    "full_sweep_interval": "seconds between two full looks of the elected replica at "
    "every index its sweeps read, besides those at its election and after its watch "
    "broke (a bound on how long an event lost without the watch breaking could delay "
    "due work); 0 = none",
    "stuck_written_after": "seconds after which an entry committed and not yet verified "
    "is counted by status and named by explain as stuck (no watcher settled it)",
    "staging_retention": "seconds a consumed entry's file stays in staging after its last "
    "ack, unless its manifest says (staging_retention_seconds); then the watcher owning "
    "its task's shard removes it; 0 = once consumed, negative = never",
    "shards": "shards tasks map to, fixed when the first watcher registers (1..4096)",
    "shard_move_deadline": "seconds a watcher has to hand over a shard before it is taken",
    "metrics": "HOST:PORT to serve Prometheus metrics on, at /metrics (empty = off; "
    "port 0 = pick one and log it)",
}

def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> RegistryConfig:
    """Build the configuration from the command line and environment (pure)."""
    config = settings.load(
        RegistryConfig, argv, environ, prog="baton-registry",
        description="Baton registry: the gRPC server that owns the entry state machine.",
        help=_HELP, choices={"log_format": FORMATS}, not_negative=("gc_young",))
    check_archive(config)
    if not math.isfinite(config.staging_retention):
        raise BatonError(f"--staging-retention {config.staging_retention} is not a number "
                         "of seconds (0 = once consumed, negative = never)")
    return config


def check_archive(config: RegistryConfig) -> None:
    """One archive store, not two: replicas that disagree on it would each see half."""
    if config.archive_dir and config.archive_s3_bucket:
        raise BatonError("--archive-dir and --archive-s3-bucket both set: archive to a "
                         "directory or to S3, not both")
    if (config.archive_s3_prefix or config.archive_s3_endpoint) and not config.archive_s3_bucket:
        raise BatonError("--archive-s3-prefix/--archive-s3-endpoint need --archive-s3-bucket")
