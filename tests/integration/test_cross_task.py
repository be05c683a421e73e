"""Dependencies across tasks (``depends_on: ["other-task:file_id"]``): checked at
creation, released by the other task's verification, blocked by its death, and read
from the other task's archive once it is archived (real etcd, real registry)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle, produce_verified
from test_cli import invoke, ok_json

from baton_relay.client import Client, Session
from baton_relay.kernel.errors import IllegalTransition, InvalidManifest
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

Wait = Callable[..., None]


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle], tmp_path: Path
             ) -> RegistryHandle:
    return registry_factory(archive_dir=str(tmp_path / "archive"))


def released(client: Client, task_id: str, file_id: str) -> Callable[[], bool]:
    return lambda: "claimable" in client.operator.explain(task_id, file_id).text


def test_an_entry_waits_for_another_tasks_entry_and_is_released_by_its_verification(
    client: Client, session: Session, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "ocr", "entries": [{"file_id": "p1", "path": "p1"}]})
    client.operator.create_task({"task_id": "report", "entries": [
        {"file_id": "r", "path": "r", "depends_on": ["ocr:p1"]}]})
    text = client.operator.explain("report", "r").text
    assert "It waits for dependencies: ocr:p1 (pending)" in text
    with pytest.raises(IllegalTransition):
        client.claim("report", "r", session=session)
    produce_verified(client, session, "ocr", "p1")
    wait_for(released(client, "report", "r"), what="r released by ocr:p1's verification")
    assert client.claim("report", "r", session=session).file_id == "r"


def test_another_tasks_entry_must_exist_when_the_task_is_created(client: Client) -> None:
    client.operator.create_task({"task_id": "ocr", "entries": [{"file_id": "p1", "path": "p1"}]})
    for deps, message in ((["nope:p1"], "'nope:p1', which does not exist (create task 'nope'"),
                          (["ocr:p9"], "'ocr:p9', which does not exist"),
                          (["report:a"], "an entry of its own task is named by its file id"),
                          (["ocr:"], "expected TASK:FILE_ID")):
        with pytest.raises(InvalidManifest, match=re.escape(message)):
            client.operator.create_task({"task_id": "report", "entries": [
                {"file_id": "a", "path": "a", "depends_on": deps}]})
        with pytest.raises(Exception, match="no task 'report'"):
            client.operator.get_task("report")


def test_a_dead_dependency_in_another_task_blocks_until_requeued(
    client: Client, session: Session, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "ocr", "max_retries": 0,
                                 "entries": [{"file_id": "p1", "path": "p1"}]})
    client.operator.create_task({"task_id": "report", "entries": [
        {"file_id": "r", "path": "r", "depends_on": ["ocr:p1"]}]})
    claim = client.claim("ocr", "p1", session=session)
    client.fail("ocr", "p1", claim.token, "scanner jammed", session=session)
    text = client.operator.explain("report", "r").text
    assert "It is blocked: dependencies ocr:p1 dead" in text
    assert client.operator.get_entry("report", "r").blocked
    client.operator.requeue("ocr", "p1")
    produce_verified(client, session, "ocr", "p1")
    wait_for(released(client, "report", "r"), what="released after the requeue")


def test_a_dependency_in_an_archived_task_is_read_from_its_archive(
    client: Client, session: Session, wait_for: Wait,
) -> None:
    client.operator.create_task({"task_id": "ocr", "entries": [{"file_id": "p1", "path": "p1"}]})
    produce_verified(client, session, "ocr", "p1")
    lease = client.consume("ocr", "default", "p1", session=session)
    client.ack("ocr", "p1", "default", lease.token, session=session)
    wait_for(lambda: client.operator.get_task("ocr").status == pb.TASK_STATUS_COMPLETED,
             what="completed")
    client.operator.archive_task("ocr")
    # Created after its dependency left etcd: found in the archive, released at once.
    client.operator.create_task({"task_id": "report", "entries": [
        {"file_id": "r", "path": "r", "depends_on": ["ocr:p1"]}]})
    wait_for(released(client, "report", "r"), what="released from the archive")


def test_a_dead_dependency_in_another_task_is_counted_as_blocked(
    client: Client, session: Session, registry: RegistryHandle, wait_for: Wait,
) -> None:
    """A task counts an entry blocked by another task's dead entry as `explain` and the
    entry say, in `task get` and `status`, while that task is live and once it is
    archived; an entry blocked within its own task is counted alongside."""
    client.operator.create_task({"task_id": "xa", "max_retries": 0,
                                 "entries": [{"file_id": "a1", "path": "a1"},
                                    {"file_id": "a2", "path": "a2"}]})
    client.operator.create_task({"task_id": "xb", "max_retries": 0, "entries": [
        {"file_id": "b1", "path": "b1", "depends_on": ["xa:a2"]},
        {"file_id": "b2", "path": "b2"},
        {"file_id": "b3", "path": "b3", "depends_on": ["b2"]},
        {"file_id": "b4", "path": "b4", "depends_on": ["xa:a1"]}]})

    def counted() -> tuple[int, int, int, list[str]]:
        """(task get's count, `task get -o json`'s, `status -o json`'s, the entries
        `explain` calls blocked)."""
        shown = ok_json(invoke(registry, "task", "get", "xb", "-o", "json"))
        status = ok_json(invoke(registry, "status", "xb", "-o", "json"))
        explained = [f for f in ("b1", "b2", "b3", "b4")
                     if "It is blocked" in client.operator.explain("xb", f).text]
        return client.operator.get_task("xb").blocked, int(shown["blocked"]), status["blocked"], \
            explained

    assert counted() == (0, 0, 0, [])
    claim = client.claim("xa", "a2", session=session)
    client.fail("xa", "a2", claim.token, "scanner jammed", session=session)
    assert "It is blocked: dependencies xa:a2 dead" in client.operator.explain("xb", "b1").text
    assert client.operator.get_entry("xb", "b1").blocked
    assert counted() == (1, 1, 1, ["b1"])
    claim = client.claim("xb", "b2", session=session)
    client.fail("xb", "b2", claim.token, "bad page", session=session)
    assert counted() == (2, 2, 2, ["b1", "b3"])
    # xa finishes (a1 consumed, a2 dead) and leaves etcd: its archive still says a2 died.
    produce_verified(client, session, "xa", "a1")
    lease = client.consume("xa", "default", "a1", session=session)
    client.ack("xa", "a1", "default", lease.token, session=session)
    wait_for(lambda: client.operator.get_task("xa").status == pb.TASK_STATUS_COMPLETED,
             what="completed")
    client.operator.archive_task("xa")
    wait_for(released(client, "xb", "b4"), what="b4 released by xa:a1")
    assert counted() == (2, 2, 2, ["b1", "b3"])
    assert client.operator.get_entry("xb", "b1").blocked
