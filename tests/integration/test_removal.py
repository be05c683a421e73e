"""DeleteTask (`baton task delete`): a task that never ran, or is stuck being created, or
(asked to discard its history) a cancelled one, is removed with every key that names it,
on a real etcd; anything else is refused and left as it was."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import blake3
import pytest
from registry_fixtures import on_etcd
from test_cli import invoke, ok_json, one_error_line

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import KV, Etcd, Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.verbs import removal
from baton_relay.registry.verbs.removal import Removal

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

FAST = {"base_seconds": 0.001}


def entries(*ids: str, **fields: Any) -> list[dict[str, Any]]:
    return [{"file_id": i, "path": i, **fields} for i in ids]


class Store:
    """The test's keys in etcd, read and written straight (not through the registry)."""

    def __init__(self, registry: Any) -> None:
        self.endpoint = registry.etcd
        self.prefix = registry.prefix
        self.keys = Keys(registry.prefix)

    def _run(self, work: Any) -> Any:
        return on_etcd(self.endpoint, work)

    def all(self) -> dict[bytes, KV]:
        """Every key under the test's prefix, read a page at a time."""
        async def work(etcd: Etcd) -> dict[bytes, KV]:
            return {kv.key: kv async for kv in etcd.scan(self.prefix.encode(), page=100)}

        return dict(self._run(work))

    def naming(self, task_id: str) -> dict[bytes, int]:
        """Keys with a path segment equal to ``task_id``, and their mod revisions."""
        return {k: kv.mod_revision for k, kv in self.all().items()
                if task_id in k[len(self.prefix):].decode().split("/")}

    def under(self, base: bytes) -> list[bytes]:
        return sorted(k for k in self.all() if k.startswith(base))

    def set_status(self, task_id: str, status: str) -> None:
        """Rewrite a task header's status, as an interrupted call would have left it."""
        key = self.keys.task(task_id)

        async def work(etcd: Etcd) -> None:
            kv = await etcd.get(key)
            assert kv is not None
            header = json.loads(kv.value)
            header["status"] = status
            await etcd.txn([], [Put(key, json.dumps(header).encode())])

        self._run(work)

    def status(self, task_id: str) -> str | None:
        kv = self.all().get(self.keys.task(task_id))
        return None if kv is None else str(json.loads(kv.value)["status"])


