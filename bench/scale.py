"""Scale: a task of 100,000 entries — creating it, claiming from it, the registry's memory."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median

from baton_relay.client import Client, RetryPolicy, Session, parse_manifest
from baton_relay.kernel import errors

from .agents import AgentArgs, baton_agent, double_claims, rate
from .harness import (
    BenchError,
    Stack,
    check_interrupted,
    first_line,
    load_average,
    ms,
    on_etcd,
    ratio,
    rss_kib,
)
from .pool import Pool
from .profiles import Profile
from .report import Cell, Section, Table

METHOD = """
One registry process on a fresh etcd. A task of {big:,} entries is created with one
`CreateTask` call (timed from the call to its reply; the manifest is built
beforehand), next to a task of {small:,}. Then {agents} agents (one process each)
claim → commit {claims} entries from the small task, then as many from the large
one ({rounds} round(s), alternating, so both see the same machine); a claim reads
one page of the task's ready index however large the task is. The last column
times that read alone, straight from etcd (`registry._etcd.Etcd.range`, limit 64),
after the claims. Memory is the `VmRSS` of the registry process (and of etcd) from
`/proc/PID/status`.

**Entries held in etcd**: after those claims, tasks of {big:,} entries are created until
etcd holds {total:,} entries across tasks, and the same claims run again, on the large
task and on a fresh task of {small:,}. The reaper run (below) comes after, with all of
them held.

