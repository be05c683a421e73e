"""One logging style for both daemons: key=value or JSON lines, with the entry's task,
file id and revision on every line about an entry."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from registry_fixtures import RegistryHandle, allow_suite_etcd

from baton_relay.client import Client
from baton_relay.kernel import errors
from baton_relay.kernel.logs import formatter, setup_logging


def test_entry_lines_carry_task_file_and_revision(
    registry: RegistryHandle, client: Client, wait_for: Callable[..., None]
) -> None:
    """A move, a death and a reaped claim: each line names the task, the file and the
    revision the entry moved at (the journal's)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter("json"))
    logger = logging.getLogger("baton.registry")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        client.operator.create_task({"task_id": "lg", "max_retries": 0, "digest_optional": True,
                                     "entries": [{"file_id": "a", "path": "a"},
                                        {"file_id": "b", "path": "b"}]})
        with client.open_session("p", ttl=10) as s:
            c = client.claim("lg", "a", session=s)
            client.fail("lg", "a", c.token, "broken", session=s)
        lost = client.open_session("q", ttl=2, keepalive=False)
        client.claim("lg", "b", session=lost)
        wait_for(lambda: client.operator.get_entry("lg", "b").state != 2, timeout=20,
                 what="the lost claim reaped")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    seen = [json.loads(line) for line in stream.getvalue().splitlines()]
    about = [line for line in seen if line.get("task") == "lg"]
    assert {line["msg"] for line in about} >= {"entry moved", "entry dead",
                                               "reaped a lost claim"}
    revisions = {r.revision for f in ("a", "b") for r in client.operator.journal("lg", f)}
    for line in about:
        assert line["file_id"] in ("a", "b") and line["revision"] > 0, line
        if line["msg"] != "entry moved" or line["was"] != "new":  # creation: no record
            assert line["revision"] in revisions, line
    dead = next(line for line in about if line["msg"] == "entry dead")
    assert dead["file_id"] == "a" and dead["level"] == "warning"
    with pytest.raises(errors.NotFound):
        client.operator.get_entry("lg", "zz")


def test_the_registry_process_logs_in_the_chosen_format(etcd: Any) -> None:
    """`--log-format json`: every line the registry process writes is a JSON object
    with ts, level, logger and msg; `kv` writes key=value lines with the same keys."""
    for fmt, parse in (("json", json.loads), ("kv", _kv)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
             *allow_suite_etcd(), "--log-format", fmt, "--listen", "127.0.0.1:0",
             "--prefix", f"/logs-{fmt}/"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("baton-registry listening on ")
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=60)
        logged = [parse(line) for line in err.splitlines() if line]
        assert len(logged) >= 3, err  # serving, shutting down, stopped
        for record in logged:
            assert {"ts", "level", "logger", "msg"} <= set(record), record


def _kv(line: str) -> dict[str, str]:
    import shlex

    return dict(part.split("=", 1) for part in shlex.split(line) if "=" in part)


def test_setup_keeps_libraries_at_warning() -> None:
    """Baton's loggers at the chosen level, the libraries under them at WARNING."""
    stream = io.StringIO()
    setup_logging("DEBUG", "kv", stream)
    try:
        logging.getLogger("baton.x").debug("mine")
        logging.getLogger("somelib").info("theirs")
        logging.getLogger("somelib").warning("loud")
    finally:
        logging.getLogger().handlers[:] = []
    out = stream.getvalue()
    assert "msg=mine" in out and "theirs" not in out and "msg=loud" in out


def test_the_watchers_lines_about_an_entry_carry_its_revision(
    client: Client, watcher_factory: Callable[..., Any], wait_for: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher's "reported" line (DEBUG: one comes for each file) names the task,
    the file and the revision the registry's reply carried."""
    from watcher_fixtures import is_state, make_task, put_bytes

    caplog.set_level(logging.DEBUG, logger="baton.watcher")  # one line a file: DEBUG
    make_task(client, "wl", {"a": "a.bin"})
    with client.open_session("p", ttl=10) as s:
        # committed before the watcher starts: its one report is the one that verifies
        # (a report racing the commit would name the earlier revision it saw)
        put_bytes(client, s, "wl", "a", b"logged bytes")
    watcher_factory()
    wait_for(is_state(client, "wl", "a", 4), what="a verified")
    revision = client.operator.get_entry("wl", "a").revision
    reported = [getattr(r, "baton_fields", {}) for r in caplog.records
                if r.getMessage() == "reported"]
    assert reported, [r.getMessage() for r in caplog.records]
    assert reported[-1]["task"] == "wl" and reported[-1]["file_id"] == "a"
    assert reported[-1]["revision"] == revision