@pytest.fixture
def store(registry: Any) -> Store:
    return Store(registry)


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny pages and chunks, so a small task takes many reads and transactions."""
    monkeypatch.setattr(removal, "LIST_PAGE", 7)
    monkeypatch.setattr(removal, "DELETE_CHUNK", 5)
    monkeypatch.setattr(removal, "CLAIM_CHUNK", 2)
    monkeypatch.setattr(removal, "PARALLEL", 3)


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def slots_of(store: Store, session_id: int) -> list[bytes]:
    return store.under(store.keys.slots(session_id))


# --- a stuck creation -----------------------------------------------------------------


def test_a_task_stuck_creating_is_removed_with_every_key(
        client: Client, store: Store, small_pages: None) -> None:
    """A task left `creating` is removed; no key names it after; a task t10 is untouched."""
    client.operator.create_task({"task_id": "t1", "consumers": ["g"],
                                 "entries": entries(*(f"f{i:02d}" for i in range(40)))})
    client.operator.create_task({"task_id": "t10", "entries": entries("f00", "f01")})
    store.set_status("t1", "creating")
    before = store.naming("t1")
    other = store.naming("t10")
    assert len(before) == 1 + 40 * 3  # header; per entry: the entry, ready and open keys

    resp = client.operator.delete_task("t1", "stuck after an etcd outage")

    assert resp.keys_removed == len(before)
    assert dict(resp.removed) == {"header": 1, "entries": 40, "ready": 40, "open": 40}
    assert resp.task.status == pb.TASK_STATUS_DELETING
    assert "stuck after an etcd outage" in resp.task.status_reason
    assert store.naming("t1") == {}
    assert store.naming("t10") == other
    with pytest.raises(errors.NotFound):
        client.operator.get_task("t1")
    assert [t.spec.task_id for t in client.operator.list_tasks()] == ["t10"]


def test_a_creation_stops_writing_once_its_task_is_marked_deleting(
        client: Client, store: Store) -> None:
    """CreateTask of a task being deleted is refused and writes no entry chunk."""
    manifest = {"task_id": "t1", "entries": entries("a", "b")}
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    store.set_status("t1", "creating")
    client.operator.delete_task("t1")
    client.operator.create_task(manifest)  # created again, as a fresh task
    store.set_status("t1", "deleting")  # a delete under way again
    before = store.naming("t1")
    with pytest.raises(errors.IllegalTransition, match="being deleted"):
        client.operator.create_task(manifest)
    assert store.naming("t1") == before


def test_a_stuck_task_can_be_created_again_after_removal(client: Client, store: Store) -> None:
    """Once removed, the same task id can be created afresh and handed out."""
    manifest = {"task_id": "t1", "entries": entries("a", "b")}
    client.operator.create_task(manifest)
    store.set_status("t1", "creating")
    client.operator.delete_task("t1")
    task, created = client.operator.create_task(manifest)
    assert created and task.status == pb.TASK_STATUS_ACTIVE
    with client.open_session("p", ttl=10) as s:
        assert client.claim("t1", session=s).file_id == "a"


# --- a cancelled task with claims, slots and a journal ----------------------------------


def test_a_cancelled_task_leaves_no_key_and_frees_the_slots(
        client: Client, store: Store, small_pages: None) -> None:
    """Create, claim, commit, consume, fail, cancel, rm: nothing of it is left; slots free."""
    client.operator.create_task({"task_id": "t1", "consumers": ["g"], "backoff": FAST,
                                 "entries": entries("a", "b", "c", "d", "e")})
    with client.open_session("p", ttl=30, slots=3) as p, \
            client.open_session("c", ttl=30, slots=2) as c:
        done = client.claim("t1", "a", session=p)
        client.commit("t1", "a", done.token, 1, digest(b"x"))
        client.watcher.report("t1", "a", 1, digest(b"x"))
        failed = client.claim("t1", "b", session=p)
        client.fail("t1", "b", failed.token, "disk full")
        client.claim("t1", "c", session=p)
        client.claim("t1", "d", session=p)
        client.consume("t1", "g", session=c)
        assert len(slots_of(store, p.session_id)) == 2 and slots_of(store, c.session_id)
        assert store.under(store.keys.journal_all("t1"))

        client.operator.cancel_task("t1", "wrong input")
        resp = client.operator.delete_task("t1", discard_history=True)

        assert store.naming("t1") == {}
        assert resp.removed["journal"] >= 6 and resp.removed["entries"] == 5
        assert slots_of(store, p.session_id) == slots_of(store, c.session_id) == []
        assert store.under(store.keys.agent(p.session_id))  # the sessions live on


def test_claims_left_by_an_interrupted_cancel_are_revoked_with_their_slots(
        client: Client, store: Store, small_pages: None) -> None:
    """Live claims, consume claims and slots of a cancelled task go; another task's stay."""
    client.operator.create_task({"task_id": "t1", "consumers": ["g"],
                                 "entries": entries("a", "b", "c", "d")})
    client.operator.create_task({"task_id": "t10", "entries": entries("x", "y", "z")})
    with client.open_session("p", ttl=30, slots=4) as p, \
            client.open_session("c", ttl=30, slots=2) as c:
        for file_id in ("a", "b"):
            claim = client.claim("t1", file_id, session=p)
            client.commit("t1", file_id, claim.token, 1, digest(b"x"))
            client.watcher.report("t1", file_id, 1, digest(b"x"))
        client.consume("t1", "g", "a", session=c)
        client.consume("t1", "g", "b", session=c)
        live = client.claim("t1", "c", session=p)
        client.claim("t1", "d", session=p)
        kept = client.claim("t10", "x", session=p)
        # The cancel applied, but the registry stopped before revoking the claims.
        store.set_status("t1", "cancelled")
        other = store.naming("t10")

        resp = client.operator.delete_task("t1", discard_history=True)

        assert resp.removed["claims"] == 4 and resp.removed["inflight"] == 4
        assert resp.removed["slots"] == 4
        assert store.naming("t1") == {}
        assert store.naming("t10") == other
        assert len(slots_of(store, p.session_id)) == 1  # t10/x's
        assert slots_of(store, c.session_id) == []
        with pytest.raises(errors.NotFound):
            client.commit("t1", "c", live.token, 1, digest(b"x"))
        # p's three freed slots take three more claims.
        assert client.claim("t10", "y", session=p).file_id == "y"
        assert client.claim("t10", "z", session=p).file_id == "z"
        assert client.commit("t10", "x", kept.token, 1,
                             digest(b"x")).state == pb.ENTRY_STATE_WRITTEN


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize("discard_history", [False, True])
@pytest.mark.parametrize("status", ["active", "paused", "completed"])
def test_a_task_that_ran_and_is_not_cancelled_is_refused_and_unchanged(
        client: Client, store: Store, status: str, discard_history: bool) -> None:
    """An active, paused or completed task that ran is refused (cancel it first), even
    when its history may go; no key changes."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    with client.open_session("p", ttl=30, slots=2) as s:
        client.claim("t1", "a", session=s)
        if status == "paused":
            client.operator.pause_task("t1")
        if status == "completed":
            store.set_status("t1", "completed")
        before = store.all()
        with pytest.raises(errors.IllegalTransition) as refused:
            client.operator.delete_task("t1", discard_history=discard_history)
        assert f"it is {status}" in str(refused.value) and "cancel it first" in str(refused.value)
        assert store.all() == before


def test_a_cancelled_task_that_ran_is_kept_unless_its_history_may_go(
        client: Client, store: Store) -> None:
    """A cancelled task with history is refused, naming the entry that ran, and left as it
    was; with discard_history it is deleted."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    with client.open_session("p", ttl=30) as s:
        claim = client.claim("t1", "b", session=s)
        client.fail("t1", "b", claim.token, "disk full")
    client.operator.cancel_task("t1")
    before = store.all()
    with pytest.raises(errors.IllegalTransition) as refused:
        client.operator.delete_task("t1")
    assert str(refused.value) == (
        "cannot delete task 't1': it is cancelled and has history (entry 'b' ran; "
        "`baton log t1` shows it): a task that ran is kept for audit, not deleted; once "
        "finished it is archived out of etcd (`baton task archive t1`); --discard-history "
        "deletes a cancelled task with its journal")
    assert store.all() == before
    assert client.operator.delete_task("t1", discard_history=True).removed["journal"] == 2
    assert store.naming("t1") == {}


