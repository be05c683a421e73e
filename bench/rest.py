"""At rest: what an idle stack holding many entries costs, per process, while etcd
compacts its history under it (issue 39)."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from baton_relay.client import Client, Session
from baton_relay.kernel import errors, pki
from baton_relay.local.etcdproc import EtcdProcess, free_port
from baton_relay.local.stack import ETCD_UPKEEP
from baton_relay.registry.store.etcd import KV, Etcd, EtcdAuth
from baton_relay.registry.store.txn import REQUEST_LEASE_SPAN, REQUEST_TTL

from .harness import (
    BenchError,
    Daemon,
    Stack,
    check_interrupted,
    cpu_seconds,
    etcd_kv_calls,
    load_average,
    ratio,
    terminate,
)
from .profiles import Profile
from .profiling import Function, Recorder, py_spy
from .report import Section, Table, line_plot

METHOD = """
A stack shaped as `baton up` runs it: etcd with `baton up`'s flags
(`--auto-compaction-mode=periodic --auto-compaction-retention={compaction}
--experimental-watch-progress-notify-interval={notify}`), a registry (archiving to a
directory, metrics on), one watcher on the staging directory (a state file, metrics
on){tls}. It is loaded with {entries:,} entries across {tasks} tasks: {pending:,}
pending, {verified:,} verified (claimed, their file written into staging, committed
with its digest, verified by the watcher) and {consumed:,} consumed (verified, then
taken and acked by a consumer group) — by {workers} loading threads with
`ClaimBatch`, `CommitBatch`, `ConsumeBatch` and `AckBatch` of 21. Once the load is done
and the watcher's first sync is over (a snapshot of every task's Watch stream, its
queues empty, its snapshots and hashes still for {settle:g} s){tail} and etcd has
compacted the load's history away, the stack is left alone for
{idle:g} s ({periods:g} compaction periods of {period:g} s at least), and measured
over that window:

* **CPU** of each process from `/proc/PID/stat` (user + system): CPU seconds ÷ wall
  seconds is the cores it kept busy; the goal is at most 1 % of a core each.
* **What the registry served**, from its metrics (`baton_grpc_calls` by method):
  `ListEntries` calls (the goal: none after the first sync), `Watch` calls (each
  stream a client opened or resumed), and every call in all.
* **What the watcher did**, from its metrics: stream snapshots (the goal: none after
  the first sync), stream resumes, reconciliations, files hashed.
* **etcd's requests** (`Range` and `Txn` as etcd counts them) and whether the
  registry's own etcd watch (the view of the hot keys) broke and reloaded (its log).
* **etcd's revision and compactions**: every write moves the revision, and each
  periodic compaction after one walks every stored key (its index, then its database
  in batches), whatever changed; a compaction at a revision already compacted costs
  nothing. The goal: no write at rest, so no compaction.
* **etcd alone**: after the window the watcher and the registry are stopped and, once
  etcd has compacted their last writes away, etcd is measured on its own holding the
  same keys, with no client: the floor no client of it can take away (its runtime's
  memory upkeep grows with what it stores).
