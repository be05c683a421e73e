"""``baton top``: a live view of the tasks, stuck entries, leases and watchers.

Each refresh goes through the client library only: the task list, each task's
counts (``get_task``), its written and dead entries when it has any, and the live
sessions. Throughput is the difference between two refreshes. Between refreshes, a
thread watching the task headers wakes the view early when a task appears or
changes status. rich is imported to draw the frame only; ``-o json`` does without
it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ...kernel import errors
from ._common import (
    STATES,
    Settings,
    as_dict,
    emit_json,
    emit_table,
    output_option,
    pass_settings,
    session_json,
    state_name,
    status_name,
)
from ._root import cli

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

    from ...kernel.v1 import baton_pb2 as pb
    from .._client import Client

T = TypeVar("T")

#: a header change wakes the view, but not sooner than this after the last refresh
MIN_GAP = 0.5
#: pause before the header watch is opened again after it failed
WATCH_RETRY = 2.0
#: what the watchers panel says until watchers register with the registry
WATCHER_NOTE = "per-watcher rows come with watcher registration"
LEASES_REFUSED = "needs the operator role"
#: claims named in a session's row; the rest are counted
CLAIMS_SHOWN = 3


def utc_now() -> datetime:
    return datetime.now(UTC)


# --- what one refresh saw -----------------------------------------------------------


@dataclass(frozen=True)
class Stuck:
    """An entry written and not yet verified for too long, or a dead one."""

    task_id: str
    file_id: str
    state: str
    #: seconds since the entry last changed (its ``updated_at``)
    age: float
    updated_at: str
    error: str


@dataclass(frozen=True)
class TaskView:
    task: pb.Task
    #: entries that reached verified (or went on to consumed) per second; None until
    #: the task has been seen twice
    verified_rate: float | None
    consumed_rate: float | None
    stuck: int


@dataclass(frozen=True)
class Frame:
    at: datetime
    #: seconds since the previous refresh began; None for the first
    elapsed: float | None
    tasks: list[TaskView]
    #: written ones first (oldest first), then dead ones (latest first)
    stuck: list[Stuck]
    #: the entries waiting for a watcher (written), and the one waiting longest
    waiting: int
    oldest_waiting: Stuck | None
    #: None when the identity may not list sessions
    sessions: list[pb.AgentInfo] | None


#: how tasks are ordered: those still moving first
STATUS_ORDER = ("active", "paused", "creating", "deleting", "completed", "cancelled")


class Sampler:
    """Takes a :class:`Frame` per call; a task's rates come from its counts in the
    last frame that was taken whole, over the time between the two frames.

    ``get_task`` reads every entry of a task on the registry, so a completed or
    cancelled task is read again only when its header says something moved (its
    status, or its open or dead count).
    """

    def __init__(self, client: Client, task_ids: Sequence[str] = (), *,
                 stuck_after: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = utc_now) -> None:
        self._client = client
        self._task_ids = tuple(task_ids)
        self._stuck_after = stuck_after
        self._clock = clock
        self._now = now
        self._started: float | None = None
        #: per task of the last frame: (entries verified or consumed, entries consumed)
        self._counted: dict[str, tuple[int, int]] = {}
        self._settled: dict[str, tuple[tuple[int, ...], pb.Task, list[pb.Entry]]] = {}
        self._leases_refused = False

    def sample(self) -> Frame:
        started = self._clock()
        elapsed = None if self._started is None else started - self._started
        headers = self._headers(first=self._started is None)
        now = self._now()
        views: list[TaskView] = []
        counted: dict[str, tuple[int, int]] = {}
        written: list[Stuck] = []
        dead: list[Stuck] = []
        for header in headers:
            read = self._read(header)
            if read is None:
                continue  # removed since the listing
            task, entries = read
            stuck = 0
            for e in entries:
                item = _stuck(e, now)
                if item.state == "dead":
                    dead.append(item)
                    stuck += 1
                else:
                    written.append(item)
                    stuck += int(item.age >= self._stuck_after)
            states = task.states
            counts = counted[task.spec.task_id] = (
                states.get("verified", 0) + states.get("consumed", 0), states.get("consumed", 0))
            before = self._counted.get(task.spec.task_id)
            rates: tuple[float | None, float | None] = (None, None)
            if before is not None and elapsed:
                # A count can drop (a verified file found corrupt goes back to pending);
                # a rate of arrivals is never negative.
                rates = (max(counts[0] - before[0], 0) / elapsed,
                         max(counts[1] - before[1], 0) / elapsed)
            views.append(TaskView(task, *rates, stuck))
        sessions = self._sessions()
        # Only a frame taken whole is what the next one is measured against.
        self._started, self._counted = started, counted
        for task_id in set(self._settled) - set(counted):
            del self._settled[task_id]
        written.sort(key=lambda s: -s.age)
        dead.sort(key=lambda s: s.age)
        return Frame(
            at=now, elapsed=elapsed, tasks=sorted(views, key=_task_order),
            stuck=[s for s in written if s.age >= self._stuck_after] + dead,
            waiting=sum(int(v.task.states.get("written", 0)) for v in views),
            oldest_waiting=written[0] if written else None, sessions=sessions,
        )

    def _headers(self, first: bool) -> list[pb.Task]:
        headers = self._client.operator.list_tasks()
        if not self._task_ids:
            return headers
        by_id = {t.spec.task_id: t for t in headers}
        missing = [t for t in self._task_ids if t not in by_id]
        if first and missing:
            raise errors.NotFound(f"no task {missing[0]!r}", task_id=missing[0])
        return [by_id[t] for t in dict.fromkeys(self._task_ids) if t in by_id]

    def _read(self, header: pb.Task) -> tuple[pb.Task, list[pb.Entry]] | None:
        """The task with its counts, and its written and dead entries."""
        from ...kernel.v1 import baton_pb2 as pb

        task_id = header.spec.task_id
        key = (header.status, header.entry_count, header.open, header.dead)
        settled = self._settled.get(task_id)
        if settled is not None and settled[0] == key:
            return settled[1], settled[2]
        try:
            task = self._client.operator.get_task(task_id)
            entries: list[pb.Entry] = []
            for state, name in ((pb.ENTRY_STATE_WRITTEN, "written"), (pb.ENTRY_STATE_DEAD, "dead")):
                if task.states.get(name, 0):
                    entries += self._client.operator.list_entries(task_id, state=state)
        except errors.NotFound:
            return None
        if task.status in (pb.TASK_STATUS_COMPLETED, pb.TASK_STATUS_CANCELLED):
            self._settled[task_id] = (key, task, entries)
        else:
            self._settled.pop(task_id, None)
        return task, entries

    def _sessions(self) -> list[pb.AgentInfo] | None:
        if self._leases_refused:
            return None  # roles do not change while the view runs: ask once
        try:
            return sorted(self._client.operator.list_agents(),
                          key=lambda a: (a.agent, a.session_id))
        except errors.PermissionDenied:
            self._leases_refused = True
            return None


def _stuck(entry: pb.Entry, now: datetime) -> Stuck:
    try:
        age = max((now - datetime.fromisoformat(entry.updated_at)).total_seconds(), 0.0)
    except ValueError:
        age = 0.0
    return Stuck(entry.task_id, entry.file_id, state_name(entry.state), age, entry.updated_at,
                 entry.error)


def _task_order(view: TaskView) -> tuple[int, str]:
    status = status_name(view.task.status)
    rank = STATUS_ORDER.index(status) if status in STATUS_ORDER else len(STATUS_ORDER)
    return rank, view.task.spec.task_id


def _total(rates: Iterable[float | None]) -> float | None:
    known = [r for r in rates if r is not None]
    return sum(known) if known else None


def _totals(views: Sequence[TaskView]) -> dict[str, Any]:
    """The tasks added up; a rate is known once one task's is."""
    return {
        "entries": sum(v.task.entry_count for v in views),
        "states": {s: sum(int(v.task.states.get(s, 0)) for v in views) for s in STATES},
        "verified_per_s": _total(v.verified_rate for v in views),
        "consumed_per_s": _total(v.consumed_rate for v in views),
        "stuck": sum(v.stuck for v in views),
    }


