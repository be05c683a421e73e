"""Who may do what: mutual TLS, the role table, identities owning sessions and claims,
request ids scoped to their caller, tokens for operators only, task access rules.

Every case runs against a real registry serving mutual TLS, with certificates from
a CA made for the test session (``kernel.pki``), on a real etcd.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd

from baton_relay.client import Client
from baton_relay.kernel import errors, pki
from baton_relay.kernel.contract import shard_of
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.records.identity import (
    AUDIENCE,
    AUDIENCE_ROLES,
    EXCEPTIONS,
    POLICY,
    SERVICE_AUDIENCE,
)
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

DIGEST = "ab" * 32
#: every method of the three services, by name
METHODS = {m.name: m for service in pb.DESCRIPTOR.services_by_name.values()
           for m in service.methods}


# --- certificates -----------------------------------------------------------------


class PKI:
    """A CA and one identity per role (and some that should get nowhere)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        pki.create_ca(root)
        self.server = pki.issue(root, "registry", root, server_names=["localhost", "127.0.0.1"])
        self.ids: dict[str, pki.Issued] = {
            "operator": pki.issue(root, "op", root, roles=["operator"]),
            "agent": pki.issue(root, "ag", root, roles=["agent"]),
            "agent2": pki.issue(root, "ag2", root, roles=["agent"]),
            "watcher": pki.issue(root, "wa", root, roles=["watcher"]),
            # another watcher's certificate: a watcher, but not the one that registered
            "watcher2": pki.issue(root, "wa2", root, roles=["watcher"]),
            "norole": pki.issue(root, "nobody", root),
            # an operator as a person holds one: named after her, not after the role
            "ops-carol": pki.issue(root, "ops-carol", root, roles=["operator"]),
        }
        foreign = root / "foreign"
        pki.create_ca(foreign, name="Some other CA")
        self.ids["foreign"] = pki.issue(foreign, "ag", foreign, roles=["agent", "operator"])

    @property
    def ca(self) -> str:
        return str(self.root / "ca.crt")

    def settings(self) -> dict[str, str]:
        return {"tls_ca": self.ca, "tls_cert": str(self.server.cert),
                "tls_key": str(self.server.key)}

    def client(self, registry: RegistryHandle, who: str) -> Client:
        if who == "nocert":
            return Client(registry.address, ca=self.ca, cert="", key="", timeout=5,
                          retry=TEST_RETRY)
        issued = self.ids[who]
        return Client(registry.address, ca=self.ca, cert=str(issued.cert),
                      key=str(issued.key), timeout=5, retry=TEST_RETRY)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure(registry_factory: Callable[..., RegistryHandle], certs: PKI) -> RegistryHandle:
    """A registry serving mutual TLS."""
    return registry_factory(**certs.settings())


@pytest.fixture
def clients(secure: RegistryHandle, certs: PKI) -> Iterator[dict[str, Client]]:
    made = {who: certs.client(secure, who) for who in [*certs.ids, "nocert"]}
    yield made
    for c in made.values():
        c.close()


def in_flight(registry: RegistryHandle) -> list[bytes]:
    """The keys of claims the reaper has yet to settle (``inflight/``, a claim's twin)."""
    base = Keys(registry.prefix).inflight_all()

    async def read(etcd: Etcd) -> list[bytes]:
        return [kv.key async for kv in etcd.scan(base, keys_only=True)]

    return on_etcd(registry.etcd, read)


def snapshot(registry: RegistryHandle) -> dict[bytes, bytes]:
    """Every key under the registry's prefix but request records (which a refused call
    never writes either, but a permitted one in the same test may)."""

    async def read(etcd: Etcd) -> dict[bytes, bytes]:
        return {kv.key: kv.value async for kv in etcd.scan(registry.prefix.encode())
                if b"/requests/" not in kv.key}

    return on_etcd(registry.etcd, read)


def manifest(task: str = "t", n: int = 3, **extra: Any) -> dict[str, Any]:
    return {"task_id": task, "entries": [{"file_id": f"f{i}", "path": f"d/f{i}"}
                                         for i in range(n)], **extra}


# --- the table ----------------------------------------------------------------------


def test_every_method_is_in_the_table() -> None:
    """The access table names every method of the three services, and nothing else."""
    assert set(POLICY) == set(METHODS)
    assert {s.name for s in pb.DESCRIPTOR.services_by_name.values()} == set(SERVICE_AUDIENCE)


