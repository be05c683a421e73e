"""``baton-watcher`` / ``python -m watcher``: run the watcher until SIGTERM or SIGINT."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from client.logs import setup_logging
from client.sdnotify import Notifier

from .config import load_config
from .daemon import Watcher

#: printed on stdout once the watcher serves; ``baton up`` waits for it
READY = "baton-watcher watching"


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(sys.argv[1:] if argv is None else argv, os.environ)
    setup_logging(config.log_level, config.log_format)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    notifier = Notifier.from_environ(os.environ)
    watcher = Watcher(config)
    try:
        watcher.start()
        print(f"{READY} {watcher.root}", flush=True)
        notifier.ready(f"watching {watcher.root}, registry {config.registry}")
        while not stop.wait(notifier.watchdog_interval):
            notifier.watchdog()
    finally:
        notifier.stopping()
        # Each worker finishes and reports the file it is hashing.
        watcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
