"""Baton's client: the wire contract, the agent library and the ``baton`` CLI.

    from client import Client, produce, consume

    with Client("127.0.0.1:7390") as c, c.open_session("ocr-1", ttl=10) as s:
        with produce(c, s, "t1", "a") as out:
            out.write(b"hello")
        with consume(c, s, "t1", group="default", timeout=30) as got:
            print(got.data)
"""

from . import errors
from ._client import DEFAULT_REGISTRY, Claim, Client, Lease, RetryPolicy, Session, parse_manifest
from .consumer import Delivery, consume, next_lease, read_verified
from .producer import Output, produce, put

__all__ = [
    "DEFAULT_REGISTRY",
    "Claim",
    "Client",
    "Delivery",
    "Lease",
    "Output",
    "RetryPolicy",
    "Session",
    "consume",
    "errors",
    "next_lease",
    "parse_manifest",
    "produce",
    "put",
    "read_verified",
]
