"""The registry's Prometheus metrics, and how its ``/metrics`` endpoint reads them.

The only module of the registry that imports ``prometheus_client``. Each replica
keeps its own ``CollectorRegistry`` (several replicas may share a process, as in
the tests). What moves on every call is counted as it happens, by a wrapper
around every gRPC method (:meth:`RegistryMetrics.instrument`) and around every
etcd request (:meth:`RegistryMetrics.etcd_request`); what the registry already
counts (plans made again, claims reaped, sessions ended) is read when scraped;
and the levels (tasks by status, entries by state) are computed when scraped:
tasks from the watch-fed view, entries from count-only reads of the indexes,
cached for ``COUNT_TTL`` seconds (see docs/operations.md, Metrics, for the cost).

Label values come from bounded sets only: method names of the service, gRPC
status codes, names of Baton's error classes, entry states, task statuses, etcd
request kinds; and etcd member names and releases (as many as the cluster has
members). Never an id, a path, a host or an identity; but for the claims by fairness
key, labelled by task and by the fairness keys its manifest declares (at most
``registry.fairness.MAX_KEYS``), counted only for tasks that declare them.

The endpoint is prometheus_client's HTTP server on a thread of its own
(``kernel.metrics_endpoint``, the watcher's too). A scrape there asks the replica's
event loop for the levels (:meth:`RegistryMetrics.scraped_levels`): they are refreshed
and read on the loop, so what they read needs no lock, and a refresh can await etcd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...kernel import errors
from ...kernel.errors import ERROR_NAMES, BatonError
from ...kernel.metrics_endpoint import CLOSE_TIMEOUT, MetricsEndpoint, serve_metrics
from ...kernel.names import state_name, status_name
from ...kernel.v1 import baton_pb2 as pb
from ..records.model import TaskRecord
from ..rules.pools import PoolAdmin
from ..store.backlog import GroupBacklog
from ..store.etcd import KV

if TYPE_CHECKING:
    from ..rules.core import Core
    from ..store.etcd_members import EtcdMembers
    from ..sweeps.archive import Archiver
    from ..sweeps.deadlines import Deadlines
    from ..sweeps.stalls import Stalls
    from ..verbs.leases import Leases
    from ..verbs.sessions import Reaper, Sessions
    from ..verbs.shards import Shards

log = logging.getLogger("baton.registry")

# The text format 0.0.4 would show each counter's creation time as a series of its
# own (``*_created``); nothing reads them, and they double what is stored.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: seconds the entry counts (count-only reads of the indexes) are reused between scrapes
COUNT_TTL = 10.0
#: seconds a scrape waits for the levels to be refreshed (then serves the last ones)
REFRESH_TIMEOUT = 5.0
#: handling times of calls and etcd requests: a claim takes about a millisecond
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)

#: methods whose outcome is counted per step, and the counter they add to
STEPS = {"Claim": "claims", "ClaimBatch": "claims", "Commit": "commits",
         "CommitBatch": "commits", "Fail": "fails", "Consume": "consumes",
         "ConsumeBatch": "consumes", "Ack": "acks",
         "AckBatch": "acks", "Nack": "nacks"}
#: the calls whose claims are counted by fairness key (a commit-and-claim's next one)
FAIR_STEPS = frozenset({"Claim", "ClaimBatch", "CommitAndClaim", "CommitAndClaimBatch"})
_STEP_HELP = {
    "claims": "Entries handed to producers (Claim, ClaimBatch: ok counts entries), and "
    "refused claim calls by error",
    "commits": "Entries committed (Commit, CommitBatch: ok counts entries), and refused "
    "commit calls by error",
    "fails": "Fail calls (a producer gave an entry up), by outcome",
    "consumes": "Entries leased to consumers (Consume, ConsumeBatch: ok counts entries), "
    "and refused consume calls by error",
    "acks": "Entries acked (Ack, AckBatch: ok counts entries), and refused ack calls by "
    "error",
    "nacks": "Nack calls, by outcome",
}
#: the kinds of etcd request a registry makes (the ``op`` label)
ETCD_OPS = ("range", "txn", "lease", "watch", "status")
#: where each entry state is counted from: index prefixes (all tasks) whose keys are
#: the entries in that state (see docs/architecture.md, The keyspace)
INDEXES = ("ready", "delayed", "waiting", "open", "dead", "cready", "cdelayed", "inflight_p",
           "inflight_c")
#: the values of the ``status`` label of ``baton_tasks`` (and "unknown")
TASK_STATUSES = tuple(status_name(n) for n in pb.TaskStatus.values() if n)


def outcome_of(name: str) -> str:
    """A Baton error's name as a label value: itself when it is one of Baton's errors,
    else "other" (a subclass defined elsewhere travels under its own name)."""
    return name if name in ERROR_NAMES else "other"


def _code_of(context: Any, exc: BaseException) -> str:
    """The status a failed call ended with, as a label value."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN"


