"""Baton's watcher: one daemon per host that hashes files as they land and reports them.

    from baton_relay.watcher import WatcherConfig, start_watcher

    w = start_watcher(WatcherConfig(registry="127.0.0.1:7390", staging="/srv/staging"))
    ...
    w.stop()
"""

from .config import WatcherConfig, load_config
from .daemon import Watcher, start_watcher
from .errors import WatcherError

__all__ = ["Watcher", "WatcherConfig", "WatcherError", "load_config", "start_watcher"]