**etcd alone**: after the large task is created, the keys and values its creation
wrote (entries, ready and open keys) are read back and written again under another
prefix, straight through the registry's etcd client, in transactions of 120 puts (40
of them create-only), 8 in flight: the time etcd itself needs for what a creation
writes. (These keys stay in etcd; the weighing below counts only the task's own.)

**What etcd holds per entry**: right after the two tasks are created, every key under
the registry's prefix is read back in pages of {page:,} (`registry._etcd.Etcd.range`);
the keys that name the large task (its header, entries, indexes and journal records,
whichever exist) are summed, key and value bytes, by the first segment of the key,
and divided by its entries.

**The reaper**: after the claims, {sessions} sessions (one thread each) claim
{reap:,} entries of the large task with `ClaimBatch` and keep them in flight; then
their sessions are revoked (`CloseSession`: the lease ends, etcd deletes the claims,
as when agents die). Timed from the first revoke until etcd holds no `inflight/` twin
of the task's claims any more (the reaper deletes a twin in the transaction that
sends its entry back to pending; etcd's count, read every {poll:g} s, puts no load on
the registry), and until `GetTask` shows every one of those entries `pending` again
(`GetTask` reads every entry of the task, so it is sent only as often as keeps it
under a tenth of the time, and at once when the count reaches zero; the time is
that of its reply). The run gives up after {timeout:g} s, or when no claim has been
reaped for {stall:g} s. A measurement that fails becomes a row saying why, and the
rest of the scenario goes on.
"""

#: CreateTask is sent again (that completes an interrupted creation) at most this often
CREATE_ATTEMPTS = 3
#: if the large task cannot be created, these fractions of it are tried (each on a fresh
#: etcd and registry, so that memory is weighed without the failed attempts' remains)
FALLBACKS = (1, 4, 10)
#: the registry's key prefix (``Stack.registry``'s default)
KEY_PREFIX = "/baton/v1/"
#: keys per read when weighing what etcd holds (replies stay well under gRPC's 4 MiB)
WEIGH_PAGE = 1000
#: key families whose second segment is the kind of claim, not the task
KINDED = ("claims", "inflight")
#: the reaper run gives up when no entry came back to pending for this long
REAP_STALL = 120.0
#: seconds between GetTask polls while the reaper works
REAP_POLL = 0.2
#: TTL of the sessions that hold the claims (revoked explicitly, never left to expire)
REAP_TTL = 3600


@dataclass
class Created:
    task: str
    entries: int
    seconds: float
    calls: int
    error: str = ""
    ok: bool = True


def create(address: str, task: str, entries: int) -> Created:
    """Create a task of ``entries``, sending it up to ``CREATE_ATTEMPTS`` times."""
    spec = parse_manifest({"task_id": task, "digest_optional": True, "entries": [
        {"file_id": f"e{i:06d}", "path": f"d{i % 100:02d}/e{i:06d}"} for i in range(entries)]})
    error = ""
    # One try per call, so that every call the creation needed is counted here.
    with Client(address, timeout=600, retry=RetryPolicy(attempts=1)) as c:
        t0 = time.perf_counter()
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                c.operator.create_task(spec)
                return Created(task, entries, time.perf_counter() - t0, attempt, error)
            except errors.BatonError as e:
                error = f"{type(e).__name__}: {e}"
        return Created(task, entries, time.perf_counter() - t0, CREATE_ATTEMPTS, error, False)


def etcd_alone(endpoint: str, task: str, prefix: str = KEY_PREFIX) -> tuple[int, float]:
    """etcd's own time for what creating ``task`` wrote: the same keys and values (read
    back from etcd, then written under another prefix) in transactions of 120 puts with
    40 create-only compares, 8 in flight, through the registry's etcd client. Returns
    (keys, seconds)."""
    from baton_relay.registry.store.etcd import Etcd, Put, absent
    from baton_relay.registry.store.keys import Keys

    keys = Keys(prefix)
    bases = [keys.entries(task), keys.ready_all(task), keys.open_all(task)]

    async def go(etcd: Etcd) -> tuple[int, float]:
        held = [(b"/etcd-alone" + kv.key, kv.value) for base in bases
                async for kv in etcd.scan(base)]
        gate = asyncio.Semaphore(8)

        async def chunk(part: list[tuple[bytes, bytes]]) -> None:
            async with gate:
                await etcd.txn([absent(k) for k, _ in part[:40]],
                               [Put(k, v) for k, v in part])

        t0 = time.perf_counter()
        await asyncio.gather(*(chunk(held[i:i + 120]) for i in range(0, len(held), 120)))
        return len(held), time.perf_counter() - t0

    return on_etcd(endpoint, go)


def head_read_ms(endpoint: str, task: str, reads: int = 50) -> float:
    """Median ms of the read a claim starts with: the first 64 keys of the ready index."""
    from baton_relay.registry.store.etcd import Etcd
    from baton_relay.registry.store.keys import Keys

    async def go(etcd: Etcd) -> list[float]:
        times = []
        for _ in range(reads):
            t0 = time.perf_counter()
            await etcd.range(Keys().ready_all(task), limit=64)
            times.append(time.perf_counter() - t0)
        return times

    return ms(on_etcd(endpoint, go), 0.5)


@dataclass
class Held:
    """Keys of one task in etcd, and their bytes (key + value), by family."""

    families: dict[str, list[int]] = field(default_factory=dict)
    #: keys under the prefix that do not name the task (the other task, sessions, ...)
    other: list[int] = field(default_factory=lambda: [0, 0])

    @property
    def keys(self) -> int:
        return sum(k for k, _ in self.families.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.families.values())


def weigh(endpoint: str, task: str, prefix: str = KEY_PREFIX) -> Held:
    """Every key under ``prefix`` read in pages; those naming ``task`` summed by family."""
    from baton_relay.registry.store.etcd import Etcd

    async def go(etcd: Etcd) -> Held:
        held = Held()
        base = prefix.encode()
        async for kv in etcd.scan(base, page=WEIGH_PAGE):
            parts = kv.key[len(base):].decode(errors="replace").split("/")
            size = len(kv.key) + len(kv.value)
            if task not in parts[1:]:
                held.other[0] += 1
                held.other[1] += size
                continue
            family = "/".join(parts[:2]) if parts[0] in KINDED else parts[0]
            count = held.families.setdefault(family, [0, 0])
            count[0] += 1
            count[1] += size
        return held

    return on_etcd(endpoint, go)


@dataclass
class Reaped:
    """Claims held by sessions that were then revoked, and how long the reaper took."""

    wanted: int
    sessions: int
    claimed: int = 0
    claim_seconds: float = float("nan")
    revoke_seconds: float = float("nan")
    #: from the first revoke until etcd held no inflight twin of the task's claims
    reaped_seconds: float = float("nan")
    #: from the first revoke to the GetTask reply that showed every entry pending
    back_seconds: float = float("nan")
    #: the median time one GetTask took while polling
    poll_ms: float = float("nan")
    error: str = ""


class InflightCount:
    """How many claims of a task have a durable twin left: etcd's count, not a scan."""

    def __init__(self, endpoint: str, task: str) -> None:
        from baton_relay.registry.store.etcd import Etcd
        from baton_relay.registry.store.keys import Keys

        self.prefix = Keys(KEY_PREFIX).inflight_of_task("p", task)
        self.etcd = Etcd(endpoint, timeout=30)
        self.runner = asyncio.Runner()

    def __enter__(self) -> InflightCount:
        async def connect() -> None:
            await self.etcd.connect()

        self.runner.run(connect())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.runner.run(self.etcd.close())
        finally:
            self.runner.close()

    def __call__(self) -> int:
        async def count() -> int:
            return await self.etcd.count(self.prefix)

        return self.runner.run(count())


