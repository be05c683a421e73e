"""The console's web server: pages rendered from the registry's replies, actions sent
as the operator's own calls, and live updates fed by one registry watch per task
that every open browser shares (server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ...client._client import Client
from ...client.cli._common import Settings
from ...kernel import errors
from ...kernel.names import state_name, status_name
from ...kernel.v1 import baton_pb2 as pb
from .charts import throughput_svg

HERE = Path(__file__).resolve().parent
#: task statuses after which nothing moves (no watch is kept on them)
FINISHED = {pb.TASK_STATUS_CANCELLED, pb.TASK_STATUS_ARCHIVED}
#: how long the rate looks back (seconds)
RATE_WINDOW = 60.0
#: at most this often a changed task is read again and sent to the browsers (seconds)
COALESCE = 0.3
#: entries of one state a task page lists
PAGE_ENTRIES = 200
#: stuck entries a task page explains
EXPLAINED = 20


@dataclass(frozen=True)
class Identity:
    """Who the console acts as: the certificate's name and whether it is an operator
    (a console without identities talks to a registry that has none: it may do all)."""

    name: str
    operator: bool


def identity_of(settings: Settings) -> Identity:
    if not settings.cert:
        return Identity("", True)
    from ...kernel.pki import identity

    name, roles = identity(Path(settings.cert).read_bytes())
    return Identity(name, "operator" in roles)




class Hub:
    """Live task summaries for every browser: one WatchTasks stream, one Watch stream
    per unfinished task, and one reader that asks GetTask again for the tasks whose
    streams moved (at most every ``COALESCE`` seconds), then sends the summary to each
    subscriber."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: set[asyncio.Queue[str]] = set()
        self.followed: set[str] = set()
        self.dirty: set[str] = set()
        self.samples: dict[str, deque[tuple[float, int]]] = {}
        self.changed = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for target in (self._watch_tasks, self._flush):
            threading.Thread(target=target, daemon=True).start()

    def subscribe(self) -> asyncio.Queue[str]:
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=1000)
        self.queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[str]) -> None:
        self.queues.discard(q)

    def _mark(self, task_id: str) -> None:
        with self.lock:
            self.dirty.add(task_id)
        self.changed.set()

    def _watch_tasks(self) -> None:
        while not self.stop.is_set():
            try:
                for task in self.client.watch_tasks():
                    self._mark(task.spec.task_id)
                    if task.status not in FINISHED:
                        self._follow(task.spec.task_id)
            except errors.BatonError:
                pass
            self.stop.wait(1.0)  # the stream ended or broke: open it again

    def _follow(self, task_id: str) -> None:
        with self.lock:
            if task_id in self.followed:
                return
            self.followed.add(task_id)
        threading.Thread(target=self._watch_entries, args=(task_id,), daemon=True).start()

    def _watch_entries(self, task_id: str) -> None:
        try:
            for _ in self.client.watch(task_id, start_revision=-1):
                self._mark(task_id)
        except errors.BatonError:
            pass
        with self.lock:
            self.followed.discard(task_id)

    def _flush(self) -> None:
        while not self.stop.is_set():
            self.changed.wait()
            self.changed.clear()
            with self.lock:
                due, self.dirty = self.dirty, set()
            for task_id in due:
                try:
                    row = self.summary(self.client.get_task(task_id))
                except errors.BatonError:
                    continue
                self._send(json.dumps(row))
            self.stop.wait(COALESCE)

    def _send(self, data: str) -> None:
        loop = self.loop
        if loop is None:
            return
        for q in list(self.queues):
            loop.call_soon_threadsafe(_offer, q, data)

    def rate(self, task_id: str, consumed: int) -> float | None:
        """Entries consumed per second over the last minute, as seen here."""
        now = time.monotonic()
        with self.lock:
            seen = self.samples.setdefault(task_id, deque())
            if not seen or seen[-1][1] != consumed:
                seen.append((now, consumed))
            while len(seen) > 1 and now - seen[0][0] > RATE_WINDOW:
                seen.popleft()
            if len(seen) < 2:
                return None
            (t0, c0), (t1, c1) = seen[0], seen[-1]
        return (c1 - c0) / max(now - t0, t1 - t0, 1e-3)

    def summary(self, task: pb.Task) -> dict[str, Any]:
        states = dict(task.states)
        consumed = int(states.get("consumed", 0))
        rate = self.rate(task.spec.task_id, consumed)
        total = task.entry_count
        return {
            "task_id": task.spec.task_id, "status": status_name(task.status),
            "status_reason": task.status_reason, "entries": total, "consumed": consumed,
            "progress": f"{consumed}/{total}" + (f" ({100 * consumed // total}%)"
                                                  if total else ""),
            "rate": "-" if rate is None else f"{rate:.2f}/s",
            "dead": task.dead, "stuck": task.stuck_written + task.blocked,
            "states": {state_name(s): int(states.get(state_name(s), 0))
                       for s in pb.EntryState.values() if s},
        }