def test_access_follows_the_audience_with_listed_exceptions() -> None:
    """Each method serves the audience of its service, whose role it allows; any other
    role it allows is in the exceptions table, which never restates the audience's role."""
    assert set(AUDIENCE) == set(METHODS)
    for name, method in METHODS.items():
        assert AUDIENCE[name] == SERVICE_AUDIENCE[method.containing_service.name], name
    assert set(EXCEPTIONS) <= set(AUDIENCE)
    for method, audience in AUDIENCE.items():
        own = AUDIENCE_ROLES[audience]
        extra = EXCEPTIONS.get(method, frozenset())
        assert not own & extra, f"{method}: the exception restates its audience"
        assert POLICY[method] == own | extra, method


def _request(method: str, world: dict[str, Any]) -> Any:
    """A request for ``method`` that would do something real if it were let in."""
    t, f, sid, tok = world["task"], world["file"], world["session"], world["token"]
    return {
        "CreateTask": pb.CreateTaskRequest(spec=_spec(manifest("other"))),
        "GetTask": pb.GetTaskRequest(task_id=t),
        "ListTasks": pb.ListTasksRequest(),
        "GetEntry": pb.GetEntryRequest(task_id=t, file_id=f),
        "ListEntries": pb.ListEntriesRequest(task_id=t),
        "PauseTask": pb.PauseTaskRequest(task_id=t),
        "ResumeTask": pb.ResumeTaskRequest(task_id=t),
        "CancelTask": pb.CancelTaskRequest(task_id=t),
        "DeleteTask": pb.DeleteTaskRequest(task_id=t),
        "ArchiveTask": pb.ArchiveTaskRequest(task_id=t),
        "Requeue": pb.RequeueRequest(task_id=t, file_id="f2"),
        "Journal": pb.JournalRequest(task_id=t),
        "Explain": pb.ExplainRequest(task_id=t, file_id=f),
        "ListAgents": pb.ListAgentsRequest(),
        "RevokeSession": pb.RevokeSessionRequest(session_id=sid, reason="matrix"),
        "RotateLease": pb.RotateLeaseRequest(session_id=sid),
        "DrainHost": pb.DrainHostRequest(host="no-such-host", deadline_seconds=60),
        "UndrainHost": pb.UndrainHostRequest(host="no-such-host"),
        "OpenSession": pb.OpenSessionRequest(agent="x", ttl=30),
        "KeepAlive": pb.KeepAliveRequest(session_id=sid),
        "Session": pb.SessionRequest(open=pb.OpenSessionRequest(agent="x", ttl=30)),
        "CloseSession": pb.CloseSessionRequest(session_id=sid),
        "Claim": pb.ClaimRequest(task_id=t, session_id=sid),
        "ClaimBatch": pb.ClaimBatchRequest(task_id=t, session_id=sid, max=2),
        "Commit": pb.CommitRequest(task_id=t, file_id=f, token=tok, size=1, digest=DIGEST),
        "CommitBatch": pb.CommitBatchRequest(commits=[pb.CommitRequest(
            task_id=t, file_id=f, token=tok, size=1, digest=DIGEST)]),
        "Fail": pb.FailRequest(task_id=t, file_id=f, token=tok),
        "Checkpoint": pb.CheckpointRequest(task_id=t, file_id=f, token=tok, progress=0.5),
        "ReportVerification": pb.ReportVerificationRequest(task_id=t, file_id=f, size=1,
                                                    digest=DIGEST),
        "ReportVerificationBatch": pb.ReportVerificationBatchRequest(reports=[
            pb.ReportVerificationRequest(task_id=t, file_id=f, size=1, digest=DIGEST)]),
        "ReportProblem": pb.ReportProblemRequest(task_id=t, file_id=f,
                                                 kind=pb.ReportProblemRequest.KIND_MISSING,
                                          reason="forged"),
        "RemoveStaged": pb.RemoveStagedRequest(task_id=t, file_id=f, size=1, digest=DIGEST),
        "Consume": pb.ConsumeRequest(task_id=t, group="default", session_id=sid),
        "ConsumeBatch": pb.ConsumeBatchRequest(task_id=t, group="default", session_id=sid,
                                               max=2),
        "Ack": pb.AckRequest(task_id=t, file_id=f, group="default", token=tok),
        "Nack": pb.NackRequest(task_id=t, file_id=f, group="default", token=tok),
        "AckBatch": pb.AckBatchRequest(acks=[pb.AckRequest(task_id=t, file_id=f,
                                                           group="default", token=tok)]),
        "Watch": pb.WatchRequest(task_id=t),
        "WatchTasks": pb.WatchTasksRequest(),
        "RegisterWatcher": pb.RegisterWatcherRequest(root="/r", ttl=5),
        "WatcherHeartbeat": pb.WatcherHeartbeatRequest(watcher_id="0123456789abcdef"),
        "ReleaseShard": pb.ReleaseShardRequest(watcher_id="0123456789abcdef", shard=0),
        "ListWatchers": pb.ListWatchersRequest(),
        "ListShards": pb.ListShardsRequest(),
        "MoveShard": pb.MoveShardRequest(shard=0, to_watcher="0123456789abcdef"),
        "Rebalance": pb.RebalanceRequest(),
        "DrainWatcher": pb.DrainWatcherRequest(watcher_id="0123456789abcdef"),
        "SetPool": pb.SetPoolRequest(name="matrix", limit=1),
        "ListPools": pb.ListPoolsRequest(),
        "DeletePool": pb.DeletePoolRequest(name="matrix"),
    }[method]


