"""Baton's watcher: one daemon per host that hashes files as they land and reports them.

    from baton_relay.watcher import WatcherConfig, start_watcher

    w = start_watcher(WatcherConfig(registry="127.0.0.1:7390", staging="/srv/staging"))
    ...
    w.stop()
"""

if __name__ != "baton_relay.watcher":  # one import name per file
    raise ImportError(f"{__name__} is baton_relay.watcher: import it by that name "
                      "(the repository's root is the package baton_relay)")


from .config import WatcherConfig, load_config
from .daemon import Watcher, start_watcher
from .errors import WatcherError

__all__ = ["Watcher", "WatcherConfig", "WatcherError", "load_config", "start_watcher"]