"""

#: a process's goal at rest: at most this share of a core
GOAL_CORE = 0.01
#: files' content: the same few bytes for every one
FILE_BYTES = b"baton at rest\n" * 4
#: entries per batch call (the registry's most)
BATCH = 21
#: the consumer group that consumes
GROUP = "sink"


def seconds_of(duration: str) -> float:
    """etcd's duration (``"1m"``, ``"5s"``, ``"200ms"``, ``"1h"``, or a bare number of
    hours, as ``--auto-compaction-retention`` takes it) in seconds."""
    found = re.fullmatch(r"\s*([\d.]+)\s*(ms|s|m|h)?\s*", duration)
    if not found:
        raise BenchError(f"not a duration: {duration!r}")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 3600.0}[found.group(2)]
    return float(found.group(1)) * scale


def etcd_flags(compaction: str, notify: str) -> tuple[str, ...]:
    """``baton up``'s etcd flags (``local.stack.ETCD_UPKEEP``) with the compaction
    retention and the watch progress interval set."""
    out = []
    for flag in ETCD_UPKEEP:
        if flag.startswith("--auto-compaction-retention="):
            flag = f"--auto-compaction-retention={compaction}"
        elif flag.startswith("--experimental-watch-progress-notify-interval="):
            flag = f"--experimental-watch-progress-notify-interval={notify}"
        out.append(flag)
    return tuple(out)


def notify_interval() -> str:
    """The watch progress interval ``baton up`` gives etcd."""
    prefix = "--experimental-watch-progress-notify-interval="
    return next((f[len(prefix):] for f in ETCD_UPKEEP if f.startswith(prefix)), "10m")


# --- metrics --------------------------------------------------------------------------


def scrape(address: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, ``name{labels}`` → value (counters as exported,
    ``_total`` included)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of metric ``name``'s samples (``name`` or ``name_total``) whose labels
    include ``labels``."""
    got = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base not in (name, f"{name}_total"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            got += value
    return got


def watch_breaks(log_path: Path) -> int:
    """How often the registry's view reloaded after its etcd watch broke (its log)."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    return text.count("view: watch broken") + text.count("view: watch crashed")


# --- loading --------------------------------------------------------------------------


@dataclass
class Plan:
    """One task's entries: the first ``consumed`` end consumed, the next ``verified``
    verified, the rest pending."""

    task: str
    entries: int
    verified: int
    consumed: int


@dataclass
class Loaded:
    lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = 0
    committed: int = 0
    consumed: int = 0
    tasks: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def plans(p: Profile) -> list[Plan]:
    out = []
    for k in range(p.rest_tasks):
        n = p.rest_entries // p.rest_tasks + (1 if k < p.rest_entries % p.rest_tasks else 0)
        consumed = round(n * p.rest_consumed)
        verified = min(n - consumed, round(n * p.rest_verified))
        out.append(Plan(f"rest-{k:04d}", n, verified, consumed))
    return out


def load_task(c: Client, session: Session, plan: Plan, staging: Path, digest: str,
              done: Loaded) -> None:
    c.operator.create_task({"task_id": plan.task, "digest_optional": False, "consumers": [GROUP],
                            "entries": [{"file_id": f"e{i:06d}", "path": f"e{i:06d}"}
                               for i in range(plan.entries)]})
    done.add(created=plan.entries)
    folder = staging / plan.task
    folder.mkdir(parents=True, exist_ok=True)
    left = plan.verified + plan.consumed
    while left > 0:
        check_interrupted()
        claims = c.claim_batch(plan.task, min(BATCH, left), session=session)
        for cl in claims:
            Path(cl.path).parent.mkdir(parents=True, exist_ok=True)
            Path(cl.path).write_bytes(FILE_BYTES)
        c.commit_batch([(plan.task, cl.file_id, cl.token, len(FILE_BYTES), digest)
                        for cl in claims])
        left -= len(claims)
        done.add(committed=len(claims))
    left = plan.consumed
    deadline = time.monotonic() + 600
    while left > 0:
        check_interrupted()
        try:
            leases = c.consume_batch(plan.task, GROUP, min(BATCH, left),
                                     session=session)
        except errors.NothingToClaim:  # not verified yet: the watcher is on it
            if time.monotonic() > deadline:
                raise BenchError(f"{plan.task}: entries not verified within 600 s") from None
            time.sleep(0.05)
            continue
        c.ack_batch([(plan.task, x.file_id, GROUP, x.token) for x in leases])
        left -= len(leases)
        done.add(consumed=len(leases))
    done.add(tasks=1)


def load(p: Profile, address: str, credentials: tuple[str, str, str], staging: Path,
         todo: list[Plan]) -> tuple[Loaded, float]:
    """Load every plan on ``p.rest_workers`` threads, printing progress; (counts, s)."""
    digest = blake3.blake3(FILE_BYTES).hexdigest()
    work: queue.Queue[Plan] = queue.Queue()
    for plan in todo:
        work.put(plan)
    done = Loaded()
    ca, cert, key = credentials

    def worker(n: int) -> None:
        try:
            with Client(address, timeout=600, ca=ca, cert=cert, key=key) as c, \
                    c.open_session(f"bench-rest-{n}", ttl=60) as s:
                while not done.errors:
                    try:
                        plan = work.get_nowait()
                    except queue.Empty:
                        return
                    load_task(c, s, plan, staging, digest, done)
        except BaseException as e:
            with done.lock:
                done.errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(n,), daemon=True)
               for n in range(p.rest_workers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    want = (sum(x.entries for x in todo), sum(x.verified + x.consumed for x in todo),
            sum(x.consumed for x in todo))
    last = 0.0
    while any(t.is_alive() for t in threads):
        check_interrupted()
        time.sleep(0.2)
        if time.monotonic() - last >= 5:
            last = time.monotonic()
            print(f"  rest: loading {time.monotonic() - t0:.0f} s: created {done.created:,}"
                  f"/{want[0]:,}, committed {done.committed:,}/{want[1]:,}, consumed "
                  f"{done.consumed:,}/{want[2]:,} ({done.tasks}/{len(todo)} tasks)",
                  flush=True)
    if done.errors:
        raise BenchError(f"loading failed: {done.errors[0]}")
    return done, time.monotonic() - t0


# --- the first sync and the idle window -----------------------------------------------


WATCHER_COUNTERS = {
    "stream snapshots": "baton_watcher_stream_snapshots",
    "stream resumes": "baton_watcher_stream_resumes",
    "stream silences": "baton_watcher_stream_silences",
    "reconciliations": "baton_watcher_reconciliations",
    "files hashed": "baton_watcher_files_hashed",
}


def watcher_state(address: str) -> tuple[float, ...]:
    """(snapshots, files hashed, work queued) of the watcher: what its first sync moves
    (not its stream resumes or periodic reconciliations, which go on at rest)."""
    got = scrape(address)
    return (total(got, "baton_watcher_stream_snapshots"),
            total(got, "baton_watcher_files_hashed"), total(got, "baton_watcher_queue_depth"))


def first_sync(p: Profile, watcher_metrics: str, tasks: list[Plan], client: Client,
               watcher: Daemon) -> float:
    """Wait until every entry meant to be verified is, the watcher has taken a snapshot
    of every task, its queues are empty and its counters have not moved for
    ``p.rest_settle`` s; the seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + max(600.0, p.rest_entries / 500)
    want = {x.task: x.verified for x in tasks}
    waiting = dict(want)
    still_since, last, said = time.monotonic(), watcher_state(watcher_metrics), 0.0
    while True:
        check_interrupted()
        if watcher.process.poll() is not None:
            raise BenchError(f"the watcher exited (log {watcher.log_path})")
        if time.monotonic() > deadline:
            raise BenchError(f"no first sync within {deadline - t0:.0f} s: still "
                             f"unverified in {sorted(waiting)[:5]} ...; watcher {last}")
        for task in list(waiting):
            states = client.operator.get_task(task).states
            if states.get("verified", 0) >= want[task]:
                del waiting[task]
        now = watcher_state(watcher_metrics)
        if now != last:
            still_since, last = time.monotonic(), now
        snapshots, queued = now[0], now[-1]
        if (not waiting and snapshots >= len(tasks) and queued == 0
                and time.monotonic() - still_since >= p.rest_settle):
            return time.monotonic() - t0
        if time.monotonic() - said >= 10:
            said = time.monotonic()
            print(f"  rest: first sync {time.monotonic() - t0:.0f} s: {len(waiting)} tasks "
                  f"not all verified, watcher snapshots {snapshots:.0f}/{len(tasks)}, "
                  f"queued {queued:.0f}", flush=True)
        time.sleep(2.0)


@dataclass
class Reading:
    """Everything read at one moment of the idle window."""

    at: float
    cpu: dict[str, float]
    registry: dict[str, float]
    watcher: dict[str, float]
    etcd: dict[str, int]
    #: etcd's revision and compactions so far (``store_counts``)
    store: dict[str, float]
    breaks: int
    machine: tuple[int, int]


def machine_ticks() -> tuple[int, int]:
    """(all CPU ticks, idle ticks) of the whole machine so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


#: etcd's own samples the window reads: its revision (every write moves it), and its
#: compactions (each walks every stored key, whatever changed since the last one; one
#: at a revision already compacted is refused at once and counts nowhere)
STORE_SAMPLES = {
    "revision": "etcd_debugging_mvcc_current_revision",
    "compactions": "etcd_debugging_mvcc_db_compaction_total_duration_milliseconds_count",
    "compaction_ms": "etcd_debugging_mvcc_db_compaction_total_duration_milliseconds_sum",
    "index_pause_ms": "etcd_debugging_mvcc_index_compaction_pause_duration_milliseconds_sum",
    "leases_ended": "etcd_debugging_lease_revoked_total",
}


def store_counts(etcd: EtcdProcess) -> dict[str, float]:
    """etcd's revision and compaction counts so far (``STORE_SAMPLES``)."""
    text = etcd.get("/metrics", timeout=5).decode()
    found = {}
    for what, name in STORE_SAMPLES.items():
        sample = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        found[what] = float(sample.group(1)) if sample else float("nan")
    return found


def read(pids: dict[str, int], registry_metrics: str, watcher_metrics: str, stack: Stack,
         registry: Daemon) -> Reading:
    return Reading(time.monotonic(), {n: cpu_seconds(pid) for n, pid in pids.items()},
                   scrape(registry_metrics), scrape(watcher_metrics),
                   etcd_kv_calls(stack.etcd), store_counts(stack.etcd),
                   watch_breaks(registry.log_path), machine_ticks())


def calls(a: Reading, b: Reading, method: str = "") -> int:
    labels = {"method": method} if method else {}
    return round(total(b.registry, "baton_grpc_calls", **labels)
                 - total(a.registry, "baton_grpc_calls", **labels))


def counted(a: Reading, b: Reading, name: str) -> int:
    return round(total(b.watcher, name) - total(a.watcher, name))


# --- the scenario ---------------------------------------------------------------------


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    period = seconds_of(p.rest_compaction)
    idle = max(p.rest_idle, p.rest_periods * period)
    notify = p.rest_notify or notify_interval()
    todo = plans(p)
    notes: list[str] = []
    staging = root / "staging"
    staging.mkdir()
    registry_metrics = f"127.0.0.1:{free_port()}"
    watcher_metrics = f"127.0.0.1:{free_port()}"
    with Stack(root, registry_tls=p.rest_tls, etcd_args=etcd_flags(p.rest_compaction, notify)
               ) as stack:
        registry = stack.registry(staging, extra=(
            "--metrics", registry_metrics, "--archive-dir", str(root / "archive")))
        watcher_tls: tuple[str, ...] = ()
        if p.rest_tls:
            made = pki.local_pki(root / "pki")
            watcher_tls = ("--ca", str(made["ca"].cert), "--cert", str(made["watcher"].cert),
                           "--key", str(made["watcher"].key))
        timeout = ("--stream-timeout", f"{p.rest_stream_timeout:g}") \
            if p.rest_stream_timeout > 0 else ()
        watcher = stack.watcher(registry.address, staging, extra=(
            "--state-file", str(root / "watcher-state.sqlite"), "--metrics", watcher_metrics,
            *watcher_tls, *timeout))
        pids = {"registry": registry.pid, "watcher": watcher.pid, "etcd": stack.etcd.pid or 0}
        loaded, load_seconds = load(p, registry.address, registry.credentials, staging, todo)
        load_end = time.monotonic()
        print(f"  rest: loaded {loaded.created:,} entries in {load_seconds:.0f} s; waiting "
              "for the watcher's first sync", flush=True)
        ca, cert, key = registry.credentials
        with Client(registry.address, timeout=60, ca=ca, cert=cert, key=key) as c:
            sync_seconds = first_sync(p, watcher_metrics, todo, c, watcher)
        print(f"  rest: first sync done after {sync_seconds:.0f} s", flush=True)
        tail = None
        if p.rest_tail:
            tail = wait_tail(load_end, lambda: read(pids, registry_metrics, watcher_metrics,
                                                    stack, registry))
        else:
            notes.append(f"The load's request outcomes (kept {REQUEST_TTL} s for retries, "
                         "on leases) had not expired before the window (`rest_tail` off): "
                         "their expiries are writes if they fall in it.")
        settled_compaction(stack.etcd, period, notes)
        print(f"  rest: idle for {idle:.0f} s", flush=True)
        readings = [read(pids, registry_metrics, watcher_metrics, stack, registry)]
        end = readings[0].at + idle
        step = max(1.0, min(p.rest_sample, idle / 4))
        while time.monotonic() < end:
            check_interrupted()
            for daemon in (registry, watcher):
                if daemon.process.poll() is not None:
                    raise BenchError(f"the {daemon.name} exited at rest (log "
                                     f"{daemon.log_path})")
            time.sleep(min(step, max(0.0, end - time.monotonic())))
            readings.append(read(pids, registry_metrics, watcher_metrics, stack, registry))
            if len(readings) % max(1, round(60 / step)) == 0:
                print(f"  rest: idle {readings[-1].at - readings[0].at:.0f}/{idle:.0f} s",
                      flush=True)
        written = written_at_rest(stack, int(readings[0].store["revision"]))
        profile = profile_busiest(p, root, readings, pids)
        alone = etcd_alone(p, stack, (watcher, registry), period, notes)
    if written:
        notes.append("Keys written at rest (still in etcd at the window's end; a path "
                     "segment with a digit shown as *): " + ", ".join(
                         f"`{name}` {n}" for name, n in written[:10]) + ".")
    return section(p, todo, readings, period, idle, notify, load_seconds, sync_seconds,
                   profile, notes, plot_dir, time.monotonic() - t0, alone, tail)


def wait_tail(load_end: float, reading: Callable[[], Reading]) -> tuple[Reading, Reading]:
    """Wait until the load's request outcomes are gone: each mutating call's outcome is
    kept ``REQUEST_TTL`` s for its retries, on a lease replaced every
    ``REQUEST_LEASE_SPAN`` s, and each lease's expiry deletes its keys (a write, which
    the next periodic compaction follows). Readings at the tail's start and end."""
    end = load_end + REQUEST_TTL + REQUEST_LEASE_SPAN + 10
    first = reading()
    print(f"  rest: waiting {max(0.0, end - first.at):.0f} s for the load's request "
          "outcomes to expire", flush=True)
    last_said = first.at
    while time.monotonic() < end:
        check_interrupted()
        time.sleep(min(5.0, max(0.0, end - time.monotonic())))
        if time.monotonic() - last_said >= 60:
            last_said = time.monotonic()
            print(f"  rest: {max(0.0, end - last_said):.0f} s of the tail left", flush=True)
    return first, reading()


def written_at_rest(stack: Stack, after: int) -> list[tuple[str, int]]:
    """The keys written after revision ``after`` (still there: a deleted one is not
    seen), by pattern (a path segment with a digit in it shown as ``*``), most first."""
    flags = dict(zip(stack.etcd_flags[::2], stack.etcd_flags[1::2], strict=True))
    auth = EtcdAuth(ca=flags.get("--etcd-ca", ""), cert=flags.get("--etcd-cert", ""),
                    key=flags.get("--etcd-key", ""))

    async def read() -> list[KV]:
        etcd = Etcd(stack.etcd.endpoint, timeout=60, auth=auth)
        await etcd.connect()
        try:
            kvs, _, _ = await etcd.range(b"\0", end=b"\xff", keys_only=True, limit=10_000,
                                         min_mod_revision=after + 1)
            return kvs
        finally:
            await etcd.close()

    patterns: dict[str, int] = {}
    for kv in asyncio.run(read()):
        name = "/".join("*" if any(c.isdigit() for c in part) else part
                        for part in kv.key.decode(errors="replace").split("/"))
        patterns[name] = patterns.get(name, 0) + 1
    return sorted(patterns.items(), key=lambda item: -item[1])


def etcd_alone(p: Profile, stack: Stack, daemons: tuple[Daemon, ...], period: float,
               notes: list[str]) -> float | None:
    """etcd's share of a core holding the same keys with no client at all: the
    watcher and the registry stopped, their writes (leases revoked) compacted away,
    then ``p.rest_alone`` seconds measured. What etcd costs for what it stores (its
    runtime's memory upkeep), which no client of it can take away; None if not measured."""
    if p.rest_alone <= 0:
        return None
    for daemon in daemons:
        terminate(daemon.process, timeout=10)
    if p.rest_tail:
        # (without the tail, the load's request outcomes hold their leases for
        # REQUEST_TTL s: not worth waiting for in a short run)
        leases_gone(stack.etcd, notes)
    settled_compaction(stack.etcd, period, notes)
    pid = stack.etcd.pid or 0
    before, at = cpu_seconds(pid), time.monotonic()
    while time.monotonic() < at + p.rest_alone:
        check_interrupted()
        time.sleep(min(5.0, max(0.0, at + p.rest_alone - time.monotonic())))
    return (cpu_seconds(pid) - before) / (time.monotonic() - at)


def leases_gone(etcd: EtcdProcess, notes: list[str], wait: float = 120.0) -> None:
    """Wait until every lease granted has been revoked or has expired (a lease left by
    a stopped process deletes its keys when its TTL runs out: a write, then a
    compaction, that belongs to no client of the window)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        check_interrupted()
        text = etcd.get("/metrics", timeout=5).decode()
        held = [re.search(rf"^etcd_debugging_lease_{what}_total (\S+)$", text, re.MULTILINE)
                for what in ("granted", "revoked")]
        if None in held or float(held[0].group(1)) <= float(held[1].group(1)):  # type: ignore[union-attr]
            return
        time.sleep(1.0)
    notes.append(f"etcd still held leases {wait:.0f} s after the daemons stopped: their "
                 "expiry may fall in the etcd-alone window.")


def settled_compaction(etcd: EtcdProcess, period: float, notes: list[str]) -> None:
    """Wait until etcd has compacted up to its revision of now (a compaction period or
    two), so that the window's compactions are those its own writes call for, not the
    load's last. If writes go on meanwhile, it never comes: say so and go on."""
    target = store_counts(etcd)["revision"]
    deadline = time.monotonic() + 3 * period + 30
    while time.monotonic() < deadline:
        check_interrupted()
        if compact_revision(etcd) >= target and compactions_done(etcd):
            return
        time.sleep(min(1.0, period / 5))
    notes.append(f"etcd had not compacted up to revision {target:.0f} (the first sync's "
                 f"end) {3 * period + 30:.0f} s after it: the window's first compactions "
                 "are partly the load's.")


def compactions_done(etcd: EtcdProcess) -> bool:
    """Whether every compaction etcd started has finished its database phase (which
    goes on in the background after the compact revision is set)."""
    text = etcd.get("/metrics", timeout=5).decode()

    def count(name: str) -> float:
        sample = re.search(rf"^{name}_count (\S+)$", text, re.MULTILINE)
        return float(sample.group(1)) if sample else 0.0
    return (count("etcd_debugging_mvcc_db_compaction_total_duration_milliseconds")
            >= count("etcd_debugging_mvcc_index_compaction_pause_duration_milliseconds"))


def compact_revision(etcd: EtcdProcess) -> float:
    text = etcd.get("/metrics", timeout=5).decode()
    sample = re.search(r"^etcd_debugging_mvcc_compact_revision (\S+)$", text, re.MULTILINE)
    return float(sample.group(1)) if sample else float("inf")


def cores(a: Reading, b: Reading, name: str) -> float:
    return (b.cpu[name] - a.cpu[name]) / (b.at - a.at) if b.at > a.at else float("nan")


def profile_busiest(p: Profile, root: Path, readings: list[Reading],
                    pids: dict[str, int]) -> tuple[str, list[list[object]], str]:
    """When a Baton process missed the goal: ``py-spy record`` of the busiest for
    ``p.rest_profile`` s after the window; (process, rows of its top functions, why
    not)."""
    a, b = readings[0], readings[-1]
    missed = {n: cores(a, b, n) for n in ("registry", "watcher") if cores(a, b, n) > GOAL_CORE}
    if not missed:
        return "", [], ""
    busiest = max(missed, key=lambda n: missed[n])
    if p.rest_profile <= 0:
        return busiest, [], "profiling is off (rest_profile = 0)"
    spy = py_spy()
    if spy is None:
        return busiest, [], "py-spy is not installed"
    print(f"  rest: profiling the {busiest} for {p.rest_profile:g} s", flush=True)
    try:
        with Recorder(spy, pids[busiest], root / f"rest-{busiest}.raw") as rec:
            rec.start()
            time.sleep(p.rest_profile)
            got = rec.stop()
    except (BenchError, OSError) as e:
        return busiest, [], f"py-spy failed: {e}"
    def row(f: Function, kind: str) -> list[object]:
        return [f.name, kind, f.own, f.total, ratio(100 * f.own, got.samples),
                ratio(100 * f.total, got.samples)]

    # (not the roots every sample passes through: the module, main, the loop's runner)
    ours = sorted((f for f in got.functions
                   if baton_frame(f.name) and f.total < 0.9 * got.samples),
                  key=lambda f: (-f.total, f.name))[:10]
    rows = [row(f, "most own") for f in got.top(8)] + [row(f, "Baton's, most total")
                                                      for f in ours]
    return busiest, rows, f"{got.samples} samples holding the GIL in {p.rest_profile:g} s"


def baton_frame(name: str) -> bool:
    """Whether a py-spy frame ``function (path)`` is of Baton's code (not a library's)."""
    where = name.rpartition("(")[2]
    return "site-packages" not in where and re.search(
        r"(^|/)(registry|watcher|client|kernel|local)/", where) is not None


def tail_table(a: Reading, b: Reading) -> Table:
    """What the expiry of the load's request outcomes cost, between the first sync and
    the window: ``REQUEST_TTL`` s after a busy spell, then never again until the next."""
    wall = b.at - a.at
    table = Table(f"Before the window: the load's request outcomes expiring ({wall:.0f} s)",
                  ["process", "CPU s", "% of a core", "revisions written", "leases ended",
                   "compactions"])
    moved = [round(b.store[k] - a.store[k]) for k in ("revision", "leases_ended",
                                                       "compactions")]
    for name in ("registry", "watcher", "etcd"):
        table.rows.append([name, b.cpu[name] - a.cpu[name], 100 * cores(a, b, name),
                           *(moved if name == "etcd" else ["", "", ""])])
    return table


def section(p: Profile, todo: list[Plan], readings: list[Reading], period: float,
            idle: float, notify: str, load_seconds: float, sync_seconds: float,
            profile: tuple[str, list[list[object]], str], notes: list[str], plot_dir: Path,
            seconds: float, alone: float | None = None,
            tail: tuple[Reading, Reading] | None = None) -> Section:
    a, b = readings[0], readings[-1]
    wall = b.at - a.at
    entries = sum(x.entries for x in todo)
    verified = sum(x.verified for x in todo)
    consumed = sum(x.consumed for x in todo)
    intro = METHOD.format(
        compaction=p.rest_compaction, notify=notify,
        tls=", mutual TLS between them and to etcd as `baton up` runs it" if p.rest_tls
        else ", plaintext", entries=entries, tasks=len(todo),
        pending=entries - verified - consumed, verified=verified, consumed=consumed,
        workers=p.rest_workers, settle=p.rest_settle, idle=idle, periods=p.rest_periods,
        period=period, tail=(
            f", the load's request outcomes have expired (each mutating call's outcome is "
            f"kept {REQUEST_TTL} s for its retries, on leases whose expiries delete them: "
            "writes, each followed by a compaction; that tail is reported apart, below)"
            if tail is not None else ""))
    cpu = Table(f"CPU at rest over {wall:.0f} s ({wall / period:.1f} compaction periods), "
                f"{entries:,} entries in {len(todo)} tasks",
                ["process", "CPU s", "cores", "% of a core", f"goal ≤ {GOAL_CORE:.0%}"])
    shares = {}
    for name in ("registry", "watcher", "etcd"):
        used = b.cpu[name] - a.cpu[name]
        shares[name] = cores(a, b, name)
        cpu.rows.append([name, used, shares[name], 100 * shares[name],
                         "yes" if shares[name] <= GOAL_CORE else "no"])
    if alone is not None:
        cpu.rows.append(["etcd alone, same keys, no client (after the window)", None, alone,
                         100 * alone, "yes" if alone <= GOAL_CORE else "no"])
    busy = 1 - (b.machine[1] - a.machine[1]) / max(1, b.machine[0] - a.machine[0])
    list_entries = calls(a, b, "ListEntries")
    snapshots = counted(a, b, "baton_watcher_stream_snapshots")
    counts = Table("What happened at rest, same window",
                   ["what", "count", "per minute", "goal"])
    per_min = 60 / wall if wall > 0 else float("nan")

    def row(what: str, n: int, goal: str = "") -> None:
        counts.rows.append([what, n, n * per_min, goal])

    row("registry: ListEntries calls", list_entries, "0")
    row("registry: Watch calls (streams opened or resumed)", calls(a, b, "Watch"))
    row("registry: every gRPC call", calls(a, b))
    row("watcher: stream snapshots", snapshots, "0")
    row("watcher: stream resumes", counted(a, b, "baton_watcher_stream_resumes"), "0")
    row("watcher: stream silences (resumes after no message)",
        counted(a, b, "baton_watcher_stream_silences"), "0")
    row("watcher: reconciliations", counted(a, b, "baton_watcher_reconciliations"))
    row("watcher: files hashed", counted(a, b, "baton_watcher_files_hashed"))
    row("registry: view reloads (its etcd watch broke)", b.breaks - a.breaks)
    for method in ("Range", "Txn"):
        row(f"etcd: {method} requests", b.etcd.get(method, 0) - a.etcd.get(method, 0))
    moved = b.store["revision"] - a.store["revision"]
    row("etcd: revisions written (every write moves it)", round(moved), "0")
    row("etcd: compactions run (each walks every stored key)",
        round(b.store["compactions"] - a.store["compactions"]), "0")
    row("etcd: leases ended (revoked or expired: an expiry deletes its keys, a write)",
        round(b.store["leases_ended"] - a.store["leases_ended"]))
    compaction_s = (b.store["compaction_ms"] - a.store["compaction_ms"]) / 1000
    load_table = Table("Loading and the first sync",
                       ["entries", "pending", "verified", "consumed", "load s", "entries/s",
                        "first sync s"])
    load_table.rows.append([entries, entries - verified - consumed, verified, consumed,
                            load_seconds, entries / load_seconds if load_seconds else None,
                            sync_seconds])
    tables = [cpu, counts, load_table]
    if tail is not None:
        tables.append(tail_table(*tail))
    busiest, rows, why = profile
    if rows:
        prof = Table(f"The {busiest} at rest, profiled after the window: py-spy, the functions "
                     f"with the most samples of their own, then Baton's with the most in "
                     f"all ({why})", ["function", "listed as", "own samples", "total samples",
                                     "own %", "total %"])
        prof.rows = rows  # type: ignore[assignment]
        tables.append(prof)
    elif busiest:
        notes.append(f"The {busiest} missed the goal; no profile: {why}.")
    series = {}
    for name in ("registry", "watcher", "etcd"):
        xs = [r.at - a.at for r in readings[1:]]
        ys = [100 * cores(r0, r1, name) for r0, r1 in itertools.pairwise(readings)]
        series[name] = (xs, ys)
    plots = [line_plot(plot_dir / "rest_cpu.png", "CPU at rest, per sampling interval",
                       "seconds into the idle window", "% of a core", series)]
    met = all(v <= GOAL_CORE for v in shares.values())
    notes.append(f"The machine's CPUs were {busy:.0%} busy over the window (everything "
                 f"running on it, {os.cpu_count()} cores); load average at its end "
                 f"{load_average()}.")
    top = max(shares, key=lambda n: shares[n])
    headline = (f"At rest ({entries:,} entries in {len(todo)} tasks, {wall:.0f} s idle, "
                f"compaction every {period:g} s): registry {100 * shares['registry']:.2f} %, "
                f"watcher {100 * shares['watcher']:.2f} %, etcd {100 * shares['etcd']:.2f} % "
                f"of a core (goal ≤ {GOAL_CORE:.0%} each: {'met' if met else 'missed'}; "
                f"busiest the {top}); ListEntries {list_entries}, stream snapshots "
                f"{snapshots} after the first sync (goal 0).")
    facts = {f"rest.cores.{n}": v for n, v in shares.items()}
    facts["rest.list_entries"] = float(list_entries)
    facts["rest.snapshots"] = float(snapshots)
    facts["rest.revisions"] = moved
    if alone is not None:
        facts["rest.cores.etcd_alone"] = alone
    if compaction_s > 0:
        notes.append(f"etcd's compactions in the window took {compaction_s:.1f} s of wall "
                     "time in all (its database walk, in batches with pauses).")
    return Section("rest", "At rest", intro, tables, plots, notes=notes, headlines=[headline],
                   seconds=seconds, load=load_average(), facts=facts)
