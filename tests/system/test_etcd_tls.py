"""The registry's etcd connection over TLS, with client certificates and etcd users.

Every etcd here is a real one of this module's own, serving its client API over
TLS (``local.etcdproc.EtcdTLS``) with certificates from ``kernel.pki``;
``BATON_TEST_ETCD`` picks the binary, so the module runs on 3.4 and 3.5 alike.
The auth-enabled etcd grants the user ``baton`` readwrite on ``/baton-test/``
and nothing else: whatever the registry does through it needs no more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import pytest
from registry_fixtures import TEST_RETRY, on_etcd, start_registry
from test_etcd_endpoints import Relay, needs_ipv6

from baton_relay.client import Client
from baton_relay.kernel import errors, pki
from baton_relay.local.etcdproc import EtcdProcess, EtcdTLS, free_port
from baton_relay.registry.store.etcd import Etcd, EtcdAuth, Get, Put, absent

T = TypeVar("T")

BINARY = os.environ.get("BATON_TEST_ETCD") or None
ROOT_PASSWORD = "root-secret"
BATON_PASSWORD = "baton-secret"
#: the only keys the ``baton`` role may touch
ALLOWED = "/baton-test/"


def on(endpoint: str, auth: EtcdAuth, body: Callable[[Etcd], Awaitable[T]],
       timeout: float = 5.0) -> T:
    """Run ``body`` on a connection of its own made with ``auth``."""
    return on_etcd(endpoint, body, timeout, auth)


def connect_error(endpoint: str, auth: EtcdAuth, timeout: float = 3.0) -> tuple[str, float]:
    """The message connecting fails with, and how long failing took."""

    async def status(conn: Etcd) -> str:
        return await conn.status()

    started = time.monotonic()
    with pytest.raises(errors.BatonError) as caught:
        on(endpoint, auth, status, timeout=timeout)
    return str(caught.value), time.monotonic() - started


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pki.Issued]:
    """A CA, etcd's server certificate (loopback names) and the registry's client one."""
    return pki.local_pki(tmp_path_factory.mktemp("pki"))


def client_auth(made: dict[str, pki.Issued], **more: str) -> EtcdAuth:
    """The CA, the registry's client certificate and its key (plus ``more``)."""
    client = made[pki.ETCD_CLIENT]
    return EtcdAuth(ca=str(made["ca"].cert), cert=str(client.cert), key=str(client.key), **more)


def tls_process(root: Path, made: dict[str, pki.Issued], server: str = "etcd",
                extra: tuple[str, ...] = ()) -> EtcdProcess:
    client = made[pki.ETCD_CLIENT]
    tls = EtcdTLS(cert=made[server].cert, key=made[server].key, ca=made["ca"].cert,
                  client_cert=client.cert, client_key=client.key)
    return EtcdProcess(root / "data", log_path=root / "etcd.log", binary=BINARY, tls=tls,
                       extra_args=extra)


def enable_auth(etcd: EtcdProcess, password_file: Path) -> None:
    """Users ``root`` and ``baton`` (readwrite on ``/baton-test/`` only), then auth on;
    also a user named after the client certificate's CN, with the same role."""
    for argv in (
        ["user", "add", "root", f"--new-user-password={ROOT_PASSWORD}"],
        ["user", "grant-role", "root", "root"],
        ["role", "add", "baton"],
        ["role", "grant-permission", "baton", "--prefix=true", "readwrite", ALLOWED],
        ["user", "add", "baton", f"--new-user-password={BATON_PASSWORD}"],
        ["user", "grant-role", "baton", "baton"],
        ["user", "add", pki.ETCD_CLIENT, f"--new-user-password={uuid4().hex}"],
        ["user", "grant-role", pki.ETCD_CLIENT, "baton"],
        ["auth", "enable"],
    ):
        etcd.etcdctl(*argv)
    password_file.write_text(BATON_PASSWORD + "\n")


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory,
             made: dict[str, pki.Issued]) -> Iterator[EtcdProcess]:
    """etcd over TLS that checks client certificates (``--client-cert-auth``)."""
    with tls_process(tmp_path_factory.mktemp("etcd-tls"), made) as process:
        yield process


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory,
              made: dict[str, pki.Issued]) -> Iterator[EtcdProcess]:
    """etcd over TLS with authentication enabled (see :func:`enable_auth`)."""
    root = tmp_path_factory.mktemp("etcd-auth")
    with tls_process(root, made) as process:
        enable_auth(process, root / "password")
        yield process


