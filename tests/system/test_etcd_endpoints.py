"""``--etcd`` endpoints: DNS names and IPv6 addresses, for one member and for several.

The session's etcd listens on 127.0.0.1 only; an IPv6 member is reached through
a small TCP relay listening on [::1] (skipped when the machine has no IPv6
loopback), so every case runs against that one etcd.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from registry_fixtures import TEST_RETRY, on_etcd, start_registry

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.local.etcdproc import EtcdProcess, free_port
from baton_relay.registry.store.etcd import Etcd, parse_endpoints

T = TypeVar("T")


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1)")


class Relay:
    """Forwards every TCP connection made to [::1]:port to 127.0.0.1:target."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.server.bind(("::1", 0))
        self.server.listen(16)
        self.port = int(self.server.getsockname()[1])
        self.accepted = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
                self._open += [downstream, upstream]
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()
        with self._lock:
            for s in self._open:
                s.close()


@pytest.fixture
def relay(etcd: EtcdProcess) -> Iterator[Relay]:
    """[::1]:port relayed to the session's etcd."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback (::1)")
    r = Relay(etcd.client_port)
    yield r
    r.close()


async def status(conn: Etcd) -> str:
    return await conn.status()


async def twenty_calls(conn: Etcd) -> list[str]:
    return [await conn.status() for _ in range(20)]


@pytest.mark.parametrize(("endpoint", "members"), [
    ("127.0.0.1:2379", [("127.0.0.1", 2379)]),
    ("etcd-0.example:2379", [("etcd-0.example", 2379)]),
    ("[::1]:2379", [("::1", 2379)]),
    ("http://localhost:2379/", [("localhost", 2379)]),
    (" a:1 , [fe80::1%eth0]:2, 10.0.0.3:3,", [("a", 1), ("fe80::1%eth0", 2), ("10.0.0.3", 3)]),
])
def test_endpoint_forms_are_parsed(endpoint: str, members: list[tuple[str, int]]) -> None:
    """Names, IPv4 and bracketed IPv6 addresses (optionally after http://) are accepted."""
    assert parse_endpoints(endpoint) == members


@pytest.mark.parametrize(("endpoint", "message"), [
    ("", "host:port"),
    ("localhost", "host:port"),
    ("localhost:http", "host:port"),
    ("localhost:70000", "host:port"),
    ("::1:2379", "brackets"),
    ("[::1]", "host:port"),
    ("[etcd]:2379", "not an IPv6 address"),
    ("https://etcd:2379", "only plain http"),
])
def test_malformed_endpoints_are_refused(endpoint: str, message: str) -> None:
    """A malformed endpoint is refused up front, saying what is wrong."""
    with pytest.raises(ValueError, match=message):
        Etcd(endpoint)


def test_a_dns_name_reaches_etcd(etcd: EtcdProcess) -> None:
    """One member given by name (localhost:PORT) is resolved and reached."""
    assert on_etcd(f"localhost:{etcd.client_port}", status)


@needs_ipv6
def test_an_ipv6_address_reaches_etcd(relay: Relay) -> None:
    """One member given as an IPv6 address ([::1]:PORT) is reached."""
    assert on_etcd(f"[::1]:{relay.port}", status)
    assert relay.accepted >= 1


@needs_ipv6
def test_several_members_by_name_and_ipv6_are_all_used(etcd: EtcdProcess, relay: Relay) -> None:
    """Several members, one a name (IPv4) and one IPv6, are resolved into one balanced list."""
    calls = on_etcd(f"localhost:{etcd.client_port},[::1]:{relay.port}", twenty_calls)
    assert len(calls) == 20 and relay.accepted >= 1


def test_several_named_members_work(etcd: EtcdProcess) -> None:
    """Several members given by name (and repeated) are reached."""
    port = etcd.client_port
    assert len(on_etcd(f"localhost:{port},localhost:{port},127.0.0.1:{port}", twenty_calls)) == 20


def test_a_member_that_is_down_fails_no_call(etcd: EtcdProcess) -> None:
    """With one member down, calls go to the member that is up."""
    assert len(on_etcd(f"127.0.0.1:{free_port()},localhost:{etcd.client_port}", twenty_calls)) == 20


def test_a_member_that_does_not_resolve_is_left_out(
        etcd: EtcdProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A member whose name does not resolve is logged and left out; the others serve."""
    caplog.set_level(logging.WARNING, logger="baton.registry")
    assert on_etcd(f"no-such-host.invalid:2379,localhost:{etcd.client_port}", status)
    assert "no-such-host.invalid" in caplog.text


def test_no_member_resolving_is_unavailable() -> None:
    """When no member's name resolves, connecting fails as Unavailable, naming them."""
    with pytest.raises(errors.Unavailable, match="no-such-host"):
        on_etcd("no-such-host.invalid:2379,other.invalid:2379", status)


@needs_ipv6
def test_registry_serves_through_named_and_ipv6_members(
        etcd: EtcdProcess, relay: Relay, prefix: str, staging: Path) -> None:
    """A registry started with --etcd localhost:PORT,[::1]:PORT serves claims."""
    handle = start_registry(f"localhost:{etcd.client_port},[::1]:{relay.port}", prefix, staging)
    try:
        with Client(handle.address, timeout=10, retry=TEST_RETRY) as client:
            client.operator.create_task({"task_id": "t",
                                         "entries": [{"file_id": "a", "path": "a"}]})
            with client.open_session("p", ttl=10) as s:
                assert client.claim("t", session=s).file_id == "a"
    finally:
        handle.stop()
