"""The console's web server: pages rendered from the registry's replies, actions sent
as the operator's own calls, and live updates fed by one registry watch per task
that every open browser shares (server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ...client.cli._common import Settings
from ...kernel import errors
from ...kernel.contract import ID_PATTERN
from ...kernel.names import state_name
from ...kernel.v1 import baton_pb2 as pb
from . import actions
from .charts import ago, throughput_svg
from .live import Hub

HERE = Path(__file__).resolve().parent
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


def checked_ids(**ids: str) -> None:
    """Raise :class:`~kernel.errors.NotFound` for an id no task or entry can have (a
    page of it is not found, as one of an unknown id is), before asking the registry."""
    for kind, value in ids.items():
        if not re.fullmatch(ID_PATTERN, value):
            shown = value if len(value) <= 40 else f"{value[:40]}… ({len(value)} characters)"
            raise errors.NotFound(f"{shown!r} is not a valid {kind.replace('_', ' ')} "
                                  f"(expected {ID_PATTERN})")


def same_origin(request: Request) -> bool:
    """Whether a request came from the console's own pages: no cross-site fetch, and an
    Origin (when the browser sends one) that is the console itself."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.headers.get('host')}"


class Console:
    """The pages and actions; every registry call runs off the event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = settings.client()
        self.me = identity_of(settings)
        self.hub = Hub(self.client)
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"),
                               autoescape=select_autoescape(["html"]))
        self.env.globals["ago"] = ago

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
        listed = await self.call(self.client.operator.list_tasks)
        rows = []
        for t in listed:
            task = await self.call(self.client.operator.get_task, t.spec.task_id)
            row = self.hub.summary(task)
            row["oldest"] = await self.oldest_waiting(task.spec.task_id)
            rows.append(row)
        return self.page("tasks.html", rows=rows)

    async def oldest_waiting(self, task_id: str) -> str:
        pending = await self.call(self.client.operator.list_entries, task_id,
                                  pb.ENTRY_STATE_PENDING, PAGE_ENTRIES)
        oldest = min(pending, key=lambda e: e.updated_at, default=None)
        return f"{oldest.file_id} since {oldest.updated_at}" if oldest else "-"

    async def task(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        checked_ids(task_id=task_id)
        task = await self.call(self.client.operator.get_task, task_id)
        row = self.hub.summary(task)
        dead = await self.call(self.client.operator.list_entries, task_id, pb.ENTRY_STATE_DEAD,
                               PAGE_ENTRIES)
        deaths = []
        for e in dead:
            # every attempt, from the journal as explain reads it: who, host, token,
            # how it ended, the digest it declared
            explained = await self.call(self.client.operator.explain, task_id, e.file_id)
            deaths.append({"entry": e, "attempts": list(explained.attempts),
                           "more": explained.attempts_total - len(explained.attempts)})
        written = await self.call(self.client.operator.list_entries, task_id,
                                  pb.ENTRY_STATE_WRITTEN, PAGE_ENTRIES)
        stuck = []
        if task.stuck_written or task.blocked:
            candidates = list(written)
            if task.blocked:
                pending = await self.call(self.client.operator.list_entries, task_id,
                                          pb.ENTRY_STATE_PENDING, PAGE_ENTRIES)
                candidates += [e for e in pending if e.blocked]
            for e in candidates[:EXPLAINED]:
                explained = await self.call(self.client.operator.explain, task_id, e.file_id)
                stuck.append({"entry": e, "why": explained.text})
        journal = await self.call(self.client.operator.journal, task_id)
        chart = throughput_svg([(r.at, r.to_state) for r in journal])
        return self.page("task.html", task=task, row=row, deaths=deaths, stuck=stuck,
                         groups=sorted(task.consumed_by_group.items()), chart=chart,
                         state_name=state_name)

    async def entry(self, request: Request) -> Response:
        task_id, file_id = request.path_params["task_id"], request.path_params["file_id"]
        checked_ids(task_id=task_id, file_id=file_id)
        explained = await self.call(self.client.operator.explain, task_id, file_id)
        journal = await self.call(self.client.operator.journal, task_id, file_id)
        return self.page("entry.html", task_id=task_id, entry=explained.entry,
                         why=explained.text, journal=journal, state_name=state_name,
                         attempts=list(explained.attempts),
                         more=explained.attempts_total - len(explained.attempts))

    async def sessions(self, request: Request) -> Response:
        agents, refused = await self.tried(self.client.operator.list_agents)
        return self.page("sessions.html", agents=agents or [], refused=refused)

    async def watchers(self, request: Request) -> Response:
        watchers, refused = await self.tried(self.client.operator.list_watchers)
        shards, refused_shards = await self.tried(self.client.operator.list_shards)
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
        action = actions.ACTIONS.get(name)
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
        checked_ids(**{k: args[k] for k in ("task_id", "file_id") if k in args})
        if request.method == "GET":
            impact, problem = await self.call(actions.impact, self.client, name, args)
            return self.page("confirm.html", action=action, name=name, args=args,
                             impact=impact, problem=problem)
        reason = str(params.get("reason", "")).strip()
        evidence = str(params.get("evidence", "")).strip()
        if not reason:
            return self.refuse(400, "an action needs a reason")
        if not evidence:
            return self.refuse(400, "an action needs evidence (a link or a text)")
        try:
            done = await self.call(actions.perform, self.client, name, args, reason, evidence)
        except errors.NotFound:
            raise  # a 404 page, as for a page of it
        except (errors.BatonError, ValueError) as e:
            return self.refuse(409, str(e))
        return self.page("message.html", title=f"{action.title}: done", status="done",
                         text=done, back=action.back(args))

    def refuse(self, status: int, text: str) -> Response:
        html = self.env.get_template("message.html").render(
            me=self.me, title="Refused", status="refused", text=text)
        return HTMLResponse(html, status_code=status)

    def not_found(self, text: str) -> Response:
        html = self.env.get_template("message.html").render(
            me=self.me, title="Not found", status="not-found", text=text, back="/tasks")
        return HTMLResponse(html, status_code=404)


def make_app(settings: Settings) -> Starlette:
    console = Console(settings)

    async def not_found(request: Request, exc: Exception) -> Response:
        return console.not_found(str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 404:
            return console.not_found(f"no page {request.url.path}")
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return console.refuse(status, str(getattr(exc, "detail", exc)))

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
                                         errors.BatonError: refused,
                                         HTTPException: http_error})


def serve(settings: Settings, host: str, port: int, out: Callable[[str], None]) -> None:
    import uvicorn

    app = make_app(settings)
    out(f"console: http://{host}:{port}/ (registry {settings.registry})")
    uvicorn.run(app, host=host, port=port, log_level="warning")
