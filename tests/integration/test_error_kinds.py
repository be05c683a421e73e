"""Errors that know their kind: a permanent failure goes dead at once, a delayed fail or
nack hands the entry out again no sooner than asked, requeue replays one consumer group,
and a dead entry's explanation lists every attempt at it."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from click.testing import CliRunner, Result
from registry_fixtures import TEST_RETRY, RegistryHandle, on_etcd, produce_verified

from baton_relay.client import Client, PermanentError, RetryAfter, consume, produce
from baton_relay.client.cli import cli
from baton_relay.kernel import errors, pki
from baton_relay.kernel.contract import MAX_DELAY_SECONDS
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.store.etcd import Etcd

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

#: retries become claimable again at once (the default backoff starts at 1 s)
FAST_RETRY = {"base_seconds": 0.001}
#: the delay the delayed fail and nack ask for: long enough to look in between
DELAY = 1.5


def manifest(task: str = "t", n: int = 1, **extra: Any) -> dict[str, Any]:
    return {"task_id": task, "backoff": FAST_RETRY,
            "entries": [{"file_id": f"f{i}", "path": f"d/f{i}"} for i in range(n)], **extra}


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def snapshot(registry: RegistryHandle) -> dict[bytes, tuple[bytes, int]]:
    """Every key under the test's prefix (value, mod revision) but request records."""

    async def read(etcd: Etcd) -> dict[bytes, tuple[bytes, int]]:
        return {kv.key: (kv.value, kv.mod_revision)
                async for kv in etcd.scan(registry.prefix.encode())
                if b"/requests/" not in kv.key}

    return on_etcd(registry.etcd, read)