def hold(c: Client, task: str, session: Session, quota: int, batch: int) -> int:
    """Claim ``quota`` entries of ``task`` with ClaimBatch and keep them; how many."""
    claimed = 0
    while claimed < quota:
        check_interrupted()
        try:
            got = c.claim_batch(task, min(batch, quota - claimed), session=session)
        except errors.NothingToClaim:
            break
        if not got:
            break
        claimed += len(got)
    return claimed


def reap(p: Profile, address: str, endpoint: str, task: str) -> Reaped:
    """Claim entries, revoke the sessions holding them, time the way back to pending."""
    out = Reaped(p.reap_claims, p.reap_sessions)
    with Client(address, timeout=120) as c, InflightCount(endpoint, task) as inflight:
        pending0 = c.operator.get_task(task).states.get("pending", 0)
        want = min(p.reap_claims, pending0)
        sessions = [c.open_session(f"reaped-{i}", ttl=REAP_TTL, keepalive=False)
                    for i in range(p.reap_sessions)]
        quotas = [want // len(sessions) + (i < want % len(sessions))
                  for i in range(len(sessions))]
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(sessions), thread_name_prefix="reaped") as ex:
                counts = list(ex.map(lambda sq: hold(c, task, sq[0], sq[1], p.batch_size),
                                     zip(sessions, quotas, strict=True)))
            out.claim_seconds = time.perf_counter() - t0
            out.claimed = sum(counts)
        except errors.BatonError as e:
            out.error = f"claiming: {type(e).__name__}: {e}"
        finally:
            t_revoke = time.perf_counter()
            try:
                for s in sessions:
                    c.close_session(s.session_id)
            except errors.BatonError as e:
                out.error = out.error or f"revoking: {type(e).__name__}: {e}"
            out.revoke_seconds = time.perf_counter() - t_revoke
        if out.error:
            return out
        out.error = wait_pending(c, inflight, task, pending0, t_revoke, p.reap_timeout, out)
    return out


def wait_pending(c: Client, inflight: InflightCount, task: str, pending: int, since: float,
                 timeout: float, out: Reaped) -> str:
    """Wait until GetTask shows ``pending`` entries pending and none writing; "" or why not.

    etcd's count of the task's inflight twins (cheap, and no load on the registry) is
    read every ``REAP_POLL`` s and says when the reaper is done; GetTask reads every
    entry through the registry, so it is sent only as often as keeps it under a tenth
    of the registry's time, and at once when the count reaches zero.
    """
    deadline = since + timeout
    left, changed, next_get, last_error = -1, since, since, ""
    durations: list[float] = []
    try:
        while True:
            check_interrupted()
            now = time.perf_counter()
            count = inflight()
            if count != left:
                left, changed = count, time.perf_counter()
            if count == 0 and math.isnan(out.reaped_seconds):
                out.reaped_seconds = time.perf_counter() - since
            if count == 0 or now >= next_get:
                t = time.perf_counter()
                try:
                    states = c.operator.get_task(task).states
                except errors.BatonError as e:
                    states, last_error = None, f"; last GetTask: {type(e).__name__}: {e}"
                now = time.perf_counter()
                durations.append(now - t)
                next_get = now + 9 * (now - t)
                if (states is not None and states.get("writing", 0) == 0
                        and states.get("pending", 0) >= pending):
                    out.back_seconds = now - since
                    return ""
            if now >= deadline or now - changed >= REAP_STALL:
                why = ("gave up" if now >= deadline
                       else f"none was reaped for {REAP_STALL:g} s")
                return (f"{left:,} of {out.claimed:,} claims not reaped "
                        f"{now - since:.0f} s after the revoke ({why}){last_error}")
            time.sleep(min(REAP_POLL, max(0.0, deadline - now)))
    finally:
        out.poll_ms = 1000 * median(durations) if durations else float("nan")