@pytest.mark.parametrize("status", ["active", "paused", "cancelled"])
def test_a_task_that_never_ran_is_deleted_with_every_key(
        client: Client, store: Store, small_pages: None, status: str) -> None:
    """No entry of it was ever claimed: deleted whatever its status; no key names it
    after, under any prefix; another task is untouched."""
    client.operator.create_task({"task_id": "t1", "consumers": ["g"],
                                 "entries": [*entries(*(f"f{i:02d}" for i in range(12))),
                                    {"file_id": "late", "path": "late",
                                     "depends_on": ["f00"]}]})
    client.operator.create_task({"task_id": "t10", "entries": entries("f00")})
    if status == "paused":
        client.operator.pause_task("t1")
    if status == "cancelled":
        client.operator.cancel_task("t1")
    other = store.naming("t10")

    resp = client.operator.delete_task("t1", "created by mistake")

    assert resp.removed["header"] == 1 and resp.removed["entries"] == 13
    assert "journal" not in resp.removed
    assert store.naming("t1") == {}
    assert store.naming("t10") == other
    with pytest.raises(errors.NotFound):
        client.operator.get_task("t1")


def test_a_claim_that_commits_first_makes_the_delete_refused(
        client: Client, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim committing between the delete's look at the journal and its mark wins:
    the delete, planned again, finds the history and is refused; the claim stands."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    real = Removal._mark_plan
    claims: list[Any] = []
    session = client.open_session("p", ttl=30)

    def racing(self: Removal, req: pb.DeleteTaskRequest) -> Any:
        plan = real(self, req)

        async def claim_first(txn: Any) -> Any:
            task = await plan(txn)
            if not claims:  # off the registry's loop, which serves the claim
                claims.append(await asyncio.to_thread(client.claim, "t1", "a",
                                                      session=session))
            return task

        return claim_first

    monkeypatch.setattr(Removal, "_mark_plan", racing)
    with session:
        with pytest.raises(errors.IllegalTransition, match="has history"):
            client.operator.delete_task("t1")
        assert claims and store.status("t1") == "active"
        assert client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_WRITING


def test_a_claim_racing_the_delete_loses_once_the_task_is_marked(
        client: Client, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim planned on the active task, the delete applied before it commits: the
    claim is refused and nothing of the task is left."""
    from baton_relay.registry.verbs.producers import Producers

    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    real = Producers._session
    deleted: list[pb.DeleteTaskResponse] = []

    async def delete_meanwhile(self: Producers, txn: Any, *args: Any) -> Any:
        slots = await real(self, txn, *args)
        if not deleted:
            deleted.append(await asyncio.to_thread(client.operator.delete_task, "t1"))
        return slots

    monkeypatch.setattr(Producers, "_session", delete_meanwhile)
    with client.open_session("p", ttl=30) as s, \
            pytest.raises((errors.TaskNotActive, errors.NotFound)):
        client.claim("t1", "a", session=s)
    assert deleted and deleted[0].removed["entries"] == 2
    assert store.naming("t1") == {}


def test_an_unknown_task_is_not_found(client: Client) -> None:
    """Deleting a task that does not exist is NotFound."""
    with pytest.raises(errors.NotFound):
        client.operator.delete_task("nope")


# --- twice, and interrupted -------------------------------------------------------------


def test_delete_twice_replays_then_finds_nothing(client: Client, store: Store) -> None:
    """A retried delete (same request id) gets the first reply; a new one is NotFound."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a")})
    client.operator.cancel_task("t1")
    first = client._call("DeleteTask", pb.DeleteTaskRequest(task_id="t1", request_id="rm-1"))
    again = client._call("DeleteTask", pb.DeleteTaskRequest(task_id="t1", request_id="rm-1"))
    assert again == first and first.keys_removed > 0
    with pytest.raises(errors.NotFound):
        client.operator.delete_task("t1")
    assert store.naming("t1") == {}