def _spec(data: dict[str, Any]) -> pb.TaskSpec:
    from baton_relay.client import parse_manifest

    return parse_manifest(data)


def _call(client: Client, method: str, request: Any) -> None:
    """One call of ``method``; a stream is read until its first message."""
    if METHODS[method].client_streaming:
        stream = client._channel.stream_stream(
            f"/{METHODS[method].containing_service.full_name}/{method}",
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString)
        replies = stream(iter([request]), timeout=5)
        try:
            next(iter(replies))
        except grpc.RpcError as e:
            from baton_relay.client._wire import raise_from_rpc

            raise raise_from_rpc(e) from None
        finally:
            replies.cancel()
        return
    if METHODS[method].server_streaming:
        call = getattr(client._stub, method)(request, timeout=5)
        try:
            next(iter(call))
        except grpc.RpcError as e:
            from baton_relay.client._wire import raise_from_rpc as _raise_from_rpc

            raise _raise_from_rpc(e) from None
        finally:
            call.cancel()
        return
    client._call(method, request)


#: methods that end what the matrix's later calls act on: called last, in this order
DESTRUCTIVE = ("RevokeSession", "CloseSession", "CancelTask", "DeleteTask")


@pytest.mark.parametrize("who", ["operator", "agent", "watcher", "norole", "foreign",
                                 "nocert"])
def test_role_matrix(secure: RegistryHandle, clients: dict[str, Client], who: str,
                     certs: PKI, wait_for: Callable[..., None]) -> None:
    """Every method called by every identity: what the table does not allow is refused
    (PERMISSION_DENIED, or no connection at all without a certificate of the CA) and
    changes nothing; what it allows gets past the table."""
    owner = clients["agent"]
    owner.operator.create_task(manifest())
    session = owner.open_session("owner", ttl=30)
    claim = owner.claim("t", "f0", session=session)
    world = {"task": "t", "file": "f0", "session": session.session_id, "token": claim.token}
    roles = {"operator": {"operator"}, "agent": {"agent"}, "watcher": {"watcher"}}.get(who,
                                                                                       set())
    caller = clients[who]
    for method in sorted(POLICY):
        if method in DESTRUCTIVE:
            continue  # destructive when allowed: checked below, last
        before = snapshot(secure)
        try:
            _call(caller, method, _request(method, world))
        except errors.NotShardOwner:
            pass  # let in by the table; a report from no shard's owner is not believed
        except errors.PermissionDenied:
            assert not POLICY[method] & roles, f"{who} refused {method}, which it may call"
            assert snapshot(secure) == before, f"refused {method} by {who} changed state"
            continue
        except errors.Unavailable:
            assert who in ("foreign", "nocert"), f"{who}: {method} could not connect"
            assert snapshot(secure) == before
            continue
        except errors.BatonError:
            pass  # let in by the table; refused by the state machine (tokens, states)
        assert POLICY[method] & roles, f"{who} got into {method}"
    for method in DESTRUCTIVE:
        before = snapshot(secure)
        try:
            _call(caller, method, _request(method, world))
        except (errors.PermissionDenied, errors.Unavailable):
            assert not POLICY[method] & roles or who not in ("operator", "agent")
            assert snapshot(secure) == before
            continue
        except errors.BatonError:
            pass
        assert POLICY[method] & roles, f"{who} got into {method}"
        if method in ("RevokeSession", "CloseSession"):
            # The session's claims go with it; the registry's reaper then returns their
            # entries in the background: that must be over before the next snapshot.
            wait_for(lambda: not in_flight(secure), what="the session's claims returned")


