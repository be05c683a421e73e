"""Prometheus metrics of a real registry and a real watcher, scraped over HTTP."""

from __future__ import annotations

import gzip
import io
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle
from tools import require
from watcher_fixtures import digest, make_task

from baton_relay.client import Client, put
from baton_relay.kernel.errors import InvalidArgument, NotFound, NothingToClaim, StaleToken
from baton_relay.kernel.metrics_endpoint import parse_address
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess
from baton_relay.registry import RegistryConfig
from baton_relay.registry.edge.config import load_config as registry_config
from baton_relay.registry.edge.metrics import RegistryMetrics
from baton_relay.watcher import Watcher
from baton_relay.watcher.config import load_config as watcher_config

#: ids distinctive enough that finding one among label values cannot be chance
TASK = "metrics-task-q7z"
FILES = {"file-alpha-q7z": b"alpha bytes", "file-beta-q7z": b"beta, longer bytes",
         "file-gamma-q7z": b"gamma"}
PRODUCER, CONSUMER, LOST = "agent-maker-q7z", "agent-taker-q7z", "agent-lost-q7z"
GROUP = "group-readers-q7z"

#: one sample of the text format: name, labels, value
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """One scrape of ``/metrics``: the declared types and every sample."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                assert m, f"not a sample line: {line!r}"
                labels = dict(_LABEL.findall(m.group(2) or ""))
                self.samples.append((m.group(1), labels, float(m.group(3))))

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        found = [v for n, ls, v in self.samples
                 if n == name and all(ls.get(k) == want for k, want in labels.items())]
        assert found, f"no sample {name}{labels} in:\n{self.text}"
        return sum(found)

    def label_values(self) -> set[str]:
        return {v for _, labels, _ in self.samples for v in labels.values()}


def scrape(port: int, path: str = "/metrics") -> Scrape:
    # No proxy: an http_proxy setting must not intercept a loopback request.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return Scrape(resp.read().decode())


def check_conventions(s: Scrape) -> None:
    """Names, types and units as Prometheus expects them of Baton."""
    assert s.types, "no metric declared"
    for name, kind in s.types.items():
        assert name.startswith("baton_"), name
        assert kind in ("counter", "gauge", "histogram"), (name, kind)
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        # a unit in the name is a base unit, and comes last (before _total)
        base = name.removesuffix("_total")
        for unit in ("seconds", "bytes"):
            if unit in base.split("_"):
                assert base.endswith("_" + unit), name
        for bad in ("millis", "_ms", "kilo", "_kb", "mib"):
            assert bad not in name, name
    for name, _, _ in s.samples:
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in s.types or family in s.types, f"{name} has no TYPE line"


def check_no_ids(s: Scrape, ids: Iterable[str]) -> None:
    """No label value is, or contains, an id the test used."""
    values = s.label_values()
    for value in values:
        for id_ in ids:
            assert id_ not in value, f"label value {value!r} holds the id {id_!r}"


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    """The test's registry, serving metrics on a port it picks."""
    return registry_factory(metrics="127.0.0.1:0")


def metrics_port(handle: RegistryHandle) -> int:
    port = handle._running.metrics_port
    assert port > 0
    return port


def metrics_of(handle: RegistryHandle) -> RegistryMetrics:
    metrics = handle._running.metrics
    assert metrics is not None
    return metrics


