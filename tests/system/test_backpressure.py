"""Back-pressure between stages: a task's ``backlog_limits`` refuse producers' claims
with ``Backpressure`` while a consumer group is at its limit, on a real etcd and
registry; the producing helpers wait it out."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from registry_fixtures import agent_processes, on_etcd, produce_verified
from test_cli import invoke, ok_json, one_error_line
from test_metrics import check_conventions, metrics_port, scrape

from baton_relay.client import Client, Session, produce, produce_each
from baton_relay.client.aio import AsyncClient
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import KV, Etcd
from baton_relay.registry.store.keys import Keys

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: the pipeline's agents (producers and a consumer), as processes
PIPELINE_PROC = Path(__file__).parents[1] / "pipeline_proc.py"


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def manifest(n: int, limit: int | None, groups: tuple[str, ...] = ("g",)) -> dict[str, Any]:
    """Task t of ``n`` entries e00.., consumed by ``groups``; ``limit`` on the first."""
    spec: dict[str, Any] = {
        "task_id": "t", "consumers": list(groups),
        "entries": [{"file_id": f"e{i:02d}", "path": f"e{i:02d}"} for i in range(n)]}
    if limit is not None:
        spec["backlog_limits"] = {groups[0]: {"entries": limit}}
    return spec


def keys_under(registry: Any) -> dict[bytes, KV]:
    """Every key of the test's prefix (to show a refused claim changed nothing)."""
    async def work(etcd: Etcd) -> dict[bytes, KV]:
        return {kv.key: kv async for kv in etcd.scan(registry.prefix.encode(), page=500)}

    return on_etcd(registry.etcd, work)


def refused(client: Client, s: Session) -> errors.Backpressure:
    with pytest.raises(errors.Backpressure) as info:
        client.claim("t", session=s)
    return info.value


@pytest.mark.parametrize(("limits", "problem"), [
    ({"h": {"entries": 5}}, "backlog_limits['h']: 'h' is not a consumer group"),
    ({"g": {"entries": 0}}, "backlog_limits['g'].entries: 0 is not a number of entries"),
    ({"g": {"entries": -3}}, "backlog_limits['g'].entries: -3"),
    ({"g": {"entries": 5, "bytes": 1024}}, "backlog_limits['g'].bytes: a backlog limit "
                                          "in bytes is not supported"),
])
def test_a_bad_limit_is_refused_naming_the_field(client: Client, limits: dict[str, Any],
                                                 problem: str) -> None:
    """A limit on a group the task does not have, not positive, or in bytes: the
    manifest is refused and the problem names the field; no task is created."""
    spec = {**manifest(2, None), "backlog_limits": limits}
    with pytest.raises(errors.InvalidManifest) as info:
        client.operator.create_task(spec)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems
    with pytest.raises(errors.NotFound):
        client.operator.get_task("t")


def test_a_limit_is_kept_with_the_task(client: Client) -> None:
    """The manifest's limit travels back in the task's spec."""
    client.operator.create_task(manifest(2, 7))
    assert client.operator.get_task("t").spec.backlog_limits["g"].entries == 7


def test_a_claim_at_the_limit_is_refused_and_changes_nothing(
        client: Client, registry: Any) -> None:
    """Two verified entries waiting for g, limit 2: the next claim is refused with
    Backpressure naming the group, its backlog and limit; etcd is left as it was."""
    client.operator.create_task(manifest(5, 2))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        for f in ("e00", "e01"):
            produce_verified(client, s, "t", f)
        before = keys_under(registry)
        e = refused(client, s)
        assert keys_under(registry) == before
    assert (e.task_id, e.group, e.backlog, e.limit, e.over) == ("t", "g", 2, 2, 0)
    assert "'g'" in e.message and "limit of 2" in e.message
    assert client.operator.get_entry("t", "e02").state == pb.ENTRY_STATE_PENDING


def test_claims_in_flight_count_toward_the_backlog(client: Client) -> None:
    """Entries being produced will be the group's: two claims in hand reach a limit
    of 2, and a group that holds an entry still counts it until it acks."""
    client.operator.create_task(manifest(5, 2))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        a = client.claim("t", session=s)
        client.claim("t", session=s)
        assert refused(client, s).backlog == 2
        client.commit("t", a.file_id, a.token, 1, digest(b"x"), session=s)
        client.watcher.report("t", a.file_id, 1, digest(b"x"))
        lease = client.consume("t", "g", session=s)
        assert refused(client, s).backlog == 2  # held by g, not acked: still its backlog
        client.ack("t", lease.file_id, "g", lease.token, session=s)
        assert client.claim("t", session=s).file_id


