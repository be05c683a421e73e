"""The watcher's configuration: flags, ``BATON_*`` variables, an optional TOML file.

Precedence: flag > environment > TOML file > default. Every flag ``--some-name``
has the variable ``BATON_SOME_NAME`` and the TOML key ``some_name``, as for the
registry (both load through ``kernel.settings``). This is the only module of the
watcher that reads the environment, and it reads it only from the mapping it is
given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..kernel import settings
from ..kernel.collector import HELP as GC_YOUNG_HELP
from ..kernel.collector import YOUNG
from ..kernel.logs import FORMATS

OBSERVERS = ("auto", "inotify", "poll")
LOG_FORMATS = FORMATS

#: files of at least this many bytes are hashed on several threads
#: (measured with bench/hash_threshold.py, see docs/watcher.md)
LARGE_FILE = 1 << 20


@dataclass(frozen=True)
class WatcherConfig:
    registry: str = "127.0.0.1:7390"
    ca: str = ""
    cert: str = ""
    key: str = ""
    staging: str = "/var/lib/baton/staging"
    observer: str = "auto"
    reconcile_interval: float = 30.0
    #: a backstop for changes the kernel never reported as lost: rare enough that the
    #: full pass it costs (every entry of the shards listed and checked) stays small at rest
    full_reconcile_interval: float = 6 * 3600.0
    poll_interval: float = 1.0
    hash_workers: int = 2
    large_file: int = LARGE_FILE
    max_failures: int = 3
    retry_delay: float = 0.2
    event_queue: int = 65536
    #: streams last while they are healthy: no timer (watcher/sync.py), but a silence
    #: limit of three of the progress intervals ``baton up`` gives etcd (10 s)
    stream_timeout: float = 0.0
    stream_silence: float = 30.0
    reporter: str = ""
    state_file: str = ""
    log_level: str = "INFO"
    log_format: str = "kv"
    # Python's cyclic garbage collector (kernel/collector.py)
    gc_young: int = YOUNG
    metrics: str = ""
    shard_ttl: int = 10
    cold_after: float = 24 * 3600.0
    removal_rate: float = 200.0


_HELP = {
    "registry": "registry address host:port",
    "ca": "PEM file of the CA that signed the registry's certificate "
    "(set with --cert and --key: mutual TLS; none of the three: plaintext)",
    "cert": "PEM certificate of this watcher's identity (its OU includes watcher)",
    "key": "PEM private key of --cert",
    "staging": "staging root; a task's files live under STAGING/TASK/",
    "observer": "auto (inotify, polling where inotify cannot see), inotify or poll",
    "reconcile_interval": "seconds between routine reconciliations: they check what may "
    "have changed (files not seen verified, directories with events, unwatched trees)",
    "full_reconcile_interval": "seconds between full reconciliations on a timer, which list "
    "and check every entry, a backstop for changes the kernel never reported as lost (0 = "
    "none: only at start, after an overflow, a lost registry or a shard gained)",
    "poll_interval": "seconds between scans of trees the polling observer watches",
    "hash_workers": "files hashed at the same time",
    "large_file": "bytes from which a file is hashed on several threads",
    "max_failures": "failed hashes in a row before a file is reported corrupted",
    "retry_delay": "seconds before a failed hash is tried again (doubling per attempt)",
    "event_queue": "file events buffered before an overflow forces a full reconciliation",
    "stream_timeout": "seconds a registry stream lasts before it is ended and resumed (0 "
    "or less = none: a stream lasts while it is healthy)",
    "stream_silence": "seconds without a message (a change or a progress event) after which "
    "a task's Watch stream is resumed from its revision (0 or less = none)",
    "reporter": "name of this watcher in reports (empty = watcher@HOSTNAME)",
    "state_file": "SQLite file remembering what was hashed, kept across restarts "
    "(empty = memory only; a restart rehashes verified files once)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "kv (key=value lines) or json (one object per line)",
    "gc_young": GC_YOUNG_HELP,
    "metrics": "HOST:PORT to serve Prometheus metrics on, at /metrics (empty = off; "
    "port 0 = pick one and log it)",
    "shard_ttl": "seconds the watcher's registration (and its shards) outlives its last "
    "heartbeat",
    "cold_after": "seconds without a change after which a task directory is unwatched and "
    "left to the periodic reconciliation",
    "removal_rate": "most consumed entries' files removed from staging per second, once "
    "their retention has passed",
}

_CHOICES: dict[str, tuple[str, ...]] = {"observer": OBSERVERS, "log_format": LOG_FORMATS}
_POSITIVE = ("reconcile_interval", "poll_interval", "hash_workers", "large_file",
             "max_failures", "event_queue", "shard_ttl", "cold_after", "removal_rate")


def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> WatcherConfig:
    """Build the configuration from the command line and environment (pure)."""
    return settings.load(
        WatcherConfig, argv, environ, prog="baton-watcher",
        description="Baton watcher: hashes files as they land in the staging area and "
        "reports their BLAKE3 digests to the registry.",
        help=_HELP, choices=_CHOICES, positive=_POSITIVE, not_negative=("gc_young",))