def test_registry_counts_the_steps_of_a_handoff(
    registry: RegistryHandle, client: Client, watcher_factory: Callable[..., Watcher],
    staging: Path, wait_for: Callable[..., None],
) -> None:
    """After claims, commits, verifications, consumes, acks and nacks (and refused calls),
    the registry's /metrics shows each counted by outcome, the latencies, the etcd
    requests and the levels, under Baton's naming rules, with no id among label values."""
    watcher = watcher_factory(metrics="127.0.0.1:0")
    client.operator.create_task({"task_id": TASK, "consumers": [GROUP], "entries": [
        {"file_id": f, "path": f"out/{f}.bin"} for f in FILES]})
    with client.open_session(PRODUCER, ttl=10) as producer:
        for file_id, data in FILES.items():
            put(client, producer, TASK, file_id, io.BytesIO(data))
        with pytest.raises(NothingToClaim):
            client.claim(TASK, session=producer)
        with pytest.raises(StaleToken):
            client.commit(TASK, "file-alpha-q7z", 12345, 1, digest(b"x"), session=producer)
    for file_id in FILES:
        wait_for(lambda f=file_id: client.operator.get_entry(TASK,
                                                             f).state == pb.ENTRY_STATE_VERIFIED,  # type: ignore[misc]
                 what=f"{file_id} verified")
    with client.open_session(CONSUMER, ttl=10) as consumer:
        first = client.consume(TASK, GROUP, session=consumer)
        client.nack(TASK, first.file_id, GROUP, first.token, "not now", session=consumer)
        for _ in FILES:
            lease = client.consume(TASK, GROUP, session=consumer)
            client.ack(TASK, lease.file_id, GROUP, lease.token, session=consumer)
        with pytest.raises(NothingToClaim):
            client.consume(TASK, GROUP, session=consumer)

    s = scrape(metrics_port(registry))
    check_conventions(s)
    assert s.value("baton_claims_total", outcome="ok") == 3
    assert s.value("baton_claims_total", outcome="NothingToClaim") == 1
    assert s.value("baton_commits_total", outcome="ok") == 3
    assert s.value("baton_commits_total", outcome="StaleToken") == 1
    assert s.value("baton_consumes_total", outcome="ok") == 4
    assert s.value("baton_consumes_total", outcome="NothingToClaim") == 1
    assert s.value("baton_acks_total", outcome="ok") == 3
    assert s.value("baton_nacks_total", outcome="ok") == 1
    # a report that came before its commit leaves the entry writing; the commit settles it
    assert s.value("baton_reports_total", kind="digest") >= 3
    assert s.value("baton_grpc_calls_total", method="Claim", code="OK") == 3
    assert s.value("baton_grpc_calls_total", method="Claim", code="NOT_FOUND") == 1
    assert s.value("baton_grpc_calls_total", method="Commit", code="FAILED_PRECONDITION") == 1
    # both sessions on their streams, each ended by its agent when done
    assert s.value("baton_grpc_calls_total", method="Session", code="OK") == 2
    assert s.value("baton_grpc_call_duration_seconds_count", method="Claim") == 4
    assert s.value("baton_grpc_call_duration_seconds_count", method="Consume") == 5
    assert 0 < s.value("baton_grpc_call_duration_seconds_sum", method="Claim") < 10
    assert s.value("baton_grpc_call_duration_seconds_bucket", method="Claim", le="+Inf") == 4
    assert s.value("baton_grpc_streams", method="WatchTasks") == 1  # the watcher's
    for op in ("range", "txn", "lease", "watch"):
        assert s.value("baton_etcd_request_duration_seconds_count", op=op) > 0, op
    assert s.value("baton_txn_committed_total") >= s.value("baton_txn_etcd_requests_total") > 0
    assert s.value("baton_txn_replans_total", reason="compare") >= 0
    assert s.value("baton_txn_gave_up_total") == 0
    assert s.value("baton_txn_settled_total") >= 0
    assert s.value("baton_sessions_closed_total") == 2
    assert s.value("baton_tasks", status="active") + s.value("baton_tasks",
                                                              status="completed") == 1
    assert s.value("baton_tasks", status="paused") == 0
    assert s.value("baton_entries", state="dead") == 0
    assert s.value("baton_entries", state="pending") == 0
    assert s.value("baton_index_keys", index="open") == 0  # every entry consumed
    assert s.value("baton_view_ready") == 1

    w = scrape(watcher.metrics_port)
    check_conventions(w)
    sizes = sum(len(d) for d in FILES.values())
    assert w.value("baton_watcher_files_hashed_total") >= 3
    assert w.value("baton_watcher_hashed_bytes_total") >= sizes
    assert w.value("baton_watcher_hash_duration_seconds_count") == w.value(
        "baton_watcher_files_hashed_total")
    assert w.value("baton_watcher_reports_total", kind="digest") >= 3
    assert w.value("baton_watcher_reconciliations_total") >= 1
    assert w.value("baton_watcher_events_total") > 0
    assert w.value("baton_watcher_overflows_total") == 0
    assert w.value("baton_watcher_inotify_watches") >= 1
    assert w.value("baton_watcher_queue_depth", queue="checks") >= 0
    assert w.value("baton_watcher_tasks") >= 0
    assert w.value("baton_watcher_oldest_written_seconds") == 0

    ids = [TASK, *FILES, PRODUCER, CONSUMER, GROUP, socket.gethostname(), watcher.reporter,
           str(staging), "out/"]
    check_no_ids(s, ids)
    check_no_ids(w, ids)