@pytest.fixture
def key() -> bytes:
    """A key under the prefix the ``baton`` role may use, no other test's."""
    return f"{ALLOWED}{uuid4().hex}/".encode()


async def exercise(conn: Etcd, prefix: bytes) -> dict[str, Any]:
    """What the registry does to etcd, once each: txn, reads, watch, leases."""
    seen: dict[str, Any] = {"version": await conn.status()}
    start = (await conn.txn([absent(prefix + b"a")], [Put(prefix + b"a", b"1")])).revision
    stream = conn.watch(prefix, start)
    seen["watched"] = [(e.kind, e.kv.key) for e in await asyncio.wait_for(anext(stream), 5)]
    await stream.aclose()  # type: ignore[attr-defined]
    lease, _ = await conn.grant(30)
    await conn.txn([], [Put(prefix + b"leased", b"x", lease=lease)])
    seen["keepalive"] = await conn.keepalive(lease)
    seen["ttl"] = await conn.time_to_live(lease)
    seen["read"] = (await conn.read([Get(prefix, prefix=True)]))[0]
    seen["count"] = await conn.count(prefix)
    seen["scan"] = [kv.key async for kv in conn.scan(prefix, page=1)]
    await conn.revoke(lease)
    seen["after_revoke"] = await conn.get(prefix + b"leased")
    return seen


def check_exercised(seen: dict[str, Any], prefix: bytes) -> None:
    assert re.fullmatch(r"3\.\d+\.\d+", seen["version"])
    assert seen["watched"] == [("put", prefix + b"a")]
    assert 0 < seen["keepalive"] <= 30 and 0 < seen["ttl"] <= 30
    assert [kv.key for kv in seen["read"]] == [prefix + b"a", prefix + b"leased"]
    assert seen["count"] == 2
    assert seen["scan"] == [prefix + b"a", prefix + b"leased"]
    assert seen["after_revoke"] is None


# --- settings --------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "named"), [
    ({"ca": "ca.crt", "cert": "c.crt"}, "--etcd-cert is given without --etcd-key"),
    ({"ca": "ca.crt", "key": "c.key"}, "--etcd-key is given without --etcd-cert"),
    ({"cert": "c.crt", "key": "c.key"}, "--etcd-cert is given without --etcd-ca"),
    ({"user": "baton"}, "--etcd-user is given without --etcd-password-file"),
    ({"password": "x"}, "--etcd-password-file is given without --etcd-user"),
])
def test_settings_that_need_another_are_refused(settings: dict[str, str], named: str) -> None:
    """A certificate without its key (or the reverse, or without a CA), a user without a
    password: refused up front, naming both settings."""
    with pytest.raises(errors.InvalidArgument, match=named):
        EtcdAuth(**settings)