def memory(stack: Stack, registry_pid: int, when: str) -> list[Cell]:
    db = stack.etcd.data_dir / "member" / "snap" / "db"
    db_mib = db.stat().st_size / 2**20 if db.exists() else None
    return [when, rss_kib(registry_pid) / 1024, rss_kib(stack.etcd.pid or 0) / 1024, db_mib]


@dataclass
class Claimed:
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cycles: int = 0
    claimed: list[list[str]] = field(default_factory=list)
    #: etcd's time for the first page (64 keys) of the task's ready index, median ms
    head_ms: float = float("nan")


@dataclass
class Measured:
    small: Created
    big: Created
    runs: dict[str, Claimed]
    #: the registry's VmRSS once both tasks exist
    rss_mib: float
    #: what etcd holds for the large task right after its creation (or why unknown)
    held: Held | str
    #: etcd's db file, bytes, at the same moment
    db_bytes: int
    reaped: Reaped
    #: entries held in etcd (all tasks) for ``filled_runs``; 0 if the fill failed
    filled: int = 0
    filled_runs: dict[str, Claimed] = field(default_factory=dict)


def measure(p: Profile, root: Path, big_entries: int, pool: Pool, section: Section,
            creates: Table, mem: Table) -> Measured | None:
    """On a fresh etcd and registry: create the two tasks, claim from both, weigh."""
    with Stack(root) as stack:
        registry = stack.registry(root / "staging")
        with Client(registry.address) as c:
            c.operator.list_tasks()  # the registry has served one call before it is weighed
        mem.rows.append(memory(stack, registry.pid, "idle, empty"))
        small = create(registry.address, f"small-{p.scale_small}", p.scale_small)
        big = create(registry.address, f"big-{big_entries}", big_entries)
        for x in (small, big):
            creates.rows.append([x.entries, x.seconds, ratio(x.entries, x.seconds), x.calls,
                                 "created" if x.ok else "FAILED"])
        if not (small.ok and big.ok):
            failed = big if small.ok else small
            mem.rows.append(memory(stack, registry.pid,
                                   f"after {failed.calls} failed creations of "
                                   f"{failed.entries:,} entries"))
            section.notes.append(f"Creating the task of {failed.entries:,} entries failed "
                                 f"{failed.calls} times in a row ({failed.error}); the next "
                                 "size was tried on a fresh etcd and registry.")
            return None
        rss_mib = rss_kib(registry.pid) / 1024
        mem.rows.append(memory(stack, registry.pid,
                               f"after creating {small.entries:,} + {big.entries:,} entries"))
        db = stack.etcd.data_dir / "member" / "snap" / "db"
        db_bytes = db.stat().st_size if db.exists() else 0
        held: Held | str
        try:
            held = weigh(stack.etcd.endpoint, big.task)
        except Exception as e:  # a failed measurement is a row, not the scenario's end
            held = first_line(e)
        try:
            n_keys, alone = etcd_alone(stack.etcd.endpoint, big.task)
            creates.rows.append([big.entries, alone, ratio(big.entries, alone), 1,
                                 f"etcd alone: the same {n_keys:,} keys and values"])
        except Exception as e:  # a failed measurement is a row, not the scenario's end
            creates.rows.append([big.entries, None, None, 0,
                                 f"etcd alone: FAILED ({first_line(e)})"])
        runs = claim_rounds(p, pool, registry.address, [small.task, big.task], "")
        mem.rows.append(memory(stack, registry.pid, "after the claims"))
        for task, out in runs.items():
            out.head_ms = head_read_ms(stack.etcd.endpoint, task)
        filled, filled_runs = fill(p, pool, registry.address, small, big, creates, section)
        if filled:
            mem.rows.append(memory(stack, registry.pid,
                                   f"after filling etcd to {filled:,} entries and claiming"))
        try:
            reaped = reap(p, registry.address, stack.etcd.endpoint, big.task)
        except Exception as e:  # a failed measurement is a row, not the scenario's end
            reaped = Reaped(p.reap_claims, p.reap_sessions, error=first_line(e))
        mem.rows.append(memory(stack, registry.pid, "after the reaper run"))
    return Measured(small, big, runs, rss_mib, held, db_bytes, reaped, filled, filled_runs)