def test_refusal_is_exit_7(secure: RegistryHandle, certs: PKI, tmp_path: Path) -> None:
    """The CLI reports a refused call as exit status 7 and says why."""
    import subprocess
    import sys

    ids = certs.ids["watcher"]
    env = {"BATON_REGISTRY": secure.address, "BATON_CA": certs.ca,
           "BATON_CERT": str(ids.cert), "BATON_KEY": str(ids.key), "PATH": "/usr/bin:/bin"}
    (tmp_path / "m.json").write_text('{"task_id": "x", "entries": [{"file_id": "a", '
                                     '"path": "a"}]}')
    done = subprocess.run([sys.executable, "-m", "baton_relay.client.cli", "task", "create",
                           str(tmp_path / "m.json")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 7, done.stderr
    assert "CreateTask is not allowed to wa (watcher)" in done.stderr


# --- the attacks of issue 9, replayed -----------------------------------------------------


def test_a_stranger_cannot_use_another_agents_token(clients: dict[str, Client],
                                                    secure: RegistryHandle) -> None:
    """Knowing a claim's token and session is not enough: commit, fail, keepalive and
    close from another identity are refused, and the claim is untouched."""
    owner, stranger = clients["agent"], clients["agent2"]
    owner.operator.create_task(manifest())
    s = owner.open_session("owner", ttl=30)
    claim = owner.claim("t", "f0", session=s)
    before = snapshot(secure)
    for attempt in (
        lambda: stranger.commit("t", "f0", claim.token, 1, DIGEST),
        lambda: stranger.commit("t", "f0", claim.token, 1, DIGEST, session=s.session_id),
        lambda: stranger.fail("t", "f0", claim.token, "sabotage"),
        lambda: stranger.keepalive(s.session_id),
        lambda: stranger.close_session(s.session_id),
        lambda: stranger.claim("t", "f1", session=s.session_id),
    ):
        with pytest.raises(errors.PermissionDenied):
            attempt()
    assert snapshot(secure) == before
    assert owner.operator.get_entry("t", "f0").state == pb.ENTRY_STATE_WRITING
    # the owner still can, and naming the wrong session is refused even for it
    s2 = owner.open_session("owner-2", ttl=30)
    with pytest.raises(errors.PermissionDenied):
        owner.commit("t", "f0", claim.token, 1, DIGEST, session=s2)
    assert owner.commit("t", "f0", claim.token, 1, DIGEST,
                        session=s).state == pb.ENTRY_STATE_WRITTEN


def test_only_watchers_verify(clients: dict[str, Client], secure: RegistryHandle) -> None:
    """A verification or a problem report from anyone but a watcher is refused."""
    agent = clients["agent"]
    agent.operator.create_task(manifest())
    s = agent.open_session("p", ttl=30)
    c = agent.claim("t", "f0", session=s)
    agent.commit("t", "f0", c.token, 1, DIGEST, session=s)
    before = snapshot(secure)
    for who in ("agent", "operator"):
        with pytest.raises(errors.PermissionDenied):
            clients[who].watcher.report("t", "f0", 1, DIGEST)
        with pytest.raises(errors.PermissionDenied):
            clients[who].watcher.report_problem("t", "f0", pb.ReportProblemRequest.KIND_CORRUPTED,
                                                "forged")
    assert snapshot(secure) == before
    assert clients["watcher"].watcher.report("t", "f0", 1, DIGEST).state == pb.ENTRY_STATE_VERIFIED


def test_a_watcher_is_its_certificate(clients: dict[str, Client],
                                      secure: RegistryHandle) -> None:
    """Another watcher certificate naming a registered watcher's id and its current
    epoch is refused — a verification, a report of another digest, a problem report, a
    heartbeat, a release, a registration ending it as its "previous" — and changes
    nothing; the registered watcher goes on, and the
    journal names its certificate, with the name it gave itself as a label."""
    agent = clients["agent"]
    agent.operator.create_task(manifest())
    s = agent.open_session("p", ttl=30)
    c = agent.claim("t", "f0", session=s)
    agent.commit("t", "f0", c.token, 1, DIGEST, session=s)
    reg = clients["watcher"].watcher.register_watcher(str(secure.staging), reporter="wa@host",
                                                      ttl=30)
    n = shard_of("t", reg.shard_count)
    (epoch,) = [g.epoch for g in reg.shards if g.shard == n]
    me = {"watcher_id": reg.watcher_id, "shard_epoch": epoch}
    before = snapshot(secure)
    rogue = clients["watcher2"]
    for forged in (lambda: rogue.watcher.report("t", "f0", 1, DIGEST, reporter="wa@host", **me),
                   lambda: rogue.watcher.report("t", "f0", 1, "1" * 64, **me),
                   lambda: rogue.watcher.report_problem("t", "f0",
                                                        pb.ReportProblemRequest.KIND_MISSING,
                                                        "forged", **me),
                   lambda: rogue.watcher.watcher_heartbeat(reg.watcher_id),
                   lambda: rogue.watcher.release_shard(reg.watcher_id, n, epoch),
                   lambda: rogue.watcher.register_watcher(str(secure.staging), ttl=30,
                                                          previous=reg.watcher_id)):
        with pytest.raises(errors.PermissionDenied, match="another identity"):
            forged()
    assert snapshot(secure) == before
    watcher = clients["watcher"]
    watcher.watcher.watcher_heartbeat(reg.watcher_id)
    assert watcher.watcher.report("t", "f0", 1, DIGEST, reporter="wa@host",
                          **me).state == pb.ENTRY_STATE_VERIFIED
    (verified,) = [r for r in clients["operator"].operator.journal("t",
                                                                   "f0") if r.event == "verified"]
    assert (verified.who, verified.label) == ("wa", "wa@host")


def test_only_operators_list_sessions_and_see_tokens(clients: dict[str, Client]) -> None:
    """ListAgents is an operator's; entries and journal show tokens to operators only."""
    agent, op = clients["agent"], clients["operator"]
    agent.operator.create_task(manifest())
    s = agent.open_session("p", ttl=30)
    c = agent.claim("t", "f0", session=s)
    with pytest.raises(errors.PermissionDenied):
        agent.operator.list_agents()
    assert agent.operator.get_entry("t", "f0").token == 0
    assert all(e.token == 0 for e in agent.operator.list_entries("t"))
    assert all(r.token == 0 for r in agent.operator.journal("t", "f0"))
    assert op.operator.get_entry("t", "f0").token == c.token
    assert any(r.token == c.token for r in op.operator.journal("t", "f0"))
    listed = [a for a in op.operator.list_agents() if a.session_id == s.session_id]
    assert listed and listed[0].claims[0].token == c.token


def test_operator_actions_record_the_operators_identity(
        clients: dict[str, Client], caplog: pytest.LogCaptureFixture,
        wait_for: Callable[..., None]) -> None:
    """What an operator does is recorded under her certificate's identity, never a bare
    "operator": the journal's `requeued`, `revoked` by `lease revoke` and by a drain's
    deadline name ops-carol, and the registry's log names her for task controls, lease
    rotations and undrains."""
    agent, carol = clients["agent"], clients["ops-carol"]
    agent.operator.create_task(manifest(n=4, max_retries=0))
    caplog.set_level(logging.INFO, logger="baton.registry")
    with agent.open_session("p", ttl=30) as s:
        c = agent.claim("t", "f0", session=s)
        agent.fail("t", "f0", c.token, "scanner jammed", session=s)
    assert agent.operator.get_entry("t", "f0").state == pb.ENTRY_STATE_DEAD
    carol.operator.requeue("t", "f0")
    (requeued,) = [r for r in carol.operator.journal("t", "f0") if r.event == "requeued"]
    assert requeued.who == "ops-carol"

    s = agent.open_session("p", ttl=30, keepalive=False)
    agent.claim("t", "f1", session=s)
    assert carol.operator.rotate_leases(s.session_id)
    carol.operator.revoke_sessions(s.session_id, reason="stuck")
    (revoked,) = [r for r in carol.operator.journal("t", "f1") if r.event == "revoked"]
    assert (revoked.who, revoked.reason) == ("ops-carol", "stuck")

    s = agent.open_session("p", ttl=30, keepalive=False, host="h-9")
    agent.claim("t", "f2", session=s)
    carol.operator.drain_host("h-9", deadline=1, reason="reboot")
    wait_for(lambda: agent.operator.get_entry("t", "f2").state == pb.ENTRY_STATE_PENDING,
             what="the deadline")
    (revoked,) = [r for r in carol.operator.journal("t", "f2") if r.event == "revoked"]
    assert (revoked.who, revoked.reason) == ("ops-carol", "drain deadline")
    carol.operator.undrain_host("h-9")

    carol.operator.pause_task("t", "disk swap")
    carol.operator.resume_task("t")
    carol.operator.cancel_task("t")
    logged = [r.getMessage() for r in caplog.records if r.name == "baton.registry"]
    for what in ("task t: pause by ops-carol, now paused (pause: disk swap)",
                 "task t: resume by ops-carol, now active", "task t: cancel by ops-carol",
                 "rotated by ops-carol",
                 "host h-9 undrained by ops-carol"):
        assert any(what in line for line in logged), (what, logged)
    assert not any("by operator" in line for line in logged), logged


def test_request_ids_are_scoped_to_their_caller(clients: dict[str, Client]) -> None:
    """Another identity's request id replays nothing: it is a new request of its own."""
    a, b = clients["agent"], clients["agent2"]
    a.operator.create_task(manifest())
    sa, sb = a.open_session("a", ttl=30), b.open_session("b", ttl=30)
    first = a._call("Claim", pb.ClaimRequest(task_id="t", file_id="f0",
                                             session_id=sa.session_id, request_id="same-id"))
    again = a._call("Claim", pb.ClaimRequest(task_id="t", file_id="f0",
                                             session_id=sa.session_id, request_id="same-id"))
    assert again.token == first.token  # the caller's own retry is answered as before
    other = b._call("Claim", pb.ClaimRequest(task_id="t", file_id="f1",
                                             session_id=sb.session_id, request_id="same-id"))
    assert other.entry.file_id == "f1" and other.token != first.token


def test_commit_needs_a_digest_unless_the_task_opts_out(clients: dict[str, Client]) -> None:
    """A commit without the producer's digest is refused, unless digest_optional."""
    agent = clients["agent"]
    agent.operator.create_task(manifest())
    agent.operator.create_task(manifest("loose", digest_optional=True))
    s = agent.open_session("p", ttl=30)
    c = agent.claim("t", "f0", session=s)
    with pytest.raises(errors.InvalidArgument, match="digest"):
        agent.commit("t", "f0", c.token, 1, session=s)
    assert agent.operator.get_entry("t", "f0").state == pb.ENTRY_STATE_WRITING
    c2 = agent.claim("loose", "f0", session=s)
    assert agent.commit("loose", "f0", c2.token, 1, session=s).state == pb.ENTRY_STATE_WRITTEN


# --- roles per task ---------------------------------------------------------------


def test_task_access_rules(clients: dict[str, Client], certs: PKI,
                           secure: RegistryHandle) -> None:
    """Producers per entry, per directory and per task, and consumers per group, by
    identity name: others are refused (and passed over by claim-next), explain says why."""
    a, b = clients["agent"], clients["agent2"]  # identities "ag" and "ag2"
    a.operator.create_task({
        "task_id": "acl", "consumers": ["readers"], "digest_optional": True,
        "entries": [{"file_id": "mine", "path": "raw/mine", "producers": ["ag"]},
                    {"file_id": "dir", "path": "raw/x/dir"},
                    {"file_id": "rest", "path": "top"}],
        "access": {"producers": ["ag2"],
                   "paths": [{"dir": "raw", "producers": ["ag", "zz-*"]}],
                   "groups": [{"group": "readers", "consumers": ["ag2"]}]},
    })
    sa, sb = a.open_session("a", ttl=30), b.open_session("b", ttl=30)
    with pytest.raises(errors.PermissionDenied):
        b.claim("acl", "mine", session=sb)
    with pytest.raises(errors.PermissionDenied):
        b.claim("acl", "dir", session=sb)
    with pytest.raises(errors.PermissionDenied):
        a.claim("acl", "rest", session=sa)
    assert b.claim("acl", session=sb).file_id == "rest"  # the only one ag2 may produce
    with pytest.raises(errors.NothingToClaim):
        b.claim("acl", session=sb)
    got = {c.file_id: c for c in (a.claim("acl", session=sa) for _ in range(2))}
    assert set(got) == {"mine", "dir"}
    text = b.operator.explain("acl", "mine").text
    assert "ag2 may not produce it" in text and "Group readers consumers must match ag2" in text
    # consumers of group readers: ag2 only
    for fid in ("mine", "dir"):
        a.commit("acl", fid, got[fid].token, 1, session=sa)
        clients["watcher"].watcher.report("acl", fid, 1, DIGEST)
    with pytest.raises(errors.PermissionDenied):
        a.consume("acl", "readers", session=sa)
    assert b.consume("acl", "readers", session=sb).group == "readers"


def test_reads_follow_the_tasks_access_rules(clients: dict[str, Client]) -> None:
    """A task whose rules name only ag: ag2's every read of its contents is refused,
    naming the rule, and its listings leave it out; ag, the operator and the watcher
    read it; a task without rules stays open to all. No read shows ag's token to
    anyone but an operator, explain included."""
    ag, ag2 = clients["agent"], clients["agent2"]
    ag.operator.create_task({"task_id": "private", "consumers": ["g"], "digest_optional": True,
                             "entries": [{"file_id": "f0", "path": "f0"}],
                             "access": {"producers": ["ag"],
                               "groups": [{"group": "g", "consumers": ["ag"]}]}})
    ag.operator.create_task({"task_id": "open", "digest_optional": True,
                             "entries": [{"file_id": "f0", "path": "f0"}]})
    s = ag.open_session("a", ttl=30)
    claim = ag.claim("private", "f0", session=s)
    reads = {
        "GetTask": lambda c: c.operator.get_task("private"),
        "ListEntries": lambda c: c.operator.list_entries("private"),
        "GetEntry": lambda c: c.operator.get_entry("private", "f0"),
        "Journal": lambda c: c.operator.journal("private"),
        "Journal of an entry": lambda c: c.operator.journal("private", "f0"),
        "Explain": lambda c: c.operator.explain("private", "f0"),
        "Watch": lambda c: next(iter(c.watch("private", timeout=5))),
    }
    # the task-rules dimension covers every read the access table opens beyond
    # operators: these reads, and the two listings below
    opened = {m for m, extra in EXCEPTIONS.items() if extra == {"agent", "watcher"}}
    assert {name.split()[0] for name in reads} | {"ListTasks", "WatchTasks"} == opened | {
        "Watch"}
    for name, read in reads.items():
        with pytest.raises(errors.PermissionDenied, match=r"may not read task 'private'.*ag"):
            read(ag2)
        for who in ("agent", "operator", "watcher"):
            assert read(clients[who]) is not None, (name, who)
    assert [t.spec.task_id for t in ag2.operator.list_tasks()] == ["open"]
    assert {t.spec.task_id for t in ag.operator.list_tasks()} == {"open", "private"}
    seen = [t.spec.task_id for t in itertools.islice(ag2.operator.watch_tasks(timeout=3), 2)]
    assert seen == ["open"]
    assert ag2.operator.get_task("open").spec.task_id == "open"
    # tokens: an operator's explanation names it; nobody else's reply carries it
    assert f"token {claim.token}" in clients["operator"].operator.explain("private", "f0").text
    mine = ag.operator.explain("private", "f0")
    assert "token" not in mine.text and mine.entry.token == 0
    assert ag.operator.get_entry("private", "f0").token == 0
    assert all(r.token == 0 for r in ag.operator.journal("private", "f0"))


# --- TLS itself ----------------------------------------------------------------------


def _served_serial(address: str, certs: PKI) -> int:
    """The serial number of the certificate the registry presents to a new connection."""
    from cryptography import x509

    ctx = ssl.create_default_context(cafile=certs.ca)
    ctx.set_alpn_protocols(["h2"])
    ids = certs.ids["agent"]
    ctx.load_cert_chain(str(ids.cert), str(ids.key))
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_certificate_rotation_without_restart(
    registry_factory: Callable[..., RegistryHandle], certs: PKI, tmp_path: Path,
    wait_for: Callable[..., None],
) -> None:
    """Swapping the registry's certificate files: the next connection sees the new
    certificate, with no restart, and a Watch stream open across the swap goes on."""
    files = tmp_path / "server"
    files.mkdir()
    shutil.copy(certs.server.cert, files / "registry.crt")
    shutil.copy(certs.server.key, files / "registry.key")
    reg = registry_factory(tls_ca=certs.ca, tls_cert=str(files / "registry.crt"),
                           tls_key=str(files / "registry.key"))
    agent = certs.client(reg, "agent")
    agent.operator.create_task(manifest("rot", digest_optional=True))
    first = _served_serial(reg.address, certs)
    seen: list[pb.TaskEvent] = []
    stop = threading.Event()

    def follow() -> None:
        for event in agent.watch("rot"):
            seen.append(event)
            if stop.is_set():
                return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    wait_for(lambda: any(e.kind == pb.TaskEvent.KIND_SYNCED for e in seen), what="watch synced")
    # rotate: a new certificate for the same names, written in place atomically
    fresh = pki.issue(certs.root, "registry-next", tmp_path / "next",
                      server_names=["localhost", "127.0.0.1"])
    time.sleep(0.01)  # a different mtime even on coarse clocks
    shutil.copy(fresh.key, files / ".k")
    shutil.copy(fresh.cert, files / ".c")
    (files / ".k").replace(files / "registry.key")
    (files / ".c").replace(files / "registry.crt")
    wait_for(lambda: _served_serial(reg.address, certs) != first, what="new certificate")
    # the stream opened before the swap still delivers
    count = len(seen)
    s = agent.open_session("p", ttl=30)
    agent.claim("rot", "f0", session=s)
    wait_for(lambda: len(seen) > count, what="an event after the swap")
    stop.set()
    # and a new client connects through the new certificate
    with certs.client(reg, "operator") as op:
        assert op.operator.get_task("rot").entry_count == 3
    agent.close()


def test_plaintext_needs_insecure(registry_factory: Callable[..., RegistryHandle]) -> None:
    """No TLS files and no --insecure: the registry refuses to start, saying how."""
    with pytest.raises(errors.InvalidArgument, match="--insecure"):
        registry_factory(insecure=False)


def test_plaintext_beyond_loopback_needs_a_second_flag(
        registry_factory: Callable[..., RegistryHandle]) -> None:
    """--insecure on a non-loopback address refuses to start, naming the way out; with
    --insecure-beyond-loopback it serves; the second flag alone is refused."""
    with pytest.raises(errors.InvalidArgument, match="--insecure-beyond-loopback"):
        registry_factory(listen="0.0.0.0:0")
    handle = registry_factory(listen="0.0.0.0:0", insecure_beyond_loopback=True)
    with Client(f"127.0.0.1:{handle.port}", timeout=10, retry=TEST_RETRY) as c:
        assert c.operator.list_tasks() == []
    with pytest.raises(errors.InvalidArgument, match="goes with --insecure"):
        registry_factory(insecure=False, insecure_beyond_loopback=True)


def test_plaintext_client_of_a_tls_registry_is_told(secure: RegistryHandle) -> None:
    """A client without TLS settings gets an error that names them."""
    with Client(secure.address, ca="", cert="", key="", timeout=3, retry=TEST_RETRY) as c, \
            pytest.raises(errors.Unavailable, match="BATON_CA"):
        c.operator.list_tasks()


def test_server_settings_from_flags_and_environment() -> None:
    """The TLS and etcd credential settings load from flags and BATON_* variables."""
    from baton_relay.registry.edge.config import load_config

    cfg = load_config(["--tls-ca", "/a", "--tls-cert", "/b", "--tls-key", "/c"],
                      {"BATON_INSECURE": "0", "BATON_ETCD_CA": "/e"})
    assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key, cfg.insecure, cfg.etcd_ca) == (
        "/a", "/b", "/c", False, "/e")
    assert load_config(["--insecure"], {}).insecure is True
    assert load_config([], {"BATON_INSECURE": "yes"}).insecure is True


# --- the CLI ----------------------------------------------------------------------


def _cli(env: dict[str, str], *args: str, stdin: str | None = None) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "baton_relay.client.cli", *args], env=env,
                          input=stdin, capture_output=True, text=True, timeout=60, check=False)