def test_unreadable_and_mismatched_files_are_refused(
        tmp_path: Path, made: dict[str, pki.Issued]) -> None:
    """A CA that cannot be read or is no PEM, a key that is not the certificate's: each
    refused when connecting, naming the setting and the file, before any network."""
    missing = tmp_path / "missing.crt"
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    other = pki.issue(made["ca"].cert.parent, "other-client", tmp_path)
    client = made[pki.ETCD_CLIENT]
    cases = [
        (EtcdAuth(ca=str(missing)), rf"--etcd-ca {re.escape(str(missing))}: cannot read"),
        (EtcdAuth(ca=str(garbage)), "--etcd-ca .*: not a PEM file"),
        (EtcdAuth(ca=str(made["ca"].cert), cert=str(client.cert), key=str(other.key)),
         "--etcd-cert .* and --etcd-key .* do not make a usable pair"),
        (EtcdAuth(ca=str(made["ca"].cert), cert=str(client.cert), key=str(missing)),
         "--etcd-key .*: cannot read"),
    ]
    for auth, message in cases:
        with pytest.raises(errors.InvalidArgument, match=message):
            on(f"127.0.0.1:{free_port()}", auth, Etcd.status)


def test_https_endpoints_go_with_tls_only() -> None:
    """https:// is accepted when TLS is on; http:// is then refused, and https:// without."""
    auth = EtcdAuth(ca="ca.crt")
    assert Etcd("https://a:1,https://b:2", auth=auth).members == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match="--etcd-ca turns TLS on"):
        Etcd("http://a:1", auth=auth)
    with pytest.raises(ValueError, match="https:// needs --etcd-ca"):
        Etcd("https://a:1")


def test_the_password_is_not_shown() -> None:
    """The password stays out of the settings' repr (and so out of logs)."""
    assert "hunter2" not in repr(EtcdAuth(user="baton", password="hunter2"))


# --- TLS ---------------------------------------------------------------------------


def test_the_etcd_process_serves_tls_only(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """EtcdProcess with EtcdTLS: an https URL, healthy through its client certificate,
    and nothing for a probe without one."""
    assert tls_etcd.url == f"https://{tls_etcd.endpoint}"
    assert tls_etcd.healthy()
    anonymous = EtcdTLS(cert=made["etcd"].cert, key=made["etcd"].key, ca=made["ca"].cert)
    bare = EtcdProcess(tls_etcd.data_dir, tls_etcd.client_port, tls_etcd.peer_port,
                       tls=anonymous)
    assert not bare.healthy()
    with pytest.raises(ValueError, match="go together"):
        EtcdTLS(cert=Path("c"), key=Path("k"), ca=Path("a"), client_cert=Path("x"))


def test_mutual_tls_serves_everything_the_registry_uses(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued], key: bytes) -> None:
    """With the CA and a client certificate, txn, reads, watch and leases all work."""
    check_exercised(on(tls_etcd.endpoint, client_auth(made), lambda c: exercise(c, key)), key)


def test_without_a_client_certificate_connect_fails_clearly(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """Against --client-cert-auth, TLS without a client certificate fails at connect, at
    once, saying so."""
    message, took = connect_error(tls_etcd.endpoint, EtcdAuth(ca=str(made["ca"].cert)))
    assert f"cannot reach etcd at {tls_etcd.endpoint} over TLS" in message
    assert "etcd refused the client certificate" in message and "--etcd-cert" in message
    assert took < 3.0


def test_a_certificate_from_another_ca_is_refused_clearly(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued], tmp_path: Path) -> None:
    """A CA that did not sign etcd's certificate: connect says it does not chain to it."""
    other = pki.create_ca(tmp_path / "other")
    client = made[pki.ETCD_CLIENT]
    auth = EtcdAuth(ca=str(other.cert), cert=str(client.cert), key=str(client.key))
    message, took = connect_error(tls_etcd.endpoint, auth)
    assert "does not chain to --etcd-ca" in message, message
    assert took < 3.0


def test_plaintext_against_tls_etcd_fails_clearly(tls_etcd: EtcdProcess) -> None:
    """No --etcd-ca against an etcd serving TLS only: connect says to give it."""
    message, took = connect_error(tls_etcd.endpoint, EtcdAuth())
    assert f"cannot reach etcd at {tls_etcd.endpoint}" in message
    assert "give --etcd-ca" in message, message
    assert took < 3.0