def test_lost_leases_are_counted(
    registry: RegistryHandle, client: Client, wait_for: Callable[..., None],
) -> None:
    """A claim whose session expired is reaped and counted; the session's end is seen on
    the watch, and a closed session is told apart by the closed counter."""
    client.operator.create_task({"task_id": TASK, "entries": [{"file_id": f, "path": f}
                                                              for f in FILES]})
    lost = client.open_session(LOST, ttl=2, keepalive=False)
    client.claim(TASK, "file-alpha-q7z", session=lost)
    with client.open_session(PRODUCER, ttl=10):
        pass  # closed at once
    port = metrics_port(registry)
    metrics_of(registry).count_ttl = 0  # entry counts read at every scrape
    wait_for(lambda: scrape(port).value("baton_reaped_claims_total") == 1, timeout=15,
             what="the lost claim reaped")
    wait_for(lambda: scrape(port).value("baton_sessions_ended_total") == 2, timeout=15,
             what="both session ends seen")
    s = scrape(port)
    assert s.value("baton_sessions_closed_total") == 1  # so one expired
    assert s.value("baton_sessions") == 0
    assert s.value("baton_grpc_calls_total", method="CloseSession", code="OK") == 1
    # the entry went back to pending, with a backoff, and nothing is writing any more
    assert s.value("baton_entries", state="writing") == 0
    check_no_ids(s, [TASK, *FILES, PRODUCER, LOST, f"{lost.session_id:x}",
                     str(lost.session_id)])


def test_watchers_and_shards_are_counted(
    registry: RegistryHandle, client: Client, wait_for: Callable[..., None],
) -> None:
    """Watchers registered, shards by state (owned, moving, unowned), and shards owned
    after their owner was gone."""
    port = metrics_port(registry)
    assert "baton_watchers 0.0" in scrape(port).text  # no watcher: no shards either
    kept = client.watcher.register_watcher("/r", "kept", ttl=30).watcher_id
    s = scrape(port)
    assert s.value("baton_watchers") == 1
    assert s.value("baton_shards", state="owned") == 64  # given at registration
    assert s.value("baton_shards", state="unowned") == 0
    reassigned = s.value("baton_shards_reassigned_total")
    assert reassigned == 64  # the first watcher was given every shard nobody owned
    lost = client.watcher.register_watcher("/r", "lost", ttl=2).watcher_id
    assert scrape(port).value("baton_watchers") == 2
    # Shards start moving to it (two-phase); kept never hands any over here, and the
    # lost watcher expires first: the moves are called off, nothing is owned again.
    wait_for(lambda: scrape(port).value("baton_shards", state="moving") > 0,
             what="moves to the newcomer started")

    def kept_alive() -> bool:
        client.watcher.watcher_heartbeat(kept)
        return scrape(port).value("baton_watchers") == 1

    wait_for(kept_alive, timeout=15, what="the lost watcher's registration expired")
    wait_for(lambda: scrape(port).value("baton_shards", state="owned") == 64,
             what="the moves called off")
    assert scrape(port).value("baton_shards_reassigned_total") == reassigned
    check_no_ids(scrape(port), [kept, lost])