def until_claimed(client: Client, session: Any, task: str, timeout: float = 10.0) -> Any:
    """Claim the task's next entry as soon as it is claimable (deadline: ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.claim(task, session=session)
        except errors.NothingToClaim:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# --- permanent failures -------------------------------------------------------------


def test_permanent_fail_goes_dead_at_once_spending_no_retry(client: Client) -> None:
    """fail --permanent: dead at once, its retries untouched, its reason kept, and the
    journal says so; nothing is left to claim."""
    client.operator.create_task(manifest(max_retries=3))
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        entry = client.fail("t", "f0", c.token, "the source is corrupt", permanent=True,
                            session=s)
        assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_DEAD, 0)
        assert entry.error == "producer failed permanently: the source is corrupt"
        with pytest.raises(errors.NothingToClaim):
            client.claim("t", session=s)
    last = client.operator.journal("t", "f0")[-1]
    assert (last.event, last.from_state, last.to_state, last.token) == (
        "failed", "writing", "dead", c.token)
    assert "given up as permanent with 3 retries unspent" in client.operator.explain("t", "f0").text


def test_permanent_fail_with_a_stale_token_is_refused_and_changes_nothing(
        client: Client, registry: RegistryHandle) -> None:
    """A permanent fail naming an attempt that is over (its entry since claimed again)
    is refused with StaleToken, and no key changes."""
    client.operator.create_task(manifest(max_retries=3))
    with client.open_session("p", ttl=10) as s:
        first = client.claim("t", session=s)
        client.fail("t", "f0", first.token, "transient", session=s)
        second = until_claimed(client, s, "t")
        before = snapshot(registry)
        with pytest.raises(errors.StaleToken):
            client.fail("t", "f0", first.token, "too late", permanent=True, session=s)
        assert snapshot(registry) == before
        entry = client.operator.get_entry("t", "f0")
        assert (entry.state, entry.token, entry.retry_count) == (
            pb.ENTRY_STATE_WRITING, second.token, 1)


@pytest.mark.parametrize("delay", [-1.0, MAX_DELAY_SECONDS + 1.0, math.inf, math.nan])
def test_absurd_delays_are_refused_naming_the_field(
        client: Client, registry: RegistryHandle, delay: float) -> None:
    """A negative, over-a-week or non-finite delay on fail or nack is InvalidArgument
    naming delay_seconds, and changes nothing."""
    client.operator.create_task(manifest(consumers=["g"]))
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        before = snapshot(registry)
        with pytest.raises(errors.InvalidArgument) as failed:
            client.fail("t", "f0", c.token, delay=delay, session=s)
        assert failed.value.fields.get("field") == "delay_seconds"
        with pytest.raises(errors.InvalidArgument) as nacked:
            client.nack("t", "f0", "g", c.token, delay=delay, session=s)
        assert nacked.value.fields.get("field") == "delay_seconds"
        assert snapshot(registry) == before


def test_permanent_with_a_delay_is_refused(client: Client, registry: RegistryHandle) -> None:
    """permanent and delay together make no sense (a dead entry is not retried): refused,
    nothing changed."""
    client.operator.create_task(manifest())
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        before = snapshot(registry)
        with pytest.raises(errors.InvalidArgument, match="with permanent"):
            client.fail("t", "f0", c.token, permanent=True, delay=5, session=s)
        assert snapshot(registry) == before


def test_permanent_error_in_a_produce_block_kills_the_entry(client: Client) -> None:
    """A produce block raising PermanentError fails its entry permanently, and the
    exception propagates; RetryAfter delays the retry instead of the backoff."""
    client.operator.create_task(manifest(n=2, max_retries=3))
    with client.open_session("p", ttl=10) as s:
        with pytest.raises(PermanentError), produce(client, s, "t", "f0") as out:
            out.write(b"half")
            raise PermanentError("schema rejected")
        dead = client.operator.get_entry("t", "f0")
        assert (dead.state, dead.retry_count) == (pb.ENTRY_STATE_DEAD, 0)
        assert "PermanentError: schema rejected" in dead.error
        asked = time.time()
        with pytest.raises(RetryAfter), produce(client, s, "t", "f1"):
            raise RetryAfter(60, "upstream busy")
        later = client.operator.get_entry("t", "f1")
        assert (later.state, later.retry_count) == (pb.ENTRY_STATE_PENDING, 1)
        assert _epoch(later.not_before) >= asked + 60 - 0.01


def test_permanent_error_in_a_consume_block_gives_the_entry_up(
        client: Client, wait_for: Callable[..., None]) -> None:
    """A consume block raising PermanentError nacks permanently: the entry goes dead for
    every group (the other group's lease dies with it), with the group's reason."""
    client.operator.create_task(manifest(consumers=["a", "b"]))
    with client.open_session("p", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        other = client.consume("t", "b", session=s)
        with pytest.raises(PermanentError), consume(client, s, "t", "a", timeout=5):
            raise PermanentError("cannot parse")
        entry = client.operator.get_entry("t", "f0")
        assert entry.state == pb.ENTRY_STATE_DEAD
        assert entry.error == "consumer group a gave it up: PermanentError: cannot parse"
        with pytest.raises(errors.StaleToken):
            client.ack("t", "f0", "b", other.token, session=s)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "b", session=s)
    wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_COMPLETED,
             what="the task completes with its entry dead")


# --- delays -------------------------------------------------------------------------


def _epoch(stamp: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.real_time("test_on_the_clock.py::test_a_delayed_fail_is_claimable_after_its_hour")
def test_delayed_fail_is_claimable_no_sooner_than_asked(client: Client) -> None:
    """fail --delay S: not claimable before S has passed (by the registry's clock, the
    one of this process), claimable soon after; a retry is spent as for any failure."""
    client.operator.create_task(manifest(max_retries=3))
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        asked = time.time()
        entry = client.fail("t", "f0", c.token, "rate limited", delay=DELAY, session=s)
        assert (entry.state, entry.retry_count) == (pb.ENTRY_STATE_PENDING, 1)
        assert _epoch(entry.not_before) >= asked + DELAY - 0.001
        with pytest.raises(errors.IllegalTransition, match="retry backoff"):
            client.claim("t", "f0", session=s)
        with pytest.raises(errors.NothingToClaim):
            client.claim("t", session=s)
        again = until_claimed(client, s, "t", timeout=DELAY + 10)
        assert time.time() - asked >= DELAY
        assert again.file_id == "f0"


@pytest.mark.real_time("test_on_the_clock.py::test_a_delayed_nack_is_consumable_after_its_hour")
def test_delayed_nack_is_consumable_no_sooner_than_asked(
        client: Client, registry: RegistryHandle) -> None:
    """nack --delay S: the group cannot take the entry before S has passed; then the
    scheduler hands it back, and a consumer waiting on the task's watch gets it."""
    client.operator.create_task(manifest(consumers=["g"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        lease = client.consume("t", "g", session=s)
        asked = time.time()
        client.nack("t", "f0", "g", lease.token, "downstream full", delay=DELAY, session=s)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "g", session=s)
        with pytest.raises(errors.IllegalTransition):
            client.consume("t", "g", "f0", session=s)
        assert "handed back to g at" in client.operator.explain("t", "f0").text
        with consume(client, s, "t", "g", timeout=DELAY + 10) as got:
            assert time.time() - asked >= DELAY
            assert got.lease.file_id == "f0"
    entry = client.operator.get_entry("t", "f0")
    assert entry.state == pb.ENTRY_STATE_CONSUMED
    events = [r.event for r in client.operator.journal("t", "f0") if r.event != "consuming"]
    assert events[-3:] == ["nacked", "returned", "acked"]
    assert not [k for k in snapshot(registry) if b"/cdelayed/" in k]


def test_a_delayed_nack_of_an_entry_whose_bytes_go_drops_its_key(
        client: Client, registry: RegistryHandle) -> None:
    """An entry that leaves verified while a group's nack delay runs takes its delayed
    key with it: nothing hands the group bytes that are gone."""
    client.operator.create_task(manifest(consumers=["g"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        lease = client.consume("t", "g", session=s)
        client.nack("t", "f0", "g", lease.token, delay=60, session=s)
        assert [k for k in snapshot(registry) if b"/cdelayed/" in k]
        entry = client.watcher.report_problem("t", "f0", pb.ReportProblemRequest.KIND_MISSING,
                                              "gone")
        assert entry.state == pb.ENTRY_STATE_PENDING
    assert not [k for k in snapshot(registry) if b"/cdelayed/" in k]


def test_a_cancel_takes_the_delayed_nacks_with_it(
        client: Client, registry: RegistryHandle) -> None:
    """Cancelling a task deletes its delayed nacks' keys with its claimable ones, so the
    scheduler has nothing to hand back to a group of a cancelled task."""
    client.operator.create_task(manifest(consumers=["g"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        lease = client.consume("t", "g", session=s)
        client.nack("t", "f0", "g", lease.token, delay=60, session=s)
    assert [k for k in snapshot(registry) if b"/cdelayed/" in k]
    client.operator.cancel_task("t", reason="stop")
    assert not [k for k in snapshot(registry) if b"/cdelayed/" in k or b"/cready/" in k]


# --- requeue of one group -----------------------------------------------------------


def test_requeue_of_one_group_replays_only_that_group(
        client: Client, wait_for: Callable[..., None]) -> None:
    """requeue --group a on a consumed entry: a is handed it again, b (which acked it
    too) is not; the completed task is active again, and completes again."""
    client.operator.create_task(manifest(consumers=["a", "b"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        for group in ("a", "b"):
            lease = client.consume("t", group, session=s)
            client.ack("t", "f0", group, lease.token, session=s)
        wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_COMPLETED,
                 what="the task completes")
        entry = client.operator.requeue("t", "f0", group="a")
        assert (entry.state, list(entry.consumed_by)) == (pb.ENTRY_STATE_VERIFIED, ["b"])
        assert client.operator.get_task("t").status == pb.TASK_STATUS_ACTIVE
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "b", session=s)
        again = client.consume("t", "a", session=s)
        assert again.file_id == "f0"
        assert client.ack("t", "f0", "a", again.token, session=s).state == (
            pb.ENTRY_STATE_CONSUMED)
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "a", session=s)
    wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_COMPLETED,
             what="the task completes again")
    last = [r for r in client.operator.journal("t", "f0") if r.event == "requeued"][-1]
    assert (last.group, last.from_state, last.to_state) == ("a", "consumed", "verified")


def test_requeue_of_one_group_of_a_verified_entry(client: Client) -> None:
    """On an entry still verified (b has not acked), requeue --group a forgets a's ack
    only: a takes it again, b's own turn is untouched."""
    client.operator.create_task(manifest(consumers=["a", "b"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        lease = client.consume("t", "a", session=s)
        client.ack("t", "f0", "a", lease.token, session=s)
        entry = client.operator.requeue("t", "f0", group="a")
        assert (entry.state, list(entry.consumed_by)) == (pb.ENTRY_STATE_VERIFIED, [])
        assert client.consume("t", "a", session=s).file_id == "f0"
        assert client.consume("t", "b", session=s).file_id == "f0"


def test_requeue_of_a_group_that_did_not_ack_is_refused(
        client: Client, registry: RegistryHandle) -> None:
    """A group that has not acked the entry has nothing to replay (IllegalTransition), a
    group that is no consumer of it is bad input naming the field; neither changes a key."""
    client.operator.create_task(manifest(consumers=["a", "b"]))
    with client.open_session("c", ttl=10) as s:
        produce_verified(client, s, "t", "f0")
        before = snapshot(registry)
        with pytest.raises(errors.IllegalTransition, match="has not acked it"):
            client.operator.requeue("t", "f0", group="a")
        with pytest.raises(errors.InvalidArgument) as bad:
            client.operator.requeue("t", "f0", group="nobody")
        assert bad.value.fields.get("field") == "group"
        assert snapshot(registry) == before


def test_requeue_of_a_whole_task_for_one_group(client: Client, registry: RegistryHandle,
                                               wait_for: Callable[..., None]) -> None:
    """requeue TASK --group a (no file): every entry a acked is handed to a again, none
    to b; sent again before a acks, it replays nothing twice; CLI and library agree."""
    client.operator.create_task(manifest(n=3, consumers=["a", "b"]))
    with client.open_session("c", ttl=10) as s:
        for f in ("f0", "f1", "f2"):
            produce_verified(client, s, "t", f)
            groups = ("a", "b") if f != "f2" else ("b",)
            for group in groups:
                lease = client.consume("t", group, f, session=s)
                client.ack("t", f, group, lease.token, session=s)
        assert client.operator.replay_task("t", "a") == 2
        assert client.operator.replay_task("t", "a") == 0
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "b", session=s)
        taken = sorted(client.consume("t", "a", session=s).file_id for _ in range(3))
        assert taken == ["f0", "f1", "f2"]
        with pytest.raises(errors.InvalidArgument) as bad:
            client.operator.replay_task("t", "nobody")
        assert bad.value.fields.get("field") == "group"
    out = invoke(registry, "requeue", "t", "--group", "b", "--reason", "b's index rebuilt",
                 "--evidence", "OPS-9", "-o", "json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"task_id": "t", "group": "b", "replayed": 3}
    replays = [r for r in client.operator.journal("t", "f2") if r.event == "requeued"]
    assert len(replays) == 1 and replays[0].reason.startswith("b's index rebuilt")
    assert replays[0].evidence == "OPS-9"
    assert invoke(registry, "requeue", "t").exit_code == 2


# --- attempts -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, the registry's certificate, two agents, a watcher and an operator."""
    root = tmp_path_factory.mktemp("pki")
    pki.create_ca(root)
    pki.issue(root, "registry", root, server_names=["localhost", "127.0.0.1"])
    for name, role in [("writer-1", "agent"), ("writer-2", "agent"),
                       ("hasher", "watcher"), ("op", "operator")]:
        pki.issue(root, name, root, roles=[role])
    return root


@pytest.fixture
def secure(registry_factory: Callable[..., RegistryHandle], certs: Path) -> RegistryHandle:
    return registry_factory(tls_ca=str(certs / "ca.crt"), tls_cert=str(certs / "registry.crt"),
                            tls_key=str(certs / "registry.key"))


@pytest.fixture
def as_(secure: RegistryHandle, certs: Path) -> Iterator[Callable[[str], Client]]:
    """A client per identity, made on first use."""
    made: dict[str, Client] = {}

    def client_of(name: str) -> Client:
        if name not in made:
            made[name] = Client(secure.address, ca=str(certs / "ca.crt"),
                                cert=str(certs / f"{name}.crt"), key=str(certs / f"{name}.key"),
                                timeout=10, retry=TEST_RETRY)
        return made[name]

    yield client_of
    for c in made.values():
        c.close()


def test_a_dead_entry_explains_every_attempt(as_: Callable[[str], Client]) -> None:
    """Three attempts by two identities on two hosts: a commit the watcher found other
    bytes for, a failure, a failure with no retry left. The explanation lists each with
    who, host, token, error, digest and times, oldest first."""
    op, w1, w2, watcher = as_("op"), as_("writer-1"), as_("writer-2"), as_("hasher")
    op.operator.create_task(manifest(max_retries=2))
    good, bad = b"the bytes", b"other bytes"
    with w1.open_session("ocr-1", ttl=10, host="node-a") as s1, \
            w2.open_session("ocr-2", ttl=10, host="node-b") as s2:
        c1 = w1.claim("t", session=s1)
        w1.commit("t", "f0", c1.token, len(good), digest(good), session=s1)
        watcher.watcher.report("t", "f0", len(bad), digest(bad))
        c2 = until_claimed(w2, s2, "t")
        w2.fail("t", "f0", c2.token, "disk full", session=s2)
        c3 = until_claimed(w1, s1, "t")
        assert w1.fail("t", "f0", c3.token, "disk still full",
                       session=s1).state == pb.ENTRY_STATE_DEAD
    explained = op.operator.explain("t", "f0")
    attempts = list(explained.attempts)
    assert explained.attempts_total == 3
    assert [(a.number, a.who, a.label, a.host, a.token) for a in attempts] == [
        (1, "writer-1", "ocr-1", "node-a", c1.token),
        (2, "writer-2", "ocr-2", "node-b", c2.token),
        (3, "writer-1", "ocr-1", "node-a", c3.token)]
    first, second, third = attempts
    assert first.digest == digest(good) and first.size == len(good)
    assert "mismatch" in first.error or digest(bad) in first.error, first.error
    assert (second.outcome, second.error) == ("failed", "producer failed: disk full")
    assert (third.outcome, third.error) == ("failed", "producer failed: disk still full")
    for a in attempts:
        assert a.claimed_at and a.ended_at and a.claimed_at <= a.ended_at
        assert not a.permanent
    text = explained.text
    for a in attempts:
        assert f"#{a.number} {a.claimed_at} by {a.who} \"{a.label}\" on {a.host}, " \
               f"token {a.token}" in text
    assert "disk still full" in text


def test_an_attempt_given_up_is_marked_permanent(client: Client) -> None:
    """The attempt that failed permanently says so; attempts in progress have no end."""
    client.operator.create_task(manifest(n=2))
    with client.open_session("p", ttl=10, host="node-c") as s:
        c = client.claim("t", "f0", session=s)
        client.fail("t", "f0", c.token, "never", permanent=True, session=s)
        held = client.claim("t", "f1", session=s)
        (gone,) = client.operator.explain("t", "f0").attempts
        (live,) = client.operator.explain("t", "f1").attempts
    assert (gone.permanent, gone.outcome, gone.host) == (True, "failed", "node-c")
    assert (live.token, live.ended_at, live.outcome) == (held.token, "", "")


def test_an_archived_dead_entry_explains_its_attempts_from_the_archive(
        registry_factory: Callable[..., RegistryHandle], tmp_path: Path,
        wait_for: Callable[..., None]) -> None:
    """Once its task is archived, a dead entry's attempts are read from the archived
    journal: the same attempts as before."""
    registry = registry_factory(archive_dir=str(tmp_path / "archive"))
    with Client(registry.address, timeout=10, retry=TEST_RETRY) as client:
        client.operator.create_task(manifest(max_retries=1))
        with client.open_session("p", ttl=10, host="node-d") as s:
            for reason in ("first", "second"):
                c = until_claimed(client, s, "t")
                client.fail("t", "f0", c.token, reason, session=s)
        wait_for(lambda: client.operator.get_task("t").status == pb.TASK_STATUS_COMPLETED,
                 what="the task completes with its entry dead")
        live = client.operator.explain("t", "f0")
        assert client.operator.archive_task("t").status == pb.TASK_STATUS_ARCHIVED
        archived = client.operator.explain("t", "f0")
    assert [a.error for a in live.attempts] == ["producer failed: first",
                                                 "producer failed: second"]
    assert list(archived.attempts) == list(live.attempts)
    assert "#2 " in archived.text and "node-d" in archived.text


# --- the CLI ------------------------------------------------------------------------


def invoke(registry: RegistryHandle, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"BATON_REGISTRY": registry.address})


def test_cli_fail_nack_requeue_and_explain_flags(
        client: Client, registry: RegistryHandle, staging: Path) -> None:
    """baton fail --permanent / --delay, nack --delay, requeue --group and explain -o json
    do what the library calls do; a bad delay exits 2 naming the field."""
    client.operator.create_task(manifest(n=3, consumers=["a", "b"]))
    with client.open_session("p", ttl=30) as s:
        c0 = client.claim("t", "f0", session=s)
        out = invoke(registry, "fail", "t", "f0", "--token", str(c0.token), "--reason", "x",
                     "--permanent", "-o", "json")
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["state"] == "dead"
        c1 = client.claim("t", "f1", session=s)
        bad = invoke(registry, "fail", "t", "f1", "--token", str(c1.token), "--delay", "-3")
        assert bad.exit_code == 2 and "delay_seconds" in bad.output
        out = invoke(registry, "fail", "t", "f1", "--token", str(c1.token), "--delay", "30",
                     "-o", "json")
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["not_before"]
        produce_verified(client, s, "t", "f2")
        lease = client.consume("t", "a", session=s)
        out = invoke(registry, "nack", "t", "f2", "-g", "a", "--token", str(lease.token),
                     "--delay", "30")
        assert out.exit_code == 0, out.output
        with pytest.raises(errors.NothingToClaim):
            client.consume("t", "a", session=s)
        other = client.consume("t", "b", session=s)
        client.ack("t", "f2", "b", other.token, session=s)
        out = invoke(registry, "requeue", "t", "f2", "--group", "b", "-o", "json")
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout).get("consumed_by", []) == []
        refused = invoke(registry, "requeue", "t", "f2", "--group", "b")
        assert refused.exit_code == 4, refused.output
    explained = invoke(registry, "explain", "t", "f0", "-o", "json")
    assert explained.exit_code == 0, explained.output
    data = json.loads(explained.stdout)
    assert data["attempts_total"] == 1
    assert data["attempts"][0]["token"] in (c0.token, str(c0.token))
    assert data["attempts"][0]["permanent"] is True


def test_a_retry_backoff_key_cancelled_meanwhile_is_passed_over_not_planned_against(
        client: Client, registry: RegistryHandle, wait_for: Callable[..., None]) -> None:
    """The scheduler lists a delayed (retry backoff) key, then a cancel deletes it before
    the promotion's transaction: the promotion does nothing, at once, instead of planning
    again and again against a key that will not come back."""
    import asyncio

    from baton_relay.registry.store.txn import write

    client.operator.create_task(manifest(max_retries=3))
    with client.open_session("p", ttl=10) as s:
        c = client.claim("t", session=s)
        failed = client.fail("t", "f0", c.token, "later", delay=0.5, session=s)
    (index,) = [k for k in snapshot(registry) if b"/delayed/" in k]
    client.operator.cancel_task("t", reason="stop")
    assert index not in snapshot(registry)
    due = _epoch(failed.not_before)
    wait_for(lambda: time.time() > due + 0.05, 10, "the backoff to be over")
    running = registry._running
    before = dict(running.core.txns.replans)
    plan = running.scheduler._promote_plan("t", "f0", index)
    done = asyncio.run_coroutine_threadsafe(
        write(running.core.txns, plan, fresh=True), registry._loop).result(timeout=30)
    assert done is False
    assert running.core.txns.replans == before