def same_origin(request: Request) -> bool:
    """Whether a request came from the console's own pages: no cross-site fetch, and an
    Origin (when the browser sends one) that is the console itself."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.headers.get('host')}"


def _offer(q: asyncio.Queue[str], data: str) -> None:
    if not q.full():
        q.put_nowait(data)


class Console:
    """The pages and actions; every registry call runs off the event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = settings.client()
        self.me = identity_of(settings)
        self.hub = Hub(self.client)
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"),
                               autoescape=select_autoescape(["html"]))

    def page(self, template: str, **context: Any) -> HTMLResponse:
        html = self.env.get_template(template).render(me=self.me, **context)
        return HTMLResponse(html)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await run_in_threadpool(fn, *args, **kwargs)

    async def tried(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, str]:
        """(reply, "") or (None, the error) when the identity may not, or it failed."""
        try:
            return await self.call(fn, *args), ""
        except errors.BatonError as e:
            return None, str(e)

    # pages -------------------------------------------------------------------------

    async def tasks(self, request: Request) -> Response:
        listed = await self.call(self.client.list_tasks)
        rows = []
        for t in listed:
            task = await self.call(self.client.get_task, t.spec.task_id)
            row = self.hub.summary(task)
            row["oldest"] = await self.oldest_waiting(task.spec.task_id)
            rows.append(row)
        return self.page("tasks.html", rows=rows)

    async def oldest_waiting(self, task_id: str) -> str:
        pending = await self.call(self.client.list_entries, task_id,
                                  pb.ENTRY_STATE_PENDING, PAGE_ENTRIES)
        oldest = min(pending, key=lambda e: e.updated_at, default=None)
        return f"{oldest.file_id} since {oldest.updated_at}" if oldest else "-"

    async def task(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        task = await self.call(self.client.get_task, task_id)
        row = self.hub.summary(task)
        dead = await self.call(self.client.list_entries, task_id, pb.ENTRY_STATE_DEAD,
                               PAGE_ENTRIES)
        deaths = []
        for e in dead:
            journal = await self.call(self.client.journal, task_id, e.file_id, 5)
            last = next((r for r in reversed(journal) if r.to_state == "dead"), None)
            deaths.append({"entry": e, "who": last.who if last else e.owner,
                           "token": last.token if last else e.token})
        written = await self.call(self.client.list_entries, task_id,
                                  pb.ENTRY_STATE_WRITTEN, PAGE_ENTRIES)
        stuck = []
        if task.stuck_written or task.blocked:
            candidates = list(written)
            if task.blocked:
                pending = await self.call(self.client.list_entries, task_id,
                                          pb.ENTRY_STATE_PENDING, PAGE_ENTRIES)
                candidates += [e for e in pending if e.blocked]
            for e in candidates[:EXPLAINED]:
                explained = await self.call(self.client.explain, task_id, e.file_id)
                stuck.append({"entry": e, "why": explained.text})
        journal = await self.call(self.client.journal, task_id)
        chart = throughput_svg([(r.at, r.to_state) for r in journal])
        return self.page("task.html", task=task, row=row, deaths=deaths, stuck=stuck,
                         groups=sorted(task.consumed_by_group.items()), chart=chart,
                         state_name=state_name)

    async def entry(self, request: Request) -> Response:
        task_id, file_id = request.path_params["task_id"], request.path_params["file_id"]
        explained = await self.call(self.client.explain, task_id, file_id)
        journal = await self.call(self.client.journal, task_id, file_id)
        return self.page("entry.html", task_id=task_id, entry=explained.entry,
                         why=explained.text, journal=journal, state_name=state_name)

    async def sessions(self, request: Request) -> Response:
        agents, refused = await self.tried(self.client.list_agents)
        return self.page("sessions.html", agents=agents or [], refused=refused)

    async def watchers(self, request: Request) -> Response:
        watchers, refused = await self.tried(self.client.list_watchers)
        shards, refused_shards = await self.tried(self.client.list_shards)
        return self.page("watchers.html", watchers=watchers or [],
                         shards=shards.shards if shards else [], refused=refused or refused_shards)

    async def events(self, request: Request) -> Response:
        q = self.hub.subscribe()

        async def stream() -> AsyncIterator[str]:
            try:
                yield ": connected\n\n"
                while True:
                    try:
                        data = await asyncio.wait_for(q.get(), timeout=15)
                        yield f"event: task\ndata: {data}\n\n"
                    except TimeoutError:
                        yield ": still here\n\n"
                    if await request.is_disconnected():
                        return
            finally:
                self.hub.unsubscribe(q)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    # actions -----------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        """GET: what the action would touch, and a form asking why; POST: do it."""
        name = request.path_params["action"]
        action = ACTIONS.get(name)
        if action is None:
            return self.page("message.html", title="No such action", status="error",
                             text=f"unknown action {name!r}")
        if not self.me.operator:
            return self.refuse(403, f"{self.me.name or 'this identity'} is not an operator")
        if request.method == "POST" and not same_origin(request):
            # Another site's page must not act as the operator through their browser.
            return self.refuse(403, "an action is accepted only from the console's own pages")
        params = dict(request.query_params) if request.method == "GET" else dict(
            await request.form())
        args = {k: str(params.get(k, "")).strip() for k in action.fields}
        missing = [k for k in action.fields if not args[k]]
        if missing:
            return self.refuse(400, f"missing {', '.join(missing)}")
        if request.method == "GET":
            impact, problem = await self.impact(name, args)
            return self.page("confirm.html", action=action, name=name, args=args,
                             impact=impact, problem=problem)
        reason = str(params.get("reason", "")).strip()
        evidence = str(params.get("evidence", "")).strip()
        if not reason:
            return self.refuse(400, "an action needs a reason")
        if not evidence:
            return self.refuse(400, "an action needs evidence (a link or a text)")
        try:
            done = await self.call(self.perform, name, args, reason, evidence)
        except errors.BatonError as e:
            return self.refuse(409, str(e))
        return self.page("message.html", title=f"{action.title}: done", status="done",
                         text=done, back=action.back(args))

    def refuse(self, status: int, text: str) -> Response:
        html = self.env.get_template("message.html").render(
            me=self.me, title="Refused", status="refused", text=text)
        return HTMLResponse(html, status_code=status)

    async def impact(self, name: str, args: dict[str, str]) -> tuple[list[str], str]:
        """What the action touches, in lines, before it is done (or what stops it)."""
        c = self.client
        try:
            if name in ("pause", "resume", "cancel"):
                task = await self.call(c.get_task, args["task_id"])
                agents = await self.call(c.list_agents)
                holding = [a for a in agents if any(k.task_id == args["task_id"]
                                                    for k in a.claims)]
                claims = sum(1 for a in holding for k in a.claims
                             if k.task_id == args["task_id"])
                return [f"task {args['task_id']} is {status_name(task.status)}",
                        f"{task.open} open entries of {task.entry_count}",
                        f"{claims} claims held by {len(holding)} sessions"
                        + (" (cancel revokes them)" if name == "cancel" else "")], ""
            if name == "requeue":
                entry = await self.call(c.get_entry, args["task_id"], args["file_id"])
                return [f"1 entry: {entry.file_id} is {state_name(entry.state)}"
                        + (f" ({entry.error})" if entry.error else "")], ""
            if name == "requeue-dead":
                dead = await self.call(c.list_entries, args["task_id"], pb.ENTRY_STATE_DEAD)
                return [f"{len(dead)} dead entries go back to pending"], ""
            if name == "revoke":
                agent = self._agent(await self.call(c.list_agents), int(args["session_id"]))
                return [f"1 session: {agent.agent} on {agent.host}",
                        f"{len(agent.claims)} claims go back now"], ""
            if name == "drain":
                agents = [a for a in await self.call(c.list_agents) if a.host == args["host"]]
                return [f"{len(agents)} sessions on {args['host']} take no new work",
                        f"{sum(len(a.claims) for a in agents)} claims they hold are revoked "
                        "at the deadline"], ""
            if name == "move":
                shards = await self.call(c.list_shards)
                shard = next((s for s in shards.shards if s.shard == int(args["shard"])), None)
                if shard is None:
                    return [], f"no shard {args['shard']}"
                return [f"shard {shard.shard}: {shard.tasks} tasks, owner "
                        f"{shard.owner or 'nobody'} (epoch {shard.epoch}) → "
                        f"{args['to_watcher']}"], ""
        except (errors.BatonError, ValueError) as e:
            return [], str(e)
        return [], ""

    @staticmethod
    def _agent(agents: list[pb.AgentInfo], session_id: int) -> pb.AgentInfo:
        for a in agents:
            if a.session_id == session_id:
                return a
        raise errors.NotFound(f"no session {session_id:x}")

    def perform(self, name: str, args: dict[str, str], reason: str, evidence: str) -> str:
        """Send the action as the operator's own call; a line saying what it did."""
        c = self.client
        if name in ("pause", "resume", "cancel"):
            call = {"pause": c.pause_task, "resume": c.resume_task, "cancel": c.cancel_task}
            task = call[name](args["task_id"], reason, evidence)
            return f"task {args['task_id']} is {status_name(task.status)}"
        if name == "requeue":
            entry = c.requeue(args["task_id"], args["file_id"], reason, evidence)
            return f"{entry.file_id} is {state_name(entry.state)}"
        if name == "requeue-dead":
            dead = c.list_entries(args["task_id"], pb.ENTRY_STATE_DEAD)
            for e in dead:
                c.requeue(args["task_id"], e.file_id, reason, evidence)
            return f"{len(dead)} dead entries requeued"
        if name == "revoke":
            done = c.revoke_sessions(int(args["session_id"]), reason=reason, evidence=evidence)
            return "; ".join(f"session {s.session_id:x} of {s.agent} revoked, "
                             f"{s.claims_returned} claims returned" for s in done) or \
                "the session was already gone"
        if name == "drain":
            drained = c.drain_host(args["host"], reason=reason, evidence=evidence)
            return (f"{drained.host} draining until {drained.deadline}: {drained.sessions} "
                    f"sessions, {drained.claims} claims")
        if name == "move":
            shard = c.move_shard(int(args["shard"]), args["to_watcher"], reason=reason,
                                 evidence=evidence)
            return f"shard {shard.shard}: owner {shard.owner}, moving to {shard.moving_to or '-'}"
        raise errors.InvalidArgument(f"unknown action {name!r}")


@dataclass(frozen=True)
class Action:
    title: str
    fields: tuple[str, ...]
    back: Callable[[dict[str, str]], str]


ACTIONS: dict[str, Action] = {
    "pause": Action("Pause task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "resume": Action("Resume task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "cancel": Action("Cancel task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "requeue": Action("Requeue entry", ("task_id", "file_id"),
                      lambda a: f"/tasks/{a['task_id']}/entries/{a['file_id']}"),
    "requeue-dead": Action("Requeue every dead entry", ("task_id",),
                           lambda a: f"/tasks/{a['task_id']}"),
    "revoke": Action("Revoke session", ("session_id",), lambda a: "/sessions"),
    "drain": Action("Drain host", ("host",), lambda a: "/sessions"),
    "move": Action("Move shard", ("shard", "to_watcher"), lambda a: "/watchers"),
}


def make_app(settings: Settings) -> Starlette:
    console = Console(settings)

    async def not_found(request: Request, exc: Exception) -> Response:
        return console.refuse(404, str(exc))

    async def refused(request: Request, exc: Exception) -> Response:
        status = 403 if isinstance(exc, errors.PermissionDenied) else 502
        return console.refuse(status, str(exc))

    async def home(request: Request) -> Response:
        return RedirectResponse("/tasks")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        console.hub.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            console.hub.stop.set()
            console.hub.changed.set()

    routes = [
        Route("/", home),
        Route("/tasks", console.tasks),
        Route("/tasks/{task_id}", console.task),
        Route("/tasks/{task_id}/entries/{file_id}", console.entry),
        Route("/sessions", console.sessions),
        Route("/watchers", console.watchers),
        Route("/events", console.events),
        Route("/act/{action}", console.act, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={errors.NotFound: not_found,
                                         errors.BatonError: refused})


def serve(settings: Settings, host: str, port: int, out: Callable[[str], None]) -> None:
    import uvicorn

    app = make_app(settings)
    out(f"console: http://{host}:{port}/ (registry {settings.registry})")
    uvicorn.run(app, host=host, port=port, log_level="warning")
