"""One vocabulary in the CLI's JSON: enum values are the short lower-case names the
tables show (``verified``, ``active``, ``snapshot``), never the wire's
``ENTRY_STATE_VERIFIED``; against a real registry on a real etcd."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import produce_verified
from test_cli import SUBPROCESS_TIMEOUT, Lines, cli_env, invoke, ok_json

from baton_relay.client import Client
from baton_relay.kernel import names
from baton_relay.kernel.v1 import baton_pb2 as pb

#: a value as the wire names an enum's: PREFIX_VALUE in capitals
ENUM_LIKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$")
MANIFEST = {"task_id": "t1", "entries": [{"file_id": f, "path": f"{f}.bin"}
                                         for f in ("a", "b", "c")]}


def enum_like(data: Any, where: str = "") -> list[str]:
    """Every string of ``data`` (values, and keys of objects) spelt as a wire enum."""
    if isinstance(data, dict):
        return [*(f"{where}.{k} (key)" for k in data if ENUM_LIKE.match(str(k))),
                *(p for k, v in data.items() for p in enum_like(v, f"{where}.{k}"))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in enum_like(v, f"{where}[{i}]")]
    if isinstance(data, str) and ENUM_LIKE.match(data):
        return [f"{where} = {data}"]
    return []


def test_every_enum_value_has_the_name_the_tables_use() -> None:
    """The JSON's name of each entry state and task status is the tables' name."""
    from baton_relay.client.cli._common import enum_name

    for value in pb.EntryState.values():
        assert enum_name(pb.EntryState.DESCRIPTOR, value) == names.state_name(value)
    for value in pb.TaskStatus.values():
        assert enum_name(pb.TaskStatus.DESCRIPTOR, value) == names.status_name(value)
    kind = pb.ReportProblemRequest.Kind
    for value in kind.values()[1:]:
        assert enum_name(kind.DESCRIPTOR, value) == names.kind_name(value)
    assert enum_name(pb.EntryState.DESCRIPTOR, 999) == 999  # a newer registry's: as sent


def test_the_json_of_every_command_has_the_tables_names(registry: Any, client: Client,
                                                        tmp_path: Path) -> None:
    """task create/get/ls, status, log, explain, commit, fail, checkpoint, pause, top,
    lease, pool, watcher and shard -o json name states and statuses as the tables do."""
    made = ok_json(invoke(registry, "task", "create", "-", "-o", "json",
                          stdin=json.dumps(MANIFEST)))
    got = ok_json(invoke(registry, "task", "get", "t1", "-o", "json"))
    assert got["status"] == "active" and made["task"]["status"] == "active"
    listed = ok_json(invoke(registry, "task", "ls", "-o", "json"))
    with client.open_session("p", ttl=30) as s:
        produce_verified(client, s, "t1", "a")
        claim = client.claim("t1", "b", session=s)
        c_claim = client.claim("t1", "c", session=s)
        data = tmp_path / "b.bin"
        data.write_bytes(b"bee")
        checkpoint = ok_json(invoke(registry, "checkpoint", "t1", "b", "--token",
                                    str(claim.token), "--progress", "0.5", "-o", "json"))
        committed = ok_json(invoke(registry, "commit", "t1", "b", "--token", str(claim.token),
                                   "--file", str(data), "-o", "json"))
        failed = ok_json(invoke(registry, "fail", "t1", "c", "--token", str(c_claim.token),
                                "--reason", "no disk", "-o", "json"))
    assert committed["state"] == "written" and failed["state"] in ("pending", "dead")
    status = ok_json(invoke(registry, "status", "t1", "--entries", "-o", "json"))
    assert {e["file_id"]: e["state"] for e in status["entries"]}["a"] == "verified"
    logged = invoke(registry, "log", "t1", "-o", "json")  # one object a line
    assert logged.exit_code == 0, logged.output
    journal = [json.loads(line) for line in logged.stdout.splitlines()]
    assert "verified" in {r["to_state"] for r in journal}
    explained = ok_json(invoke(registry, "explain", "t1", "a", "-o", "json"))
    assert explained["entry"]["state"] == "verified"
    paused = ok_json(invoke(registry, "task", "pause", "t1", "--reason", "x", "-o", "json"))
    assert paused["status"] == "paused"
    top = ok_json(invoke(registry, "top", "--once", "-o", "json"))
    outputs = {
        "task create": made, "task get": got, "task ls": listed, "checkpoint": checkpoint,
        "commit": committed, "fail": failed, "status": status, "log": journal,
        "explain": explained, "task pause": paused, "top": top,
        **{" ".join(cmd): ok_json(invoke(registry, *cmd, "-o", "json"))
           for cmd in (("lease", "ls"), ("pool", "ls"), ("watcher", "ls"), ("shard", "ls"))},
    }
    wire = {cmd: found for cmd, data in outputs.items() if (found := enum_like(data))}
    assert wire == {}


@pytest.mark.slow
def test_watch_json_names_the_kind_and_state_as_the_tables_do(registry: Any,
                                                              client: Client) -> None:
    """`baton watch -o json`: kind `snapshot`/`synced`, entry state `pending`."""
    client.operator.create_task(MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "watch", "t1", "--from-revision",
         "0", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(registry.address))
    try:
        lines = Lines(proc)
        first = json.loads(lines.until(lambda line: line.startswith("{"),
                                       timeout=SUBPROCESS_TIMEOUT))
        synced = json.loads(lines.until(lambda line: "synced" in line.lower(),
                                        timeout=SUBPROCESS_TIMEOUT))
    finally:
        proc.terminate()
        proc.wait(SUBPROCESS_TIMEOUT)
    assert first["kind"] == "snapshot" and first["entry"]["state"] == "pending"
    assert synced["kind"] == "synced"
    assert enum_like(first) == enum_like(synced) == []
