"""What the watcher counts about itself, in the form its ``/metrics`` endpoint serves.

Counters are plain integers under a lock (read by tests, benchmarks and the log
line at stop) and are read into Prometheus families when scraped; hash times go
into a histogram; levels (queue depth, inotify watches, entries the watcher
knows of) are asked of the daemon when scraped (:meth:`Metrics.levels`), on the
thread of the endpoint's request. The only module of the watcher that imports
``prometheus_client``; each watcher keeps its own ``CollectorRegistry``, so several
can run in one process (as in the tests). The endpoint is the registry's too
(``kernel.metrics_endpoint``).

Label values come from bounded sets only: report kinds, entry states, names of
Baton's errors, queue names. Never a task or file id, a path or a host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..kernel import errors
from ..kernel.errors import ERROR_NAMES
from ..kernel.metrics_endpoint import MetricsEndpoint, serve_metrics

# Nothing reads the ``*_created`` series the text format would add per counter.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: counters kept by name (``Metrics.add``): their metric names and help
COUNTERS = {
    "events": ("baton_watcher_events", "File events handled (inotify or polling)"),
    "overflows": ("baton_watcher_overflows", "Times file events were lost (the kernel's "
                  "queue or the watcher's overflowed); each forces a full reconciliation"),
    "reconciliations": ("baton_watcher_reconciliations", "Reconciliations: routine ones "
                        "(every --reconcile-interval: what may have changed) and full ones"),
    "full_reconciliations": ("baton_watcher_full_reconciliations", "Reconciliations that "
                             "listed every served task's entries and checked them against "
                             "the disk (at start, after an overflow, a lost registry or a "
                             "shard gained; every --full-reconcile-interval)"),
    "reconcile_listings": ("baton_watcher_reconcile_listings", "Listings (ListTasks, "
                           "ListEntries) asked of the registry by reconciliations"),
    "reconcile_entries_listed": ("baton_watcher_reconcile_entries_listed", "Entries read "
                                 "from the registry by reconciliations"),
    "reconcile_entries_checked": ("baton_watcher_reconcile_entries_checked", "Entries "
                                  "handed to a check by reconciliations (each at least a "
                                  "stat of its file)"),
    "reconcile_trees_walked": ("baton_watcher_reconcile_trees_walked", "Watched task "
                               "trees walked again by reconciliations (every directory "
                               "listed, watches added where missing)"),
    "stream_snapshots": ("baton_watcher_stream_snapshots", "Snapshots of a task's entries "
                         "taken by its Watch stream (when first served, after a broken "
                         "stream or a resume too late for etcd's history)"),
    "stream_resumes": ("baton_watcher_stream_resumes", "Watch streams resumed from the "
                       "revision they had come to, without a snapshot"),
    "stream_silences": ("baton_watcher_stream_silences", "Watch streams resumed because "
                        "nothing, not even a progress event, came for --stream-silence "
                        "seconds (counted among the resumes)"),
    "inline_checks": ("baton_watcher_inline_checks", "Checks made on the thread that read "
                      "the event or the registry's news (no hand-off; a large file found "
                      "is handed on to a hash worker)"),
    "worker_checks": ("baton_watcher_worker_checks", "Checks made by the hash workers (large "
                      "files, directories to list, retries, reconciliations, snapshots)"),
    "hashes": ("baton_watcher_files_hashed", "Files hashed to the end"),
    "hashed_bytes": ("baton_watcher_hashed_bytes", "Bytes of the files hashed"),
    "hash_failures": ("baton_watcher_hash_failures", "Hashes that failed (file changed, "
                      "vanished or unreadable); retried, then reported"),
    "linked": ("baton_watcher_linked_files", "Verified files found with several names "
               "(hard links), polled from then on"),
    "staging_files_removed": ("baton_watcher_staging_files_removed", "Consumed entries' "
                              "files removed from staging past their retention"),
    "staging_bytes_removed": ("baton_watcher_staging_removed_bytes", "Bytes of the files "
                              "removed from staging past their retention"),
    "staging_files_changed": ("baton_watcher_staging_files_changed", "Files due for "
                              "removal kept: their bytes changed after verification "
                              "(journalled by the registry)"),
    "staging_files_refused": ("baton_watcher_staging_files_refused", "Files due for "
                              "removal left alone: a symlink, not a regular file, or a "
                              "symlink on the way"),
    "staging_dirs_removed": ("baton_watcher_staging_dirs_removed", "Directories of "
                             "archived or deleted tasks removed once empty"),
}
#: how long hashing one file takes, from a small file to gigabytes
HASH_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def error_name(exc: BaseException) -> str:
    """An error as a label value: the name of Baton's error class it is, else "other"."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ERROR_NAMES and cls.__module__ == errors.__name__:
            return cls.__name__
    return "other"


@dataclass(frozen=True)
class Levels:
    """What the daemon reports when scraped."""

    #: entries waiting for a check, file events not yet dispatched
    queued_checks: int = 0
    queued_events: int = 0
    inotify_watches: int = 0
    tasks: int = 0
    #: live entries the watcher knows of, by state name
    entries: dict[str, int] = field(default_factory=dict)
    #: seconds since the longest-written entry was committed (0: none written)
    oldest_written: float = 0.0
    #: bytes of consumed entries' files in staging that the watcher will remove
    staging_held: int = 0