def test_claims_resume_once_the_group_acks(client: Client) -> None:
    """Refused at the limit; once g consumes and acks one entry, a claim succeeds."""
    client.operator.create_task(manifest(4, 1))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
        refused(client, s)
        lease = client.consume("t", "g", session=s)
        client.ack("t", lease.file_id, "g", lease.token, session=s)
        assert client.claim("t", session=s).file_id == "e01"


def test_only_a_limited_group_counts(client: Client) -> None:
    """The limit is g's: h's untouched backlog does not matter, g's does."""
    client.operator.create_task(manifest(4, 1, ("g", "h")))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
        lease = client.consume("t", "g", session=s)
        client.ack("t", lease.file_id, "g", lease.token, session=s)
        # h has not consumed e00, but only g is limited.
        assert client.claim("t", session=s).file_id == "e01"


def test_nothing_left_to_claim_is_not_back_pressure(client: Client) -> None:
    """At the limit with every entry produced: a claim says there is nothing to claim
    (the producer is done), not that it should wait."""
    client.operator.create_task(manifest(1, 1))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
        with pytest.raises(errors.NothingToClaim):
            client.claim("t", session=s)


def test_a_batch_claims_no_more_than_the_limit_leaves_room_for(client: Client) -> None:
    """Limit 3, one entry waiting: a batch of 10 takes 2; the next batch is refused."""
    client.operator.create_task(manifest(8, 3))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
        assert len(client.claim_batch("t", 10, session=s)) == 2
        with pytest.raises(errors.Backpressure):
            client.claim_batch("t", 10, session=s)


def test_a_fused_commit_applies_and_its_next_claim_is_refused(client: Client) -> None:
    """Commit-and-claim at the limit: the commit applies, no next claim is handed out,
    and the claim the helper then makes is refused with Backpressure."""
    client.operator.create_task(manifest(4, 1))
    with client.open_session("p", ttl=30) as s:
        c = client.claim("t", session=s)
        entry, nxt = client.commit_and_claim("t", c.file_id, c.token, 1, digest(b"x"),
                                             session=s)
        assert entry.state == pb.ENTRY_STATE_WRITTEN and nxt is None
        client.watcher.report("t", c.file_id, 1, digest(b"x"))
        assert refused(client, s).backlog == 1
    assert [e.state for e in client.operator.list_entries("t")].count(pb.ENTRY_STATE_PENDING) == 3


