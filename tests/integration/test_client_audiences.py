"""The client's calls by audience: ``client.operator`` and ``client.watcher`` hold the
operators' and watchers' calls; their old spellings on ``Client`` warn and still work."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
from test_cli import invoke, ok_json

from baton_relay.client import Client, produce
from baton_relay.client._client import MOVED
from baton_relay.client._operator import OperatorCalls
from baton_relay.client._watcher_calls import WatcherCalls
from baton_relay.kernel.v1 import baton_pb2 as pb


def test_every_moved_call_keeps_its_old_name_and_signature() -> None:
    """Each operator and watcher call is still on Client, with the same signature."""
    assert set(MOVED["operator"]) == {n for n in vars(OperatorCalls) if not n.startswith("_")}
    assert set(MOVED["watcher"]) == {n for n in vars(WatcherCalls) if not n.startswith("_")}
    for audience, calls in (("operator", OperatorCalls), ("watcher", WatcherCalls)):
        for name in MOVED[audience]:
            old = getattr(Client, name)
            assert inspect.signature(old) == inspect.signature(getattr(calls, name)), name


def test_old_names_warn_and_still_work(client: Client, staging: Path) -> None:
    """Client.create_task, .get_task, .report ... warn, naming the new spelling, and work."""
    with pytest.warns(DeprecationWarning, match=r"use client\.operator\.create_task"):
        task, created = client.create_task(
            {"task_id": "t1", "entries": [{"file_id": "a", "path": "a.bin"}]})
    assert created and task.spec.task_id == "t1"
    with pytest.warns(DeprecationWarning, match=r"use client\.operator\.get_task"):
        assert client.get_task("t1").spec.task_id == "t1"
    with client.open_session("p", ttl=10) as s, produce(client, s, "t1", "a") as out:
        out.write(b"old names")
    with pytest.warns(DeprecationWarning, match=r"use client\.watcher\.report"):
        entry = client.report("t1", "a", out.size, out.digest)
    assert entry.state == pb.ENTRY_STATE_VERIFIED
    with pytest.warns(DeprecationWarning, match=r"use client\.operator\.list_entries"):
        assert [e.file_id for e in client.list_entries("t1")] == ["a"]


def test_new_names_do_not_warn(client: Client) -> None:
    """The calls on client.operator and client.watcher raise no DeprecationWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        client.operator.create_task({"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}]})
        assert client.operator.get_task("t1").spec.task_id == "t1"
        assert client.operator.list_watchers() == []


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_cli_operator_commands_call_no_deprecated_name(registry: object) -> None:
    """baton's operator commands (task create/ls/get, explain, log, agents, watcher ls,
    pause/resume, status) run with DeprecationWarning an error."""
    manifest = '{"task_id": "t1", "entries": [{"file_id": "a", "path": "a"}]}'
    for args, stdin in ((("task", "create", "-"), manifest), (("task", "ls"), None),
                        (("task", "get", "t1"), None), (("explain", "t1", "a"), None),
                        (("log", "t1"), None), (("agents",), None), (("watcher", "ls"), None),
                        (("task", "pause", "t1"), None), (("task", "resume", "t1"), None),
                        (("status", "t1"), None)):
        result = invoke(registry, *args, stdin=stdin)
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            (args, result.exception)
        assert result.exit_code == 0, (args, result.output)
    assert len(ok_json(invoke(registry, "task", "ls", "-o", "json"))) == 1