def test_entry_counts_follow_the_indexes(
    registry_factory: Callable[..., RegistryHandle], client: Client, registry: RegistryHandle,
) -> None:
    """Entries by state come from count-only reads of the indexes, read again once their
    cache has aged; two replicas in one process keep metrics of their own."""
    other = registry_factory(metrics="127.0.0.1:0")
    client.operator.create_task({"task_id": TASK, "entries": [{"file_id": f, "path": f}
                                                              for f in FILES]})
    s = scrape(metrics_port(registry))
    assert s.value("baton_entries", state="pending") == 3
    assert s.value("baton_entries", state="unfinished") == 3
    assert s.value("baton_index_keys", index="ready") == 3
    with client.open_session(PRODUCER, ttl=10) as producer:
        client.claim(TASK, session=producer)
        # the cached counts are kept for a while: a scrape right away reads them again
        assert scrape(metrics_port(registry)).value("baton_entries", state="writing") == 0
        metrics_of(registry).count_ttl = 0  # as if the counts had aged
        s = scrape(metrics_port(registry))
        assert s.value("baton_entries", state="writing") == 1
        assert s.value("baton_entries", state="pending") == 2
        assert s.value("baton_sessions") == 1
    assert s.value("baton_claims_total", outcome="ok") == 1
    o = scrape(metrics_port(other))
    assert "baton_claims_total" not in {n for n, _, _ in o.samples} or o.value(
        "baton_claims_total") == 0
    assert o.value("baton_entries", state="writing") == 1  # etcd's count: the same for both


def test_refused_calls_are_counted(registry: RegistryHandle, client: Client) -> None:
    """A refused call is counted with its code, and the error's name is its outcome."""
    with client.open_session(PRODUCER, ttl=10) as producer, pytest.raises(NotFound):
        client.claim("no-such-task-q7z", session=producer)
    s = scrape(metrics_port(registry))
    assert {ls["outcome"] for n, ls, v in s.samples if n == "baton_claims_total" and v} == {
        "NotFound"}
    assert s.value("baton_grpc_calls_total", method="Claim", code="NOT_FOUND") == 1
    check_no_ids(s, ["no-such-task-q7z"])