def _first(items: Sequence[T], rows: int) -> Sequence[T]:
    return items[:rows] if rows else items


# --- the header watch -------------------------------------------------------------


class HeaderWatch:
    """Wakes the view when a task header says what the view does not show (a task
    created, paused, resumed, completed, cancelled).

    Its thread only compares and signals; the view's loop does the refresh, and waits
    on :attr:`changed`, where Ctrl-C lands cleanly. The stream ends when the client's
    channel is closed, and so does the thread.
    """

    def __init__(self, client: Client, task_ids: Sequence[str] = ()) -> None:
        self._client = client
        self._task_ids = set(task_ids)
        self._shown: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baton-top-headers", daemon=True)

    def start(self, frame: Frame) -> None:
        self.showing(frame)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def showing(self, frame: Frame) -> None:
        with self._lock:
            self._shown = {v.task.spec.task_id: v.task.status for v in frame.tasks}

    def _run(self) -> None:
        # Resumed where it stood after a break (the registry away: the interval
        # refreshes meanwhile), so a header that did not change is not sent again.
        try:
            for task in self._client.operator.follow_tasks(self._stop, retry=WATCH_RETRY):
                if self._task_ids and task.spec.task_id not in self._task_ids:
                    continue
                with self._lock:
                    shown = self._shown.get(task.spec.task_id)
                if shown != task.status:
                    self.changed.set()
        except ValueError:
            return  # the client is closed: the view is over