def test_tls_against_plaintext_etcd_fails_clearly(
        etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """--etcd-ca against a plaintext etcd: connect says it does not serve TLS there."""
    message, took = connect_error(etcd.endpoint, client_auth(made))
    assert "over TLS" in message and "does not serve TLS" in message, message
    assert took < 3.0


def test_the_certificate_must_name_the_host_as_written(
        tmp_path: Path, made: dict[str, pki.Issued]) -> None:
    """etcd's certificate is checked against each endpoint's host as written: a
    certificate for 127.0.0.1 serves 127.0.0.1:PORT, not localhost:PORT."""
    address_only = pki.issue(made["ca"].cert.parent, "etcd-address", tmp_path / "pki",
                             server_names=["127.0.0.1"])
    with tls_process(tmp_path, {**made, "etcd-address": address_only},
                     server="etcd-address") as process:
        assert on(process.endpoint, client_auth(made), Etcd.status)
        message, _ = connect_error(f"localhost:{process.client_port}", client_auth(made))
        assert "does not name the host" in message and "subject alternative names" in message


async def twenty_calls(conn: Etcd) -> list[str]:
    return [await conn.status() for _ in range(20)]


def test_several_members_over_tls_each_checked_by_its_name(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """Several members over TLS (a name and an address) are all reached, each checked
    against its own name."""
    port = tls_etcd.client_port
    calls = on(f"localhost:{port},127.0.0.1:{port}", client_auth(made), twenty_calls)
    assert len(calls) == 20


def test_a_member_that_is_down_fails_no_call_over_tls(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued],
        caplog: pytest.LogCaptureFixture) -> None:
    """Over TLS, a member that is down is logged at connect and given no call."""
    caplog.set_level(logging.WARNING, logger="baton.registry")
    down = f"127.0.0.1:{free_port()}"
    calls = on(f"{down},localhost:{tls_etcd.client_port}", client_auth(made), twenty_calls)
    assert len(calls) == 20
    assert down in caplog.text


@needs_ipv6
def test_an_ipv6_member_over_tls(tls_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """[::1]:PORT over TLS is checked against the address ::1 in etcd's certificate."""
    relay = Relay(tls_etcd.client_port)
    try:
        calls = on(f"[::1]:{relay.port},localhost:{tls_etcd.client_port}", client_auth(made),
                   twenty_calls)
        assert len(calls) == 20 and relay.accepted >= 1
    finally:
        relay.close()


# --- etcd users --------------------------------------------------------------------


def baton_auth(made: dict[str, pki.Issued], password: str = BATON_PASSWORD) -> EtcdAuth:
    return client_auth(made, user="baton", password=password)


def test_a_user_with_readwrite_on_the_prefix_can_do_all_the_registry_does(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued], key: bytes) -> None:
    """User ``baton`` (readwrite on /baton-test/ only): status, txn, reads, watch, lease
    grant, put with a lease, keepalive, time-to-live and revoke all work."""
    check_exercised(on(auth_etcd.endpoint, baton_auth(made), lambda c: exercise(c, key)), key)
    assert auth_etcd.healthy()  # /health needs no user: a restart is seen ready


def test_the_user_is_denied_outside_its_prefix(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """A read outside the role's prefix is refused, and the error says what role is needed."""

    async def outside(conn: Etcd) -> None:
        await conn.get(b"/elsewhere/key")

    with pytest.raises(errors.Internal, match=r"permission denied.*readwrite on the registry"):
        on(auth_etcd.endpoint, baton_auth(made), outside)


def test_the_certificate_name_is_a_user_too(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued], key: bytes) -> None:
    """With --client-cert-auth and no --etcd-user, etcd takes the certificate's CN as the
    user: a user of that name with the role needs no password."""
    check_exercised(on(auth_etcd.endpoint, client_auth(made), lambda c: exercise(c, key)), key)


def test_a_wrong_password_is_refused_at_connect(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """A wrong password fails connect with InvalidArgument naming the settings."""
    message, _ = connect_error(auth_etcd.endpoint, baton_auth(made, password="wrong"))
    assert "refused user 'baton'" in message and "--etcd-password-file" in message


def test_a_user_against_etcd_without_auth_is_refused(
        tls_etcd: EtcdProcess, made: dict[str, pki.Issued]) -> None:
    """--etcd-user against an etcd whose authentication is off: connect says so."""
    message, _ = connect_error(tls_etcd.endpoint, baton_auth(made))
    assert "authentication disabled" in message


def test_a_registry_serves_through_the_restricted_user(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued], tmp_path: Path) -> None:
    """A registry given --etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file
    starts and serves a task's claim and commit with readwrite on its prefix only."""
    client = made[pki.ETCD_CLIENT]
    password = tmp_path / "etcd-password"
    password.write_text(BATON_PASSWORD + "\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    handle = start_registry(
        auth_etcd.endpoint, f"{ALLOWED}{uuid4().hex}/", staging,
        etcd_ca=str(made["ca"].cert), etcd_cert=str(client.cert), etcd_key=str(client.key),
        etcd_user="baton", etcd_password_file=str(password))
    try:
        with Client(handle.address, timeout=10, retry=TEST_RETRY) as c:
            c.operator.create_task({"task_id": "t", "digest_optional": True,
                                    "entries": [{"file_id": "a", "path": "a"}]})
            with c.open_session("p", ttl=10) as s:
                claim = c.claim("t", session=s)
                assert c.commit("t", claim.file_id, claim.token, 0, session=s).file_id == "a"
    finally:
        handle.stop()


def authentications(etcd: EtcdProcess) -> int:
    """How many Authenticate calls etcd has answered (from its metrics)."""
    found = re.findall(r'grpc_server_handled_total\{[^}]*grpc_method="Authenticate"[^}]*\} '
                       r'(\S+)', etcd.get("/metrics").decode())
    return sum(int(float(n)) for n in found)


def forget_tokens(etcd: EtcdProcess) -> int:
    """etcd forgets every auth token it handed out, now: auth turned off and on again
    (a simple token is forgotten the same way once unused for --auth-token-ttl s, by
    etcd's own clock, which a test cannot move on). How many Authenticate calls etcd
    has answered then (etcdctl's own included)."""
    for command in ("disable", "enable"):
        etcd.etcdctl("--user", f"root:{ROOT_PASSWORD}", "auth", command)
    return authentications(etcd)


def test_an_expired_token_is_renewed_transparently(
        auth_etcd: EtcdProcess, made: dict[str, pki.Issued], key: bytes) -> None:
    """etcd forgets a token (unused for --auth-token-ttl seconds; here: at once): the next
    unary call, watch or lease grant logs in again once and succeeds, also when many
    calls race."""
    process = auth_etcd

    async def body(conn: Etcd) -> None:
        await conn.txn([], [Put(key + b"a", b"1")])
        logins = forget_tokens(process)
        rev = (await conn.txn([], [Put(key + b"b", b"2")])).revision
        assert authentications(process) == logins + 1
        logins = forget_tokens(process)
        stream = conn.watch(key, rev)
        assert [e.kv.key for e in await asyncio.wait_for(anext(stream), 5)] == [key + b"b"]
        await stream.aclose()  # type: ignore[attr-defined]
        assert authentications(process) == logins + 1
        logins = forget_tokens(process)
        lease, _ = await conn.grant(10)
        assert await conn.keepalive(lease) > 0
        assert authentications(process) == logins + 1
        logins = forget_tokens(process)
        got = await asyncio.gather(*(conn.get(key + b"a") for _ in range(10)))
        assert all(kv is not None and kv.value == b"1" for kv in got)
        assert authentications(process) == logins + 1

    on(process.endpoint, baton_auth(made), body)
