"""Traces of a file's hand-off: one trace per entry attempt, across processes.

Off unless the standard OpenTelemetry environment asks for traces
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_TRACES_EXPORTER`` set to something else than ``none``; ``OTEL_SDK_DISABLED=true``
wins). Off, every helper here is a check of one module flag: OpenTelemetry is not
imported, nothing is allocated, nothing is sent. On, the packages come from the
``trace`` extra (``pip install 'baton-relay[trace]'``); a process that lacks them says
so once and runs untraced.

The context travels with the entry as a W3C ``traceparent`` string: the producer's
claim carries its attempt's span, the registry keeps it on the entry, the watcher's
verification span is its child and takes its place on the entry, and each consumer
group's span is the child of that (docs/operations.md, "Traces").
"""

from __future__ import annotations

import atexit
import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

logger = logging.getLogger("baton.tracing")

#: a W3C trace context header (version 00): trace id, parent span id, flags
TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_NO_TRACE = "0" * 32
_NO_SPAN = "0" * 16

#: what the extra is called in the error said when its packages are missing
EXTRA = "pip install 'baton-relay[trace]'"


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (the OpenTelemetry SDK's own variables)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


#: traces are on in this process (read once, at import; ``setup`` may turn them off)
ENABLED = wanted()
_tracer: Any = None


def valid(traceparent: str) -> bool:
    """Whether ``traceparent`` is a W3C trace context of version 00 naming a trace."""
    m = TRACEPARENT_RE.match(traceparent)
    return m is not None and m.group(1) != _NO_TRACE and m.group(2) != _NO_SPAN


def trace_id(traceparent: str) -> str:
    """The trace id a ``traceparent`` names ("" for none): what log lines carry."""
    return traceparent[3:35] if len(traceparent) == 55 else ""


def setup(service: str) -> bool:
    """Install the process's tracer provider (OTLP over gRPC, batched, flushed at exit)
    if traces are wanted; the service name is ``OTEL_SERVICE_NAME``'s, else ``service``.
    Whether traces are on. Called by each daemon and, lazily, by an agent's first span."""
    global ENABLED, _tracer
    if not ENABLED or _tracer is not None:
        return ENABLED
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        ENABLED = False
        logger.warning("traces are asked for (OTEL_* environment) but OpenTelemetry is "
                       "not installed (%s): running without them; %s", e.name, EXTRA)
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # what is batched leaves before the process does
    _tracer = trace.get_tracer("baton")
    return True


def _get_tracer() -> Any:
    if _tracer is None:
        setup("baton-agent")
    return _tracer


def _context_of(traceparent: str) -> Any:
    """The OpenTelemetry context whose parent is ``traceparent`` (None: none)."""
    if not traceparent or not valid(traceparent):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def start(name: str, *, parent: str = "", attributes: Mapping[str, Any] | None = None,
          start_ns: int | None = None, link: str = "", current: bool = False) -> Any:
    """A new span (None when traces are off), the child of ``parent`` (a traceparent;
    "" and ``current``: of the span current in this thread; "" alone: a new trace).
    ``link``: a traceparent the span is linked to, not a child of (the work that
    produced this file, in a trace of its own). End it with :func:`end`."""
    if not ENABLED or (tracer := _get_tracer()) is None:
        return None
    from opentelemetry import context, trace

    if parent:
        ctx = _context_of(parent)
    elif current:
        ctx = None  # OpenTelemetry's default: the current context
    else:
        ctx = context.Context()  # a root: a trace of its own
    links = []
    if link and (linked := _context_of(link)) is not None:
        links.append(trace.Link(trace.get_current_span(linked).get_span_context()))
    return tracer.start_span(name, context=ctx, attributes=_clean(attributes),
                             links=links, start_time=start_ns)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v not in (None, "")}


def annotate(span: Any, **attributes: Any) -> None:
    """Add attributes to ``span`` (nothing when it is None)."""
    if span is not None and (clean := _clean(attributes)):
        span.set_attributes(clean)


def end(span: Any, error: BaseException | None = None, end_ns: int | None = None) -> None:
    """End ``span`` (nothing when it is None), marked failed with ``error``."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=end_ns)


def traceparent(span: Any) -> str:
    """The ``traceparent`` naming ``span`` ("" when it is None)."""
    if span is None:
        return ""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def current() -> str:
    """The ``traceparent`` of the span current in this thread or task ("" for none, and
    always when traces are off): what a call to the registry carries."""
    if not ENABLED:
        return ""
    from opentelemetry import trace

    c = trace.get_current_span().get_span_context()
    if not c.is_valid:
        return ""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


@contextmanager
def span(name: str, *, parent: str = "", attributes: Mapping[str, Any] | None = None,
         current: bool = True) -> Iterator[Any]:
    """A span around a block, current in it (so calls made in it carry it); the
    child of ``parent``, else of the current span. Yields None when traces are off."""
    if not ENABLED:
        yield None
        return
    with using(start(name, parent=parent, attributes=attributes, current=current)) as s:
        yield s


def carried(coro: Any) -> Any:
    """``coro`` to be run on another thread's event loop with this thread's current
    span (a blocking client hands its stream calls to its loop so)."""
    if not ENABLED:
        return coro
    from opentelemetry import context

    ctx = context.get_current()

    async def run() -> Any:
        token = context.attach(ctx)
        try:
            return await coro
        finally:
            context.detach(token)

    return run()


@contextmanager
def using(s: Any, *, unsent: tuple[type[BaseException], ...] = ()) -> Iterator[Any]:
    """``s`` current in the block (log lines and calls made in it name its trace);
    ended when the block ends, marked failed if it raises. A block that raises one of
    ``unsent`` leaves it unended, so it is never sent (a call refused before it did
    anything: no trace of it). Nothing for None."""
    if s is None:
        yield None
        return
    from opentelemetry import trace

    try:
        with trace.use_span(s, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            yield s
    except unsent:
        raise
    except BaseException as e:
        end(s, e)
        raise
    end(s)


#: the request fields a span of a call names, as its attributes
_CALL_FIELDS = (("task_id", "baton.task"), ("file_id", "baton.file_id"),
                ("token", "baton.token"), ("group", "baton.group"))


def call_attributes(request: Any) -> dict[str, Any]:
    """What a span of a call to the registry says of its request (task, file, token,
    group, where it names them; a fused step's first part's)."""
    part = getattr(request, "commit", None) or getattr(request, "ack", None) or request
    out: dict[str, Any] = {}
    for name, key in _CALL_FIELDS:
        value = getattr(part, name, None)
        if value:
            out[key] = value
    return out


@contextmanager
def within(traceparent: str) -> Iterator[None]:
    """The span ``traceparent`` names current in the block, as a remote parent: no span
    is made, but spans started and lines logged in it belong to that trace. Nothing
    when traces are off or ``traceparent`` names none."""
    ctx = _context_of(traceparent) if ENABLED else None
    if ctx is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


@contextmanager
def active(s: Any) -> Iterator[Any]:
    """``s`` current in the block, not ended by it (nothing for None)."""
    if s is None:
        yield None
        return
    from opentelemetry import trace

    with trace.use_span(s, end_on_exit=False, record_exception=False,
                        set_status_on_exception=False):
        yield s


def child(parent: str, name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A span ``name``, the child of ``parent`` (a traceparent), current in the block,
    with ``attributes`` named ``baton.KEY``; nothing when ``parent`` is "" (untraced)."""
    if not parent:
        return nullcontext()
    return span(name, parent=parent,
                attributes={f"baton.{k}": v for k, v in attributes.items()})