def claim_rounds(p: Profile, pool: Pool, address: str, tasks: list[str],
                 tag: str) -> dict[str, Claimed]:
    """``p.scale_rounds`` rounds of claim → commit by ``p.scale_agents`` agents on each
    task in turn (alternating, so that every task sees the same machine)."""
    per = max(1, p.scale_claims // p.scale_agents)
    runs = {task: Claimed() for task in tasks}
    for r in range(p.scale_rounds):
        for task, out in runs.items():
            args = [AgentArgs(address, task, f"agent{tag}-{r}-{i}", p.seconds,
                              max_entries=per) for i in range(p.scale_agents)]
            rnd = pool.run(baton_agent, args, p.seconds)
            n = sum(x.calls for x in rnd.results)
            out.rates.append(rate(n, rnd.start, [x.end for x in rnd.results]))
            out.latencies += [v for x in rnd.results for v in x.latencies]
            out.cycles += n
            out.claimed += [x.claimed for x in rnd.results]
    return runs


def fill(p: Profile, pool: Pool, address: str, small: Created, big: Created,
         creates: Table, section: Section) -> tuple[int, dict[str, Claimed]]:
    """Create tasks of ``p.scale_big`` entries until etcd holds ``p.scale_total`` entries
    across tasks, then claim from the small and the large task again."""
    held = small.entries + big.entries
    k = 0
    while held < p.scale_total:
        check_interrupted()
        size = min(p.scale_big, p.scale_total - held)
        made = create(address, f"fill-{k}-{size}", size)
        creates.rows.append([made.entries, made.seconds, ratio(made.entries, made.seconds),
                             made.calls, "created (fill)" if made.ok else "FAILED (fill)"])
        if not made.ok:
            section.notes.append(f"Filling etcd to {p.scale_total:,} entries stopped at "
                                 f"{held:,}: {made.error}")
            return 0, {}
        held += size
        k += 1
    # The first small task may be nearly drained by now: a fresh one of the same size.
    fresh = create(address, f"small-filled-{p.scale_small}", p.scale_small)
    if not fresh.ok:
        section.notes.append(f"A second small task could not be created: {fresh.error}")
        return 0, {}
    runs = claim_rounds(p, pool, address, [fresh.task, big.task], "-filled")
    return held + fresh.entries, {small.task: runs[fresh.task], big.task: runs[big.task]}


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    per = max(1, p.scale_claims // p.scale_agents)
    intro = METHOD.format(big=p.scale_big, small=p.scale_small, agents=p.scale_agents,
                          claims=per * p.scale_agents, rounds=p.scale_rounds, page=WEIGH_PAGE,
                          sessions=p.reap_sessions, reap=p.reap_claims, poll=REAP_POLL,
                          timeout=p.reap_timeout, stall=REAP_STALL, total=p.scale_total)
    section = Section("scale", "Scale", intro)
    mem = Table("Memory", ["when", "registry VmRSS MiB", "etcd VmRSS MiB", "etcd db file MiB"])
    creates = Table("Creating a task (one CreateTask call)",
                    ["entries", "seconds", "entries/s", "calls", "result"])
    done = None
    with Pool(p.scale_agents) as pool:
        for i, cut in enumerate(FALLBACKS):
            done = measure(p, root / f"try-{i}", p.scale_big // cut, pool, section, creates,
                           mem)
            if done is not None:
                break
    if done is None:
        raise BenchError(f"no task of {p.scale_big // FALLBACKS[-1]:,} entries or more could "
                         "be created")
    small, big, runs = done.small, done.big, done.runs
    claims = Table(f"Claim → commit with {p.scale_agents} agents, by task size and by "
                   "entries held in etcd",
                   ["entries in the task", "entries held in etcd", "cycles/s",
                    "claim p50 ms", "claim p99 ms", "cycles measured", "double claims",
                    "etcd: first 64 keys of the ready index, ms"])
    both = small.entries + big.entries
    for held_n, table_runs in ((both, runs), (done.filled, done.filled_runs)):
        for created in (small, big):
            if created.task not in table_runs:
                continue
            out = table_runs[created.task]
            claims.rows.append([created.entries, held_n, mean(out.rates),
                                ms(out.latencies, 0.5), ms(out.latencies, 0.99), out.cycles,
                                double_claims(out.claimed), out.head_ms])
    slowdown = ratio(mean(runs[big.task].rates), mean(runs[small.task].rates))
    big_rss = done.rss_mib
    if big.entries != p.scale_big:
        section.headlines.append(f"Scale: a task of {p.scale_big:,} entries could NOT be "
                                 f"created (see the notes); the numbers are for "
                                 f"{big.entries:,}.")
    section.headlines.append(
        f"Scale: creating a task of {big.entries:,} entries took {big.seconds:.1f} s "
        f"({big.calls} call{'s' if big.calls > 1 else ''}); claim throughput at "
        f"{big.entries:,} entries is {slowdown:.2f}x that at {small.entries:,}; registry RSS "
        f"with both tasks {big_rss:.0f} MiB.")
    if done.filled:
        filled_rate = mean(done.filled_runs[small.task].rates)
        section.headlines.append(
            f"Scale: with {done.filled:,} entries held in etcd (across tasks), claims from "
            f"the task of {small.entries:,} ran at "
            f"{ratio(filled_rate, mean(runs[small.task].rates)):.2f}x their rate with "
            f"{both:,} held, from the task of {big.entries:,} at "
            f"{ratio(mean(done.filled_runs[big.task].rates), mean(runs[big.task].rates)):.2f}x.")
    held_table, per_entry = held_rows(done, small.entries + big.entries)
    reaper_table = reaper_rows(done.reaped)
    section.headlines.append(held_headline(big.entries, per_entry, done.held))
    section.headlines.append(reaper_headline(done.reaped))
    if not isinstance(done.held, str) and "journal" not in done.held.families:
        section.notes.append("No `journal/` keys of the large task existed right after its "
                             "creation, so none are in its bytes per entry.")
    section.tables = [creates, claims, held_table, reaper_table, mem]
    section.facts = {"scale.slowdown": slowdown, "scale.create_s": big.seconds,
                     "scale.create_n": float(big.entries), "scale.rss_mib": big_rss}
    section.seconds = time.monotonic() - t0
    section.load = load_average()
    return section


def held_rows(done: Measured, all_entries: int) -> tuple[Table, float]:
    """The table of what etcd holds for the large task; and its bytes per entry."""
    entries = done.big.entries
    table = Table(f"What etcd holds for the task of {entries:,} entries, right after "
                  "CreateTask (keys + values)",
                  ["keys under", "keys", "bytes", "bytes per entry"])
    if isinstance(done.held, str):
        table.rows.append([f"all of the task: FAILED ({done.held})", None, None, None])
        return table, float("nan")
    held = done.held
    for family, (keys, size) in sorted(held.families.items(), key=lambda kv: -kv[1][1]):
        table.rows.append([f"`{family}/`", keys, size, size / entries])
    per_entry = held.bytes / entries
    table.rows.append(["**all of the task**", held.keys, held.bytes, per_entry])
    table.rows.append(["other keys (the small task, sessions, ...)", held.other[0],
                       held.other[1], None])
    table.rows.append(["etcd's db file ÷ entries of both tasks (history and free pages "
                       "included)", None, done.db_bytes, done.db_bytes / all_entries])
    return table, per_entry


def held_headline(entries: int, per_entry: float, held: Held | str) -> str:
    if isinstance(held, str):
        return f"Scale: what etcd holds per entry could NOT be read ({held})."
    families = ", ".join(f"`{f}/`" for f in sorted(held.families))
    return (f"Scale: etcd holds {per_entry:,.0f} bytes per entry of the {entries:,}-entry "
            f"task right after its creation (keys + values under {families}).")


def reaper_rows(r: Reaped) -> Table:
    table = Table(f"The reaper: {r.wanted:,} claims in flight, their sessions revoked",
                  ["claims in flight", "sessions", "claiming s", "revoking s",
                   "revoke → last claim reaped, s", "claims reaped per s",
                   "revoke → GetTask shows every entry pending, s", "GetTask ms (one poll)",
                   "result"])
    table.rows.append([r.claimed, r.sessions, r.claim_seconds, r.revoke_seconds,
                       r.reaped_seconds, ratio(r.claimed, r.reaped_seconds), r.back_seconds,
                       r.poll_ms, f"FAILED: {r.error}" if r.error else "all pending"])
    return table


def reaper_headline(r: Reaped) -> str:
    if r.error:
        return (f"Scale: the reaper run with {r.wanted:,} claims in flight FAILED "
                f"({r.error}).")
    return (f"Scale: with {r.claimed:,} claims in flight, the reaper had them all back "
            f"{r.reaped_seconds:.1f} s after their sessions were revoked "
            f"({ratio(r.claimed, r.reaped_seconds):,.0f} claims/s); GetTask showed every "
            f"entry pending after {r.back_seconds:.1f} s.")
