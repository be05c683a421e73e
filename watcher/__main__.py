"""``baton-watcher`` / ``python -m baton_relay.watcher``: run the watcher until SIGTERM or
SIGINT."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from ..kernel import collector, tracing
from ..kernel.errors import BatonError
from ..kernel.logs import setup_logging
from ..kernel.sdnotify import Notifier
from .config import load_config
from .daemon import Watcher

#: printed on stdout once the watcher serves; ``baton up`` waits for it
READY = "baton-watcher watching"
#: how often the main thread looks whether a stop was asked for (seconds)
TICK = 0.1


def _lighter_records() -> None:
    """A log record without what no line shows: where it was logged from (a walk up
    the stack per line), its thread's and its process's names. The standard library's
    own advice (the logging HOWTO, "Optimization"); worth it here because a line is
    logged for each file reported."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(sys.argv[1:] if argv is None else argv, os.environ)
    setup_logging(config.log_level, config.log_format)
    _lighter_records()
    tracing.setup("baton-watcher")
    collector.tune(config.gc_young)
    requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only records it: a handler that took a lock (Event.set) could deadlock with
        # the main thread it interrupted while that thread held the same lock.
        requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    notifier = Notifier.from_environ(os.environ)
    try:
        watcher = Watcher(config)
    except BatonError as e:
        print(f"baton-watcher: {e}", file=sys.stderr)
        return 1
    failed: BatonError | None = None
    try:
        watcher.start()
        print(f"{READY} {watcher.root}", flush=True)
        notifier.ready(f"watching {watcher.root}, registry {config.registry}")
        interval = notifier.watchdog_interval
        next_ping = time.monotonic() + interval if interval else math.inf
        while not requested:
            time.sleep(TICK)  # a signal ends the sleep early; its handler only notes it
            if time.monotonic() >= next_ping:
                notifier.watchdog()
                next_ping = time.monotonic() + (interval or math.inf)
    except BatonError as e:  # at start: a setting it cannot use (--metrics)
        failed = e
    finally:
        notifier.stopping()
        # Each worker finishes and reports the file it is hashing.
        watcher.stop()
    if failed is not None:
        # Last, after the log of the stop: the line a reader of the unit's log sees.
        print(f"baton-watcher: {failed}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
