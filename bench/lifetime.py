"""Lifetime: tasks created, run and finished one after the other, totalling many
entries, while etcd's database and key count and the bytes held in staging are
sampled and claim latency is timed."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from baton_relay.client import Client, Session
from baton_relay.kernel import errors
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

from .harness import (
    BenchError,
    Stack,
    check_interrupted,
    load_average,
    ms,
    on_etcd,
    rss_kib,
)
from .profiles import Profile
from .report import Section, Table, line_plot

METHOD = """
One registry on a fresh etcd that compacts its history periodically, keeping
{compaction} of it (`--auto-compaction-mode=periodic
--auto-compaction-retention={compaction}`), archiving finished
tasks as soon as its archiver next looks (`--archive-dir`, `--archive-after 0`,
`--archive-interval 5`), and removing consumed entries' files from staging
{retention:g} s after their last ack (`--staging-retention {retention:g}`), which one
watcher does (`baton-watcher --removal-rate 1000`). {agents} agents (threads, each its
own client and session) take tasks of {size:,} entries in turn until {total:,} entries
have been handed over: each claims {batch} entries (`ClaimBatch`), writes each
entry's file ({file_bytes:,} bytes) into staging, commits them (`CommitBatch`), waits
for the watcher to verify them, takes {batch} verified entries for the task's one
consumer group (`ConsumeBatch`) and acks them in one call (`AckBatch`); the first
agent to find a task drained moves all of them to the next, which the first of them
to get there creates. So every entry takes the whole path, every task completes and
is archived, and every file leaves staging. Every {every:g} s the run samples etcd's
own metrics (`etcd_mvcc_db_total_size_in_bytes`, `..._in_use_in_bytes`,
`etcd_debugging_mvcc_keys_total`), counts the keys under the registry's prefix
(request outcomes apart), sums the bytes of the files under the staging root, and
reads the registry's memory; claim latency is the time of each `ClaimBatch` call, by
window of {window:,} entries handed over.
"""

#: entries claimed (and committed) per call
BATCH = 20
#: etcd's metrics sampled
METRICS = {"db": "etcd_mvcc_db_total_size_in_bytes",
           "in_use": "etcd_mvcc_db_total_size_in_use_in_bytes",
           "keys": "etcd_debugging_mvcc_keys_total"}


def upkeep(retention: str) -> tuple[str, ...]:
    """etcd's flags for periodic compaction keeping ``retention`` of history."""
    return ("--auto-compaction-mode=periodic", f"--auto-compaction-retention={retention}")
#: the registry's key prefix (``Stack.registry``'s default)
PREFIX = "/baton/v1/"


@dataclass
class Sample:
    at: float
    done: int
    db: float
    in_use: float
    keys: float
    registry_kib: int
    archived: int
    #: keys under the registry's prefix: request outcomes, and everything else
    requests: int = 0
    task_keys: int = 0
    #: bytes of the files under the staging root
    staging: int = 0


