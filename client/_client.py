"""The client: one connection to a registry and the calls of its three services."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..kernel.contract import DEFAULT_REGISTRY
from ._agent import AgentCalls, Session
from ._operator import OperatorCalls, check_manifest_size, parse_manifest
from ._watcher_calls import WatcherCalls
from ._wire import Claim, Lease
from .retry import RetryPolicy

__all__ = ["DEFAULT_REGISTRY", "Claim", "Client", "Lease", "OperatorCalls", "RetryPolicy",
           "Session", "WatcherCalls", "check_manifest_size", "parse_manifest"]


if TYPE_CHECKING:  # the deprecated spellings, typed as the calls they forward to
    class _Moved(OperatorCalls, WatcherCalls):
        pass
else:
    class _Moved:  # filled in below, with calls that warn
        pass


class Client(AgentCalls, _Moved):
    """A connection to a registry. Thread-safe; one per process is enough.

    With ``ca``, ``cert`` and ``key`` (paths of PEM files) it speaks mutual TLS,
    the certificate being the caller's identity; given none of them, it reads
    ``BATON_CA``, ``BATON_CERT`` and ``BATON_KEY``; with none set anywhere it
    speaks plaintext, which only a registry started with ``--insecure`` accepts.

    Its calls mirror the registry's services, one object per audience over the one
    connection: what agents call (``AgentCalls``, on the client itself: sessions,
    claims, commits, consumes, acks, watch), what operators call (``client.operator``,
    ``OperatorCalls``) and what watchers call (``client.watcher``, ``WatcherCalls``).
    The operators' and watchers' calls on the client itself (``client.get_task``) are
    deprecated: they warn and go on working until the next release.
    """

    def __init__(self, target: str = DEFAULT_REGISTRY, *, timeout: float = 10.0,
                 retry: RetryPolicy | None = None, ca: str | None = None,
                 cert: str | None = None, key: str | None = None) -> None:
        super().__init__(target, timeout=timeout, retry=retry, ca=ca, cert=cert, key=key)
        #: what operators call: tasks, entries, the journal, sessions, shards, pools
        self.operator = OperatorCalls(self)
        #: what watchers call: membership, shards, and what they found on disk
        self.watcher = WatcherCalls(self)


def _moved(audience: str, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """``Client.NAME``, forwarding to ``client.AUDIENCE.NAME`` with a warning."""

    @functools.wraps(call)
    def forward(self: Client, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"Client.{name} is deprecated and goes in the next release: "
                      f"use client.{audience}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(getattr(self, audience), name)(*args, **kwargs)

    return forward


#: the calls that moved from ``Client`` to ``client.operator`` and ``client.watcher``
MOVED = {audience: [name for name, value in vars(calls).items()
                    if callable(value) and not name.startswith("_")]
         for audience, calls in (("operator", OperatorCalls), ("watcher", WatcherCalls))}

for _audience, _names in MOVED.items():
    for _name in _names:
        _calls = OperatorCalls if _audience == "operator" else WatcherCalls
        setattr(_Moved, _name, _moved(_audience, _name, getattr(_calls, _name)))
