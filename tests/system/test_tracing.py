"""Traces: a file's hand-off is one trace, from its producer through the watcher to
each of its consumer groups, across processes (docs/operations.md, "Traces").

A real OTLP receiver (the collector's trace service over gRPC) runs in the test
process; the registry, the watcher and the agents are processes of their own, traced
by the standard ``OTEL_*`` environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from registry_fixtures import RegistryHandle, allow_suite_etcd

from baton_relay.client import Client, consume, produce
from baton_relay.kernel import tracing
from baton_relay.kernel.contract import parse_attempt
from baton_relay.kernel.errors import IllegalTransition, InvalidArgument
from baton_relay.kernel.v1 import baton_pb2 as pb

Wait = Callable[..., None]
AGENT = Path(__file__).parents[1] / "trace_agent.py"
IDS = ["a", "b", "c"]


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any] = field(hash=False)

    def says(self, **wanted: Any) -> bool:
        return all(self.attributes.get(f"baton.{k}") == v for k, v in wanted.items())


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector's OTLP/gRPC trace endpoint receives, kept."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(),
                                    {a.key: _value(a.value) for a in s.attributes}))
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def all(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@pytest.fixture
def otlp() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def traced_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_INSECURE="true",
               OTEL_BSP_SCHEDULE_DELAY="200")
    return env


def token_of(entry: pb.Entry) -> int:
    """The fencing token of the committed attempt (in its file's name)."""
    attempt = parse_attempt(entry.attempt_path)
    assert attempt is not None, entry
    return attempt[1]


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM: a daemon stops gracefully, and its spans leave at exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_files_hand_off_is_one_trace_across_a_three_stage_pipeline(
        etcd: Any, prefix: str, staging: Path, tmp_path: Path,
        otlp: tuple[Receiver, str], wait_for: Wait) -> None:
    """Three stages (s1 → s2 → s3), s1 read by two groups: every consumed entry has one
    trace holding its producer's attempt (claim, write, checkpoint, commit), the
    watcher's verification and each group's consumption (read, ack), parent-linked in
    that order, with the registry's spans of the calls inside; the watcher's log lines
    about the entry name the trace."""
    receiver, endpoint = otlp
    env = traced_env(endpoint)
    procs: list[subprocess.Popen[str]] = []
    watcher_log = tmp_path / "watcher.log"
    try:
        registry = subprocess.Popen(
            [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
             *allow_suite_etcd(), "--listen", "127.0.0.1:0", "--staging", str(staging),
             "--prefix", prefix],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(registry)
        line = registry.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, f"registry did not start: {line!r}"
        address = line.split()[-1]
        with watcher_log.open("w") as log:
            watcher = subprocess.Popen(
                [sys.executable, "-m", "baton_relay.watcher", "--registry", address,
                 "--staging", str(staging), "--log-format", "json", "--log-level", "debug"],
                stdout=subprocess.DEVNULL, stderr=log, env=env)
        procs.append(watcher)
        with Client(address) as client:
            for task, groups in (("s1", ["next", "audit"]), ("s2", ["last"]), ("s3", ["end"])):
                client.operator.create_task({"task_id": task, "consumers": groups, "entries": [
                    {"file_id": f, "path": f"{f}.txt"} for f in IDS]})
            agents = [
                ["produce", "s1"],
                ["relay", "s1", "next", "s2", len(IDS)],
                ["relay", "s2", "last", "s3", len(IDS)],
                ["consume", "s1", "audit", len(IDS)],
                ["consume", "s3", "end", len(IDS)],
            ]
            for args in agents:
                procs.append(subprocess.Popen(
                    [sys.executable, str(AGENT), address, *map(str, args)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            for p in procs[2:]:
                out, err = p.communicate(timeout=180)
                assert p.returncode == 0, (p.args, out, err)
            committed = {(t, f): token_of(client.operator.get_entry(t, f))
                         for t in ("s1", "s2", "s3") for f in IDS}
            assert all(client.operator.get_entry(t, f).state == pb.ENTRY_STATE_CONSUMED
                       for t, f in committed)
        stop(watcher)
        stop(registry)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    consumers = {"s1": ["next", "audit"], "s2": ["last"], "s3": ["end"]}

    def complete() -> bool:
        spans = receiver.all()
        return all(any(s.name == "baton.consume" and s.says(task=t, file_id=f, group=g)
                       for s in spans)
                   and any(s.name.startswith("baton.registry/") and s.says(task=t, file_id=f)
                           for s in spans)
                   for t, groups in consumers.items() for f in IDS for g in groups)

    wait_for(complete, timeout=30, what="every consumption's spans at the receiver")
    spans = receiver.all()
    by_id = {s.span_id: s for s in spans}
    logged = [json.loads(x) for x in watcher_log.read_text().splitlines() if x.startswith("{")]

    for task, groups in consumers.items():
        for f in IDS:
            consumed = [s for s in spans if s.name == "baton.consume" and s.says(task=task,
                                                                                file_id=f)]
            assert sorted(s.attributes["baton.group"] for s in consumed) == sorted(groups)
            trace = {s.trace_id for s in consumed}
            assert len(trace) == 1, f"{task}/{f}: its consumers are in {len(trace)} traces"
            (trace_id,) = trace
            mine = [s for s in spans if s.trace_id == trace_id]
            # consumer ← watcher ← producer's attempt, the attempt the root
            for c in consumed:
                verify = by_id[c.parent]
                assert (verify.name, verify.service) == ("baton.verify", "baton-watcher")
                assert verify.says(task=task, file_id=f)
                attempt = by_id[verify.parent]
                assert (attempt.name, attempt.service) == ("baton.produce", "baton-agent")
                assert attempt.says(task=task, file_id=f) and attempt.parent == ""
                assert c.service == "baton-agent" and c.attributes["baton.token"] > 0
                assert {s.name for s in mine if s.parent == c.span_id} >= {"baton.read",
                                                                          "baton.ack"}
            (root,) = [s for s in mine if s.parent == ""]
            assert root.says(task=task, file_id=f, token=committed[(task, f)], attempt=1)
            steps = {s.name for s in mine if s.parent == root.span_id}
            assert steps >= {"baton.claim", "baton.write", "baton.commit", "baton.verify"}
            if task == "s1":
                assert "baton.checkpoint" in steps
            # every span about the entry is in this one trace (one attempt, no retry)
            about = [s for s in spans if s.says(task=task, file_id=f)]
            assert {s.trace_id for s in about} == {trace_id}, [
                (s.service, s.name) for s in about if s.trace_id != trace_id]
            # the registry's spans of the calls sit under the agent's and watcher's
            served = [s for s in mine if s.service == "baton-registry"]
            assert served and all(by_id[s.parent].service in ("baton-agent", "baton-watcher")
                                  for s in served), [(s.name, s.parent) for s in served]
            assert any(s.name == "baton.registry/ReportVerification" for s in served)
            # the watcher's line about its verification names the trace
            lines = [x for x in logged if x.get("task") == task and x.get("file_id") == f
                     and x.get("msg") == "reported"]
            assert lines and all(x.get("trace_id") == trace_id for x in lines), lines


@pytest.mark.parametrize("stream", [True, False])
def test_a_claim_refused_while_produce_waits_out_back_pressure_leaves_no_trace(
        etcd: Any, prefix: str, staging: Path, otlp: tuple[Receiver, str],
        wait_for: Wait, stream: bool) -> None:
    """A traced producer whose claims are refused with Backpressure until ``produce``
    gives up sends no span about that entry, and neither does the registry: a refused
    claim is not an attempt. (What it does next, a put elsewhere, is traced, the
    registry's span of its claim included.)"""
    receiver, endpoint = otlp
    env = traced_env(endpoint)
    registry = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
         *allow_suite_etcd(), "--listen", "127.0.0.1:0", "--staging", str(staging),
         "--prefix", prefix],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = registry.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, f"registry did not start: {line!r}"
        address = line.split()[-1]
        with Client(address) as client:
            client.operator.create_task({"task_id": "t", "consumers": ["g"],
                                         "backlog_limits": {"g": {"entries": 1}},
                                         "entries": [{"file_id": f, "path": f} for f in "ab"]})
            client.operator.create_task({"task_id": "m",
                                         "entries": [{"file_id": "x", "path": "x"}]})
            # a claim in hand is g's backlog to be: at the limit, b's claims are refused
            held = client.open_session("holder", ttl=30, keepalive=False)
            client.claim("t", "a", session=held)
            script = (
                "import io\n"
                "from baton_relay.client import Client, errors, produce, put\n"
                f"c = Client({address!r})\n"
                f"s = c.open_session('pressed', ttl=10, keepalive={stream!r})\n"
                "try:\n"
                "    with produce(c, s, 't', 'b', wait=1.0) as out:\n"
                "        out.write(b'never')\n"
                "except errors.Backpressure:\n"
                "    print('refused', flush=True)\n"
                "put(c, s, 'm', 'x', io.BytesIO(b'after'))\n"
                "c.close_session(s.session_id)\n"
            )
            done = subprocess.run([sys.executable, "-c", script], env=env, text=True,
                                  capture_output=True, timeout=60)
            assert done.returncode == 0 and done.stdout == "refused\n", done
            assert client.operator.get_entry("t", "b").state == pb.ENTRY_STATE_PENDING

        # spans leave each process in the order they ended: once the registry's span of
        # the put's commit and the agent's attempt at it are in, the refused claims'
        # would be too
        def put_seen() -> bool:
            spans = receiver.all()
            return (any(s.service == "baton-registry" and s.says(task="m")
                        for s in spans)
                    and any(s.name == "baton.produce" and s.says(task="m") for s in spans))

        wait_for(put_seen, timeout=30, what="the put's spans at the receiver")
        about = [(s.service, s.name) for s in receiver.all() if s.says(task="t")]
        assert not about, about
        assert any(s.service == "baton-registry" and s.name == "baton.registry/Claim"
                   and s.says(task="m") for s in receiver.all())
    finally:
        stop(registry)


def test_traces_are_off_without_the_environment_and_nothing_is_imported(
        registry: RegistryHandle, client: Client, tmp_path: Path) -> None:
    """No OTEL_* variable: an agent that produces and consumes never imports
    OpenTelemetry, and its entries carry no trace context."""
    client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a.txt"}]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    script = (
        "import io, sys\n"
        "from baton_relay.client import Client, put, consume\n"
        "from baton_relay.kernel import tracing\n"
        f"c = Client({registry.address!r})\n"
        "s = c.open_session('quiet', ttl=10)\n"
        "put(c, s, 't', 'a', io.BytesIO(b'hello'))\n"
        "print(c.operator.get_entry('t', 'a').traceparent or '-')\n"
        "print(tracing.ENABLED, any(m.startswith('opentelemetry') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")
    assert out[:2] == ["-", "False False"], out


def test_asked_for_without_the_packages_says_so_once_and_runs_untraced() -> None:
    """OTEL_* set but OpenTelemetry missing: one warning naming the extra, then off."""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    script = (
        "import sys, logging\n"
        "logging.basicConfig()\n"
        "sys.modules['opentelemetry'] = None  # as if not installed\n"
        "from baton_relay.kernel import tracing\n"
        "assert tracing.ENABLED\n"
        "print(tracing.setup('x'), tracing.setup('x'), tracing.ENABLED,"
        " tracing.start('baton.produce'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False False False None"
    assert done.stderr.count("baton-relay[trace]") == 1, done.stderr


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
])
def test_the_standard_environment_decides(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


@pytest.mark.parametrize("bad", [
    "garbage",
    "00-" + "0" * 32 + "-" + "1" * 16 + "-01",    # no trace
    "00-" + "1" * 32 + "-" + "0" * 16 + "-01",    # no span
    "01-" + "1" * 32 + "-" + "1" * 16 + "-01",    # another version
    "00-" + "A" * 32 + "-" + "1" * 16 + "-01",    # upper case
])
def test_a_claim_with_a_malformed_trace_context_is_refused_and_changes_nothing(
        client: Client, bad: str, wait_for: Wait) -> None:
    client.operator.create_task({"task_id": "t", "backoff": {"base_seconds": 0.001},
                                 "entries": [{"file_id": "a", "path": "a.txt"}]})
    with client.open_session("p", ttl=10, keepalive=False) as session:
        with pytest.raises(InvalidArgument, match="traceparent"):
            client.claim("t", "a", session=session, traceparent=bad)
        entry = client.operator.get_entry("t", "a")
        assert entry.state == pb.ENTRY_STATE_PENDING and entry.traceparent == ""
        # a well-formed one is kept on the entry it claims; the next claim replaces it
        good = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        claim = client.claim("t", "a", session=session, traceparent=good)
        assert client.operator.get_entry("t", "a").traceparent == good
        client.fail("t", "a", claim.token, "try again", session=session, delay=0.0)
        assert client.operator.get_entry("t", "a").traceparent == good  # the failed attempt's

        def claimed_untraced() -> bool:
            try:
                client.claim("t", "a", session=session, traceparent="")
            except IllegalTransition:  # its retry backoff (a millisecond) not over yet
                return False
            return True

        wait_for(claimed_untraced, what="the entry claimable again")
        assert client.operator.get_entry("t", "a").traceparent == ""


def test_the_helpers_work_the_same_untraced(client: Client) -> None:
    """Off (this test process has no OTEL_*), produce and consume still hand a file
    over, and nothing about traces appears on the entry."""
    assert not tracing.ENABLED
    client.operator.create_task({"task_id": "t", "entries": [{"file_id": "a", "path": "a.txt"}]})
    with client.open_session("p", ttl=10) as session:
        with produce(client, session, "t", "a") as out:
            out.write(b"bytes")
        client.watcher.report("t", "a", 5, out.digest, reporter="test-watcher")
        with consume(client, session, "t", timeout=10) as got:
            assert got.data == b"bytes" and got.traceparent == ""
    assert client.operator.get_entry("t", "a").traceparent == ""


def test_the_documented_environment_turns_traces_on() -> None:
    """docs/operations.md's "Traces" block: the extra it installs is the package's
    `trace` extra (OpenTelemetry's API, SDK and OTLP/gRPC exporter), and the variables
    it exports turn traces on."""
    import tomllib

    from test_docs import fenced_blocks

    root = Path(__file__).resolve().parents[2]
    (block,) = [text for _, text in fenced_blocks(root / "docs" / "operations.md")
                if text.startswith("pip install 'baton-relay[trace]'")]
    env = dict(line.split()[1].split("=", 1) for line in block.splitlines()
               if line.startswith("export "))
    assert env and tracing.wanted(env)
    assert not tracing.wanted({k: v for k, v in env.items()
                               if k != "OTEL_EXPORTER_OTLP_ENDPOINT"})
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    wanted = {"opentelemetry-api", "opentelemetry-sdk",
              "opentelemetry-exporter-otlp-proto-grpc"}
    assert {d.split(">")[0].split("=")[0] for d in extras["trace"]} == wanted
    assert "baton-relay[trace]" in extras["dev"]
