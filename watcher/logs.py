"""Structured logs: one line per event, as ``key=value`` pairs or as a JSON object.

Call :func:`log` with the fields that identify what happened (``task``,
``file_id``, ``size``, ...); the formatters put them after the message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

_FIELDS = "baton_fields"


def log(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with ``fields`` attached (skipped cheaply when the level is off)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={_FIELDS: fields}, stacklevel=2)


def _stamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = getattr(record, _FIELDS, {})
    return fields


def _kv_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text, ensure_ascii=False)
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=... msg="..." task=t1 file_id=a``."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = {
            "ts": _stamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        line = " ".join(f"{k}={_kv_value(v)}" for k, v in pairs.items())
        if record.exc_info:
            line += " exc=" + _kv_value(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the same keys as :class:`KeyValueFormatter`."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _stamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send the ``baton`` loggers to ``stream`` (stderr) in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger("baton")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