def test_cert_issue_mints_a_working_identity(secure: RegistryHandle, certs: PKI,
                                             tmp_path: Path) -> None:
    """`baton cert issue` mints an identity from the CA in --pki (or beside BATON_CA) that
    the registry accepts with the roles it was given, and no others."""
    base = {"PATH": "/usr/bin:/bin", "BATON_REGISTRY": secure.address}
    done = _cli({**base, "BATON_CA": certs.ca}, "cert", "issue", "--role", "agent",
                "--name", "shell-agent", "--out", str(tmp_path / "ids"), "-o", "json")
    assert done.returncode == 0, done.stderr
    import json

    made = json.loads(done.stdout)
    assert made["roles"] == ["agent"] and Path(made["key"]).stat().st_mode & 0o077 == 0
    assert pki.identity(Path(made["cert"]).read_bytes()) == ("shell-agent", ("agent",))
    env = {**base, "BATON_CA": certs.ca, "BATON_CERT": made["cert"], "BATON_KEY": made["key"]}
    created = _cli(env, "task", "create", "-", stdin='{"task_id": "cli", "digest_optional": '
                   'false, "entries": [{"file_id": "a", "path": "a"}]}')
    assert created.returncode == 0, created.stderr
    claim = _cli(env, "claim", "cli", "a", "-o", "json")
    assert claim.returncode == 0, claim.stderr
    token = str(json.loads(claim.stdout)["token"])
    # a commit without a digest on a task that requires one: exit 2, saying so
    bare = _cli(env, "commit", "cli", "a", "--token", token, "--size", "1")
    assert bare.returncode == 2 and "--digest" in bare.stderr, bare.stderr
    # an agent is not an operator
    denied = _cli(env, "agents")
    assert denied.returncode == 7 and "ListAgents" in denied.stderr
    # and no CA to issue from is a clear error
    nothing = _cli(base, "cert", "issue", "--role", "agent", "--name", "x", "--out",
                   str(tmp_path / "x"))
    assert nothing.returncode == 2 and "--pki" in nothing.stderr


def test_a_list_of_replicas_over_tls(registry_factory: Callable[..., RegistryHandle],
                                     certs: PKI) -> None:
    """One client on a list of replicas (`ipv4:A,B`) checks their certificates against
    the first host, and fails over to the second when the first stops."""
    first, second = (registry_factory(**certs.settings()) for _ in range(2))
    ids = certs.ids["operator"]
    target = f"ipv4:{first.address},{second.address}"
    with Client(target, ca=certs.ca, cert=str(ids.cert), key=str(ids.key), timeout=5,
                retry=TEST_RETRY) as c:
        c.operator.create_task(manifest("both"))
        first.stop()
        assert c.operator.get_task("both").entry_count == 3