def fetch(port: int, method: str = "GET", path: str = "/metrics",
          **headers: str) -> tuple[int, dict[str, str], bytes]:
    """One request to ``127.0.0.1:port``: status, headers, body (an HTTP error included)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     headers=headers)
    try:
        with opener.open(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_both_daemons_answer_alike(
    registry: RegistryHandle, watcher_factory: Callable[..., Watcher],
) -> None:
    """The registry's and the watcher's endpoints are the same server (prometheus_client's):
    the text format on GET /metrics, OpenMetrics when asked as Prometheus asks, gzip when
    asked, HEAD refused with 405, a plain HTTP/1.0 client answered."""
    watcher = watcher_factory(metrics="127.0.0.1:0")
    for port, family in ((metrics_port(registry), "baton_grpc_calls"),
                         (watcher.metrics_port, "baton_watcher_events")):
        status, headers, body = fetch(port)
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert f"# TYPE {family}_total counter" in body.decode()
        status, headers, body = fetch(port, Accept="application/openmetrics-text;"
                                      "version=1.0.0,text/plain;version=0.0.4;q=0.5")
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert f"# TYPE {family} counter" in body.decode() and body.endswith(b"# EOF\n")
        status, headers, body = fetch(port, **{"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert f"# TYPE {family}_total counter" in gzip.decompress(body).decode()
        assert fetch(port, "HEAD")[0] == 405
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200 OK\r\n") and family.encode() in reply


def test_stop_closes_the_endpoint_of_both_daemons(
    registry_factory: Callable[..., RegistryHandle], watcher_factory: Callable[..., Watcher],
) -> None:
    """A registry's stop and a watcher's stop close their /metrics port."""
    registry = registry_factory(metrics="127.0.0.1:0")
    watcher = watcher_factory(metrics="127.0.0.1:0")
    ports = [metrics_port(registry), watcher.metrics_port]
    for port in ports:
        assert fetch(port)[0] == 200
    registry.stop()
    watcher.stop()
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_metrics_setting() -> None:
    """--metrics, BATON_METRICS and the TOML key set both daemons' address; off by default;
    a bad address is refused with the setting, the address and the reason."""
    for load in (registry_config, watcher_config):
        assert load([], {}).metrics == ""
        assert load(["--metrics", "127.0.0.1:9464"], {}).metrics == "127.0.0.1:9464"
        assert load([], {"BATON_METRICS": "[::1]:0"}).metrics == "[::1]:0"
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("0.0.0.0:9465") == ("0.0.0.0", 9465)
    form = "expected HOST:PORT (an IPv6 host in brackets; port 0 = pick one)"
    for bad, reason in (("9464", form), ("host:", form), (":9464", form), ("host:-1", form),
                        ("host:99999", "port 99999 is out of range (0-65535)")):
        with pytest.raises(InvalidArgument) as e:
            parse_address(bad)
        assert str(e.value) == f"--metrics {bad}: {reason}"
        assert (e.value.setting, e.value.address, e.value.reason) == (  # type: ignore[attr-defined]
            "--metrics", bad, reason)


def test_registry_refuses_a_bad_metrics_address(
    etcd: object, prefix: str, staging: Path,
) -> None:
    """A registry asked to serve metrics on an address it cannot use does not start."""
    import asyncio

    from baton_relay.registry import start

    config = RegistryConfig(etcd=etcd.endpoint, listen="127.0.0.1:0",  # type: ignore[attr-defined]
                            staging=str(staging), prefix=prefix, insecure=True,
                            metrics="not-an-address")
    with pytest.raises(InvalidArgument, match=r"^--metrics not-an-address: expected HOST:PORT"):
        asyncio.run(start(config))


def test_watcher_metrics_without_a_registry_call(
    registry: RegistryHandle, watcher_factory: Callable[..., Watcher], client: Client,
    staging: Path, wait_for: Callable[..., None],
) -> None:
    """The watcher's levels: the entries it knows by state, and how long the oldest
    written one has waited for its digest."""
    w = watcher_factory(metrics="127.0.0.1:0")
    make_task(client, TASK, {f: f for f in FILES})
    wait_for(lambda: scrape(w.metrics_port).value("baton_watcher_entries", state="pending")
             == 3, what="the watcher to know the task")
    s = scrape(w.metrics_port)
    assert s.value("baton_watcher_tasks") == 1
    assert s.value("baton_watcher_entries", state="verified") == 0
    check_conventions(s)
    check_no_ids(s, [TASK, *FILES, str(staging)])


# --- deploy/: the alerting rules and the dashboard ----------------------------------

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "baton-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "baton.json"
#: Grafana's own variables, which PromQL does not know, and what stands for them
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def declared(text: str) -> set[str]:
    """The metric names a scrape declares, with a histogram's series names."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@pytest.fixture
def exported(registry: RegistryHandle, client: Client, watcher_factory: Callable[..., Watcher],
             etcd: object) -> dict[str, set[str]]:
    """The metric names a running registry and watcher export, and etcd's own."""
    watcher = watcher_factory(metrics="127.0.0.1:0")
    with client.open_session(PRODUCER, ttl=10) as producer:
        client.operator.create_task({"task_id": TASK, "entries": [{"file_id": "a", "path": "a"}]})
        client.claim(TASK, session=producer)
    return {
        "baton": declared(scrape(metrics_port(registry)).text)
        | declared(scrape(watcher.metrics_port).text),
        "etcd": declared(etcd.get("/metrics").decode()),  # type: ignore[attr-defined]
    }


def metric_names(expr: str) -> set[str]:
    """Every metric an expression selects, after parsing it with a real PromQL parser."""
    import promql_parser

    for variable, stands_for in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, stands_for)
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers
                                      if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_alerting_rules_parse_and_use_exported_metrics(exported: dict[str, set[str]]) -> None:
    """deploy/prometheus/baton-rules.yaml is a Prometheus rule file: groups of recording
    and alerting rules with the fields Prometheus reads, each expression parsed by a
    PromQL parser, every metric one Baton exports, etcd's own, or a rule recorded here."""
    import promql_parser
    import yaml

    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    groups = doc["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    known = exported["baton"] | exported["etcd"] | recorded | {"ALERTS"}
    alerts = set()
    for group in groups:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert isinstance(rule["expr"], str)
            unknown = metric_names(rule["expr"]) - known
            assert not unknown, f"{rule.get('alert') or rule.get('record')} uses {unknown}"
            if "record" in rule:
                assert set(rule) <= {"record", "expr", "labels"}
                assert re.fullmatch(r"baton:[a-z_]+:[a-z0-9_]+", rule["record"]), rule
                continue
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations",
                                 "keep_firing_for"}
            assert re.fullmatch(r"Baton[A-Za-z]+", rule["alert"]) and rule["alert"] not in alerts
            alerts.add(rule["alert"])
            promql_parser.parse_duration(rule["for"])
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert {"summary", "description"} <= set(rule["annotations"])
    # what docs/operations.md promises an alert for
    assert {"BatonEntriesStuckWritten", "BatonDeadEntriesGrowing", "BatonLeaseExpiriesSpiking",
            "BatonWatcherBacklog", "BatonEtcdDatabaseNearQuota",
            "BatonEtcdVersionRefused", "BatonBackpressureLong"} <= alerts
    for name in ("etcd_mvcc_db_total_size_in_bytes", "etcd_server_quota_backend_bytes"):
        assert name in exported["etcd"], name


