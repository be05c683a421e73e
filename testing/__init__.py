"""Testing agents without etcd: a registry served in-process on an in-memory store,
with a clock the test owns (docs/testing.md).

The in-memory store (:mod:`.store`) has the interface the registry uses of etcd and is
held to etcd's behaviour by a conformance suite; the registry running on it is the real
one, unchanged.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .clock import Clock
    from .registry import InProcessRegistry, serve, start_in_process
    from .store import MemoryEtcd

#: each public name and its module: loaded on first use, so that pytest's loading of the
#: fixtures (``pytest_plugin``) costs nothing where the registry's extras are not installed
_WHERE = {"Clock": "clock", "InProcessRegistry": "registry", "serve": "registry",
          "start_in_process": "registry", "MemoryEtcd": "store"}

__all__ = ["Clock", "InProcessRegistry", "MemoryEtcd", "serve", "start_in_process"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