def _error_of(context: Any, code: str) -> str:
    """The name of the Baton error a failed call sent (``_abort`` puts it in the trailing
    metadata), else its status code (a call cancelled, an error of the transport)."""
    for key, value in context.trailing_metadata() or ():
        if key == errors.ERROR_KEY:
            return outcome_of(str(value))
    return code


def _result_of(result: Any) -> str:
    """A batched report's outcome as a label value: the entry's state after it, or the
    name of the error it alone ended with."""
    if result.HasField("error"):
        return outcome_of(result.error.metadata.get(errors.ERROR_KEY, "")
                          ) if errors.ERROR_KEY in result.error.metadata else result.error.code
    return _state_name(result.entry.state)


@dataclass
class _Sources:
    """What the registry counts itself, read when scraped."""

    core: Core
    reaper: Reaper | None
    sessions: Sessions | None
    shards: Shards | None = None
    leases: Leases | None = None
    etcd_members: EtcdMembers | None = None
    deadlines: Deadlines | None = None
    archiver: Archiver | None = None
    stalls: Stalls | None = None


class RegistryMetrics:
    """One replica's metrics: counted by wrappers, read and computed when scraped."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 count_ttl: float = COUNT_TTL) -> None:
        self.clock = clock
        self.count_ttl = count_ttl
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter("baton_grpc_calls", "gRPC calls handled, by method and status "
                             "code", ["method", "code"], registry=r)
        self.call_seconds = Histogram(
            "baton_grpc_call_duration_seconds", "Time the registry took to handle a unary "
            "call (from the call reaching the handler to its reply), by method", ["method"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.streams = Gauge("baton_grpc_streams", "Server streams open (Watch, "
                             "WatchTasks), by method", ["method"], registry=r)
        self.steps = {name: Counter(f"baton_{name}", text, ["outcome"], registry=r)
                      for name, text in _STEP_HELP.items()}
        self.reports = Counter(
            "baton_reports", "Watcher reports received: kind digest (ReportVerification, each of a "
            "ReportVerificationBatch) or "
            "problem (ReportProblem), by the entry's state after it, or the error",
            ["kind", "result"], registry=r)
        self.fair_claims = Counter(
            "baton_claims_by_fairness_key", "Producer claims of entries of tasks with fair "
            "shares, by task and fairness key (the keys a manifest declares)",
            ["task", "key"], registry=r)
        self.etcd_seconds = Histogram(
            "baton_etcd_request_duration_seconds", "etcd requests as the registry sees "
            "them (watch: until etcd confirmed the watch), by kind", ["op"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.etcd_failures = Counter("baton_etcd_request_failures", "etcd requests that "
                                     "failed, by kind", ["op"], registry=r)
        self._etcd = {op: (self.etcd_seconds.labels(op), self.etcd_failures.labels(op))
                      for op in ETCD_OPS}
        self._sources: _Sources | None = None
        self._tasks: dict[str, int] = {}
        self._indexes: dict[str, int] = {}
        #: watchers registered, and shards by state (owned, moving, unowned)
        self._watchers = 0
        self._shards: dict[str, int] = {}
        #: limited groups' backlogs, by task, as the last refresh counted them
        self._backlogs: list[tuple[str, GroupBacklog]] = []
        self._counted_at = -1.0
        #: etcd's revision when the entry counts were read (-1: never)
        self._counted_revision = -1
        #: concurrency pools: limit and units held (each scrape), entries waiting
        #: (once per ``count_ttl``)
        self._pools: dict[str, tuple[int, int]] = {}
        self._pool_waiting: dict[str, int] = {}
        self._endpoint: MetricsEndpoint | None = None
        #: the replica's loop, where a scrape refreshes and reads the levels
        self._loop: asyncio.AbstractEventLoop | None = None
        r.register(_Levels(self))

    # what moves on every call -------------------------------------------------

    def instrument(self, method: str, behaviour: Any, streaming: bool) -> Any:
        """``behaviour`` (a gRPC method handler) counted: its calls by status code,
        a unary call's handling time, a stream while open, and for the hot steps their
        outcome."""
        children: dict[str, Any] = {}

        def count(code: str) -> None:
            child = children.get(code)
            if child is None:
                child = children[code] = self.calls.labels(method, code)
            child.inc()

        if streaming:
            open_streams = self.streams.labels(method)

            @functools.wraps(behaviour)
            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                code = "OK"
                open_streams.inc()
                try:
                    async for item in behaviour(request, context):
                        yield item
                except BaseException as e:
                    code = _code_of(context, e)
                    raise
                finally:
                    open_streams.dec()
                    count(code)

            return stream

        # The children the happy path touches, looked up once.
        seconds = self.call_seconds.labels(method)
        ok_calls = self.calls.labels(method, "OK")
        step = self.steps[STEPS[method]] if method in STEPS else None
        ok_steps = step.labels("ok") if step is not None else None
        report = {"ReportVerification": "digest", "ReportProblem": "problem"}.get(method)
        claims = method in FAIR_STEPS

        @functools.wraps(behaviour)
        async def unary(request: Any, context: Any) -> Any:
            start = self.clock()
            try:
                reply = await behaviour(request, context)
            except BaseException as e:
                seconds.observe(self.clock() - start)
                code = _code_of(context, e)
                count(code)
                if step is not None:
                    step.labels(_error_of(context, code)).inc()
                elif report is not None:
                    self.reports.labels(report, _error_of(context, code)).inc()
                raise
            seconds.observe(self.clock() - start)
            ok_calls.inc()
            if claims:
                self._count_fair(reply)
            if ok_steps is not None:
                ok_steps.inc(_entries_in(reply))
            elif report is not None:
                self.reports.labels(report, _state_name(reply.entry.state)).inc()
            elif method == "ReportVerificationBatch":
                for result in reply.results:
                    self.reports.labels("digest", _result_of(result)).inc()
            return reply

        return unary

    def stream_call(self, method: str, error: BaseException | None, seconds: float,
                    reply: Any) -> None:
        """A call made on a session stream, counted as the unary ``method`` would be
        (so a dashboard sees an agent's steps whichever way they came)."""
        self.call_seconds.labels(method).observe(seconds)
        if error is None:
            code = "OK"
        elif isinstance(error, errors.BatonError):
            code = error.code.name
        else:
            code = "INTERNAL"
        self.calls.labels(method, code).inc()
        if error is None and method in FAIR_STEPS:
            self._count_fair(reply)
        if method in STEPS:
            step = self.steps[STEPS[method]]
            if error is None:
                step.labels("ok").inc(_entries_in(reply))
            else:
                step.labels(outcome_of(type(error).__name__)
                            if isinstance(error, errors.BatonError) else code).inc()

    def _count_fair(self, reply: Any) -> None:
        """Count the claims of a claim's reply by fairness key (entries of tasks
        without fair shares have none, and cost a field read)."""
        claims: Iterable[pb.ClaimResponse]
        if isinstance(reply, pb.CommitAndClaimResponse):
            claims = [reply.next] if reply.HasField("next") else []
        elif isinstance(reply, pb.CommitAndClaimBatchResponse):
            claims = reply.next
        else:
            claims = reply.claims if isinstance(reply, pb.ClaimBatchResponse) else [reply]
        for claim in claims:
            if claim.entry.fairness_key:
                self.fair_claims.labels(claim.entry.task_id, claim.entry.fairness_key).inc()

    def etcd_request(self, op: str, seconds: float, ok: bool) -> None:
        """One etcd request of kind ``op`` took ``seconds`` (``Etcd.observe``)."""
        histogram, failures = self._etcd[op]
        histogram.observe(seconds)
        if not ok:
            failures.inc()

    # what is read and computed when scraped ---------------------------------------

    def bind(self, core: Core, reaper: Reaper | None = None,
             sessions: Sessions | None = None, shards: Shards | None = None,
             leases: Leases | None = None, etcd_members: EtcdMembers | None = None,
             deadlines: Deadlines | None = None, archiver: Archiver | None = None,
             stalls: Stalls | None = None) -> None:
        """Read what ``core`` (its transactions, its view), ``reaper``, ``sessions``,
        ``shards``, ``leases``, ``deadlines``, ``archiver`` and ``stalls`` count, and
        compute the levels from them, when scraped; and the etcd members' releases as
        ``etcd_members`` last read them."""
        self._sources = _Sources(core, reaper, sessions, shards, leases, etcd_members,
                                 deadlines, archiver, stalls)

    async def refresh(self) -> None:
        """Compute the levels: tasks by status (the view, else etcd) at every scrape,
        entries by state (count-only reads of the indexes) once per ``count_ttl``."""
        if self._sources is None:
            return
        core = self._sources.core
        keys = core.keys
        view = core.view
        if view is not None and view.ready:
            headers = await view.scan(keys.tasks(), 0, False)
        else:
            headers = [kv async for kv in core.etcd.scan(keys.tasks())]
        tasks = dict.fromkeys(TASK_STATUSES, 0)
        for kv in headers:
            try:
                status = TaskRecord.load(kv.value).status
            except Exception:  # a record this version cannot read: counted, not named
                status = "unknown"
            status = status if status in tasks else "unknown"
            tasks[status] = tasks.get(status, 0) + 1
        self._tasks = tasks
        if self._sources.shards is not None:
            await self._count_shards(self._sources.shards)
        await self._count_pools(core)
        await self._count_backlogs(core, headers)
        now = time.monotonic()
        if self._counted_at >= 0 and now - self._counted_at < self.count_ttl:
            return
        # A count-only read makes etcd walk every key of the index, however many are
        # stored; when nothing was written since the last count (a stack at rest), the
        # counts still hold, and one read of a single key says so.
        _, revision, _ = await core.etcd.range(keys.shardmap(), limit=1, keys_only=True)
        if revision == self._counted_revision:
            self._counted_at = now
            return
        if self._pools:
            self._pool_waiting = await PoolAdmin(core).waiting(set(self._pools))
        # Every task's part of an index: its prefix for one task, with no task named.
        prefixes = (keys.ready_root(), keys.delayed_all(), keys.waiting_all(),
                    keys.open_root(), keys.dead_root(),
                    keys.cready_root(), keys.cdelayed_all(),
                    keys.inflight_of_kind("p"), keys.inflight_of_kind("c"))
        counts = await asyncio.gather(*(core.etcd.count(p) for p in prefixes))
        self._indexes = dict(zip(INDEXES, counts, strict=True))
        self._counted_at, self._counted_revision = now, revision

    async def _count_pools(self, core: Core) -> None:
        """Each pool's limit and units held, from the view's mirror (else etcd)."""
        keys, view = core.keys, core.view

        async def listing(prefix: bytes) -> list[KV]:
            if view is not None and view.ready:
                return await view.scan(prefix, 0, False)
            return [kv async for kv in core.etcd.scan(prefix)]

        pools: dict[str, tuple[int, int]] = {}
        for kv in await listing(keys.pools()):
            try:
                limit = int(json.loads(kv.value).get("limit", 0))
            except (ValueError, AttributeError):
                limit = 0
            pools[keys.last_segment(kv.key)] = (limit, 0)
        base = keys.pool_units_all()
        for kv in await listing(base):
            name = kv.key[len(base):].split(b"/", 1)[0].decode()
            limit, held = pools.get(name, (0, 0))
            pools[name] = (limit, held + 1)
        self._pools = pools

    async def _count_backlogs(self, core: Core, headers: list[Any]) -> None:
        """Each limited group's backlog in the tasks that hand out work: one etcd
        request per task with ``backlog_limits`` (none for a task without)."""
        found: list[tuple[str, GroupBacklog]] = []
        for kv in headers:
            try:
                task = TaskRecord.load(kv.value)
            except Exception:  # counted as "unknown" above
                continue
            if task.backlog_limits and task.status in ("active", "paused"):
                found += [(task.task_id, b) for b in
                          await core.backlogs.count(task.task_id, task.backlog_limits)]
        self._backlogs = found

    async def _count_shards(self, shards: Shards) -> None:
        """Watchers registered and shards by state, from the view's mirror."""
        count, table = await shards.table()
        watchers = await shards.watchers()
        states = {"owned": 0, "moving": 0, "unowned": 0}
        for n in range(count):
            rec = table[n][1] if n in table else None
            state = ("unowned" if rec is None or rec.owner not in watchers
                     else "moving" if rec.moving_to else "owned")
            states[state] += 1
        self._watchers, self._shards = len(watchers), states

    def collect_levels(self) -> Iterator[Metric]:
        sources = self._sources
        if sources is None:
            return
        txns = sources.core.txns
        replans = CounterMetricFamily(
            "baton_txn_replans", "Transactions planned again: reason compare (a failed "
            "compare-and-swap: someone wrote first), moved (a candidate moved under the "
            "planner), confirm (an error seen on the view, checked again on etcd)",
            labels=["reason"])
        for reason, n in txns.replans.items():
            replans.add_metric([reason], n)
        yield replans
        yield CounterMetricFamily(
            "baton_txn_settled", "Nothing to claim or consume answered from a current "
            "view, with no etcd request", value=txns.settled)
        yield CounterMetricFamily(
            "baton_txn_gave_up", "Calls that gave up after repeated compare failures "
            "(Conflict, ABORTED)", value=txns.gave_up)
        yield CounterMetricFamily(
            "baton_txn_etcd_requests", "etcd requests that carried transactions (group "
            "commit: one request may carry several)", value=txns.committer.requests)
        yield CounterMetricFamily(
            "baton_txn_committed", "Transactions sent to etcd (applied or not)",
            value=txns.committer.carried)
        # Labelled by task and group: only tasks whose manifest sets backlog_limits,
        # a set their operators chose to bound.
        refusals = CounterMetricFamily(
            "baton_backpressure_refusals", "Producers' claims this replica refused with "
            "Backpressure, by task and by the consumer group at its backlog limit",
            labels=["task", "group"])
        for (task_id, group), n in sorted(sources.core.backlogs.refusals.items()):
            refusals.add_metric([task_id, group], n)
        yield refusals
        backlog = GaugeMetricFamily(
            "baton_backlog", "A limited consumer group's backlog (verified entries not "
            "yet acked by it, plus the task's producer claims in flight), by task and group",
            labels=["task", "group"])
        limit = GaugeMetricFamily(
            "baton_backlog_limit", "The group's backlog limit (the manifest's "
            "backlog_limits): producers' claims are refused while baton_backlog >= it",
            labels=["task", "group"])
        for task_id, b in self._backlogs:
            backlog.add_metric([task_id, b.group], b.backlog)
            limit.add_metric([task_id, b.group], b.limit)
        yield backlog
        yield limit
        if sources.reaper is not None:
            yield CounterMetricFamily(
                "baton_reaped_claims", "Claims whose lease was gone, moved on by this "
                "replica's reaper (producer: the entry retried; consumer: back to its group)",
                value=sources.reaper.reaped)
            yield CounterMetricFamily(
                "baton_pool_units_repaired", "Pool units this replica's reaper freed "
                "because no claim held them any more (a safety net: every path that ends "
                "a claim frees its unit, so this stays 0)",
                value=sources.reaper.pools.repaired)
        if sources.sessions is not None:
            yield CounterMetricFamily(
                "baton_sessions_closed", "Sessions closed by CloseSession on this replica "
                "(their leases revoked)", value=sources.sessions.closed)
        if sources.leases is not None:
            yield CounterMetricFamily(
                "baton_claims_revoked", "Claims this replica gave back by revoking their "
                "sessions (lease revoke, a drain's deadline): no retry spent",
                value=sources.leases.returned)
            yield CounterMetricFamily(
                "baton_leases_rotated", "Sessions this replica moved onto a fresh lease "
                "(lease rotate)", value=sources.leases.rotated)
        view = sources.core.view
        if view is not None:
            yield CounterMetricFamily(
                "baton_sessions_ended", "Session records this replica saw deleted on its "
                "watch: closed or lease expired, on any replica (see "
                "baton_sessions_closed)", value=view.sessions_ended)
            yield GaugeMetricFamily("baton_view_ready", "1 when the watch-fed view is in "
                                    "sync with etcd, else 0 (reads go to etcd)",
                                    value=1 if view.ready else 0)
            yield GaugeMetricFamily("baton_sessions", "Agent sessions open (the view's "
                                    "mirror)", value=view.session_count())
        deadlines = sources.deadlines
        if deadlines is not None:
            yield CounterMetricFamily(
                "baton_claims_expired", "Claims this replica took away at their processing "
                "deadline (claim_deadline, consume_deadline)", value=deadlines.expired)
        stalls = sources.stalls
        if stalls is not None:
            yield CounterMetricFamily(
                "baton_claims_stalled", "Claims this replica took back as stalled: no "
                "checkpoint within the entry's stall_after_seconds", value=stalls.stalled)
        archive = sources.archiver
        if archive is not None:
            yield CounterMetricFamily(
                "baton_tasks_archived", "Finished tasks this replica archived out of etcd",
                value=archive.archived)
            yield CounterMetricFamily(
                "baton_archives_expired", "Archives this replica deleted (older than "
                "--archive-retention), with their tasks' headers", value=archive.expired)
        # 0 too on a replica with no archive store: finished tasks then stay in etcd,
        # which the alert on it (BatonNoArchiver) is about
        election = archive.election if archive is not None else None
        yield GaugeMetricFamily(
            "baton_archiver_leader", "1 while this replica is the one that archives "
            "(it won the archiver election), else 0 (also when it has no archive store)",
            value=1 if archive is not None and (election is None or election.is_leader)
            else 0)
        if sources.shards is not None:
            yield CounterMetricFamily(
                "baton_shards_reassigned", "Shards this replica gave to a live watcher "
                "because their owner was gone (expired, or never there)",
                value=sources.shards.reassigned)
            yield CounterMetricFamily(
                "baton_shard_moves_forced", "Shard moves this replica forced at their "
                "deadline (the owner did not hand the shard over in time)",
                value=sources.shards.forced)
            yield GaugeMetricFamily("baton_watchers", "Watchers registered (live leases)",
                                    value=self._watchers)
            states = GaugeMetricFamily(
                "baton_shards", "Shards by state: owned, moving (a handover in progress), "
                "unowned (no live watcher serves its tasks)", labels=["state"])
            for state, n in self._shards.items():
                states.add_metric([state], n)
            yield states
        if sources.etcd_members is not None:
            yield from _etcd_members(sources.etcd_members)
        pool_limits = GaugeMetricFamily("baton_pool_limit", "A concurrency pool's limit (0: units "
                                   "held, the pool no longer defined)", labels=["pool"])
        pool_held = GaugeMetricFamily("baton_pool_units_in_use", "Units of a concurrency pool "
                                 "held by claims", labels=["pool"])
        pool_waiting = GaugeMetricFamily("baton_pool_waiting", "Claimable entries that need a "
                                    "unit of the pool (counted once per count TTL)",
                                    labels=["pool"])
        for name, (pool_limit, in_use) in sorted(self._pools.items()):
            pool_limits.add_metric([name], pool_limit)
            pool_held.add_metric([name], in_use)
            pool_waiting.add_metric([name], self._pool_waiting.get(name, 0))
        pool_refused = CounterMetricFamily("baton_pool_refusals", "Claims and consumes this "
                                      "replica answered with nothing to claim because a "
                                      "pool had no free unit", labels=["pool"])
        for name, n in sorted(sources.core.pool_refusals.items()):
            pool_refused.add_metric([name], n)
        yield from (pool_limits, pool_held, pool_waiting, pool_refused)
        tasks = GaugeMetricFamily("baton_tasks", "Tasks by status", labels=["status"])
        for status, n in self._tasks.items():
            tasks.add_metric([status], n)
        yield tasks
        if not self._indexes:
            return
        ix = self._indexes
        entries = GaugeMetricFamily(
            "baton_entries", "Entries by state, from the indexes: pending (ready, "
            "delayed or waiting), writing (producer claims not yet reaped), dead; "
            "unfinished counts every entry not yet consumed or dead", labels=["state"])
        entries.add_metric(["pending"], ix["ready"] + ix["delayed"] + ix["waiting"])
        entries.add_metric(["writing"], ix["inflight_p"])
        entries.add_metric(["dead"], ix["dead"])
        entries.add_metric(["unfinished"], ix["open"])
        yield entries
        index = GaugeMetricFamily("baton_index_keys", "Keys in each index, all tasks",
                                  labels=["index"])
        for name, n in ix.items():
            index.add_metric([name], n)
        yield index
        yield GaugeMetricFamily("baton_entry_counts_age_seconds", "Seconds since the "
                                "entry counts were read from etcd",
                                value=time.monotonic() - self._counted_at)

    # the endpoint ----------------------------------------------------------------------

    async def serve(self, address: str) -> int:
        """Serve ``/metrics`` on ``address`` (``HOST:PORT``); the bound port. A bad
        address is ``InvalidArgument`` (``kernel.metrics_endpoint``)."""
        self._loop = asyncio.get_running_loop()
        # On a thread: a host name is resolved by a blocking call.
        self._endpoint = await asyncio.to_thread(serve_metrics, address, self.registry, log)
        return self._endpoint.port

    async def close(self) -> None:
        """Stop serving ``/metrics``, within the endpoint's bounded close. It runs on a
        thread of its own, not the loop's executor: a stop must not queue behind
        whatever else the executor is busy with."""
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is None:
            return
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[bool] = loop.create_future()

        def answer(ended: bool) -> None:
            if not closed.done():
                closed.set_result(ended)

        def close() -> None:
            ended = endpoint.close()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(answer, ended)

        threading.Thread(target=close, name="metrics-close", daemon=True).start()
        if not await closed:
            log.warning("metrics: the /metrics server's thread did not end within %gs; "
                        "the port is closed and the replica stops anyway", CLOSE_TIMEOUT)

    def scraped_levels(self) -> list[Metric]:
        """The levels for a scrape on the endpoint's thread: refreshed and read on the
        replica's loop. Without a loop to ask (none served, or asked from the loop
        itself), the levels as last refreshed."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            return list(self.collect_levels())
        try:
            future = asyncio.run_coroutine_threadsafe(self._refreshed_levels(), loop)
        except RuntimeError:  # the loop is closed: the replica has stopped
            return []
        try:
            return future.result(REFRESH_TIMEOUT + 5.0)
        except TimeoutError:  # the loop is stuck: serve what is counted
            future.cancel()
            log.warning("metrics: the event loop did not answer a scrape within %gs",
                        REFRESH_TIMEOUT + 5.0)
            return []
        except concurrent.futures.CancelledError:  # the loop ended while asked
            return []

    async def _refreshed_levels(self) -> list[Metric]:
        try:
            await asyncio.wait_for(self.refresh(), REFRESH_TIMEOUT)
        except (BatonError, TimeoutError) as e:  # etcd away: the old levels
            log.debug("metrics: levels not refreshed: %s", str(e) or "timed out")
        except Exception:
            log.exception("metrics: levels not refreshed")
        return list(self.collect_levels())


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Levels(Collector):
    """Reads :meth:`RegistryMetrics.scraped_levels` into the registry's exposition."""

    def __init__(self, metrics: RegistryMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics.scraped_levels()

    def describe(self) -> Iterable[Metric]:
        return []  # computed when scraped: nothing to check for clashes up front


def _etcd_members(members: EtcdMembers) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "baton_etcd_server_info", "1 per etcd member, labelled with the release it runs "
        "(unknown: it could not be asked) as the registry last read it",
        labels=["member", "version"])
    for m in members.members:
        info.add_metric([m.label, m.version or "unknown"], 1)
    yield info
    yield GaugeMetricFamily(
        "baton_etcd_version_refused", "1 while an etcd member runs a release with a known "
        "bug that --allow-etcd-version does not name (health NOT_SERVING), else 0",
        value=1 if members.refusals else 0)


def _entries_in(reply: Any) -> int:
    """Entries a successful step moved: a batch's, else one."""
    if isinstance(reply, pb.ClaimBatchResponse):
        return len(reply.claims)
    if isinstance(reply, pb.ConsumeBatchResponse):
        return len(reply.leases)
    if isinstance(reply, pb.CommitBatchResponse | pb.AckBatchResponse):
        return len(reply.entries)
    return 1


def _state_name(state: int) -> str:
    if state not in pb.EntryState.values():
        return "other"
    return state_name(state)