def test_an_interrupted_delete_is_finished_by_the_next(
        client: Client, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd lost mid-way: the task stays `deleting` (no claims, no re-create); rm finishes."""
    manifest = {"task_id": "t1", "entries": entries("a", "b", "c")}
    client.operator.create_task(manifest)
    with client.open_session("p", ttl=30) as s:
        claim = client.claim("t1", "a", session=s)
        client.commit("t1", "a", claim.token, 1, digest(b"x"))
    client.operator.cancel_task("t1")
    journal = store.keys.journal_all("t1")
    down = threading.Event()
    down.set()
    sweep = Removal._sweep

    async def failing(self: Removal, prefix: bytes, *args: Any) -> Any:
        if down.is_set() and prefix == journal:
            raise errors.Unavailable("etcd unavailable: connection refused")
        return await sweep(self, prefix, *args)

    monkeypatch.setattr(Removal, "_sweep", failing)
    with pytest.raises(errors.Unavailable):
        client.operator.delete_task("t1", discard_history=True)

    assert store.status("t1") == "deleting"
    assert store.under(store.keys.entries("t1")) == [] and store.under(journal)
    assert [t.status for t in client.operator.list_tasks()] == [pb.TASK_STATUS_DELETING]
    with pytest.raises(errors.IllegalTransition, match="being deleted"):
        client.operator.create_task(manifest)
    assert store.status("t1") == "deleting" and store.under(store.keys.entries("t1")) == []
    with client.open_session("p", ttl=30) as s, pytest.raises(errors.TaskNotActive):
        client.claim("t1", session=s)
    with pytest.raises(errors.IllegalTransition):
        client.operator.cancel_task("t1")

    down.clear()
    resp = client.operator.delete_task("t1", discard_history=True)
    assert resp.removed["header"] == 1 and resp.removed["journal"] >= 2
    assert store.naming("t1") == {}


# --- the command line -----------------------------------------------------------------


def test_cli_task_delete(registry: Any, client: Client, store: Store) -> None:
    """`task delete --yes`: a task that ran is exit 4 until cancelled and its history
    discarded; unknown is exit 5, also through the old name `task rm`."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    with client.open_session("p", ttl=30) as s:
        client.claim("t1", "a", session=s)
        active = invoke(registry, "task", "delete", "t1", "--yes")
        assert active.exit_code == 4 and "cancel it first" in one_error_line(active.stderr)
        client.operator.cancel_task("t1")
    kept = invoke(registry, "task", "delete", "t1", "--yes")
    assert kept.exit_code == 4 and "--discard-history" in one_error_line(kept.stderr)
    done = invoke(registry, "task", "delete", "t1", "--yes", "--discard-history",
                  "--reason", "wrong batch")
    assert done.exit_code == 0, done.output
    # cancel already took the claims and the claimable indexes
    assert done.stdout.strip() == ("removed task t1: 6 keys (header 1, entries 2, journal 1, "
                                   "open 2)")
    assert store.naming("t1") == {}
    gone = invoke(registry, "task", "rm", "t1", "--yes")
    assert gone.exit_code == 5 and "t1" in one_error_line(gone.stderr)


def test_cli_task_delete_of_a_task_that_never_ran(registry: Any, client: Client,
                                                  store: Store) -> None:
    """An active task nobody claimed from is deleted as it is, no cancel needed."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a", "b")})
    done = invoke(registry, "task", "delete", "t1", "-y")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == ("removed task t1: 7 keys (header 1, entries 2, ready 2, "
                                   "open 2)")
    assert store.naming("t1") == {}


def test_cli_task_delete_json_output(registry: Any, client: Client) -> None:
    """`task delete -o json` prints the reply: keys removed, by kind, and the last header."""
    client.operator.create_task({"task_id": "t1", "entries": entries("a")})
    client.operator.cancel_task("t1")
    data = ok_json(invoke(registry, "task", "delete", "t1", "-y", "-o", "json"))
    assert data["keys_removed"] == 3 and data["removed"] == {"header": 1, "entries": 1,
                                                              "open": 1}
    assert data["task"]["status"] == "deleting"


def test_cli_task_delete_asks_on_a_terminal(
        registry: Any, client: Client, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal, delete asks first: `n` removes nothing (exit 1), `y` removes it."""
    from baton_relay.client.cli import tasks as task_commands

    monkeypatch.setattr(task_commands, "interactive", lambda: True)
    client.operator.create_task({"task_id": "t1", "entries": entries("a")})
    client.operator.cancel_task("t1")
    declined = invoke(registry, "task", "delete", "t1", stdin="n\n")
    assert declined.exit_code == 1 and store.status("t1") == "cancelled"
    accepted = invoke(registry, "task", "delete", "t1", stdin="y\n")
    assert accepted.exit_code == 0 and "removed task t1" in accepted.stdout
    assert store.naming("t1") == {}


def test_entry_chunks_need_the_header_still_creating(etcd: Any, prefix: str) -> None:
    """A creation whose header stopped being `creating` writes no more entries."""
    from baton_relay.registry.records.manifest import validate
    from baton_relay.registry.rules.core import Core
    from baton_relay.registry.verbs.tasks import Tasks

    spec = pb.TaskSpec(task_id="t", entries=[pb.EntrySpec(file_id=f"e{i}", path=f"e{i}")
                                             for i in range(5)])

    async def body() -> list[bytes]:
        client = Etcd(etcd.endpoint)
        await client.connect()
        core = Core(client, Keys(prefix), "/staging", view=False)
        try:
            tasks = Tasks(core)
            valid = validate(spec)
            header = json.dumps({"task_id": "t", "status": "deleting", "staging_dir": "/s",
                                 "entry_count": 5, "manifest_digest": valid.digest,
                                 "consumers": ["default"], "max_retries": 3}).encode()
            await client.txn([], [Put(Keys(prefix).task("t"), header)])
            with pytest.raises(errors.IllegalTransition, match="creation was stopped"):
                await tasks._write_entries("t", [valid.entries[:3], valid.entries[3:]])
            return [kv.key async for kv in client.scan(Keys(prefix).entries("t"))]
        finally:
            await core.stop()
            await client.close()

    assert asyncio.run(body()) == []