#: how many entries' report counts :meth:`Metrics.reports_of` keeps
REPORTS_KEPT = 10_000


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        #: measures hash times (injected so tests control it)
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        #: digest reports per entry, for the most recent REPORTS_KEPT entries reported (a
        #: watcher verifies millions of files over its life: not one count per file kept).
        #: Ordered: dropping a plain dict's first key scans the slots its deleted keys
        #: left, thousands once it is full, and one is dropped for each file reported.
        self._reports: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._results: Counter[tuple[str, str]] = Counter()
        #: seconds spent hashing, for the rate a watcher registers with
        self._hashing = 0.0
        self.registry = CollectorRegistry()
        self.hash_seconds = Histogram(
            "baton_watcher_hash_duration_seconds", "Time to hash one file (open to digest, "
            "the checks that it did not change included)", buckets=HASH_BUCKETS,
            registry=self.registry)
        self._levels: Callable[[], Levels] = Levels
        self._endpoint: MetricsEndpoint | None = None
        self.registry.register(_Exported(self))

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_all(self, counts: dict[str, int]) -> None:
        """Add several counts at once (a reader sees all of them or none)."""
        with self._lock:
            self._counts.update(counts)

    def hashed(self, size: int, seconds: float) -> None:
        """A file of ``size`` bytes was hashed in ``seconds``."""
        with self._lock:
            self._counts["hashes"] += 1
            self._counts["hashed_bytes"] += size
            self._hashing += seconds
        self.hash_seconds.observe(seconds)

    def hash_rate(self) -> float:
        """MB hashed per second spent hashing, over the watcher's life (0: none yet)."""
        with self._lock:
            hashed, spent = self._counts["hashed_bytes"], self._hashing
        return hashed / spent / 1e6 if spent > 0 else 0.0

    def reported(self, task_id: str, file_id: str, kind: str = "digest",
                 result: str = "") -> None:
        """A report of ``kind`` (digest, missing, corrupted) was sent for an entry; the
        registry answered with the entry in state ``result``. ``reports`` and
        :meth:`reports_of` count the digests."""
        with self._lock:
            if kind == "digest":
                self._counts["reports"] += 1
                key = (task_id, file_id)
                known = self._reports.get(key)
                if known is None and len(self._reports) >= REPORTS_KEPT:
                    self._reports.popitem(last=False)  # the longest known
                self._reports[key] = (known or 0) + 1
            self._results[(kind, result or "other")] += 1

    def refused(self, kind: str, exc: BaseException) -> None:
        """A report of ``kind`` could not be made: the registry refused it or was away."""
        with self._lock:
            self._results[(kind, error_name(exc))] += 1

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def reports_of(self, task_id: str, file_id: str) -> int:
        """Verification reports sent for one entry (0 for one reported before the last
        :data:`REPORTS_KEPT` entries reported)."""
        with self._lock:
            return self._reports.get((task_id, file_id), 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # Prometheus ----------------------------------------------------------------------

    def levels(self, source: Callable[[], Levels]) -> None:
        """Ask ``source`` for the levels when scraped."""
        self._levels = source

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = dict(self._counts)
            results = dict(self._results)
        for key, (name, text) in COUNTERS.items():
            yield CounterMetricFamily(name, text, value=counts.get(key, 0))
        reports = CounterMetricFamily(
            "baton_watcher_reports", "Reports sent to the registry: kind digest (a file "
            "hashed), missing or corrupted (a problem); result: the entry's state after "
            "it, or the error that kept it from being made", labels=["kind", "result"])
        for (kind, result), n in sorted(results.items()):
            reports.add_metric([kind, result], n)
        yield reports
        levels = self._levels()
        queue = GaugeMetricFamily("baton_watcher_queue_depth", "Work waiting: checks (entries "
                                  "to look at or hash) and events (file events not yet "
                                  "dispatched)", labels=["queue"])
        queue.add_metric(["checks"], levels.queued_checks)
        queue.add_metric(["events"], levels.queued_events)
        yield queue
        yield GaugeMetricFamily("baton_watcher_inotify_watches", "inotify watches in use "
                                "(directories watched)", value=levels.inotify_watches)
        yield GaugeMetricFamily("baton_watcher_tasks", "Tasks the watcher serves",
                                value=levels.tasks)
        entries = GaugeMetricFamily("baton_watcher_entries", "Live entries of the served "
                                    "tasks, by state, as the watcher knows them",
                                    labels=["state"])
        for state, n in sorted(levels.entries.items()):
            entries.add_metric([state], n)
        yield entries
        yield GaugeMetricFamily(
            "baton_watcher_oldest_written_seconds", "Seconds since the entry longest in "
            "state written was committed (0: none is written): a written entry waits for "
            "this watcher's digest", value=levels.oldest_written)
        yield GaugeMetricFamily(
            "baton_watcher_staging_held_bytes", "Bytes of consumed entries' files of its "
            "shards still in staging, waiting for their retention to pass (negative "
            "retentions not counted)", value=levels.staging_held)

    def serve(self, address: str, logger: logging.Logger) -> int:
        """Serve ``/metrics`` on ``address`` (``HOST:PORT``) from a thread; the bound port.
        A bad address is ``InvalidArgument`` (``kernel.metrics_endpoint``)."""
        self._endpoint = serve_metrics(address, self.registry, logger)
        return self._endpoint.port

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None


class _Exported(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics.collect())

    def describe(self) -> Iterable[Metric]:
        return []  # read when scraped: nothing to check for clashes up front
