"""The client: one connection to a registry and the calls of its three services."""

from __future__ import annotations

from ..kernel.contract import DEFAULT_REGISTRY
from ._agent import AgentCalls, Session
from ._operator import OperatorCalls, check_manifest_size, parse_manifest
from ._watcher_calls import WatcherCalls
from ._wire import Claim, Lease
from .retry import RetryPolicy

__all__ = ["DEFAULT_REGISTRY", "Claim", "Client", "Lease", "RetryPolicy", "Session",
           "check_manifest_size", "parse_manifest"]


class Client(AgentCalls, WatcherCalls, OperatorCalls):
    """A connection to a registry. Thread-safe; one per process is enough.

    With ``ca``, ``cert`` and ``key`` (paths of PEM files) it speaks mutual TLS,
    the certificate being the caller's identity; given none of them, it reads
    ``BATON_CA``, ``BATON_CERT`` and ``BATON_KEY``; with none set anywhere it
    speaks plaintext, which only a registry started with ``--insecure`` accepts.

    Its calls mirror the registry's services: what agents call (``AgentCalls``:
    sessions, claims, commits, consumes, acks, watch), what watchers call
    (``WatcherCalls``) and what operators call (``OperatorCalls``).
    """
