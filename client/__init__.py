"""Baton's client: the agent library and the ``baton`` CLI (the wire contract and the
errors are the kernel's, :mod:`baton_relay.kernel`; ``errors`` is re-exported here).

Two surfaces over one implementation of the agent's calls (the asyncio one; the
blocking client runs it on an event loop of its own), with the same helpers:

    from baton_relay.client import Client, produce, consume

    with Client("127.0.0.1:7390") as c, c.open_session("ocr-1", ttl=10) as s:
        with produce(c, s, "t1", "a") as out:
            out.write(b"hello")
        with consume(c, s, "t1", group="default", timeout=30) as got:
            print(got.data)

    from baton_relay.client import AsyncClient, aproduce, aconsume

    async with AsyncClient("127.0.0.1:7390") as c, c.session("ocr-1", ttl=10) as s:
        async with aproduce(s, "t1", "a") as out:
            await out.write(b"hello")
        async with aconsume(s, "t1", group="default", timeout=30) as got:
            print(got.data)

What operators and watchers call is on ``client.operator`` and ``client.watcher``.

The names below are loaded on first use: ``import baton_relay.client`` (and the ``baton``
command, whose every run starts a process) does not pay for gRPC, protobuf or
BLAKE3 until something needs them.
"""

from __future__ import annotations

if __name__ != "baton_relay.client":  # one import name per file
    raise ImportError(f"{__name__} is baton_relay.client: import it by that name "
                      "(the repository's root is the package baton_relay)")

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..kernel import errors
    from ..kernel.contract import DEFAULT_REGISTRY
    from ._client import Client, Session, parse_manifest
    from ._wire import Claim, Lease
    from .aconsumer import AsyncDelivery, aconsume, aconsume_each, anext_lease
    from .aio import AsyncClient, AsyncSession
    from .aproducer import AsyncOutput, aproduce, aproduce_each
    from .consumer import (
        Delivery,
        consume,
        consume_each,
        iter_parts,
        next_lease,
        read_verified,
    )
    from .failures import PermanentError, RetryAfter
    from .producer import Output, claim_waiting, produce, produce_each, put
    from .retry import RetryPolicy

#: each public name and the module that defines it
_HOME = {
    "DEFAULT_REGISTRY": "baton_relay.kernel.contract",
    "Claim": "._wire",
    "Client": "._client",
    "Lease": "._wire",
    "RetryPolicy": ".retry",
    "Session": "._client",
    "parse_manifest": "._client",
    "Delivery": ".consumer",
    "consume": ".consumer",
    "iter_parts": ".consumer",
    "consume_each": ".consumer",
    "next_lease": ".consumer",
    "read_verified": ".consumer",
    "PermanentError": ".failures",
    "RetryAfter": ".failures",
    "Output": ".producer",
    "claim_waiting": ".producer",
    "produce": ".producer",
    "produce_each": ".producer",
    "put": ".producer",
    "AsyncClient": ".aio",
    "AsyncSession": ".aio",
    "AsyncDelivery": ".aconsumer",
    "aconsume": ".aconsumer",
    "aconsume_each": ".aconsumer",
    "anext_lease": ".aconsumer",
    "AsyncOutput": ".aproducer",
    "aproduce": ".aproducer",
    "aproduce_each": ".aproducer",
}

__all__ = [
    "DEFAULT_REGISTRY",
    "AsyncClient",
    "AsyncDelivery",
    "AsyncOutput",
    "AsyncSession",
    "Claim",
    "Client",
    "Delivery",
    "Lease",
    "Output",
    "PermanentError",
    "RetryAfter",
    "RetryPolicy",
    "Session",
    "aconsume",
    "aconsume_each",
    "anext_lease",
    "aproduce",
    "aproduce_each",
    "claim_waiting",
    "consume",
    "consume_each",
    "errors",
    "iter_parts",
    "next_lease",
    "parse_manifest",
    "produce",
    "produce_each",
    "put",
    "read_verified",
]


def __getattr__(name: str) -> Any:
    if name == "errors":
        value: Any = importlib.import_module("baton_relay.kernel.errors")
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