@dataclass
class Shared:
    """What the agents share: the next task, what is done, and each claim's latency."""

    total: int
    task: int = 0
    #: the last task created (-1: none yet)
    created: int = -1
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (entries handed over before the call, seconds the ClaimBatch took)
    claims: list[tuple[int, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def spec(n: int, size: int) -> dict[str, object]:
    return {"task_id": f"life-{n:06d}", "digest_optional": True, "consumers": ["sink"],
            "entries": [{"file_id": f"e{i:05d}", "path": f"e{i:05d}"} for i in range(size)]}


def agent(address: str, name: str, size: int, shared: Shared, data: bytes) -> None:
    digest = blake3.blake3(data).hexdigest()
    with Client(address, timeout=60) as c, c.open_session(name, ttl=30) as s:
        task = -1
        while not shared.stop.is_set():
            with shared.lock:
                if shared.done >= shared.total:
                    return
                if shared.task != task:
                    task = shared.task
                    if shared.created < task:  # the first agent to get there sends it
                        c.operator.create_task(spec(task, size))
                        shared.created = task
                done_before = shared.done
            task_id = f"life-{task:06d}"
            t0 = time.perf_counter()
            try:
                claims = c.claim_batch(task_id, BATCH, session=s)
            except (errors.NothingToClaim, errors.TaskNotActive):
                with shared.lock:
                    if shared.task == task:
                        shared.task += 1  # drained: the next task
                continue
            took = time.perf_counter() - t0
            for cl in claims:
                os.makedirs(os.path.dirname(cl.path), exist_ok=True)
                with open(cl.path, "wb") as f:
                    f.write(data)
            c.commit_batch([(task_id, cl.file_id, cl.token, len(data), digest)
                            for cl in claims])
            c.ack_batch(take(c, s, task_id, len(claims)))
            with shared.lock:
                shared.claims.append((done_before, took))
                shared.done += len(claims)


def take(c: Client, s: Session, task_id: str, n: int) -> list[tuple[str, str, str, int]]:
    """Leases of ``n`` verified entries for the sink, as acks. The agent has just
    committed ``n`` and every agent consumes as many as it committed, so there are at
    least ``n`` to take once the watcher has verified them."""
    acks: list[tuple[str, str, str, int]] = []
    deadline = time.monotonic() + 30
    while len(acks) < n:
        try:
            acks += [(task_id, x.file_id, "sink", x.token) for x in
                     c.consume_batch(task_id, "sink", n - len(acks), session=s)]
        except errors.NothingToClaim:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    return acks


def etcd_metrics(stack: Stack) -> dict[str, float]:
    text = stack.etcd.get("/metrics", timeout=5).decode()
    out = {}
    for key, name in METRICS.items():
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        out[key] = float(found.group(1)) if found else float("nan")
    return out


def staged_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (what staging holds)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
    return total


async def counts(etcd: Etcd) -> tuple[int, int]:
    """(request outcomes, every key) under the registry's prefix."""
    keys = Keys(PREFIX)
    return await etcd.count(keys.request("")), await etcd.count(PREFIX.encode())


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    window = max(p.life_size, p.life_total // 10)
    section = Section("lifetime", "Lifetime",
                      METHOD.format(agents=p.life_agents, size=p.life_size,
                                    compaction=p.life_compaction,
                                    total=p.life_total, batch=BATCH, every=p.life_every,
                                    window=window, retention=p.life_retention,
                                    file_bytes=p.life_file_bytes))
    samples: list[Sample] = []
    shared = Shared(p.life_total)
    archive = root / "archive"
    staging = root / "staging"
    data = os.urandom(p.life_file_bytes)
    with Stack(root, etcd_args=upkeep(p.life_compaction)) as stack:
        registry = stack.registry(staging, extra=(
            "--archive-dir", str(archive), "--archive-after", "0", "--archive-interval", "5",
            "--staging-retention", f"{p.life_retention:g}"))
        stack.watcher(registry.address, staging, extra=("--removal-rate", "1000"))
        threads = [threading.Thread(target=_guarded, args=(registry.address, f"agent-{i}",
                                                            p.life_size, shared, data))
                   for i in range(p.life_agents)]
        started = time.monotonic()
        for t in threads:
            t.start()

        def sample() -> None:
            m = etcd_metrics(stack)
            requests, everything = on_etcd(stack.etcd.endpoint, counts)
            samples.append(Sample(time.monotonic() - started, shared.done, m["db"],
                                  m["in_use"], m["keys"], rss_kib(registry.pid),
                                  len(list(archive.glob("*.meta.json"))), requests,
                                  everything - requests, staged_bytes(staging)))

        try:
            while any(t.is_alive() for t in threads):
                check_interrupted()
                sample()
                for t in threads:
                    t.join(p.life_every / len(threads))
                if shared.errors:
                    shared.stop.set()
        finally:
            shared.stop.set()
            for t in threads:
                t.join(60)
        # The last finished tasks are archived at the archiver's next look; the task the
        # agents stopped in stays active.
        settle = time.monotonic() + 60
        finished = shared.done // p.life_size
        while len(list(archive.glob("*.meta.json"))) < finished and (
                time.monotonic() < settle):
            check_interrupted()
            time.sleep(1.0)
        sample()
        # The last files leave staging once their retention has passed.
        settle = time.monotonic() + p.life_retention + 30
        while staged_bytes(staging) > p.life_size * p.life_file_bytes and (
                time.monotonic() < settle):
            check_interrupted()
            time.sleep(1.0)
        sample()
    if shared.errors:
        raise BenchError(f"an agent failed: {shared.errors[0]}")
    table = Table("Samples (etcd's metrics, keys under the registry's prefix by kind, the "
                  "bytes held in staging, the registry's memory)",
                  ["seconds", "entries handed over", "tasks archived", "etcd db MiB",
                   "in use MiB", "keys (etcd)", "request outcomes", "other keys",
                   "staging MiB", "registry RSS MiB"])
    step = max(1, len(samples) // 12)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        table.rows.append([round(s.at), s.done, s.archived, round(s.db / 2**20, 1),
                           round(s.in_use / 2**20, 1), int(s.keys), s.requests, s.task_keys,
                           round(s.staging / 2**20, 1), round(s.registry_kib / 1024)])
    lat = Table(f"ClaimBatch latency by window of {window:,} entries handed over",
                ["entries", "calls", "p50 ms", "p99 ms"])
    windows: dict[int, list[float]] = {}
    for before, took in shared.claims:
        windows.setdefault(before // window, []).append(took)
    for w, times in sorted(windows.items()):
        lat.rows.append([f"{w * window:,} to {(w + 1) * window:,}", len(times),
                         ms(times, 0.5), ms(times, 0.99)])
    section.tables += [table, lat]
    xs = [s.done for s in samples]
    section.plots.append(line_plot(plot_dir / "lifetime-etcd.png",
                                   "etcd over a deployment's life", "entries handed over",
                                   "MiB, thousands of keys", {
                                       "db MiB": (xs, [s.db / 2**20 for s in samples]),
                                       "in use MiB": (xs, [s.in_use / 2**20 for s in samples]),
                                       "keys (thousands)": (xs, [s.keys / 1000 for s in samples]),
                                       "request outcomes (thousands)": (
                                           xs, [s.requests / 1000 for s in samples]),
                                       "other keys (thousands)": (
                                           xs, [s.task_keys / 1000 for s in samples]),
                                       "staging MiB": (xs, [s.staging / 2**20 for s in samples]),
                                   }))
    centres = [(w + 0.5) * window for w in sorted(windows)]
    section.plots.append(line_plot(plot_dir / "lifetime-claims.png",
                                   "ClaimBatch latency over a deployment's life",
                                   "entries handed over", "ms", {
                                       "claim p50": (centres, [ms(windows[w], 0.5)
                                                               for w in sorted(windows)]),
                                       "claim p99": (centres, [ms(windows[w], 0.99)
                                                               for w in sorted(windows)]),
                                   }))
    first, last = min(windows), max(windows)
    drift = ms(windows[last], 0.5) / ms(windows[first], 0.5)
    section.headlines.append(
        f"Lifetime: {shared.done:,} entries through {shared.task + 1} tasks in "
        f"{samples[-1].at / 60:.0f} min; keys of tasks at most "
        f"{max(s.task_keys for s in samples):,} (last {samples[-1].task_keys:,}), request "
        f"outcomes at most {max(s.requests for s in samples):,} (kept 10 min); etcd's "
        f"database in use at most {max(s.in_use for s in samples) / 2**20:.0f} MiB; staging "
        f"held at most {max(s.staging for s in samples) / 2**20:.1f} MiB (last "
        f"{samples[-1].staging / 2**20:.1f} MiB, {p.life_retention:g} s retention); claim "
        f"p50 in the last window ÷ the first: {drift:.2f}")
    section.notes.append("Request outcomes (`requests/`) are kept 10 minutes, on a lease "
                         "renewed every 15 s: they level off once the run is longer than "
                         "that; the other keys are those of live tasks and the headers of "
                         "archived ones.")
    section.seconds = time.monotonic() - t0
    section.load = load_average()
    return section


def _guarded(address: str, name: str, size: int, shared: Shared, data: bytes) -> None:
    try:
        agent(address, name, size, shared, data)
    except Exception as e:  # surfaced by run()
        shared.errors.append(f"{name}: {type(e).__name__}: {e}")
        shared.stop.set()