class _Seen(logging.Handler):
    """Sets ``event`` when a producer logs that it waits out back-pressure."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "back-pressured" in record.getMessage():
            self.lines.append(record.getMessage())
            self.event.set()


def test_produce_waits_for_the_group_instead_of_failing(client: Client) -> None:
    """``produce`` at the limit waits (logging once) while a consumer acks in another
    thread, then claims and commits."""
    client.operator.create_task(manifest(3, 1))
    seen = _Seen()
    logger = logging.getLogger("baton.client")
    logger.addHandler(seen)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    acked: list[str] = []

    def consumer() -> None:
        assert seen.event.wait(20), "the producer never said it waits"
        with client.open_session("c", ttl=30, keepalive=False) as cs:
            lease = client.consume("t", "g", session=cs)
            client.ack("t", lease.file_id, "g", lease.token, session=cs)
            acked.append(lease.file_id)

    try:
        with client.open_session("p", ttl=30) as s:
            produce_verified(client, s, "t", "e00")
            thread = threading.Thread(target=consumer)
            thread.start()
            with produce(client, s, "t", wait=30) as out:
                out.write(b"next")
            thread.join(30)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(old_level)
    assert acked == ["e00"]
    assert out.entry is not None and out.entry.file_id == "e01"
    assert out.entry.state == pb.ENTRY_STATE_WRITTEN
    assert len(seen.lines) == 1 and "'g'" in seen.lines[0]


def test_produce_each_on_a_stream_waits_between_fused_steps(client: Client) -> None:
    """``produce_each`` on a stream session: a fused step whose next claim is refused
    still commits, and the loop waits for the group (acking in another thread)
    instead of ending; every entry is produced."""
    client.operator.create_task(manifest(3, 1))
    seen = _Seen()
    logger = logging.getLogger("baton.client")
    logger.addHandler(seen)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    acked: list[str] = []
    done = threading.Event()

    def consumer() -> None:
        # Nothing is consumed before the loop says it waits: on a loaded machine a
        # consumer acking first could let every step through without a wait.
        if not seen.event.wait(30):
            return
        with client.open_session("c", ttl=30, keepalive=False) as cs:
            deadline = time.monotonic() + 30
            while len(acked) < 3 and time.monotonic() < deadline and not done.is_set():
                try:
                    lease = client.consume("t", "g", session=cs)
                except errors.NothingToClaim:
                    time.sleep(0.02)  # nothing verified yet: look again
                    continue
                client.ack("t", lease.file_id, "g", lease.token, session=cs)
                acked.append(lease.file_id)

    def verify(entry: pb.Entry | None) -> None:
        assert entry is not None
        client.watcher.report("t", entry.file_id, 1, digest(b"x"))

    thread = threading.Thread(target=consumer)
    thread.start()
    produced = []
    try:
        with client.open_session("p", ttl=30) as s:
            assert s.stream is not None
            previous = None
            for out in produce_each(client, s, "t", wait=30):
                if previous is not None:
                    verify(previous.entry)  # as the watcher would
                out.write(b"x")
                produced.append(out.claim.file_id)
                previous = out
            assert previous is not None
            verify(previous.entry)
        thread.join(30)
    finally:
        done.set()
        logger.removeHandler(seen)
        logger.setLevel(old_level)
    assert produced == ["e00", "e01", "e02"]
    assert sorted(acked) == produced
    assert seen.lines, "the loop never waited for the group"


def test_produce_gives_up_after_its_wait(client: Client) -> None:
    """Nobody consumes: ``produce`` raises Backpressure once its wait is over."""
    client.operator.create_task(manifest(3, 1))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
        with pytest.raises(errors.Backpressure), produce(client, s, "t", wait=0.3) as out:
            out.write(b"never")


def test_the_async_session_waits_then_claims(client: Client, registry: Any) -> None:
    """``AsyncSession.claim_waiting`` at the limit waits, logging once, while another
    session of the same loop consumes and acks; then it claims. A bare ``claim``
    raises, and a wait that runs out raises the last refusal."""
    client.operator.create_task(manifest(3, 1))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
    seen = _Seen()
    logger = logging.getLogger("baton.client")
    logger.addHandler(seen)
    old_level = logger.level
    logger.setLevel(logging.INFO)

    async def consume_once(ac: AsyncClient) -> str:
        deadline = time.monotonic() + 20
        while not seen.event.is_set():  # until the producer says it waits
            assert time.monotonic() < deadline, "the producer never said it waits"
            await asyncio.sleep(0.02)
        async with ac.session("c", ttl=30) as cs:
            lease = await cs.consume("t", "g")
            await cs.ack("t", lease.file_id, "g", lease.token)
            return lease.file_id

    async def main() -> tuple[str, str]:
        async with AsyncClient(registry.address) as ac, ac.session("p", ttl=30) as ps:
            with pytest.raises(errors.Backpressure):
                await ps.claim("t")
            with pytest.raises(errors.Backpressure):
                await ps.claim_waiting("t", wait=0.2)
            seen.event.clear()
            seen.lines.clear()
            claim, acked = await asyncio.gather(ps.claim_waiting("t", wait=30),
                                                consume_once(ac))
            return claim.file_id, acked

    try:
        claimed, acked = asyncio.run(main())
    finally:
        logger.removeHandler(seen)
        logger.setLevel(old_level)
    assert (claimed, acked) == ("e01", "e00")
    assert len(seen.lines) == 1


def test_the_cli_exits_9_naming_the_group(client: Client, registry: Any) -> None:
    """`baton claim` on a back-pressured task: exit 9, one line naming the group;
    `baton put --wait 0` the same."""
    client.operator.create_task(manifest(3, 1))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
    out = invoke(registry, "claim", "t")
    assert out.exit_code == 9, out.output
    line = one_error_line(out.stderr)
    assert "back-pressured" in line and "'g'" in line and "limit of 1" in line
    put = invoke(registry, "put", "t", "e01", "-", "--wait", "0", stdin="data")
    assert put.exit_code == 9, put.output
    shown = invoke(registry, "task", "get", "t", "-o", "json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["spec"]["backlog_limits"]["g"]["entries"] == 1


def test_explain_get_task_and_top_say_a_task_is_back_pressured(
        client: Client, registry: Any) -> None:
    """A pending entry's explanation names the group, its backlog and limit; GetTask
    carries each limited group's backlog, and `baton task get` and `baton top -o json`
    show it."""
    client.operator.create_task(manifest(3, 1, ("g", "h")))
    with client.open_session("p", ttl=30, keepalive=False) as s:
        produce_verified(client, s, "t", "e00")
    text = client.operator.explain("t", "e01").text
    assert "back-pressured" in text and "consumer group g has a backlog of 1" in text
    assert "limit of 1" in text
    (b,) = client.operator.get_task("t").backlog
    assert (b.group, b.backlog, b.limit, b.over) == ("g", 1, 1, True)
    shown = invoke(registry, "task", "get", "t")
    assert shown.exit_code == 0, shown.output
    assert "g 1/1  back-pressured" in shown.stdout
    top = ok_json(invoke(registry, "top", "--once", "-o", "json"))
    assert top["tasks"][0]["backlog"] == [{"group": "g", "backlog": 1, "limit": 1,
                                           "over": True}]


def test_refusals_and_backlogs_are_exported(
        registry_factory: Callable[..., Any]) -> None:
    """A refusal counts in baton_backpressure_refusals_total{task, group}; the limited
    group's backlog and limit are gauges; a task without limits is not labelled."""
    registry = registry_factory(metrics="127.0.0.1:0")
    with Client(registry.address, timeout=10) as client:
        client.operator.create_task(manifest(3, 1))
        client.operator.create_task({"task_id": "free", "entries": [{"file_id": "a", "path": "a"}]})
        with client.open_session("p", ttl=30, keepalive=False) as s:
            produce_verified(client, s, "t", "e00")
            refused(client, s)
            refused(client, s)
            client.claim("free", session=s)
    m = scrape(metrics_port(registry))
    check_conventions(m)
    assert m.value("baton_backpressure_refusals_total", task="t", group="g") == 2
    assert m.value("baton_backlog", task="t", group="g") == 1
    assert m.value("baton_backlog_limit", task="t", group="g") == 1
    assert "free" not in m.label_values()


