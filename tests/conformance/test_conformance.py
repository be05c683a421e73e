"""The conformance suite: every scenario of ``scenarios/`` played by every client's
driver (``PROTOCOL.md``) against one real ``baton up`` stack (etcd, the registry with
mutual TLS, a watcher), and the answers compared with what the scenario expects.

A scenario is data:

- ``task``: the manifest of its task (``task_id`` is filled in: one task per run);
- ``actors``: each actor's identity (``operator`` and ``agent`` are ``baton up``'s;
  ``pipeline-1`` is issued here); each actor is a driver process of the client under
  test;
- ``steps``, in order, each one of:
  - ``{"actor": A, "op": OP, "args": {...}}``: a request to A's driver, answered
    before the next step. ``"expect": {...}`` checks keys of the result (a value may
    be ``{"$gt": X}``, ``{"$ne": X}``, ``{"$in": [X, ...]}`` or ``{"$blake3": TEXT}``);
    ``"error": {...}`` says the call fails, and checks keys of the error (``kind``,
    ``code``);
    ``"save": NAME`` keeps the result for later steps (``"$NAME.key"`` in args or
    expectations); ``"retry_on": [KIND, ...]`` sends the request again while it
    fails with one of those kinds (for up to ``"timeout"`` seconds); ``"async": NAME``
    sends it and goes on, the reply checked by a later ``{"join": NAME, ...}`` step;
  - ``{"wait": {"file_id": F, "state": S}}``: until the operator reads the entry in
    state S (a watcher's verification, the reaper's take-back);
  - ``{"kill": A}``: A's driver killed with SIGKILL (its session left to expire).

``$task`` in args or expectations is the run's task id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import blake3
import pytest
from conformance_stack import Stack

from baton_relay.kernel.names import state_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCENARIOS = sorted(HERE.glob("scenarios/*.json"))
TS_DRIVER = ROOT / "clients" / "typescript" / "dist" / "src" / "driver.js"
#: seconds a reply may take (a consume waits up to its own timeout on top)
REPLY_TIMEOUT = 60.0


def driver_argv(client: str) -> list[str]:
    if client == "python":
        return [sys.executable, str(HERE / "conformance_driver.py")]
    node = shutil.which("node")
    assert node, "the TypeScript client's driver needs node on PATH"
    assert TS_DRIVER.exists(), (
        f"{TS_DRIVER.relative_to(ROOT)} is not built: run `make ts-client` "
        "(npm ci and npm run build in clients/typescript)")
    return [node, str(TS_DRIVER)]


class Driver:
    """One actor's driver process: requests by id, replies read by a thread."""

    def __init__(self, client: str, env: dict[str, str], log: Path) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        base["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),) if p)
        self.log = log
        self._err = log.open("wb")
        self.proc = subprocess.Popen(driver_argv(client), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**base, **env})
        self._replies: dict[int, Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._ready: Queue[dict[str, Any]] = Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            hello = self._ready.get(timeout=30)
        except Empty:
            raise AssertionError(f"the driver did not say ready:\n{self.stderr()}") from None
        assert hello.get("ready") is True, hello

    def _queue(self, call_id: int) -> Queue[dict[str, Any]]:
        with self._lock:
            return self._replies.setdefault(call_id, Queue())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.put(message)
            else:
                self._queue(int(message["id"])).put(message)

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def send(self, op: str, args: dict[str, Any]) -> int:
        self._next += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": self._next, "op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        return self._next

    def reply(self, call_id: int, timeout: float) -> dict[str, Any]:
        try:
            return self._queue(call_id).get(timeout=timeout)
        except Empty:
            raise AssertionError(f"no reply to request {call_id} within {timeout:g} s; "
                                 f"the driver's stderr:\n{self.stderr()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._err.close()

    def end(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class Run:
    """One scenario played by one client."""

    def __init__(self, stack: Stack, client: str, scenario: dict[str, Any],
                 logs: Path) -> None:
        self.stack, self.client, self.scenario, self.logs = stack, client, scenario, logs
        self.task = f"{scenario['name']}-{client}-{uuid.uuid4().hex[:6]}"
        self.saved: dict[str, Any] = {"task": self.task}
        self.drivers: dict[str, Driver] = {}
        self.pending: dict[str, tuple[Driver, int, dict[str, Any]]] = {}

    def resolve(self, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("$"):
            name, _, key = value[1:].partition(".")
            assert name in self.saved, f"{value}: nothing saved as {name!r}"
            found = self.saved[name]
            return found[key] if key else found
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value

    def driver(self, actor: str) -> Driver:
        if actor not in self.drivers:
            identity = self.scenario["actors"][actor]
            self.drivers[actor] = Driver(self.client, self.stack.identity(identity),
                                         self.logs / f"{actor}.stderr")
        return self.drivers[actor]

    def check(self, what: str, got: dict[str, Any], expected: dict[str, Any]) -> None:
        for key, want in self.resolve(expected).items():
            assert key in got, f"{what}: no {key!r} in {got}"
            value = got[key]
            if isinstance(want, dict) and "$gt" in want:
                assert value > want["$gt"], f"{what}: {key} {value!r} not > {want['$gt']!r}"
            elif isinstance(want, dict) and "$in" in want:
                assert value in want["$in"], f"{what}: {key} {value!r} not in {want['$in']!r}"
            elif isinstance(want, dict) and "$ne" in want:
                assert value != want["$ne"], f"{what}: {key} {value!r} == {want['$ne']!r}"
            elif isinstance(want, dict) and "$blake3" in want:
                digest = blake3.blake3(want["$blake3"].encode()).hexdigest()
                assert value == digest, f"{what}: {key} {value!r}, not BLAKE3 {digest}"
            else:
                assert value == want, f"{what}: {key} is {value!r}, expected {want!r}"

    def outcome(self, label: str, step: dict[str, Any], reply: dict[str, Any]) -> None:
        if "error" in step:
            assert "error" in reply, f"{label}: expected an error, got {reply}"
            self.check(label, reply["error"], step["error"])
            return
        assert "result" in reply, f"{label}: {reply.get('error')}"
        if "expect" in step:
            self.check(label, reply["result"], step["expect"])
        if "save" in step:
            self.saved[step["save"]] = reply["result"]

    def request(self, label: str, step: dict[str, Any]) -> None:
        d = self.driver(step["actor"])
        args = self.resolve(step.get("args", {}))
        if "async" in step:
            self.pending[step["async"]] = (d, d.send(step["op"], args), step)
            return
        retry_on = set(step.get("retry_on", ()))
        deadline = time.monotonic() + float(step.get("timeout", 30))
        while True:
            reply = d.reply(d.send(step["op"], args),
                            REPLY_TIMEOUT + float(args.get("timeout", 0)))
            kind = reply.get("error", {}).get("kind")
            if kind not in retry_on or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.outcome(label, step, reply)

    def wait(self, label: str, spec: dict[str, Any]) -> None:
        deadline = time.monotonic() + float(spec.get("timeout", 60))
        with self.stack.operator() as op:
            while True:
                entry = op.operator.get_entry(self.task, spec["file_id"])
                if state_name(entry.state) == spec["state"]:
                    return
                assert time.monotonic() < deadline, (
                    f"{label}: {spec['file_id']} is {state_name(entry.state)}, "
                    f"not {spec['state']}, after {spec.get('timeout', 60)} s")
                time.sleep(0.1)

    def play(self) -> None:
        manifest = dict(self.scenario["task"], task_id=self.task)
        with self.stack.operator() as op:
            op.operator.create_task(manifest)
        try:
            for n, step in enumerate(self.scenario["steps"], 1):
                label = f"{self.scenario['name']} step {n} ({step.get('op') or next(iter(step))})"
                if "op" in step:
                    self.request(label, step)
                elif "join" in step:
                    d, call_id, sent = self.pending.pop(step["join"])
                    reply = d.reply(call_id, REPLY_TIMEOUT)
                    self.outcome(label, {**sent, **step}, reply)
                elif "wait" in step:
                    self.wait(label, step["wait"])
                elif "kill" in step:
                    self.driver(step["kill"]).kill()
                else:
                    raise AssertionError(f"{label}: a step of no known kind: {step}")
            assert not self.pending, f"replies never checked: {sorted(self.pending)}"
        finally:
            for d in self.drivers.values():
                d.end()


def _load(path: Path) -> dict[str, Any]:
    scenario: dict[str, Any] = json.loads(path.read_text())
    scenario.setdefault("name", path.stem)
    return scenario


@pytest.mark.parametrize("client", ["python", "typescript"])
@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(stack: Stack, client: str, path: Path, tmp_path: Path) -> None:
    """The client's driver answers every step of the scenario as the scenario expects."""
    Run(stack, client, _load(path), tmp_path).play()


def test_every_scenario_names_what_it_checks() -> None:
    """Each scenario says what it is about and expects something of some step."""
    assert len(SCENARIOS) >= 7
    for path in SCENARIOS:
        scenario = _load(path)
        assert scenario.get("about"), f"{path.name}: no `about`"
        assert any("expect" in s or "error" in s for s in scenario["steps"]), path.name