# --- JSON ---------------------------------------------------------------------------


def frame_json(frame: Frame, number: int, *, stuck_after: float, rows: int) -> dict[str, Any]:
    """One refresh as JSON data: the numbers the table shows, lists cut at ``rows``."""
    views = frame.tasks
    totals = _totals(views)
    sessions = frame.sessions or []
    return {
        "at": _timestamp(frame.at),
        "frame": number,
        "elapsed": frame.elapsed,
        "stuck_after": stuck_after,
        "tasks": [{
            "task": v.task.spec.task_id,
            "status": status_name(v.task.status),
            "status_reason": v.task.status_reason,
            "entries": v.task.entry_count,
            "states": {s: int(v.task.states.get(s, 0)) for s in STATES},
            "blocked": v.task.blocked,
            "done": v.task.entry_count - v.task.open,
            "verified_per_s": v.verified_rate,
            "consumed_per_s": v.consumed_rate,
            "stuck": v.stuck,
            "backlog": [{"group": b.group, "backlog": b.backlog, "limit": b.limit,
                         "over": b.over} for b in v.task.backlog],
        } for v in views],
        "totals": totals,
        "stuck": {
            "total": len(frame.stuck),
            "entries": [{"task": s.task_id, "file_id": s.file_id, "state": s.state,
                         "age": round(s.age, 3), "updated_at": s.updated_at, "error": s.error}
                        for s in _first(frame.stuck, rows)],
        },
        "leases": {
            "available": frame.sessions is not None,
            "reason": "" if frame.sessions is not None else LEASES_REFUSED,
            "sessions_total": len(sessions),
            "claims_total": sum(len(a.claims) for a in sessions),
            "sessions": [{**as_dict(a), "session_id": session_json(a.session_id)}
                         for a in _first(sessions, rows)],
        },
        "watchers": {
            "waiting": frame.waiting,
            "oldest_waiting": None if frame.oldest_waiting is None else {
                "task": frame.oldest_waiting.task_id,
                "file_id": frame.oldest_waiting.file_id,
                "age": round(frame.oldest_waiting.age, 3),
            },
            "verified_per_s": totals["verified_per_s"],
            "note": WATCHER_NOTE,
        },
    }


def _timestamp(at: datetime) -> str:
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- tables ---------------------------------------------------------------------------


