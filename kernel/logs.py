"""One logging style for Baton's daemons: a line per event, ``key=value`` for people
(``--log-format kv``) or a JSON object for machines (``--log-format json``).

Built on structlog's formatter for the standard library's records, so every logger
of a daemon (and of the libraries under it) comes out the same way. Call :func:`log`
with the fields that identify what happened (``task``, ``file_id``, ``revision``,
...); they follow the message as keys of their own. A plain ``logger.info("...")``
works too and gets the same frame (time, level, logger, message).

The registry and the watcher import this; an agent's install never does (structlog
is in their extras).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

from . import tracing

FORMATS = ("kv", "json")
_FIELDS = "baton_fields"


def log(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with ``fields`` attached (skipped cheaply when the level is off).
    With traces on, a line logged in a span names its trace (``trace_id``): a line
    about an entry, in the span of a call about it, names the entry's trace."""
    if logger.isEnabledFor(level):
        if (tracing.ENABLED and "trace_id" not in fields
                and (tid := tracing.trace_id(tracing.current()))):
            fields["trace_id"] = tid
        logger.log(level, msg, extra={_FIELDS: fields}, stacklevel=2)


def _baton_fields(logger: Any, method: str, event: MutableMapping[str, Any]
                  ) -> MutableMapping[str, Any]:
    """Lift the fields :func:`log` attached to a record into the event's own keys."""
    record = event.get("_record")
    fields = getattr(record, _FIELDS, None) if record is not None else None
    if fields:
        for key, value in fields.items():
            event.setdefault(key, value)
    return event


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of ``fmt`` (``kv`` or ``json``): ``ts``, ``level``, ``logger``,
    ``msg``, then the event's fields, and ``exc`` with a traceback."""
    import structlog

    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    pre_chain: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
        _baton_fields,
    ]
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(ensure_ascii=False, default=str)
    else:
        renderer = structlog.processors.LogfmtRenderer(
            key_order=["ts", "level", "logger", "msg"], drop_missing=True)
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.EventRenamer("msg"),
            _exc_as_text,
            renderer,
        ],
    )


def _exc_as_text(logger: Any, method: str, event: MutableMapping[str, Any]
                 ) -> MutableMapping[str, Any]:
    """A traceback as one ``exc`` value (logfmt quotes and escapes it)."""
    import structlog

    exc_info = event.pop("exc_info", None)
    if exc_info:
        event["exc"] = structlog.processors.format_exc_info(
            logger, method, {"exc_info": exc_info}).get("exception", "")
    return event


def setup_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) in ``fmt``, at ``level`` for
    Baton's own loggers (``baton.*``) and at WARNING for libraries under them."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    baton = logging.getLogger("baton")
    baton.handlers[:] = []
    baton.setLevel(level.upper())
    baton.propagate = True