# --- acceptance: a two-stage pipeline whose consumer is 10x slower ---------------------

#: the issue's figures: a limit of 50, three producers, a consumer 10x slower than each
LIMIT, PRODUCERS, PRODUCE_SECONDS, CONSUME_SECONDS = 50, 3, 0.01, 0.1
#: how long the backlog is sampled once it has grown to the limit
SAMPLED_SECONDS = 6.0


def sample_backlog(registry: Any, task_id: str, group: str, until_over: int,
                   seconds: float) -> list[int]:
    """The group's backlog (verified entries waiting for it plus those it holds),
    counted from etcd every 20 ms: until it reaches ``until_over`` (20 s at most),
    then for ``seconds`` more."""
    keys = Keys(registry.prefix)
    prefixes = [keys.cready_all(task_id, group), keys.inflight_of_group(task_id, group)]

    async def work(etcd: Etcd) -> list[int]:
        seen: list[int] = []
        reached = 0.0
        start = time.monotonic()
        while True:
            seen.append(sum(await etcd.counts(prefixes)))
            now = time.monotonic()
            if not reached and (seen[-1] >= until_over or now - start > 20):
                reached = now
            if reached and now - reached >= seconds:
                return seen
            await asyncio.sleep(0.02)  # the sampling period

    return on_etcd(registry.etcd, work, timeout=10)


def run_pipeline(client: Client, registry: Any, limit: int | None) -> list[int]:
    """Three producer processes and one consumer process on a task of 2,000 entries
    (more than they get through); the consumer's backlog as sampled while they run."""
    client.operator.create_task(manifest(2000, limit))
    with agent_processes(PIPELINE_PROC, registry) as spawn:
        consumer = spawn("consumer", "t", "g", CONSUME_SECONDS)
        producers = [spawn("producer", "t", PRODUCE_SECONDS) for _ in range(PRODUCERS)]
        seen = sample_backlog(registry, "t", "g", 2 * LIMIT if limit is None else limit,
                              SAMPLED_SECONDS)
        codes = [p.poll() for p in [consumer, *producers]]
    assert codes == [None] * (1 + PRODUCERS), f"an agent process ended: {codes}"
    return seen


@pytest.mark.slow
def test_a_backlog_limit_holds_a_fast_producer_back(client: Client, registry: Any) -> None:
    """Limit 50, three producers, a consumer 10x slower: sampled throughout, the
    group's backlog reaches the limit and never exceeds 50 + the 3 producers."""
    seen = run_pipeline(client, registry, LIMIT)
    assert max(seen) >= LIMIT - PRODUCERS, max(seen)  # the limit was what held them
    assert max(seen) <= LIMIT + PRODUCERS, (max(seen), seen)
    assert client.operator.get_task("t").spec.backlog_limits["g"].entries == LIMIT


@pytest.mark.slow
def test_without_a_limit_the_backlog_grows_without_bound(
        client: Client, registry: Any) -> None:
    """The same pipeline without a limit: the backlog grows well past 50 + 3 and is
    still growing at the end."""
    seen = run_pipeline(client, registry, None)
    assert max(seen) > 2 * LIMIT + PRODUCERS, max(seen)
    half = len(seen) // 2
    assert max(seen[half:]) > max(seen[:half]), "the backlog stopped growing"