def age_text(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def rate_text(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}"


def render(frame: Frame, *, registry: str, interval: float, stuck_after: float, rows: int,
           problem: str = "") -> Group:
    """One refresh as tables: tasks, stuck entries, leases, watchers."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [Text(f"baton top  {registry}  {frame.at:%H:%M:%S}Z  "
                             f"every {interval:g} s", style="bold")]
    if problem:
        parts.append(Text(f"{problem} (showing the refresh of {frame.at:%H:%M:%S}Z)",
                          style="bold red"))
    parts.append(_tasks_table(frame) if frame.tasks else Text("tasks: none"))
    criterion = f"written for {stuck_after:g} s or more, or dead"
    parts.append(_stuck_table(frame, rows, criterion) if frame.stuck
                 else Text(f"stuck: none ({criterion})"))
    if frame.sessions is None:
        parts.append(Text(f"leases: {LEASES_REFUSED}"))
    elif not frame.sessions:
        parts.append(Text("leases: no sessions"))
    else:
        parts.append(_leases_table(frame.sessions, rows))
    oldest = frame.oldest_waiting
    parts.append(Text(
        f"watchers: {_count(frame.waiting, 'entry', 'entries')} written, waiting for "
        "verification" + ("" if oldest is None else
                          f"; the oldest {oldest.task_id}/{oldest.file_id} for "
                          f"{age_text(oldest.age)}")
        + f"; verified {rate_text(_totals(frame.tasks)['verified_per_s'])}/s\n"
        f"  ({WATCHER_NOTE})"))
    return Group(*parts)


def _tasks_table(frame: Frame) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="tasks", title_justify="left", caption_justify="left")
    table.add_column("task", overflow="fold", min_width=8)
    table.add_column("status", no_wrap=True)
    for name in (*STATES, "verified/s", "consumed/s", "stuck"):
        table.add_column(name, justify="right", no_wrap=True)
    for v in frame.tasks:
        t = v.task
        counts = [str(t.states.get(s, 0)) for s in STATES]
        if t.blocked:
            counts[0] += f" ({t.blocked} blocked)"
        status = status_name(t.status)
        table.add_row(Text(t.spec.task_id),
                      Text(status, style={"paused": "yellow", "cancelled": "red"}.get(status, "")),
                      *counts, rate_text(v.verified_rate),
                      rate_text(v.consumed_rate),
                      Text(str(v.stuck), style="bold red" if v.stuck else ""))
    reasons = [f"{v.task.spec.task_id}: {v.task.status_reason}" for v in frame.tasks
               if v.task.status_reason]
    # A limited group's backlog, and whether producers are held back by it.
    reasons += [f"{v.task.spec.task_id}: backlog of {b.group} {b.backlog}/{b.limit}"
                + (" (back-pressured: claims refused)" if b.over else "")
                for v in frame.tasks for b in v.task.backlog]
    table.caption = Text("\n".join(reasons)) if reasons else None
    if len(frame.tasks) > 1:
        all_ = _totals(frame.tasks)
        table.add_row("all", "", *map(str, all_["states"].values()),
                      rate_text(all_["verified_per_s"]), rate_text(all_["consumed_per_s"]),
                      str(all_["stuck"]), style="bold")
    return table


def _stuck_table(frame: Frame, rows: int, criterion: str) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"stuck: {len(frame.stuck)} ({criterion})", title_justify="left",
                  caption_justify="left")
    for name in ("task", "file", "state", "for", "why"):
        table.add_column(name, overflow="fold", no_wrap=name in ("state", "for"))
    for s in _first(frame.stuck, rows):
        why = s.error or ("waiting for verification" if s.state == "written" else "")
        table.add_row(Text(s.task_id), Text(s.file_id), s.state, age_text(s.age), Text(why))
    _more(table, len(frame.stuck), rows)
    return table


def _leases_table(sessions: list[pb.AgentInfo], rows: int) -> Table:
    from rich.table import Table
    from rich.text import Text

    claims = sum(len(a.claims) for a in sessions)
    table = Table(title=f"leases: {_count(len(sessions), 'session', 'sessions')}, "
                        f"{_count(claims, 'claim', 'claims')}", title_justify="left",
                  caption_justify="left")
    table.add_column("session", no_wrap=True)
    for name in ("agent", "host/pid", "claims"):
        table.add_column(name, overflow="fold")
    table.add_column("ttl", justify="right", no_wrap=True)
    for a in _first(sessions, rows):
        table.add_row(str(a.session_id), Text(a.agent), Text(f"{a.host or '?'}/{a.pid or '?'}"),
                      Text(_claims_text(a)), f"{a.ttl_left}/{a.granted_ttl} s")
    _more(table, len(sessions), rows)
    return table


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _claims_text(agent: pb.AgentInfo) -> str:
    if not agent.claims:
        return "-"
    names = [f"{c.task_id}/{c.file_id}" + (f"/{c.group}" if c.group else "")
             + _progress_text(c) for c in agent.claims[:CLAIMS_SHOWN]]
    more = len(agent.claims) - len(names)
    return f"{len(agent.claims)}: {', '.join(names)}" + (f", +{more}" if more > 0 else "")


def _progress_text(claim: pb.ClaimInfo) -> str:
    """A claim's progress by its last checkpoint and that checkpoint's age."""
    if not claim.checkpoint_at:
        return ""
    try:
        at = datetime.fromisoformat(claim.checkpoint_at.replace("Z", "+00:00"))
    except ValueError:
        return f" {claim.progress:.0%}"
    age = max((utc_now() - at).total_seconds(), 0.0)
    return f" {claim.progress:.0%} ({age:.0f} s ago)"


def _more(table: Any, total: int, rows: int) -> None:
    if rows and total > rows:
        table.caption = f"and {total - rows} more (--rows)"


# --- the command ---------------------------------------------------------------------


@cli.command()
@click.argument("task_ids", nargs=-1, metavar="[TASK]...")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              metavar="SECONDS", help="time between refreshes")
@click.option("--stuck-after", type=click.FloatRange(min=0), default=60.0, show_default=True,
              metavar="SECONDS", help="a written entry not verified for this long is stuck")
@click.option("--rows", type=click.IntRange(min=0), default=10, show_default=True,
              metavar="N", help="most stuck entries and sessions listed (0: all)")
@click.option("--frames", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help="stop after N refreshes (0: at Ctrl-C)")
@click.option("--once", is_flag=True, help="one refresh, then exit (--frames 1)")
@output_option
@pass_settings
def top(settings: Settings, task_ids: tuple[str, ...], interval: float, stuck_after: float,
        rows: int, frames: int, once: bool, output: str) -> None:
    """A live view of the tasks for the person on call, until Ctrl-C.

    Per task: status, entries by state, throughput (entries reaching verified,
    and consumed, per second between refreshes) and stuck entries (written and
    not verified for --stuck-after seconds, or dead). Then the stuck entries,
    the live sessions with their claims and lease time left (operators only),
    and what the watchers have yet to verify. TASK...: only these tasks.

    On a terminal the view redraws in place; into a pipe or file each refresh
    is printed in full, a blank line between two; -o json prints one JSON
    object per refresh.
    """
    client = settings.client()
    sampler = Sampler(client, task_ids, stuck_after=stuck_after)
    limit = 1 if once else frames

    def picture(frame: Frame, problem: str = "") -> Group:
        return render(frame, registry=settings.registry, interval=interval,
                      stuck_after=stuck_after, rows=rows, problem=problem)

    def show(frame: Frame, number: int, problem: str) -> None:
        if output == "json":
            emit_json({"at": _timestamp(utc_now()), "frame": number, "error": problem}
                      if problem else
                      frame_json(frame, number, stuck_after=stuck_after, rows=rows))
            return
        if number > 1:
            click.echo()
        emit_table(picture(frame, problem))

    watch = HeaderWatch(client, task_ids)
    try:
        first = sampler.sample()  # a registry that cannot answer even once is an error
        if limit == 1:
            show(first, 1, "")
        elif output == "table" and _terminal():
            from rich.live import Live

            # auto_refresh off: the view changes when a refresh has something new, and
            # no thread of rich's redraws it meanwhile.
            with Live(picture(first), auto_refresh=False) as live:
                _loop(sampler, watch, first, interval, limit,
                      lambda frame, _, problem: live.update(picture(frame, problem),
                                                            refresh=True))
        else:
            _loop(sampler, watch, first, interval, limit, show)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a person leaves the view: exit 0
    finally:
        watch.stop()


def _terminal() -> bool:
    from rich.console import Console

    return Console().is_terminal


def _loop(sampler: Sampler, watch: HeaderWatch, first: Frame, interval: float, limit: int,
          show: Callable[[Frame, int, str], None],
          clock: Callable[[], float] = time.monotonic) -> None:
    """Refresh every ``interval`` (sooner when a task header changes) until ``limit``
    frames were shown (0: until Ctrl-C); a registry that stops answering is shown in
    the frame, with the last numbers, and asked again at the next refresh."""
    frame, number = first, 1
    show(frame, number, "")
    last = clock()
    watch.start(frame)
    while not limit or number < limit:
        if watch.changed.wait(max(interval - (clock() - last), 0.0)):
            time.sleep(max(min(MIN_GAP, interval) - (clock() - last), 0.0))
        watch.changed.clear()
        last, number = clock(), number + 1
        try:
            frame = sampler.sample()
        except errors.Unavailable as e:  # DeadlineExceeded too
            reason = (e.message.splitlines() or [type(e).__name__])[0]
            show(frame, number, f"registry unavailable: {reason}")
            continue
        show(frame, number, "")
        watch.showing(frame)