def test_dashboard_panels_query_exported_metrics(exported: dict[str, set[str]]) -> None:
    """deploy/grafana/baton.json is a dashboard whose every panel queries Prometheus with
    expressions that parse and select metrics Baton or etcd exports."""
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    used: set[str] = set()
    queried = 0
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            unknown = names - exported["baton"] - exported["etcd"]
            assert not unknown, f"panel {panel['title']!r} uses {unknown}"
            used |= names
            queried += 1
    assert queried >= 20
    # the panels cover what the alerts are about
    assert {"baton_watcher_oldest_written_seconds", "baton_entries",
            "baton_sessions_ended_total", "baton_watcher_queue_depth",
            "etcd_mvcc_db_total_size_in_bytes"} <= used


def test_alerting_rules_pass_promtool() -> None:
    """promtool checks the rule file and runs its unit tests, which
    make each alert fire, and stay quiet, on made-up series."""
    import subprocess

    promtool = require("promtool")
    for argv in ([promtool, "check", "rules", RULES.name],
                 [promtool, "test", "rules", "baton-rules.test.yaml"]):
        done = subprocess.run(argv, cwd=RULES.parent, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def etcd_ranges(etcd: EtcdProcess) -> float:
    """Range requests etcd has served so far (its own count)."""
    text = etcd.get("/metrics", timeout=5).decode()
    return sum(float(v) for v in re.findall(
        r'^grpc_server_handled_total\{[^}]*grpc_method="Range"[^}]*\} (\S+)$', text, re.M))


def test_entry_counts_are_not_read_again_while_nothing_is_written(
    client: Client, registry: RegistryHandle, etcd: EtcdProcess,
    wait_for: Callable[..., None],
) -> None:
    """A count-only read walks every key of an index; at rest (etcd's revision has not
    moved since the last count) a scrape reads one key instead and serves the counts
    it has; a write makes the next scrape count again (etcd's own count of requests)."""
    client.operator.create_task({"task_id": TASK, "entries": [{"file_id": f, "path": f}
                                                              for f in FILES]})
    metrics_of(registry).count_ttl = 0  # the counts have always aged
    first = scrape(metrics_port(registry))
    assert first.value("baton_entries", state="pending") == 3
    before = [etcd_ranges(etcd)]

    def quiet() -> bool:
        # once the task's creation has been followed up (the sweeps), a scrape reads
        # one key: not the nine indexes again
        scrape(metrics_port(registry))
        before.append(etcd_ranges(etcd))
        return before[-1] - before[-2] <= 2
    wait_for(quiet, what="a scrape that does not count the indexes again")
    again = scrape(metrics_port(registry))
    assert again.value("baton_entries", state="pending") == 3
    assert again.value("baton_entry_counts_age_seconds") < 5
    with client.open_session(PRODUCER, ttl=10) as producer:
        client.claim(TASK, session=producer)
        ranges = etcd_ranges(etcd)
        moved = scrape(metrics_port(registry))
        assert etcd_ranges(etcd) - ranges >= 9, "a write: every index counted again"
        assert moved.value("baton_entries", state="writing") == 1
